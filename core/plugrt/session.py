"""The session: build a model once for a device intent, then run it many times."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from . import passes
from ._dtypes import numpy_dtype
from .bindings import DeviceBinding
from .build import BuiltGraph, build_graph
from .capture import Captured, CapturedPlan, CaptureReport
from .epcontext import export_context_model, required_providers, restore_context_nodes
from .errors import (
    InputDtypeError,
    InputRankError,
    InputShapeError,
    InvalidInputError,
    InvalidOptionValueError,
    MissingInputError,
    NoCaptureError,
    OptionError,
    SymbolConflictError,
    UnknownInputError,
)
from .intent import Selection, resolve_device
from .ir_utils import tensor_array
from .loader import LoadLimits, ModelSource, load_model
from .options import SessionOptions, parse_options
from .placement import PlacementReport
from .provider import Device, DeviceKind, NotCapturable
from .registry import ProviderRegistry, default_registry

__all__ = ["TensorInfo", "ModelMetadata", "Session", "SessionBuilder", "load"]

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


def _tensor_info(value: ir.Value) -> TensorInfo:
    kind, type_string, dtype = _type_string(value.type)
    shape = None
    if value.shape is not None:
        dims = []
        for dim in value.shape:
            if isinstance(dim, int):
                dims.append(dim)
            else:
                dims.append(dim.value if getattr(dim, "value", None) is not None else None)
        shape = tuple(dims)
    return TensorInfo(value.name, dtype, shape, kind, type_string)


class _InputSpec:
    """What run() checks of one input, prepared at build."""

    __slots__ = ("name", "info", "dtype", "dims", "default", "is_tensor")

    def __init__(self, info: TensorInfo, default: Any):
        self.name = info.name
        self.info = info
        self.dtype = info.dtype
        self.dims = info.shape
        self.default = default
        self.is_tensor = info.kind == "tensor"


class Session:
    """A model built for a device; ``run`` it many times.

    Use :func:`plugrt.load` or :class:`SessionBuilder` rather than this constructor.
    """

    def __init__(
        self,
        model: ModelSource,
        *,
        device: str | None = "auto",
        providers: Sequence[str] | None = None,
        options: Mapping[str, Any] | None = None,
        registry: ProviderRegistry | None = None,
    ) -> None:
        started = time.perf_counter()
        self.options: SessionOptions = parse_options(dict(options or {}))
        disabled = self.options["disabled_providers"]
        if registry is None:
            registry = default_registry() if not disabled else ProviderRegistry(disabled=disabled)
        self.registry = registry
        limits = LoadLimits(
            model_bytes=self.options["limits.model_bytes"],
            tensor_bytes=self.options["limits.tensor_bytes"],
            nodes=self.options["limits.nodes"],
            subgraph_depth=self.options["limits.subgraph_depth"],
        )
        if self.options["intra_op_num_threads"]:
            _limit_blas_threads(self.options["intra_op_num_threads"])
        loaded = load_model(model, limits)
        self.model_path = loaded.source if loaded.base_dir else None
        self._model = loaded.model
        self.selection: Selection = resolve_device(device, providers, registry)
        ir_model = loaded.model

        # Metadata is read before passes change the graph.
        self.inputs: list[TensorInfo] = [_tensor_info(v) for v in ir_model.graph.inputs]
        self.outputs: list[TensorInfo] = [_tensor_info(v) for v in ir_model.graph.outputs]
        self.metadata = ModelMetadata(
            producer_name=ir_model.producer_name or "",
            producer_version=ir_model.producer_version or "",
            graph_name=ir_model.graph.name or "",
            domain=ir_model.domain or "",
            description=ir_model.doc_string or "",
            version=int(ir_model.model_version or 0),
            custom_metadata_map=dict(ir_model.metadata_props),
            opset_imports={d or "ai.onnx": v for d, v in ir_model.opset_imports.items()},
        )

        opsets = {("" if d == "ai.onnx" else d): v for d, v in ir_model.opset_imports.items()}
        context_dir = loaded.base_dir or os.path.dirname(os.path.abspath(self.options["ep.context_file_path"] or "."))
        restored = restore_context_nodes(ir_model.graph, registry, context_dir, opsets)
        if restored:
            needed = [p for p in required_providers(ir_model.graph, registry) if p not in self.selection.providers]
            # a context node runs only on the provider that made it: add it ahead of the fallback
            self.selection.providers[-1:-1] = needed
            for provider in needed:
                self.selection.devices.setdefault(provider.name, registry.devices(provider.name)[0])

        chosen = self.selection.providers
        passes.inline_functions(ir_model, chosen)
        passes.expand_unsupported_functions(ir_model, chosen)
        if len(chosen) > 1 or self.options["optimization"] == "all":
            # providers decide on dtypes, and the plan writes large elementwise results
            # in place: both need value types and shapes
            passes.infer_types(ir_model)
        # constants fold on the host fallback wherever the list puts it: an accelerator
        # listed last would evaluate few ops and leave every later pass nothing to fuse
        host = [p for p in chosen if self.selection.devices[p.name].kind == DeviceKind.CPU]
        fold_provider = host[-1] if host else (chosen[-1] if chosen else None)
        self.optimization_stats = passes.optimize(
            ir_model,
            self.options["optimization"],
            fold_provider,
            chosen,
            # a folded constant is no bigger than what every run would compute anyway
            max_fold_bytes=self.options["limits.tensor_bytes"],
        )
        # Unique node names: placement reports, errors and EPContext export refer to them.
        passes.name_nodes(ir_model)
        opsets = {("" if d == "ai.onnx" else d): v for d, v in ir_model.opset_imports.items()}
        self._built: BuiltGraph = build_graph(
            ir_model.graph,
            chosen,
            opsets,
            registry=registry,
            strict=self.options["strict"],
            pinned=self.selection.pinned,
            profile=self.options["profiling"],
            devices=self.selection.devices,
            restored=restored,
        )
        self._plan = self._built.plan
        self._specs = [
            _InputSpec(
                info,
                tensor_array(value.const_value) if value.const_value is not None else None,
            )
            for info, value in zip(self.inputs, ir_model.graph.inputs)
        ]
        self._input_names = [s.name for s in self._specs]
        self._all_tensors = all(s.is_tensor for s in self._specs)
        self._output_index = {info.name: i for i, info in enumerate(self.outputs)}
        self._checked: set = set()
        self._capture: CapturedPlan | None = None
        self.context_model_path: str | None = None
        if self.options["ep.context_enable"]:
            self.context_model_path = self._export_context(model)
        self.build_seconds = time.perf_counter() - started

    def _export_context(self, source: ModelSource) -> str:
        path = self.options["ep.context_file_path"]
        if path is None:
            if self.model_path is None:
                raise InvalidOptionValueError(
                    "ep.context_file_path", None, "a file path when the model is given as bytes"
                )
            stem, _ = os.path.splitext(self.model_path)
            path = f"{stem}_ctx.onnx"
        written, _ = export_context_model(self, path, self.options["ep.context_embed_mode"])
        return written

    # -- introspection ---------------------------------------------------------------------

    @property
    def placement(self) -> PlacementReport:
        """Where each node runs, fallbacks with their reasons, and transfers."""
        return self._built.report

    @property
    def providers(self) -> list[str]:
        """The providers this session uses, in priority order."""
        return [p.name for p in self.selection.providers]

    @property
    def devices(self) -> dict[str, Device]:
        return dict(self.selection.devices)

    @property
    def compiled_partitions(self) -> list:
        """The compiled partitions, in execution order (restored ones included)."""
        return list(self._built.compiled)

    @property
    def model(self) -> ir.Model:
        """The model as built: after inlining, expansion and optimisation passes."""
        return self._model

    def rebuilt_with(self, replacements: Mapping[str, Any]) -> "Session":
        """A copy of this session whose partitions named in ``replacements`` are the given
        compiled partitions (e.g. restored from an EPContext); the rest are reused."""
        compiled = [replacements.get(cp.partition.name, cp) for cp in self._built.compiled]
        clone = object.__new__(Session)
        clone.__dict__.update(self.__dict__)
        opsets = {("" if d == "ai.onnx" else d): v for d, v in self._model.opset_imports.items()}
        clone._built = build_graph(
            self._model.graph,
            self.selection.providers,
            opsets,
            registry=self.registry,
            precompiled=compiled,
            profile=self.options["profiling"],
            devices=self.selection.devices,
        )
        clone._plan = clone._built.plan
        clone._checked = set()
        return clone

    @property
    def plan_source(self) -> str:
        """The generated Python of the execution plan (for debugging)."""
        return self._plan.source

    def profile(self) -> list[dict]:
        """Chrome-trace events of the runs so far (needs ``profiling=True``)."""
        records = self._plan.profile_records
        if records is None:
            raise OptionError("profiling is off; build the session with profiling=True", key="profiling")
        infos = self._plan.infos
        return [
            {
                "name": infos[i].name,
                "cat": infos[i].op_type,
                "ph": "X",
                "ts": start * 1e6,
                "dur": (end - start) * 1e6,
                "pid": os.getpid(),
                "tid": 0,
                "args": {"provider": infos[i].provider, "op_type": infos[i].op_type},
            }
            for i, start, end in records
        ]

    # -- running ---------------------------------------------------------------------------

    def run(
        self,
        feeds: Mapping[str, Any] | None = None,
        output_names: Iterable[str] | None = None,
        *,
        bindings: Sequence[DeviceBinding] = (),
    ) -> dict[str, Any]:
        """Run the model. ``feeds`` maps input names to arrays; returns outputs by name.

        With ``bindings``, bound inputs are read from their buffers and bound outputs are
        stored into theirs and returned as None (their bytes stay on the device).
        """
        if bindings:
            return self._run_bound(dict(feeds or {}), bindings)
        values = self._run_plan(feeds or {})
        if output_names is None:
            return {info.name: _deliver(v) for info, v in zip(self.outputs, values)}
        return {name: _deliver(values[self._output_index_of(name)]) for name in output_names}

    # -- device bindings ---------------------------------------------------------------

    def allocate_binding(
        self,
        input: str | None = None,
        output: str | None = None,
        *,
        dtype: Any = None,
        shape: Sequence[int] | None = None,
        capacity: Sequence[int] | None = None,
    ) -> DeviceBinding:
        """A persistent buffer on the session's device bound to ``input``, ``output`` or
        both (one buffer carrying state across runs). ``capacity`` (default ``shape``)
        may exceed the logical ``shape``; both default to the declared ones."""
        info = self._info_for(input, output)
        dtype = np.dtype(dtype if dtype is not None else info.dtype)
        if shape is None:
            if info.shape is None or not all(isinstance(d, int) for d in info.shape):
                raise InvalidInputError(
                    f"binding {info.name!r} has symbolic dims {info.shape}; pass shape=", input_name=input
                )
            shape = info.shape
        capacity = tuple(capacity) if capacity is not None else tuple(shape)
        provider, device = self._binding_provider()
        allocate = getattr(provider, "allocate", None) if provider is not None else None
        buffer = allocate(capacity, dtype, device) if allocate is not None else np.zeros(capacity, dtype)
        return DeviceBinding(
            input=input,
            output=output,
            buffer=buffer,
            shape=shape,
            device=device,
            upload=(lambda host, target: provider.upload(host, target)) if hasattr(provider, "upload") else None,
            download=getattr(provider, "to_host", None) if allocate is not None else None,
        )

    def bind_array(self, array: np.ndarray, *, input: str | None = None, output: str | None = None) -> DeviceBinding:
        """Bind caller-owned host memory (a numpy array) to an input and/or output."""
        self._info_for(input, output)
        if not isinstance(array, np.ndarray):
            raise InvalidInputError("bind_array needs a numpy array", input_name=input)
        return DeviceBinding(
            input=input, output=output, buffer=array, shape=array.shape, device=self.devices.get(self.providers[-1]),
            caller_owned=True,
        )

    def _info_for(self, input: str | None, output: str | None) -> TensorInfo:
        if input is None and output is None:
            raise InvalidInputError("name an input, an output, or both")
        if input is not None and input not in self._input_names:
            raise UnknownInputError(input, self._input_names)
        if output is not None and output not in self._output_index:
            raise InvalidInputError(f"unknown output {output!r}; the model's outputs are {list(self._output_index)}")
        return self.inputs[self._input_names.index(input)] if input is not None else self.outputs[self._output_index[output]]

    def _binding_provider(self):
        """The provider whose memory bindings live in: the first one with its own memory."""
        for provider in self.selection.providers:
            if getattr(provider, "memory", "host") != "host" and hasattr(provider, "allocate"):
                return provider, self.selection.devices.get(provider.name)
        return None, self.selection.devices.get(self.providers[-1]) if self.providers else None

    def _run_bound(self, feeds: dict[str, Any], bindings: Sequence[DeviceBinding]) -> dict[str, Any]:
        for binding in bindings:
            if binding.input is not None:
                feeds[binding.input] = binding.view()
        values = self._run_plan(feeds)
        return self._store_bound(values, bindings)

    def _store_bound(self, values: list, bindings: Sequence[DeviceBinding]) -> dict[str, Any]:
        bound = {b.output: b for b in bindings if b.output is not None}
        result = {}
        for info, value in zip(self.outputs, values):
            binding = bound.get(info.name)
            if binding is None:
                result[info.name] = _deliver(value)
            else:
                binding.store(value)
                result[info.name] = None
        return result

    # -- capture and replay --------------------------------------------------------------

    def try_capture(
        self, feeds: Mapping[str, Any] | None = None, *, bindings: Sequence[DeviceBinding] = ()
    ) -> "Captured | NotCapturable":
        """Record the plan for these input shapes (and bindings) so ``replay`` can re-run
        it without checks or allocation. Returns Captured (with a report of captured
        segments and eager seams) or NotCapturable (every node declined, with reasons)."""
        self.reset()
        captured = CapturedPlan(self, dict(feeds or {}), bindings)
        if not captured.report.segments:
            return NotCapturable(captured.report.seams)
        self._capture = captured
        return Captured(captured.report)

    def replay(
        self, feeds: Mapping[str, Any] | None = None, *, bindings: Sequence[DeviceBinding] | None = None
    ) -> dict[str, Any]:
        """Re-run the capture. ``feeds`` refill the captured input buffers (same shapes);
        bound inputs are read from their buffers as they are now."""
        captured = self._capture
        if captured is None:
            raise NoCaptureError()
        captured.check(bindings)
        if feeds:
            captured.load_feeds(dict(feeds))
        values = captured.replay()
        if values is None:  # an eager seam changed shape: this run goes the plain way
            return self.run(captured.current_feeds(), bindings=captured.bindings)
        return self._store_bound(values, captured.bindings)

    def reset(self) -> None:
        """Drop the capture (required before shapes change or bindings are freed)."""
        self._capture = None

    @property
    def capture_report(self) -> "CaptureReport | None":
        return self._capture.report if self._capture is not None else None

    def run_list(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any]) -> list:
        values = self._run_plan(feeds)
        if not output_names:
            return [_deliver(v) for v in values]
        return [_deliver(values[self._output_index_of(name)]) for name in output_names]

    def _output_index_of(self, name: str) -> int:
        try:
            return self._output_index[name]
        except KeyError:
            raise InvalidInputError(
                f"unknown output {name!r}; the model's outputs are {list(self._output_index)}"
            ) from None

    def _run_plan(self, feeds: Mapping[str, Any]) -> list:
        try:
            args = [feeds[name] for name in self._input_names]
        except KeyError:
            args = self._fill_defaults(feeds)
        except TypeError:
            raise InvalidInputError(f"feeds must be a mapping of input name to array, got {type(feeds).__name__}") from None
        if len(feeds) > len(args) or (len(feeds) != len(args) and any(n not in self._input_names for n in feeds)):
            self._check_unknown(feeds)
        if self._all_tensors:
            try:
                key = tuple([(a.dtype, a.shape) for a in args])
            except AttributeError:
                args = [a if isinstance(a, np.ndarray) else self._as_array(s, a) for s, a in zip(self._specs, args)]
                key = tuple([(a.dtype, a.shape) for a in args])
            if key not in self._checked:
                self._check_signature(args)
                if len(self._checked) >= _SIGNATURE_CACHE_SIZE:
                    self._checked.clear()
                self._checked.add(key)
        else:
            args = [self._as_array(s, a) if s.is_tensor else a for s, a in zip(self._specs, args)]
            self._check_signature([a for s, a in zip(self._specs, args) if s.is_tensor], tensors_only=True)
        return self._plan.run(*args)

    @staticmethod
    def _as_array(spec: _InputSpec, value: Any) -> np.ndarray:
        if isinstance(value, np.ndarray):
            return value
        if isinstance(value, np.generic) or isinstance(value, (int, float, bool, list, tuple)):
            array = np.asarray(value, dtype=spec.dtype) if spec.dtype is not None and not isinstance(value, np.generic) else np.asarray(value)
            return array
        raise InvalidInputError(
            f"input {spec.name!r} must be a numpy array, got {type(value).__name__}", input_name=spec.name
        )

    def _fill_defaults(self, feeds: Mapping[str, Any]) -> list:
        self._check_unknown(feeds)
        args = []
        for spec in self._specs:
            if spec.name in feeds:
                args.append(feeds[spec.name])
            elif spec.default is not None:
                args.append(spec.default)
            elif not spec.is_tensor and spec.info.kind == "optional":
                args.append(None)
            else:
                raise MissingInputError(spec.name, [s.name for s in self._specs if s.default is None])
        return args

    def _check_unknown(self, feeds: Mapping[str, Any]) -> None:
        for name in feeds:
            if name not in self._input_names:
                raise UnknownInputError(name, self._input_names)

    def _check_signature(self, args: list, tensors_only: bool = False) -> None:
        specs = [s for s in self._specs if s.is_tensor] if tensors_only else self._specs
        bound: dict[str, tuple[str, int, int]] = {}
        for spec, array in zip(specs, args):
            if spec.dtype is not None and array.dtype != spec.dtype:
                if not (spec.dtype == object and array.dtype.kind in "OU"):
                    raise InputDtypeError(spec.name, str(spec.dtype), str(array.dtype))
            if spec.dims is None:
                continue
            declared = "[" + ", ".join("?" if d is None else str(d) for d in spec.dims) + "]"
            if array.ndim != len(spec.dims):
                raise InputRankError(spec.name, len(spec.dims), array.ndim, declared)
            for axis, (want, got) in enumerate(zip(spec.dims, array.shape)):
                if want is None:
                    continue
                if isinstance(want, int):
                    if want != got and want >= 0:
                        raise InputShapeError(spec.name, axis, want, got, declared)
                    continue
                previous = bound.get(want)
                if previous is None:
                    bound[want] = (spec.name, axis, got)
                elif previous[2] != got:
                    raise SymbolConflictError(want, previous, (spec.name, axis, got))


def _limit_blas_threads(threads: int) -> None:
    """Cap the host BLAS threads (process-wide: BLAS libraries have one pool). On a machine
    where other work holds cores, fewer BLAS threads than cores avoid long stalls."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads, user_api="blas")


def _deliver(value: Any) -> Any:
    """Outputs the caller may keep and mutate: arrays (never numpy scalars), own memory."""
    if isinstance(value, np.ndarray):
        return value if value.flags.writeable else value.copy()
    if isinstance(value, np.generic):
        return np.asarray(value)
    if isinstance(value, list):
        return [_deliver(v) for v in value]
    return value


class SessionBuilder:
    """Fluent construction: ``SessionBuilder().model(p).device("gpu").option(k, v).build()``."""

    def __init__(self) -> None:
        self._model: ModelSource | None = None
        self._device: str | None = "auto"
        self._providers: list[str] | None = None
        self._options: dict[str, Any] = {}
        self._warmup: int = 0
        self._registry: ProviderRegistry | None = None

    def model(self, path: str | os.PathLike) -> "SessionBuilder":
        self._model = path
        return self

    def model_bytes(self, data: bytes) -> "SessionBuilder":
        self._model = bytes(data)
        return self

    def device(self, device: str) -> "SessionBuilder":
        self._device = device
        return self

    def provider(self, name: str) -> "SessionBuilder":
        """Add an explicit provider (in priority order); the CPU fallback is added last."""
        self._providers = (self._providers or []) + [name]
        return self

    def option(self, key: str, value: Any) -> "SessionBuilder":
        self._options[key] = value
        return self

    def options(self, **options: Any) -> "SessionBuilder":
        self._options.update(options)
        return self

    def registry(self, registry: ProviderRegistry) -> "SessionBuilder":
        self._registry = registry
        return self

    def warmup(self, runs: int = 1) -> "SessionBuilder":
        """Run the model ``runs`` times on inputs of the declared shapes after building."""
        self._warmup = runs
        return self

    def build(self) -> Session:
        if self._model is None:
            raise OptionError("SessionBuilder needs a model: call .model(path) or .model_bytes(data)", key="model")
        session = Session(
            self._model,
            device=self._device,
            providers=self._providers,
            options=self._options,
            registry=self._registry,
        )
        if self._warmup:
            from .inputs import example_inputs

            feeds = example_inputs(session.inputs)
            for _ in range(self._warmup):
                session.run(feeds)
        return session


def load(model: ModelSource, device: str | None = "auto", **options: Any) -> Session:
    """Build a session for ``model`` (a path, os.PathLike or bytes) on ``device``.

    ``device``: "auto", "cpu", "gpu", "gpu:N", "cuda:N", a provider name, or a policy
    ("prefer_cpu", "prefer_gpu", "prefer_npu", "max_performance", "min_power").
    Options are strict; see ``plugrt.options.OPTIONS``. ``providers=[...]`` gives an
    explicit ordered provider list instead of a device.
    """
    providers = options.pop("providers", None)
    registry = options.pop("registry", None)
    return Session(model, device=device, providers=providers, options=options, registry=registry)
