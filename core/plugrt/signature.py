"""A model's declared inputs and outputs, and the checks ``run`` makes of the arrays fed to it."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from ._dtypes import numpy_dtype
from .ir_utils import tensor_array
from .loader import DECLARED_TYPE_KEY
from .errors import (
    InputDtypeError,
    InputRankError,
    InputShapeError,
    InvalidInputError,
    MissingInputError,
    SymbolConflictError,
    UnknownInputError,
)
from .transfers import MemorySpaces

__all__ = ["TensorInfo", "ModelMetadata", "InputSpec", "InputSignature", "input_specs", "tensor_info", "model_metadata"]

_SIGNATURE_CACHE_SIZE = 256


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """A model input or output: name, element dtype, shape (ints, symbol names or None)."""

    name: str
    dtype: np.dtype | None
    shape: tuple[int | str | None, ...] | None
    kind: str = "tensor"  # "tensor", "sequence", "optional", "map"
    type_string: str = ""  # onnxruntime's spelling, e.g. "tensor(float)"


@dataclasses.dataclass(frozen=True)
class ModelMetadata:
    producer_name: str
    producer_version: str
    graph_name: str
    domain: str
    description: str
    version: int
    custom_metadata_map: dict[str, str]
    opset_imports: dict[str, int]


def model_metadata(model: ir.Model) -> ModelMetadata:
    return ModelMetadata(
        producer_name=model.producer_name or "",
        producer_version=model.producer_version or "",
        graph_name=model.graph.name or "",
        domain=model.domain or "",
        description=model.doc_string or "",
        version=int(model.model_version or 0),
        custom_metadata_map=dict(model.metadata_props),
        opset_imports={d or "ai.onnx": v for d, v in model.opset_imports.items()},
    )


def _type_string(type_: ir.TypeProtocol | None) -> tuple[str, str, np.dtype | None]:
    if type_ is None:
        return "tensor", "tensor(undefined)", None
    if isinstance(type_, ir.SequenceType):
        inner = _type_string(type_.elem_type)[1]
        return "sequence", f"seq({inner})", None
    if isinstance(type_, ir.OptionalType):
        inner = _type_string(type_.elem_type)[1]
        return "optional", f"optional({inner})", None
    dtype_enum = type_.dtype
    try:
        dtype = numpy_dtype(int(dtype_enum))
    except ValueError:
        dtype = None
    return "tensor", f"tensor({dtype_enum.name.lower()})", dtype


def _declared_type_string(type_proto: onnx.TypeProto) -> tuple[str, str]:
    """(kind, onnxruntime's spelling) of a type onnx_ir cannot hold, e.g. ZipMap's
    ``seq(map(int64,tensor(float)))``."""
    kind = type_proto.WhichOneof("value")
    if kind == "map_type":
        key = onnx.TensorProto.DataType.Name(type_proto.map_type.key_type).lower()
        return "map", f"map({key},{_declared_type_string(type_proto.map_type.value_type)[1]})"
    if kind == "sequence_type":
        return "sequence", f"seq({_declared_type_string(type_proto.sequence_type.elem_type)[1]})"
    if kind == "optional_type":
        return "optional", f"optional({_declared_type_string(type_proto.optional_type.elem_type)[1]})"
    name = onnx.TensorProto.DataType.Name(type_proto.tensor_type.elem_type).lower()
    return "tensor", f"tensor({name})"


def tensor_info(value: ir.Value) -> TensorInfo:
    declared = value.meta.get(DECLARED_TYPE_KEY)
    if declared is not None:
        kind, type_string = _declared_type_string(declared)
        return TensorInfo(value.name or "", None, None, kind, type_string)
    kind, type_string, dtype = _type_string(value.type)
    shape = None
    if value.shape is not None:
        dims: list[int | str | None] = []
        for dim in value.shape:
            if isinstance(dim, int):
                dims.append(dim)
            else:
                dims.append(dim.value if getattr(dim, "value", None) is not None else None)
        shape = tuple(dims)
    return TensorInfo(value.name or "", dtype, shape, kind, type_string)


class InputSpec:
    """What run() checks of one input, prepared at build."""

    __slots__ = ("name", "info", "dtype", "dims", "default", "is_tensor")

    def __init__(self, info: TensorInfo, default: Any):
        self.name = info.name
        self.info = info
        self.dtype = info.dtype
        self.dims = info.shape
        self.default = default  # an initializer's array when the input may be omitted
        self.is_tensor = info.kind == "tensor"


def input_specs(infos: Sequence[TensorInfo], values: Sequence[ir.Value], homes: Mapping[ir.Value, Any]) -> list[InputSpec]:
    """One spec per input; an initializer input's default is moved once to the device
    memory in ``homes`` when only that memory reads it."""
    specs = []
    for info, value in zip(infos, values):
        default = tensor_array(value.const_value) if value.const_value is not None else None
        home = homes.get(value)
        if default is not None and home is not None:
            default = home.to_device(default, home.default_device)
        specs.append(InputSpec(info, default))
    return specs


class InputSignature:
    """The inputs ``run`` takes: fills defaults, refuses unknown names, and checks dtypes
    and shapes once per distinct signature (a shape-keyed cache)."""

    def __init__(self, specs: Sequence[InputSpec], spaces: MemorySpaces):
        self.specs = list(specs)
        self.names = [s.name for s in self.specs]
        self._spaces = spaces
        self._all_tensors = all(s.is_tensor for s in self.specs)
        self._checked: set = set()
        # (type, dtype, shape) of each argument of the latest run, in input order (stats()
        # plans its activation memory from it): the key the checks compute anyway
        self.last: tuple | None = None

    def arguments(self, feeds: Mapping[str, Any]) -> list:
        """The plan's arguments for ``feeds``, in input order, checked."""
        try:
            args = [feeds[name] for name in self.names]
        except KeyError:
            args = self._fill_defaults(feeds)
        except TypeError:
            raise InvalidInputError(
                f"feeds must be a mapping of input name to array, got {type(feeds).__name__}"
            ) from None
        if len(feeds) > len(args) or (len(feeds) != len(args) and any(n not in self.names for n in feeds)):
            self._check_unknown(feeds)
        if not self._all_tensors:
            args = [self._as_array(s, a) if s.is_tensor else a for s, a in zip(self.specs, args)]
            self.check([a for s, a in zip(self.specs, args) if s.is_tensor], tensors_only=True)
            self.last = tuple((type(a), getattr(a, "dtype", None), getattr(a, "shape", None)) for a in args)
            return args
        try:
            key = tuple([(type(a), a.dtype, a.shape) for a in args])
        except AttributeError:
            args = [self._as_array(s, a) for s, a in zip(self.specs, args)]
            key = tuple([(type(a), a.dtype, a.shape) for a in args])
        if key not in self._checked:
            if not all(t is np.ndarray for t, _, _ in key):  # subclasses become ndarrays; device arrays must be owned
                args = [self._as_array(s, a) for s, a in zip(self.specs, args)]
            self.check(args)
            # a signature with an ndarray subclass is never cached: its arrays are converted on every run
            if not any(t is not np.ndarray and issubclass(t, np.ndarray) for t, _, _ in key):
                if len(self._checked) >= _SIGNATURE_CACHE_SIZE:
                    self._checked.clear()
                self._checked.add(key)
        self.last = key
        return args

    def note(self, feeds: Mapping[str, Any]) -> None:
        """Record ``feeds`` as the latest run's (a run served without :meth:`arguments`:
        a plain-run graph's replay); an input not fed counts with its default."""
        values = [feeds[s.name] if s.name in feeds else s.default for s in self.specs]
        self.last = tuple((type(v), getattr(v, "dtype", None), getattr(v, "shape", None)) for v in values)

    def last_shapes(self) -> list[tuple[int, ...] | None] | None:
        """Each input's shape in the latest run (None for one without a shape), or None before any run."""
        last = self.last
        return None if last is None else [shape for _, _, shape in last]

    def _as_array(self, spec: InputSpec, value: Any) -> Any:
        if type(value) is np.ndarray:
            return value
        if isinstance(value, np.ndarray):  # np.matrix and other subclasses: kernels get plain arrays
            return np.asarray(value).view(np.ndarray)
        if isinstance(value, np.generic) or isinstance(value, (int, float, bool, list, tuple)):
            if spec.dtype is not None and not isinstance(value, np.generic):
                return np.asarray(value, dtype=spec.dtype)
            return np.asarray(value)
        if self._spaces.owner(value) is not None:
            return value
        raise InvalidInputError(
            f"input {spec.name!r} must be a numpy array (or an array of a provider's device memory), "
            f"got {type(value).__name__}",
            input_name=spec.name,
        )

    def _fill_defaults(self, feeds: Mapping[str, Any]) -> list:
        self._check_unknown(feeds)
        args = []
        for spec in self.specs:
            if spec.name in feeds:
                args.append(feeds[spec.name])
            elif spec.default is not None:
                args.append(spec.default)
            elif not spec.is_tensor and spec.info.kind == "optional":
                args.append(None)
            else:
                raise MissingInputError(spec.name, [s.name for s in self.specs if s.default is None])
        return args

    def _check_unknown(self, feeds: Mapping[str, Any]) -> None:
        for name in feeds:
            if name not in self.names:
                raise UnknownInputError(name, self.names)

    def check(self, args: Sequence[Any], tensors_only: bool = False) -> None:
        """Dtype, rank and shape of each array against the declared ones; a symbolic
        dimension must have one size across all inputs that are not empty along it (a
        nonzero size disagreeing with another could broadcast into a wrong answer; an
        empty input cannot)."""
        specs = [s for s in self.specs if s.is_tensor] if tensors_only else self.specs
        bound: dict[str, tuple[str, int, int]] = {}
        for spec, array in zip(specs, args):
            if spec.dtype is not None and array.dtype != spec.dtype:
                if not (spec.dtype == object and array.dtype.kind in "OU"):
                    raise InputDtypeError(spec.name, str(spec.dtype), str(array.dtype))
            if spec.dims is None:
                continue
            declared = "[" + ", ".join("?" if d is None else str(d) for d in spec.dims) + "]"
            if len(array.shape) != len(spec.dims):
                raise InputRankError(spec.name, len(spec.dims), len(array.shape), declared)
            for axis, (want, got) in enumerate(zip(spec.dims, array.shape)):
                if want is None:
                    continue
                if isinstance(want, int):
                    if want != got and want >= 0:
                        raise InputShapeError(spec.name, axis, want, got, declared)
                    continue
                if got == 0:
                    # an empty input holds no values that a disagreement could misplace: the
                    # kernels see true shapes, and a graph that cannot compute it fails there
                    # (optimum's merged decoders feed empty past tensors on their first step)
                    continue
                previous = bound.get(want)
                if previous is None:
                    bound[want] = (spec.name, axis, got)
                elif previous[2] != got:
                    raise SymbolConflictError(want, previous, (spec.name, axis, got))
