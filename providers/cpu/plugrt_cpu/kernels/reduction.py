"""Reduction kernels: Reduce*, ArgMax, ArgMin."""

from __future__ import annotations

from typing import Any, Callable

import ml_dtypes
import numpy as np

from .._registry import kernel, declare_into
from .elementwise import scratch

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
    initial: Any = _extreme_identity(data.dtype, largest=False)
    return np.max(data, axis=axes, keepdims=keepdims, initial=initial)  # maximum.reduce


def _min(data: np.ndarray, axes: Any, keepdims: bool) -> Any:
    initial: Any = _extreme_identity(data.dtype, largest=True)
    return np.min(data, axis=axes, keepdims=keepdims, initial=initial)  # minimum.reduce


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


# --- the same reductions into a given array (capture's ``into`` variants): the same numpy
# calls with ``out=``, casts and temporaries in work arrays kept for the next call


def _target(out: np.ndarray, slot: str, dtype: np.dtype) -> np.ndarray:
    """``out`` when it has ``dtype``, else a work array shaped like it (cast in by _finish)."""
    return out if out.dtype == dtype else scratch(out, slot, out.shape, dtype)


def _finish(out: np.ndarray, result: np.ndarray) -> None:
    if result is not out:
        np.copyto(out, result.reshape(out.shape), casting="unsafe")


def _as_work(out: np.ndarray, data: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """data.astype(dtype, copy=False), in a work array."""
    if data.dtype == dtype:
        return data
    work = scratch(out, "work", data.shape, dtype)
    np.copyto(work, data, casting="unsafe")
    return work


def _kept_shape(shape: tuple[int, ...], axes: Any) -> tuple[int, ...]:
    """The shape of a reduction over ``axes`` with keepdims."""
    if axes is None:
        return (1,) * len(shape)
    reduced = {a + len(shape) if a < 0 else a for a in axes}
    return tuple(1 if d in reduced else n for d, n in enumerate(shape))


def _sum_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype np.sum gives without ``dtype=``: small integers and bools widen."""
    if dtype.kind in "bi" and dtype.itemsize < np.dtype(np.int_).itemsize:
        return np.dtype(np.int_)
    if dtype.kind == "u" and dtype.itemsize < np.dtype(np.uint).itemsize:
        return np.dtype(np.uint)
    return dtype


def _accumulate_into(numpy_fn: Callable[..., Any]) -> Callable[..., None]:
    def into(out: np.ndarray, data: np.ndarray, axes: Any, keepdims: bool) -> None:
        accumulator = _accumulator(data.dtype)
        result = _target(out, "result", accumulator)
        numpy_fn(data, axis=axes, keepdims=keepdims, dtype=accumulator, out=result)
        _finish(out, result)

    return into


_sum_into = _accumulate_into(np.sum)
_mean_into = _accumulate_into(np.mean)
_prod_into = _accumulate_into(np.prod)


def _max_into(out: np.ndarray, data: np.ndarray, axes: Any, keepdims: bool) -> None:
    initial: Any = _extreme_identity(data.dtype, largest=False)
    np.maximum.reduce(data, axis=axes, keepdims=keepdims, initial=initial, out=out)


def _min_into(out: np.ndarray, data: np.ndarray, axes: Any, keepdims: bool) -> None:
    initial: Any = _extreme_identity(data.dtype, largest=True)
    np.minimum.reduce(data, axis=axes, keepdims=keepdims, initial=initial, out=out)


def _l1_into(out: np.ndarray, data: np.ndarray, axes: Any, keepdims: bool) -> None:
    _sum_into(out, np.abs(data, out=scratch(out, "abs", data.shape, data.dtype)), axes, keepdims)


def _sum_of_squares(out: np.ndarray, work: np.ndarray, axes: Any, keepdims: bool) -> np.ndarray:
    """np.sum(np.square(work), axis=axes, keepdims=keepdims), in work arrays."""
    square = np.square(work, out=scratch(out, "square", work.shape, work.dtype))
    dtype = _sum_dtype(square.dtype)
    return np.sum(square, axis=axes, keepdims=keepdims, dtype=dtype, out=_target(out, "result", dtype))


def _sum_square_into(out: np.ndarray, data: np.ndarray, axes: Any, keepdims: bool) -> None:
    work = _as_work(out, data, _accumulator(data.dtype))
    _finish(out, _sum_of_squares(out, work, axes, keepdims))


def _l2_into(out: np.ndarray, data: np.ndarray, axes: Any, keepdims: bool) -> None:
    work = _as_work(out, data, _float_work_dtype(data.dtype))
    total = _sum_of_squares(out, work, axes, keepdims)
    _finish(out, np.sqrt(total, out=total))


def _log_sum_into(out: np.ndarray, data: np.ndarray, axes: Any, keepdims: bool) -> None:
    work = _as_work(out, data, _float_work_dtype(data.dtype))
    total = np.sum(work, axis=axes, keepdims=keepdims, out=_target(out, "result", work.dtype))
    with np.errstate(divide="ignore"):
        np.log(total, out=total)
    _finish(out, total)


def _log_sum_exp_into(out: np.ndarray, data: np.ndarray, axes: Any, keepdims: bool) -> None:
    work = _as_work(out, data, _float_work_dtype(data.dtype))
    kept = _kept_shape(work.shape, axes)
    shift = scratch(out, "shift", kept, work.dtype)
    np.maximum.reduce(work, axis=axes, keepdims=True, initial=-np.inf, out=shift)
    unbounded = np.isfinite(shift, out=scratch(out, "unbounded", kept, np.bool_))
    np.logical_not(unbounded, out=unbounded)
    np.copyto(shift, 0, where=unbounded)
    exp = np.subtract(work, shift, out=scratch(out, "exp", work.shape, work.dtype))
    np.exp(exp, out=exp)
    result = np.sum(exp, axis=axes, keepdims=True, out=scratch(out, "result", kept, work.dtype))
    with np.errstate(divide="ignore"):
        np.log(result, out=result)
    result += shift
    np.copyto(out, result.reshape(out.shape), casting="unsafe")


_INTO = {
    _sum: _sum_into,
    _mean: _mean_into,
    _prod: _prod_into,
    _max: _max_into,
    _min: _min_into,
    _l1: _l1_into,
    _sum_square: _sum_square_into,
    _l2: _l2_into,
    _log_sum: _log_sum_into,
    _log_sum_exp: _log_sum_exp_into,
}


# --- binding the reductions to the two ONNX signatures


def _axes_tuple(axes: Any) -> tuple[int, ...]:
    return tuple(int(a) for a in np.asarray(axes).reshape(-1).tolist())


def _with_axes_attribute(reduce: Callable[..., Any]) -> Callable[..., Any]:
    """The kernel for opsets where ``axes`` is an attribute (default: all axes)."""

    def run(data, *, axes=None, keepdims=1):
        return reduce(data, _axes_tuple(axes) if axes else None, bool(keepdims))

    def run_into(out, data, *, axes=None, keepdims=1):
        _INTO[reduce](out, data, _axes_tuple(axes) if axes else None, bool(keepdims))

    declare_into(run_into, run)
    return run


def _with_axes_input(reduce: Callable[..., Any]) -> Callable[..., Any]:
    """The kernel for opsets where ``axes`` is an optional input and an empty or
    absent ``axes`` means all axes, or no axis with ``noop_with_empty_axes``."""

    def reduce_axes(axes: Any, noop_with_empty_axes: int) -> Any:
        if axes is not None and axes.size:
            return _axes_tuple(axes)
        return () if noop_with_empty_axes else None

    def run(data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
        return reduce(data, reduce_axes(axes, noop_with_empty_axes), bool(keepdims))

    def run_into(out, data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
        _INTO[reduce](out, data, reduce_axes(axes, noop_with_empty_axes), bool(keepdims))

    declare_into(run_into, run)
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


def _arg_extreme_into(find, out, data, axis: int, keepdims: int, select_last_index: int) -> None:
    # numpy's argmax copies its input to a contiguous one whose last axis is ``axis`` (so
    # always when reversed for select_last_index): that copy goes to a work array here.
    rows = np.moveaxis(data, axis, -1)
    if select_last_index:
        rows = rows[..., ::-1]
    if not rows.flags.c_contiguous:
        copy = scratch(out, "rows", rows.shape, rows.dtype)
        np.copyto(copy, rows)
        rows = copy
    if out.dtype == np.intp and out.flags.c_contiguous:
        index = out.reshape(rows.shape[:-1])
    else:
        index = scratch(out, "index", rows.shape[:-1], np.intp)
    find(rows, axis=-1, out=index)
    if select_last_index:
        np.subtract(rows.shape[-1] - 1, index, out=index)
    if not np.may_share_memory(index, out):
        np.copyto(out, index.reshape(out.shape), casting="unsafe")


@kernel("ArgMax", 1)
def arg_max(data, *, axis=0, keepdims=1, select_last_index=0):
    return _arg_extreme(np.argmax, data, axis, keepdims, select_last_index)


def _arg_max_into(out, data, *, axis=0, keepdims=1, select_last_index=0):
    _arg_extreme_into(np.argmax, out, data, axis, keepdims, select_last_index)


declare_into(_arg_max_into, arg_max)


@kernel("ArgMin", 1)
def arg_min(data, *, axis=0, keepdims=1, select_last_index=0):
    return _arg_extreme(np.argmin, data, axis, keepdims, select_last_index)


def _arg_min_into(out, data, *, axis=0, keepdims=1, select_last_index=0):
    _arg_extreme_into(np.argmin, out, data, axis, keepdims, select_last_index)


declare_into(_arg_min_into, arg_min)
