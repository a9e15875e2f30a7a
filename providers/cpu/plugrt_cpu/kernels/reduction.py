"""Reduction kernels: Reduce*, ArgMax, ArgMin."""

from __future__ import annotations

from typing import Any, Callable

import ml_dtypes
import numpy as np

from .._registry import kernel

# Half-precision inputs are reduced in float32 and cast back: summing thousands of
# float16 values in float16 loses most of the result, and numpy has no fast bfloat16 loops.
_HALF_TYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))

def _accumulator(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float32) if dtype in _HALF_TYPES else dtype


def _float_work_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype log/exp/sqrt run in: float32 for half types, float64 for integers."""
    if dtype in _HALF_TYPES:
        return np.dtype(np.float32)
    return dtype if dtype.kind == "f" else np.dtype(np.float64)


def _cast(result: Any, dtype: np.dtype) -> Any:
    return result if result.dtype == dtype else result.astype(dtype)


# --- the reductions: fn(data, axes, keepdims) with axes a tuple (possibly empty) or None (all)


def _sum(data: np.ndarray, axes: Any, keepdims: bool) -> Any:
    return _cast(np.sum(data, axis=axes, keepdims=keepdims, dtype=_accumulator(data.dtype)), data.dtype)


def _mean(data: np.ndarray, axes: Any, keepdims: bool) -> Any:
    return _cast(np.mean(data, axis=axes, keepdims=keepdims, dtype=_accumulator(data.dtype)), data.dtype)


def _prod(data: np.ndarray, axes: Any, keepdims: bool) -> Any:
    return _cast(np.prod(data, axis=axes, keepdims=keepdims, dtype=_accumulator(data.dtype)), data.dtype)


def _extreme_identity(dtype: np.dtype, largest: bool) -> Any:
    """The identity of max (``largest=False``) or min (``largest=True``) for ``dtype``:
    what a reduction over an empty set yields."""
    if dtype == np.bool_:
        return largest
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.max if largest else info.min
    return np.inf if largest else -np.inf


def _max(data: np.ndarray, axes: Any, keepdims: bool) -> Any:
    initial = _extreme_identity(data.dtype, largest=False)
    return np.maximum.reduce(data, axis=axes, keepdims=keepdims, initial=initial)


def _min(data: np.ndarray, axes: Any, keepdims: bool) -> Any:
    initial = _extreme_identity(data.dtype, largest=True)
    return np.minimum.reduce(data, axis=axes, keepdims=keepdims, initial=initial)


def _l1(data: np.ndarray, axes: Any, keepdims: bool) -> Any:
    return _sum(np.abs(data), axes, keepdims)


def _sum_square(data: np.ndarray, axes: Any, keepdims: bool) -> Any:
    work = data.astype(_accumulator(data.dtype), copy=False)
    return _cast(np.sum(np.square(work), axis=axes, keepdims=keepdims), data.dtype)


def _l2(data: np.ndarray, axes: Any, keepdims: bool) -> Any:
    work = data.astype(_float_work_dtype(data.dtype), copy=False)
    return _cast(np.sqrt(np.sum(np.square(work), axis=axes, keepdims=keepdims)), data.dtype)


def _log_sum(data: np.ndarray, axes: Any, keepdims: bool) -> Any:
    work = data.astype(_float_work_dtype(data.dtype), copy=False)
    with np.errstate(divide="ignore"):  # the log of an empty (zero) sum is -inf by the spec
        return _cast(np.log(np.sum(work, axis=axes, keepdims=keepdims)), data.dtype)


def _log_sum_exp(data: np.ndarray, axes: Any, keepdims: bool) -> Any:
    work = data.astype(_float_work_dtype(data.dtype), copy=False)
    # Shift by the maximum for stability; where it is not finite (+-inf entries, empty
    # sets) shifting would give inf - inf, and an unshifted exp gives the right limit.
    shift = np.maximum.reduce(work, axis=axes, keepdims=True, initial=-np.inf)
    shift[~np.isfinite(shift)] = 0
    exp = np.subtract(work, shift)
    np.exp(exp, out=exp)
    with np.errstate(divide="ignore"):
        result = np.log(np.sum(exp, axis=axes, keepdims=True))
    result += shift
    if not keepdims:
        result = result.reshape(()) if axes is None else np.squeeze(result, axis=axes)
    return _cast(result, data.dtype)


# --- binding the reductions to the two ONNX signatures


def _axes_tuple(axes: Any) -> tuple[int, ...]:
    return tuple(int(a) for a in np.asarray(axes).reshape(-1).tolist())


def _with_axes_attribute(reduce: Callable[..., Any]) -> Callable[..., Any]:
    """The kernel for opsets where ``axes`` is an attribute (default: all axes)."""

    def run(data, *, axes=None, keepdims=1):
        return reduce(data, _axes_tuple(axes) if axes else None, bool(keepdims))

    return run


def _with_axes_input(reduce: Callable[..., Any]) -> Callable[..., Any]:
    """The kernel for opsets where ``axes`` is an optional input and an empty or
    absent ``axes`` means all axes, or no axis with ``noop_with_empty_axes``."""

    def run(data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
        if axes is not None and axes.size:
            reduce_axes: Any = _axes_tuple(axes)
        else:
            reduce_axes = () if noop_with_empty_axes else None
        return reduce(data, reduce_axes, bool(keepdims))

    return run


# (op, reduction, the version where axes became an input)
_REDUCTIONS = (
    ("ReduceSum", _sum, 13),
    ("ReduceMean", _mean, 18),
    ("ReduceProd", _prod, 18),
    ("ReduceMax", _max, 18),
    ("ReduceMin", _min, 18),
    ("ReduceL1", _l1, 18),
    ("ReduceL2", _l2, 18),
    ("ReduceSumSquare", _sum_square, 18),
    ("ReduceLogSum", _log_sum, 18),
    ("ReduceLogSumExp", _log_sum_exp, 18),
)

for _op, _reduce, _axes_input_version in _REDUCTIONS:
    kernel(_op, 1)(_with_axes_attribute(_reduce))
    kernel(_op, _axes_input_version)(_with_axes_input(_reduce))


# --- ArgMax / ArgMin


def _arg_extreme(find: Callable[..., Any], data: np.ndarray, axis: int, keepdims: int, select_last_index: int):
    if select_last_index:
        count = data.shape[axis]
        index = find(np.flip(data, axis), axis=axis, keepdims=bool(keepdims))
        index = (count - 1) - index
    else:
        index = find(data, axis=axis, keepdims=bool(keepdims))
    return index.astype(np.int64, copy=False)


@kernel("ArgMax", 1)
def arg_max(data, *, axis=0, keepdims=1, select_last_index=0):
    return _arg_extreme(np.argmax, data, axis, keepdims, select_last_index)


@kernel("ArgMin", 1)
def arg_min(data, *, axis=0, keepdims=1, select_last_index=0):
    return _arg_extreme(np.argmin, data, axis, keepdims, select_last_index)
