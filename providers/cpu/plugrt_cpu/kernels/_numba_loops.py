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
from llvmlite import ir  # noqa: E402
from numba import types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

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


_LANES = 16  # floats a vector of the row maximum


@intrinsic
def _vector_max(typingctx, address, n):  # type: ignore[no-untyped-def]
    """The largest of the ``n`` (at least one) float32 at ``address`` (bytes), NaN
    ignored (-inf when all are NaN): four running 16-float maxima, the last vector a
    masked load that reads nothing past the end, then the lanes folded."""
    signature = types.float32(types.int64, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        address, n = args
        i64, i32 = ir.IntType(64), ir.IntType(32)
        vector = ir.VectorType(ir.FloatType(), _LANES)
        pointer = vector.as_pointer()
        mask_type = ir.VectorType(ir.IntType(1), _LANES)
        masked_load = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vector, [pointer, i32, mask_type, vector]), "llvm.masked.load.v16f32.p0"
        )
        lowest = ir.Constant(vector, [float("-inf")] * _LANES)

        def larger(a, b):  # type: ignore[no-untyped-def]
            return builder.select(builder.fcmp_ordered(">", b, a), b, a)  # a NaN ``b`` is never taken

        def at(offset):  # type: ignore[no-untyped-def]
            return builder.inttoptr(builder.add(address, builder.mul(offset, ir.Constant(i64, 4))), pointer)

        maxima = [cgutils.alloca_once_value(builder, lowest) for _ in range(4)]
        quads = builder.sdiv(n, ir.Constant(i64, 4 * _LANES))
        with cgutils.for_range(builder, quads) as loop:
            first = builder.mul(loop.index, ir.Constant(i64, 4 * _LANES))
            for q in range(4):
                value = builder.load(at(builder.add(first, ir.Constant(i64, q * _LANES))), align=4)
                builder.store(larger(builder.load(maxima[q]), value), maxima[q])
        done = builder.mul(quads, ir.Constant(i64, 4 * _LANES))
        rest = builder.sdiv(builder.add(builder.sub(n, done), ir.Constant(i64, _LANES - 1)), ir.Constant(i64, _LANES))
        lanes = ir.Constant(ir.VectorType(i64, _LANES), list(range(_LANES)))
        with cgutils.for_range(builder, rest) as loop:
            start = builder.add(done, builder.mul(loop.index, ir.Constant(i64, _LANES)))
            left = builder.insert_element(ir.Constant(ir.VectorType(i64, _LANES), ir.Undefined), builder.sub(n, start), ir.Constant(i32, 0))
            left = builder.shuffle_vector(left, left, ir.Constant(ir.VectorType(i32, _LANES), [0] * _LANES))
            keep = builder.icmp_signed("<", lanes, left)
            value = builder.call(masked_load, [at(start), ir.Constant(i32, 4), keep, lowest])
            builder.store(larger(builder.load(maxima[0]), value), maxima[0])
        total = larger(larger(builder.load(maxima[0]), builder.load(maxima[1])), larger(builder.load(maxima[2]), builder.load(maxima[3])))
        width = _LANES
        while width > 1:  # fold the upper half of the lanes onto the lower
            width //= 2
            upper = builder.shuffle_vector(total, total, ir.Constant(ir.VectorType(i32, _LANES), [(j + width) % _LANES for j in range(_LANES)]))
            total = larger(total, upper)
        return builder.extract_element(total, ir.Constant(i32, 0))

    return signature, codegen


@_compiled
def _peak(row):  # pragma: no cover  (compiled; called by subtract_row_max)
    """max(row), NaN ignored. Whatever it gives for a row holding a NaN, that NaN stays
    in ``row - peak`` and makes the row's softmax NaN through its sum, as numpy's max
    would. LLVM does not vectorise this reduction by itself (a chain of compares and
    selects, ~0.75 ns a value; eight scalar maxima side by side, 0.32): the vector maxima
    of :func:`_vector_max` take ~0.05 (ViT's 2,364 rows of 197)."""
    return _vector_max(row.ctypes.data, row.size)


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
def _softmax_row(source, row):  # pragma: no cover  (compiled; inlined)
    """softmax(source) into ``row`` (which may be ``source``): one loop a pass, each over
    one array or two that do not overlap, so that each vectorises (see gelu_erf); the exp
    is ``_numba_epilogue``'s polynomial one (within 2 ulp of numpy's)."""
    width = row.shape[0]
    peak = _peak(source)
    total = _F(0.0)
    if source.ctypes.data == row.ctypes.data:
        for j in range(width):
            value = _exp(row[j] - peak)
            row[j] = value
            total += value
    else:
        for j in range(width):
            value = _exp(source[j] - peak)
            row[j] = value
            total += value
    inverse = _F(1.0) / total
    for j in range(width):
        row[j] *= inverse


# The context of ``softmax_job`` (int64 words; see ``softmax._compiled_softmax``): with an
# addend (``SOFTMAX_ADDEND`` non-zero), row ``r`` is ``x[r] + addend[table[r]]`` (the
# addend's rows, ``SOFTMAX_TABLE`` int64 row indices: its broadcast); ``SOFTMAX_ZERO_NAN``
# non-zero writes 0 where the softmax gave NaN (a row of -inf scores: a query every key of
# which is masked).
SOFTMAX_X, SOFTMAX_Y, SOFTMAX_ROWS, SOFTMAX_WIDTH, SOFTMAX_PER_UNIT, SOFTMAX_ADDEND, SOFTMAX_TABLE, SOFTMAX_ZERO_NAN = range(8)
SOFTMAX_WORDS = 8


@numba.cfunc(numba.void(numba.int64, numba.int64, numba.int64, numba.int64), nogil=True, cache=True)
def softmax_job(c, start, stop, slot):  # pragma: no cover  (compiled)
    """Units [start, stop) of a softmax over the rows of a C-contiguous float32 (rows,
    width) on the compiled pool, ``SOFTMAX_PER_UNIT`` rows a unit: each row's softmax
    read from the input into the output (which may be the input), the addend's row added
    first where there is one."""
    context = numba.carray(int64_pointer(c), SOFTMAX_WORDS)
    rows, width = context[SOFTMAX_ROWS], context[SOFTMAX_WIDTH]
    x = numba.carray(float32_pointer(context[SOFTMAX_X]), (rows, width))
    y = numba.carray(float32_pointer(context[SOFTMAX_Y]), (rows, width))
    group = context[SOFTMAX_PER_UNIT]
    addend = context[SOFTMAX_ADDEND]
    zero_nan = context[SOFTMAX_ZERO_NAN] != 0
    for r in range(start * group, min(rows, stop * group)):
        if addend == 0:
            _softmax_row(x[r], y[r])
        else:
            index = numba.carray(int64_pointer(context[SOFTMAX_TABLE] + r * 8), 1)[0]
            added = numba.carray(float32_pointer(addend + index * width * 4), width)
            row, source = y[r], x[r]
            for j in range(width):
                row[j] = source[j] + added[j]
            _softmax_row(row, row)
        if zero_nan:
            row = y[r]
            for j in range(width):
                value = row[j]
                row[j] = value if value == value else _F(0.0)
