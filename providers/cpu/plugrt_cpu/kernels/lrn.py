"""Local response normalisation (LRN) across channels."""

from __future__ import annotations

import numpy as np

from .._registry import kernel, declare_into
from ._window import (
    _cast_into_scratch,
    _compute_dtype,
)
from .elementwise import scratch, with_small_buffers


@kernel("LRN", 1)
def lrn(x: np.ndarray, *, alpha: float = 0.0001, beta: float = 0.75, bias: float = 1.0, size: int) -> np.ndarray:
    """Local response normalisation across channels (axis 1), in cache-sized spatial blocks."""
    return _lrn(x, alpha, beta, bias, size)


def _lrn_into(
    out: np.ndarray, x: np.ndarray, *, alpha: float = 0.0001, beta: float = 0.75, bias: float = 1.0, size: int
) -> None:
    with_small_buffers(_lrn, x, alpha, beta, bias, size, out)  # elementwise steps on strided blocks


declare_into(_lrn_into, lrn)


def _lrn(x: np.ndarray, alpha: float, beta: float, bias: float, size: int, out: np.ndarray | None = None) -> np.ndarray:
    """LRN; into ``out`` when given (the ``into`` variant, with its work arrays kept)."""
    dtype = _compute_dtype(x.dtype)
    n, channels = x.shape[:2]
    work = _cast_into_scratch(out, "x", x, dtype) if out is not None else x.astype(dtype, copy=False)
    flat = work.reshape(n, channels, -1)
    if out is not None and out.dtype == dtype and out.flags.c_contiguous:
        y = out.reshape(flat.shape)
    else:
        y = np.empty(flat.shape, dtype=dtype) if out is None else scratch(out, "y", flat.shape, dtype)
    before = (size - 1) // 2
    after = size - 1 - before  # ceil((size - 1) / 2)
    span = flat.shape[2]
    block = max(1, (256 << 10) // max(1, n * channels * dtype.itemsize))
    for start in range(0, span, block):
        xs = flat[:, :, start : start + block]
        if out is not None:
            block_shape = (n, channels, min(block, span))
            square = np.multiply(xs, xs, out=scratch(out, "square", block_shape, dtype)[:, :, : xs.shape[2]])
            total = scratch(out, "total", block_shape, dtype)[:, :, : xs.shape[2]]
            np.copyto(total, square)
        else:
            square = xs * xs
            total = square.copy()
        for shift in range(1, max(before, after) + 1):
            if shift <= before and shift < channels:
                total[:, shift:] += square[:, :-shift]
            if shift <= after and shift < channels:
                total[:, :-shift] += square[:, shift:]
        total *= dtype.type(alpha / size)
        total += dtype.type(bias)
        if beta == 0.75:  # the usual value: sqrt(t) * sqrt(sqrt(t)) is far cheaper than pow
            np.sqrt(total, out=square)
            np.sqrt(square, out=total)
            total *= square
        elif beta == 0.5:
            np.sqrt(total, out=total)
        elif beta != 1:
            np.power(total, dtype.type(beta), out=total)
        np.divide(xs, total, out=y[:, :, start : start + block])
    if out is None:
        return y.reshape(x.shape).astype(x.dtype, copy=False)
    if not np.may_share_memory(y, out):
        np.copyto(out, y.reshape(x.shape), casting="unsafe")
    return out
