"""Softmax kernels: Softmax, LogSoftmax and Hardmax (opset 1-12 on 2-D, 13+ on one axis)."""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from plugrt.threads import parallel_threads

from .._registry import kernel, declare_into
from .elementwise import compiled_loops, scratch, with_small_buffers
from ._compiled import ROW_LOOPS
from ._compiled_parallel import compiled_pool

# A softmax of this many values or more shares its rows over the compiled pool's threads
# (fewer: the hand-off costs more than the second thread saves); each value counts as
# _SOFTMAX_COST element operations against the threads' threshold (one thread below 64K
# values). 2-core EPYC, BERT-small's 4 x 128 x 128 scores: 38 us on two threads, 46 in
# the one-pass loop on one, 71 in the three passes around numpy's exp; BERT-base's
# 12 x 128 x 128: 75, 127 and 189 us.
_POOL_MIN_VALUES = 1 << 15
_SOFTMAX_COST = 64
_SOFTMAX_UNITS_PER_THREAD = 4
# Rows at least this wide take the one-pass compiled loop (the row's max, the polynomial
# exp and the sum while it is in cache) on one thread too; narrower rows, where numpy's exp
# over the whole array amortises better, keep the three passes (8 x 49 x 49, Swin's windows:
# 33 us one-pass against 27; 4 x 64 x 64: 20 against 20).
_ONE_PASS_MIN_WIDTH = 128

# Each takes ``out`` for the ``into`` variants: the same steps into it, with the per-row
# statistics in a work array.


def _row_statistics(x: np.ndarray, axis: int, out: np.ndarray | None, dtype: Any = None) -> np.ndarray | None:
    """The work array for per-row values of x along ``axis`` (keepdims), or None (eager)."""
    if out is None:
        return None
    shape = list(x.shape)
    shape[axis] = 1
    return scratch(out, ("statistics", dtype), tuple(shape), dtype or x.dtype)


def _per_row(ufunc: np.ufunc, a: np.ndarray, b: np.ndarray, out: np.ndarray | None, into: bool) -> np.ndarray:
    """ufunc(a, b, out=out), b broadcast per row: in an ``into`` call with small buffers."""
    with np.errstate(invalid="ignore"):  # an all -inf row gives NaN, as in onnx's reference
        return with_small_buffers(ufunc, a, b, out) if into else ufunc(a, b, out=out)


def _compiled_softmax(x: np.ndarray, axis: int, out: np.ndarray | None) -> np.ndarray | None:
    """Softmax over the last axis of a C-contiguous float32 ``x``: with the compiled pool, a
    row at a time in one compiled loop (on its threads where there are enough values, else
    alone for rows of ``_ONE_PASS_MIN_WIDTH`` or more); otherwise in three passes (the
    compiled max-subtraction, numpy's vectorised exp in place, the compiled normalisation)
    where numpy takes five with broadcast temporaries. None where it does not apply."""
    if x.dtype != np.float32 or x.ndim == 0 or axis not in (-1, x.ndim - 1) or not x.flags.c_contiguous:
        return None
    if out is not None and (out.dtype != np.float32 or not out.flags.c_contiguous):
        return None
    loops = compiled_loops()
    if loops is None:
        return None
    y = np.empty_like(x) if out is None else out
    rows = x.reshape(-1, x.shape[-1])
    target = y.reshape(rows.shape)
    pool = compiled_pool()
    threads = parallel_threads(x.size * _SOFTMAX_COST) if x.size >= _POOL_MIN_VALUES else 1
    if pool is not None and (threads > 1 or rows.shape[1] >= _ONE_PASS_MIN_WIDTH):
        # the rows as one job on the compiled pool, each row's softmax in one compiled loop
        # with the vectorised exp: MobileViT's 4 x 4 x 256 x 256 scores took 1.88 ms on one
        # thread (the compiled max, numpy's exp, the compiled normalisation), 1.13 so; on
        # one thread, the job runs alone (``CompiledPool.run``)
        count = rows.shape[0]
        per_unit = max(1, count // (threads * _SOFTMAX_UNITS_PER_THREAD)) if threads > 1 else count
        context = np.array([rows.ctypes.data, target.ctypes.data, count, rows.shape[1], per_unit, 0, 0, 0], np.int64)
        pool.run(loops.softmax_job.address, context, -(-count // per_unit), threads)
        return y
    loops.subtract_row_max(rows, target)
    np.exp(target, out=target)
    loops.normalize_rows(target)
    return y


_ROW_TABLES: dict[tuple[tuple[int, ...], tuple[int, ...]], np.ndarray] = {}


def _row_table(shape: tuple[int, ...], addend_shape: tuple[int, ...]) -> np.ndarray:
    """For each row of ``shape`` (its last axis the row), the index of the row of an
    addend of ``addend_shape`` (the same last axis) that broadcasts onto it; made once
    per pair of shapes."""
    key = (shape, addend_shape)
    table = _ROW_TABLES.get(key)
    if table is None:
        rows = np.arange(math.prod(addend_shape[:-1]), dtype=np.int64).reshape(addend_shape[:-1])
        table = np.ascontiguousarray(np.broadcast_to(rows, shape[:-1]).reshape(-1))
        if len(_ROW_TABLES) < 64:
            _ROW_TABLES[key] = table
    return table


def add_softmax(x: np.ndarray, addend: np.ndarray, zero_nan: bool, out: np.ndarray | None = None) -> np.ndarray:
    """``softmax(x + addend)`` over the last axis, ``addend`` broadcast onto ``x`` (its last
    axis as long), and 0 where that gives NaN when ``zero_nan`` (exporters guard an
    attention's fully masked rows so). Float32 C-order arrays in one compiled pass a row
    (the addend's row added in cache), else numpy's Add, then the softmax, then the guard."""
    y = np.empty(np.broadcast_shapes(x.shape, addend.shape), np.result_type(x, addend)) if out is None else out
    loops = compiled_loops()
    pool = compiled_pool() if loops is not None else None
    threads = parallel_threads(x.size * _SOFTMAX_COST) if x.size >= _POOL_MIN_VALUES else 1
    if (
        pool is not None and y.shape == x.shape and addend.ndim <= x.ndim and x.ndim >= 1 and addend.shape[-1:] == x.shape[-1:]
        and x.size and all(a.dtype == np.float32 and a.flags.c_contiguous for a in (x, addend, y))
        and (threads > 1 or x.shape[-1] >= _ONE_PASS_MIN_WIDTH)  # else the three passes around numpy's exp, as Softmax
    ):
        width = x.shape[-1]
        table = _row_table(x.shape, (1,) * (x.ndim - addend.ndim) + addend.shape)
        count = table.shape[0]
        per_unit = max(1, count // (threads * _SOFTMAX_UNITS_PER_THREAD)) if threads > 1 else count
        context = np.array(
            [x.ctypes.data, y.ctypes.data, count, width, per_unit, addend.ctypes.data, table.ctypes.data, int(zero_nan)], np.int64
        )
        pool.run(loops.softmax_job.address, context, -(-count // per_unit), threads)
        return y
    np.add(x, addend, out=y)
    _softmax_axis(y, -1, y)
    if zero_nan:
        nan = np.isnan(y, out=None if out is None else scratch(out, "nan", y.shape, np.bool_))
        np.copyto(y, 0, where=nan)
    return y


def _softmax_axis(x: np.ndarray, axis: int, out: np.ndarray | None = None) -> np.ndarray:
    compiled = _compiled_softmax(x, axis, out)
    if compiled is not None:
        return compiled
    statistics = _row_statistics(x, axis, out)
    into = out is not None
    y = _per_row(np.subtract, x, x.max(axis=axis, keepdims=True, out=statistics), out, into)
    np.exp(y, out=y)
    _per_row(np.divide, y, y.sum(axis=axis, keepdims=True, out=statistics), y, into)
    return y


def _log_softmax_axis(x: np.ndarray, axis: int, out: np.ndarray | None = None) -> np.ndarray:
    statistics = _row_statistics(x, axis, out)
    into = out is not None
    y = _per_row(np.subtract, x, x.max(axis=axis, keepdims=True, out=statistics), out, into)
    exp = np.exp(y, out=None if out is None else scratch(out, "exp", y.shape, y.dtype))
    _per_row(np.subtract, y, np.log(exp.sum(axis=axis, keepdims=True, out=statistics), out=statistics), y, into)
    return y


def _hardmax_axis(x: np.ndarray, axis: int, out: np.ndarray | None = None) -> np.ndarray:
    if out is None:
        y = np.zeros_like(x)
        np.put_along_axis(y, np.expand_dims(np.argmax(x, axis=axis), axis), 1, axis=axis)
        return y
    out.fill(0)
    first = np.argmax(x, axis=axis, keepdims=True, out=_row_statistics(x, axis, out, np.intp))
    np.put_along_axis(out, first, 1, axis=axis)
    return out


def _on_axis(
    fn: Callable[..., np.ndarray], x: np.ndarray, axis: int, out: np.ndarray | None = None
) -> np.ndarray:
    # Every step rounds to the input's own type (float16 / bfloat16 too), as onnx's
    # reference does: its expected outputs differ from a float32 computation by an ulp.
    if x.size == 0:
        return x.copy() if out is None else out
    return fn(x, axis) if out is None else fn(x, axis, out)


def _on_2d(fn: Callable[..., np.ndarray], x: np.ndarray, axis: int, out: np.ndarray | None = None) -> np.ndarray:
    """The opset 1-12 semantics: coerce to (prod(shape[:axis]), prod(shape[axis:]))."""
    if axis < 0:
        axis += x.ndim
    if not 0 <= axis <= x.ndim:
        raise ValueError(f"axis {axis} is out of range for rank {x.ndim}")
    rows = math.prod(x.shape[:axis])
    if out is None:
        return _on_axis(fn, x.reshape(rows, -1), 1).reshape(x.shape)
    if not out.flags.c_contiguous:
        np.copyto(out, _on_2d(fn, x, axis))
        return out
    _on_axis(fn, x.reshape(rows, -1), 1, out.reshape(rows, -1))
    return out


@kernel("Softmax", 1, compiled=ROW_LOOPS)
def softmax_2d(x: np.ndarray, *, axis: int = 1) -> np.ndarray:
    return _on_2d(_softmax_axis, x, axis)


@kernel("Softmax", 13, compiled=ROW_LOOPS)
def softmax(x: np.ndarray, *, axis: int = -1) -> np.ndarray:
    return _on_axis(_softmax_axis, x, axis)


@kernel("LogSoftmax", 1)
def log_softmax_2d(x: np.ndarray, *, axis: int = 1) -> np.ndarray:
    return _on_2d(_log_softmax_axis, x, axis)


@kernel("LogSoftmax", 13)
def log_softmax(x: np.ndarray, *, axis: int = -1) -> np.ndarray:
    return _on_axis(_log_softmax_axis, x, axis)


@kernel("Hardmax", 1)
def hardmax_2d(x: np.ndarray, *, axis: int = 1) -> np.ndarray:
    return _on_2d(_hardmax_axis, x, axis)


@kernel("Hardmax", 13)
def hardmax(x: np.ndarray, *, axis: int = -1) -> np.ndarray:
    return _on_axis(_hardmax_axis, x, axis)


def _2d_into(fn: Callable[..., np.ndarray]) -> Callable[..., None]:
    def into(out: np.ndarray, x: np.ndarray, *, axis: int = 1) -> None:
        _on_2d(fn, x, axis, out)

    return into


def _axis_into(fn: Callable[..., np.ndarray]) -> Callable[..., None]:
    def into(out: np.ndarray, x: np.ndarray, *, axis: int = -1) -> None:
        _on_axis(fn, x, axis, out)

    return into


declare_into(_2d_into(_softmax_axis), softmax_2d)
declare_into(_axis_into(_softmax_axis), softmax)
declare_into(_2d_into(_log_softmax_axis), log_softmax_2d)
declare_into(_axis_into(_log_softmax_axis), log_softmax)
declare_into(_2d_into(_hardmax_axis), hardmax_2d)
declare_into(_axis_into(_hardmax_axis), hardmax)
