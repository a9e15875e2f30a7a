"""Border checks between plugrt and what it does not control: providers and hostile models."""

from __future__ import annotations

import contextlib
import dataclasses
import contextvars
import functools
import math
from typing import Any, Callable, Iterator, Sequence, TypeVar

import numpy as np
import onnx_ir as ir

from .errors import ModelBuildError, ModelLimitError, PlugrtError, RunError
from .loader import LoadLimits
from .provider import CompiledPartition, Partition, Step

__all__ = [
    "tensor_limit",
    "planned_output_bytes",
    "check_compiled",
    "guard_step",
    "protect_inputs",
    "typed_load_errors",
    "typed_run_errors",
]

#: The largest tensor (logical bytes) a kernel may produce, for the build under way.
_TENSOR_LIMIT: contextvars.ContextVar[int] = contextvars.ContextVar(
    "plugrt_tensor_limit", default=LoadLimits().tensor_bytes
)

#: The built-in provider: its kernels are tested against ONNX's data, so their outputs
#: are not re-checked against declared types on every call (the per-node path stays tight).
_BUILT_IN = "cpu"

#: Ops whose output can be far larger than their inputs (a few bytes of shape make
#: gigabytes): their outputs are measured before anything reads them. Expand returns a
#: broadcast view that costs nothing until a reduction walks all of it.
_AMPLIFYING = frozenset(
    {
        "ConstantOfShape", "Expand", "Tile", "Range", "Resize", "Upsample", "Pad", "OneHot",
        "EyeLike", "CenterCropPad", "RandomNormal", "RandomUniform", "Multinomial", "Col2Im",
        "MaxUnpool", "ConvTranspose", "StringSplit", "Einsum",
    }
)


@contextlib.contextmanager
def tensor_limit(max_bytes: int) -> Iterator[None]:
    """Within this block, built plans refuse kernel outputs over ``max_bytes``."""
    token = _TENSOR_LIMIT.set(max_bytes)
    try:
        yield
    finally:
        _TENSOR_LIMIT.reset(token)


# -- compile results ----------------------------------------------------------------------


def check_compiled(result: Any, partition: Partition, provider: str) -> None:
    """Raise TypeError when ``compile`` returned something the plan cannot run, so the
    partition falls back to the next provider with the reason in the placement report."""
    if not isinstance(result, CompiledPartition):
        raise TypeError(f"{provider}.compile returned {type(result).__name__}, not a CompiledPartition")
    if not isinstance(result.steps, (list, tuple)):
        raise TypeError(f"{provider}.compile returned steps of type {type(result.steps).__name__}, not a list")
    produced: set[ir.Value] = set()
    for index, step in enumerate(result.steps):
        if not isinstance(step, Step) or not callable(step.fn):
            raise TypeError(f"{provider}.compile returned step {index} ({type(step).__name__}) that is not a callable Step")
        if not isinstance(step.inputs, (list, tuple)) or not isinstance(step.outputs, (list, tuple)):
            raise TypeError(f"{provider}.compile returned step {step.name or index!r} without input and output lists")
        for value in (*step.inputs, *step.outputs):
            if value is not None and not isinstance(value, ir.Value):
                raise TypeError(f"{provider}.compile returned step {step.name or index!r} naming {value!r}, not an ir.Value")
        produced.update(v for v in step.outputs if v is not None)
    missing = [v.name for v in partition.outputs if v not in produced]
    if missing:
        raise TypeError(f"{provider}.compile returned steps that never produce {missing}")


# -- kernel outputs -----------------------------------------------------------------------


def _expected(value: ir.Value | None) -> tuple[np.dtype | None, tuple[int | None, ...] | None]:
    """The dtype and shape (None for an unknown dimension) a value is declared with."""
    if value is None or not isinstance(value.type, ir.TensorType):
        return None, None
    dtype: np.dtype | None
    try:
        dtype = None if value.dtype in (None, ir.DataType.STRING) else np.dtype(value.dtype.numpy())
    except (TypeError, ValueError, AttributeError):
        dtype = None
    shape = None
    if value.shape is not None:
        shape = tuple(d if isinstance(d, int) else None for d in value.shape)
    return dtype, shape


def _contradiction(array: Any, dtype: np.dtype | None, shape: tuple[int | None, ...] | None) -> str | None:
    got_dtype = getattr(array, "dtype", None)
    got_shape = getattr(array, "shape", None)
    if got_dtype is None or got_shape is None:
        return None  # a sequence, optional or map: its type is checked by its consumers
    if dtype is not None and got_dtype != dtype:
        return f"dtype {got_dtype}, but the model declares {dtype}"
    if shape is not None and (
        len(got_shape) != len(shape) or any(e is not None and e != g for e, g in zip(shape, got_shape))
    ):
        shown = [("?" if d is None else d) for d in shape]
        return f"shape {list(got_shape)}, but the model declares {shown}"
    return None


def _size_check(limit: int) -> Callable[[Any, str, str], None]:
    def check(array: Any, name: str, op_type: str) -> None:
        size = getattr(array, "size", None)
        itemsize = getattr(getattr(array, "dtype", None), "itemsize", None)
        if isinstance(size, int) and isinstance(itemsize, int) and size * itemsize > limit:
            # a broadcast view or a lazily committed allocation: refused before any
            # consumer walks it
            raise ModelLimitError("tensor_bytes", size * itemsize, limit, source=f"node {name!r} ({op_type})")

    return check


def planned_output_bytes(op_type: str, args: Sequence[Any], itemsize: int) -> int | None:
    """The output size in bytes of a size-amplifying op, from its inputs, before it runs
    (None when the op is not one whose size follows from its inputs alone)."""
    try:
        if op_type == "ConstantOfShape" and args and args[0] is not None:
            return math.prod(int(d) for d in np.asarray(args[0]).reshape(-1)) * itemsize
        if op_type == "Expand" and len(args) >= 2:
            x, shape = args[0], np.asarray(args[1]).reshape(-1)
            target = np.broadcast_shapes(tuple(x.shape), tuple(int(d) for d in shape))
            return math.prod(target) * x.dtype.itemsize
        if op_type == "Tile" and len(args) >= 2:
            x, repeats = args[0], np.asarray(args[1]).reshape(-1)
            return math.prod(int(d) * max(int(r), 0) for d, r in zip(x.shape, repeats)) * x.dtype.itemsize
        if op_type == "Range" and len(args) >= 3:
            start, limit, delta = (np.asarray(a).item() for a in args[:3])
            if delta == 0:
                return None
            return max(math.ceil((limit - start) / delta), 0) * np.asarray(args[0]).dtype.itemsize
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None  # malformed inputs: the kernel reports them
    return None


def guard_step(step: Step, provider: str, declared: frozenset[ir.Value] = frozenset()) -> Step:
    """``step`` with border checks where they are needed, or ``step`` itself.

    - size-amplifying ops: the output size is computed from the inputs first where the op
      allows (ConstantOfShape, Expand, Tile, Range), and measured after the call for the
      others; above ``limits.tensor_bytes`` the run raises ModelLimitError;
    - a third-party provider's steps: an output whose dtype or shape contradicts the
      declared (or inferred) type is an error, which the plan reports as KernelError
      naming the node and provider; the built-in provider's steps producing a value in
      ``declared`` (the graph's outputs) have their dtype checked.
    """
    limit = _TENSOR_LIMIT.get()
    amplifying = step.op_type in _AMPLIFYING
    typed = provider != _BUILT_IN or any(v in declared for v in step.outputs if v is not None)
    if not amplifying and not typed:
        return step
    fn, name, op_type, multi, count = step.fn, step.name, step.op_type, step.multi_output, len(step.outputs)
    expectations = [_expected(v) if typed else (None, None) for v in step.outputs]
    if provider == _BUILT_IN:
        # a graph output's declared shape may be wrong in a model that onnxruntime runs
        # (with a warning); its dtype may not
        expectations = [(dtype, None) for dtype, _ in expectations]
    itemsize = next((d.itemsize for d, _ in expectations if d is not None), 1)
    if amplifying and step.outputs and step.outputs[0] is not None:
        declared_dtype, _ = _expected(step.outputs[0])
        itemsize = declared_dtype.itemsize if declared_dtype is not None else 1
    size_check = _size_check(limit)
    check_types = any(d is not None or s is not None for d, s in expectations)

    @functools.wraps(fn)
    def checked(*args: Any) -> Any:
        if amplifying:
            planned = planned_output_bytes(op_type, args, itemsize)
            if planned is not None and planned > limit:
                raise ModelLimitError("tensor_bytes", planned, limit, source=f"node {name!r} ({op_type})")
        result = fn(*args)
        outputs = result[:count] if multi else (result,)
        for array, (dtype, shape) in zip(outputs, expectations):
            if amplifying:
                size_check(array, name, op_type)
            if check_types:
                problem = _contradiction(array, dtype, shape)
                if problem is not None:
                    raise TypeError(f"{provider} returned an output of {problem}")
        return result

    into = _into_of(fn)
    if into is not None:
        # a capture replays through ``into`` with the shapes and sizes checked when it was
        # recorded (through ``checked``)
        checked.into = into  # type: ignore[attr-defined]
    return dataclasses.replace(step, fn=checked, inplace=None)  # an in-place variant would bypass the checks


def _into_of(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """The ``into(out, *inputs)`` variant a kernel offers for captures, attributes bound."""
    into = getattr(fn, "into", None)
    if into is not None:
        return into
    base, keywords = (fn.func, fn.keywords) if isinstance(fn, functools.partial) else (fn, {})
    if isinstance(base, np.ufunc):
        return lambda out, *args: base(*args, out=out, **keywords)
    into = getattr(base, "into", None)
    return functools.partial(into, **keywords) if into is not None else None


# -- the run border -------------------------------------------------------------------------


def protect_inputs(args: Sequence[Any]) -> list[Any]:
    """Read-only views of the caller's arrays: a kernel that writes into its input fails
    (KernelError) instead of changing the caller's data. A view costs no copy."""
    protected = []
    for array in args:
        if type(array) is np.ndarray and array.flags.writeable:
            array = array.view()
            array.flags.writeable = False
        protected.append(array)
    return protected


# -- the error contract ---------------------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])


def _typed_errors(wrap: Callable[[Exception], PlugrtError]) -> Callable[[F], F]:
    """A decorator turning anything but a PlugrtError (or MemoryError) out of ``fn`` into
    ``wrap(exc)``, the original chained."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except (PlugrtError, MemoryError):
                raise
            except Exception as exc:
                raise wrap(exc) from exc

        return wrapper  # type: ignore[return-value]

    return decorate


#: Anything unanticipated out of building a session becomes ModelBuildError.
typed_load_errors = _typed_errors(ModelBuildError)
#: Anything unanticipated out of a run, capture or replay becomes RunError.
typed_run_errors = _typed_errors(RunError)
