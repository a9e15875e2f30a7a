"""numba-compiled float32 loops for the transformer's row kernels (GELU, residual LayerNorm, softmax around numpy's exp): one pass where numpy needs several.

Imported only through :func:`plugrt_cpu.kernels.elementwise.compiled_loops`, which
returns None when numba is missing or ``PLUGRT_NUMBA=0``; every caller has a numpy path
that gives the same values to float32 rounding. Compiled code is cached on disk
(``cache=True``), so only the first process on a machine pays the compile (~0.4 s per
loop); later ones load it in milliseconds.

The fastmath flags allow contraction, reciprocal and reassociation (what vectorises the
loops and their sums) but not ``nnan``/``ninf``: NaN and infinity propagate as in numpy.
``error_model="numpy"`` drops the division-by-zero checks that block vectorisation.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

__all__ = [
    "bias_gelu_rows",
    "gelu_erf",
    "gelu_tanh",
    "layer_norm_rows",
    "normalize_rows",
    "scale_and_shift_rows",
    "skip_layer_norm",
    "softmax_job",
    "subtract_row_max",
]

_FLAGS: dict[str, Any] = dict(fastmath={"contract", "arcp", "nsz", "afn", "reassoc"}, nogil=True, boundscheck=False, error_model="numpy", cache=True)
_compiled = numba.njit(**_FLAGS)

# After numba's first use above: a numba that cannot set up (no writable cache, say) fails
# there, with its own error, before these modules' imports of llvmlite could.
from ._numba_epilogue import _exp  # noqa: E402
from ._numba_parallel import float32_pointer, int64_pointer  # noqa: E402


def _entry(signature):  # type: ignore[no-untyped-def]
    """An entry point compiled for exactly ``signature`` when the module is imported (by
    the background build), never again on a call: every shape shares it."""
    return numba.njit([signature], **_FLAGS)


_IN1 = numba.types.Array(numba.float32, 1, "C", readonly=True)  # read-only types take writable arrays too
_IN2 = numba.types.Array(numba.float32, 2, "C", readonly=True)
_OUT1, _OUT2 = numba.float32[::1], numba.float32[:, ::1]

_F = np.float32


@_compiled
def _gelu(v):  # pragma: no cover  (compiled; inlined into the loops below)
    """0.5 * v * (1 + erf(v / sqrt(2))) for one float32, erf as elementwise._erf_float32
    computes it (the same rational fit, clamped at +-4)."""
    z = min(max(v * _F(0.7071067811865476), _F(-4.0)), _F(4.0))
    t = z * z
    p = _F(1.9864886927765341e-6) * t + _F(2.8449755476522498e-4)
    p = p * t + _F(3.8820289464572449e-3)
    p = p * t + _F(5.3097641382377289e-2)
    p = p * t + _F(1.9351990776871800e-1)
    p = p * t + _F(1.1283791397845179)
    q = _F(3.7413503706159646e-5) * t + _F(1.1851778678227299e-3)
    q = q * t + _F(1.5204678532240398e-2)
    q = q * t + _F(1.1533889148043141e-1)
    q = q * t + _F(5.0483511927805172e-1)
    q = q * t + _F(1.0)
    e = min(max(z * p / q, _F(-1.0)), _F(1.0))
    return _F(0.5) * v * (_F(1.0) + e)


@_entry(numba.void(_IN1, _OUT1))
def gelu_erf(x, out):  # pragma: no cover  (compiled; covered through its callers)
    """out = GELU(x) over flat float32 arrays (``out`` may be ``x``)."""
    if x.ctypes.data == out.ctypes.data:
        # in place: one array, so that the loop vectorises (with two, LLVM's overlap check
        # sends an in-place call to its scalar loop: 1.92 against 0.37 ms on 605K values)
        for i in range(out.size):
            out[i] = _gelu(out[i])
        return
    for i in range(x.size):
        out[i] = _gelu(x[i])


@_compiled
def _gelu_tanh(v):  # pragma: no cover  (compiled; inlined into gelu_tanh)
    """0.5 * v * (1 + tanh(u)), u = sqrt(2 / pi) * (v + 0.044715 v^3), as v / (1 + exp(-2u)):
    the same value (0.5 * (1 + tanh(u)) is the logistic of 2u), without the cancellation of
    1 + tanh(u) for negative u, with ``_numba_epilogue``'s polynomial exp, which vectorises.
    NaN stays NaN, +inf gives +inf and -inf NaN (as the tanh form's -inf * 0)."""
    t = v * (_F(1.5957691216057308) + _F(0.07135481627159121) * (v * v))  # 2u
    return v / (_F(1.0) + _exp(-t))


@_entry(numba.void(_IN1, _OUT1))
def gelu_tanh(x, out):  # pragma: no cover  (compiled; covered through its callers)
    """out = GELU(x), the tanh approximation, over flat float32 arrays (``out`` may be ``x``)."""
    if x.ctypes.data == out.ctypes.data:  # in place: one array, so that the loop vectorises (see gelu_erf)
        for i in range(out.size):
            out[i] = _gelu_tanh(out[i])
        return
    for i in range(x.size):
        out[i] = _gelu_tanh(x[i])


@_entry(numba.void(_OUT2, _IN1))
def bias_gelu_rows(x, bias):  # pragma: no cover  (compiled)
    """x = GELU(x + bias) in place, over the rows of the 2-D float32 ``x``."""
    rows, width = x.shape
    for r in range(rows):
        for j in range(width):
            x[r, j] = _gelu(x[r, j] + bias[j])


@_entry(numba.void(_IN2, _IN2, _IN1, _IN1, numba.float64, _OUT2))
def skip_layer_norm(a, b, gamma, beta, epsilon, out):  # pragma: no cover  (compiled)
    """out = LayerNorm(a + b) over the last axis of the 2-D float32 ``a``, with ``b`` of
    a's width and a row count that divides a's (row r adds b's row r % len(b)); sums in
    float64, variance about the mean."""
    rows, width = a.shape
    period = b.shape[0]
    for r in range(rows):
        br = r % period
        total = 0.0
        for j in range(width):
            s = a[r, j] + b[br, j]
            out[r, j] = s
            total += s
        mean = total / width
        squares = 0.0
        for j in range(width):
            d = out[r, j] - mean
            squares += d * d
        inv_std = _F(1.0 / math.sqrt(squares / width + epsilon))
        mean32 = _F(mean)
        for j in range(width):
            out[r, j] = (out[r, j] - mean32) * inv_std * gamma[j] + beta[j]


@_entry(numba.void(_IN2, _IN1, _IN1, numba.float64, _OUT2, _OUT1, _OUT1))
def layer_norm_rows(x, gamma, beta, epsilon, out, mean, inv_std):  # pragma: no cover  (compiled)
    """out = LayerNorm(x) over the last axis of the 2-D float32 ``x``, with each row's mean
    and 1/std in ``mean`` and ``inv_std``; sums in float64, variance about the mean (as
    :func:`skip_layer_norm`, without the second operand)."""
    rows, width = x.shape
    for r in range(rows):
        total = 0.0
        for j in range(width):
            total += x[r, j]
        average = total / width
        squares = 0.0
        for j in range(width):
            d = x[r, j] - average
            squares += d * d
        inverse = _F(1.0 / math.sqrt(squares / width + epsilon))
        centre = _F(average)
        mean[r] = centre
        inv_std[r] = inverse
        for j in range(width):
            out[r, j] = (x[r, j] - centre) * inverse * gamma[j] + beta[j]


@numba.njit(**{**_FLAGS, "fastmath": _FLAGS["fastmath"] | {"nnan"}})
def _peak(row):  # pragma: no cover  (compiled; called by subtract_row_max)
    """max(row), the comparisons free to ignore NaN. Whatever it gives for a row holding a
    NaN, that NaN stays in ``row - peak`` and makes the row's softmax NaN through its sum,
    as numpy's max would. LLVM does not vectorise this reduction (one chain of compares
    and selects, ~0.75 ns a value): eight running maxima side by side take 0.43x the time
    (ViT's 2,364 rows of 197: 0.34 -> 0.15 ms)."""
    n = row.size
    p0 = p1 = p2 = p3 = p4 = p5 = p6 = p7 = row[0]
    j = 0
    while j + 8 <= n:
        p0, p1, p2, p3 = max(p0, row[j]), max(p1, row[j + 1]), max(p2, row[j + 2]), max(p3, row[j + 3])
        p4, p5, p6, p7 = max(p4, row[j + 4]), max(p5, row[j + 5]), max(p6, row[j + 6]), max(p7, row[j + 7])
        j += 8
    while j < n:
        p0 = max(p0, row[j])
        j += 1
    return max(max(max(p0, p1), max(p2, p3)), max(max(p4, p5), max(p6, p7)))


@_entry(numba.void(_IN2, _OUT2))
def subtract_row_max(x, out):  # pragma: no cover  (compiled)
    """out = x - max(x) per row of the 2-D float32 ``x`` (at least one column): the first
    pass of a softmax."""
    rows, width = x.shape
    if x.ctypes.data == out.ctypes.data:  # in place: one array, so that the loop vectorises (see gelu_erf)
        for r in range(rows):
            row = out[r]
            peak = _peak(row)
            for j in range(width):
                row[j] = row[j] - peak
        return
    for r in range(rows):
        peak = _peak(x[r])
        for j in range(width):
            out[r, j] = x[r, j] - peak


@_entry(numba.void(_OUT2, numba.float32))
def scale_and_shift_rows(x, factor):  # pragma: no cover  (compiled)
    """x = x * factor - max(x * factor) per row of the 2-D float32 ``x``, in place: the
    first half of a softmax (a NaN in a row makes the whole row NaN after the exp, as the
    numpy max would)."""
    rows, width = x.shape
    for r in range(rows):
        peak = -np.inf
        for j in range(width):
            v = x[r, j] * factor
            x[r, j] = v
            if v > peak:
                peak = v
        for j in range(width):
            x[r, j] -= peak


@_entry(numba.void(_OUT2))
def normalize_rows(x):  # pragma: no cover  (compiled)
    """x /= sum(x) per row of the 2-D float32 ``x``, in place (as a multiplication by the
    reciprocal: within an ulp of the division)."""
    rows, width = x.shape
    for r in range(rows):
        total = _F(0.0)
        for j in range(width):
            total += x[r, j]
        inverse = _F(1.0) / total
        for j in range(width):
            x[r, j] *= inverse


@_compiled
def _softmax_row(row):  # pragma: no cover  (compiled; inlined)
    """softmax(row) in place: one array a loop, so that each vectorises (see gelu_erf);
    the exp is ``_numba_epilogue``'s polynomial one (within 2 ulp of numpy's)."""
    width = row.shape[0]
    peak = _peak(row)
    total = _F(0.0)
    for j in range(width):
        value = _exp(row[j] - peak)
        row[j] = value
        total += value
    inverse = _F(1.0) / total
    for j in range(width):
        row[j] *= inverse


# The context of ``softmax_job`` (int64 words; see ``softmax._compiled_softmax``).
SOFTMAX_X, SOFTMAX_Y, SOFTMAX_ROWS, SOFTMAX_WIDTH, SOFTMAX_PER_UNIT = range(5)
SOFTMAX_WORDS = 5


@numba.cfunc(numba.void(numba.int64, numba.int64, numba.int64, numba.int64), nogil=True, cache=True)
def softmax_job(c, start, stop, slot):  # pragma: no cover  (compiled)
    """Units [start, stop) of a softmax over the rows of a C-contiguous float32 (rows,
    width) on the compiled pool, ``SOFTMAX_PER_UNIT`` rows a unit: each row copied into the
    output (unless it is the input), then its softmax in place."""
    context = numba.carray(int64_pointer(c), SOFTMAX_WORDS)
    rows, width = context[SOFTMAX_ROWS], context[SOFTMAX_WIDTH]
    x = numba.carray(float32_pointer(context[SOFTMAX_X]), (rows, width))
    y = numba.carray(float32_pointer(context[SOFTMAX_Y]), (rows, width))
    group = context[SOFTMAX_PER_UNIT]
    apart = context[SOFTMAX_X] != context[SOFTMAX_Y]
    for r in range(start * group, min(rows, stop * group)):
        row = y[r]
        if apart:
            source = x[r]
            for j in range(width):
                row[j] = source[j]
        _softmax_row(row)
