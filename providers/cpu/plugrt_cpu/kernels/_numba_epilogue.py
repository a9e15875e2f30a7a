"""numba-compiled float32 one-pass loops over rows: the epilogue of a product block (``c +=
residual``, ``c += bias`` per row, then a Relu), the per-channel affine of a
BatchNormalization (+ Relu) step (``y = x * multiplier + shift``), and the Clip,
HardSwish and SiLU that a fused Conv applies to its output in place.

Imported only through :func:`plugrt_cpu.kernels._gemm.epilogue_loops`, which returns None
when numba is missing or ``PLUGRT_NUMBA=0``; the callers then run numpy's ufuncs, with
the same values (the same operations in the same order, no fastmath: no fused
multiply-add), except SiLU's exp (see there). Compiled code is cached on disk (``cache=True``).

The product blocks are views of a larger output: rows of ``cols`` floats, unit steps
within a row, any step between rows. numpy's ufuncs take such a view through their
buffers, a pass per operation: on 256 rows of 392 floats out of 3136, the three passes
took 66 us where this loop takes 14 us. The affine's numpy passes over a tensor larger
than the L2 cache each go out to memory: one pass instead cut DenseNet-121's 62
BatchNormalization + Relu steps from 9.9 to 6.6 ms a run (2 threads, in the model).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

from ._numba_parallel import float32_pointer, int64_pointer

__all__ = [
    "bias_relu_rows", "bias_residual_relu_rows", "clip_in_place", "hard_swish_in_place", "scale_shift_relu_rows",
    "silu_in_place", "silu_mul", "silu_mul_step", "activation_job", "activation_rows", "ACT_NONE", "ACT_SILU", "ACT_HARD_SWISH", "ACT_CLIP", "squeeze_excite",
    "SE_RELU", "SE_SILU", "SE_HARD_SWISH", "SE_SIGMOID", "SE_HARD_SIGMOID",
]

_ZERO = np.float32(0.0)

_MATRIX = numba.float32[:, ::1]  # the whole output of one image: (channels, positions)
_ROWS = numba.types.Array(numba.float32, 2, "C", readonly=True)
_BIAS = numba.types.Array(numba.float32, 1, "A", readonly=True)
_RANGE = (numba.int64,) * 4  # rows [r0, r1), columns [j0, j1)


@numba.njit(
    [numba.void(_MATRIX, *_RANGE, _BIAS, numba.boolean)], nogil=True, boundscheck=False, error_model="numpy", cache=True
)
def bias_relu_rows(c, r0, r1, j0, j1, bias, relu):  # pragma: no cover  (compiled)
    """``c[i, j0:j1] = relu(c[i, j0:j1] + bias[i - r0])`` for rows [r0, r1) (no Relu when
    ``relu`` is false); NaN stays NaN."""
    count = j1 - j0
    for i in range(r0, r1):
        row = c[i, j0:j1]  # indexed from 0 below: no wraparound checks, the loops vectorise
        b = bias[i - r0]
        if relu:
            for j in range(count):
                v = row[j] + b
                row[j] = _ZERO if v < _ZERO else v
        else:
            for j in range(count):
                row[j] = row[j] + b


@numba.njit(
    [numba.void(_MATRIX, *_RANGE, _BIAS, _ROWS, numba.boolean)],
    nogil=True,
    boundscheck=False,
    error_model="numpy",
    cache=True,
)
def bias_residual_relu_rows(c, r0, r1, j0, j1, bias, residual, relu):  # pragma: no cover  (compiled)
    """``c[i, j0:j1] = relu((c[i, j0:j1] + residual[i, j0:j1]) + bias[i - r0])`` for rows
    [r0, r1) (no Relu when ``relu`` is false); NaN stays NaN. ``residual`` is shaped like
    ``c`` and does not overlap it."""
    count = j1 - j0
    for i in range(r0, r1):
        row = c[i, j0:j1]  # indexed from 0 below: no wraparound checks, the loops vectorise
        other = residual[i, j0:j1]
        b = bias[i - r0]
        if relu:
            for j in range(count):
                v = (row[j] + other[j]) + b
                row[j] = _ZERO if v < _ZERO else v
        else:
            for j in range(count):
                row[j] = (row[j] + other[j]) + b


_PLANES = numba.types.Array(numba.float32, 2, "C", readonly=True)
_VECTOR = numba.types.Array(numba.float32, 1, "C", readonly=True)


@numba.njit(
    [numba.void(_PLANES, numba.float32[:, ::1], _VECTOR, _VECTOR, numba.boolean, numba.int64, numba.int64)],
    nogil=True,
    boundscheck=False,
    error_model="numpy",
    cache=True,
)
def scale_shift_relu_rows(x, y, multiplier, shift, relu, r0, r1):  # pragma: no cover  (compiled)
    """``y[r] = relu(x[r] * multiplier[c] + shift[c])`` for rows [r0, r1) of (N * C,
    plane) planes, ``c = r % C`` (no Relu when ``relu`` is false); NaN stays NaN. ``y``
    may be ``x``. The product is rounded before the sum, as numpy's two ufuncs do."""
    channels = multiplier.shape[0]
    plane = x.shape[1]
    alone = x.ctypes.data == y.ctypes.data  # in place: one array a loop, so that it vectorises
    for r in range(r0, r1):
        target = y[r]
        m = multiplier[r % channels]
        s = shift[r % channels]
        if alone:
            if relu:
                for j in range(plane):
                    v = target[j] * m + s
                    target[j] = _ZERO if v < _ZERO else v
            else:
                for j in range(plane):
                    target[j] = target[j] * m + s
            continue
        source = x[r]
        if relu:
            for j in range(plane):
                v = source[j] * m + s
                target[j] = _ZERO if v < _ZERO else v
        else:
            for j in range(plane):
                target[j] = source[j] * m + s


_FLAT = numba.float32[::1]


@numba.njit([numba.void(_FLAT, numba.float32, numba.float32)], nogil=True, boundscheck=False, error_model="numpy", cache=True)
def clip_in_place(y, low, high):  # pragma: no cover  (compiled)
    """``y = min(max(y, low), high)`` in one pass, as numpy's ``clip``: NaN stays NaN."""
    for i in range(y.shape[0]):
        v = y[i]
        v = low if v < low else v
        y[i] = high if v > high else v


_SIXTH = np.float32(1.0 / 6.0)
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)


@numba.njit([numba.void(_FLAT)], nogil=True, boundscheck=False, error_model="numpy", cache=True)
def hard_swish_in_place(y):  # pragma: no cover  (compiled)
    """``y = y * clip(y * (1/6) + 0.5, 0, 1)`` in one pass, rounded as the HardSwish
    kernel's numpy passes round it (the product, then the sum: no fused multiply-add)."""
    for i in range(y.shape[0]):
        v = y[i]
        gate = v * _SIXTH + _HALF
        gate = _ZERO if gate < _ZERO else gate
        gate = _ONE if gate > _ONE else gate
        y[i] = v * gate


# -- SiLU: y / (1 + exp(-y)) with an exp the loop vectorises -------------------------------
# numba's exp is a call to the C library per value, which keeps a loop scalar (measured
# ~6x slower than numpy's vectorised exp over the four passes numpy needs). This exp is
# Cephes' expf: exp(z) = 2^n * p(r), n = round(z / ln 2), r = z - n ln 2 in two parts, p
# a degree-7 polynomial; 2^n made from its exponent bits. Within 2 ulp of the exact value
# over the range where it is finite (numpy's: within 1), so a fused SiLU's values differ
# from the numpy body's by float32 rounding.

_LOG2E = np.float32(1.44269504088896341)
_LN2_HIGH = np.float32(0.693359375)
_LN2_LOW = np.float32(-2.12194440e-4)
_EXP_MAX = np.float32(88.72283935546875)  # exp above it is infinite in float32
_EXP_MIN = np.float32(-87.33654022216797)  # exp below it is below float32's normal range
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)
_INFINITY = np.float32(np.inf)


@intrinsic
def _float_bits(typingctx, bits):  # type: ignore[no-untyped-def]
    """The float32 whose bits are the int32 ``bits``."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return numba.float32(numba.int32), codegen


_FAST = {"contract", "arcp", "nsz", "afn", "reassoc"}  # never nnan or ninf: NaN and infinity are kept


@numba.njit(fastmath=_FAST, nogil=True, boundscheck=False, error_model="numpy", inline="always")
def _exp(z):  # pragma: no cover  (compiled; inlined)
    """exp(z) for a float32 ``z``: 0 below ``_EXP_MIN``, infinity above ``_EXP_MAX``, NaN for NaN."""
    clamped = _EXP_MIN if z < _EXP_MIN else z
    clamped = _EXP_MAX if clamped > _EXP_MAX else clamped
    n = np.floor(clamped * _LOG2E + _HALF)
    r = clamped - n * _LN2_HIGH
    r = r - n * _LN2_LOW
    p = _P0 * r + _P1
    p = p * r + _P2
    p = p * r + _P3
    p = p * r + _P4
    p = p * r + _P5
    p = p * r * r + r + _ONE
    value = p * _float_bits(np.int32(n) * np.int32(1 << 23) + np.int32(127 << 23))
    value = _ZERO if z < _EXP_MIN else value
    value = _INFINITY if z > _EXP_MAX else value
    return z + value if z != z else value  # NaN in, NaN out


@numba.njit([numba.void(_FLAT)], fastmath=_FAST, nogil=True, boundscheck=False, error_model="numpy", cache=True)
def silu_in_place(y):  # pragma: no cover  (compiled)
    """``y = y / (1 + exp(-y))`` in one pass: 0 * y where exp(-y) is infinite is -0 (as
    numpy's y / inf), NaN stays NaN."""
    for i in range(y.shape[0]):
        v = y[i]
        y[i] = v / (_ONE + _exp(-v))


_FLAT_IN = numba.types.Array(numba.float32, 1, "C", readonly=True)


@numba.njit([numba.void(_FLAT_IN, _FLAT_IN, _FLAT)], fastmath=_FAST, nogil=True, boundscheck=False, error_model="numpy", cache=True)
def silu_mul(g, u, out):  # pragma: no cover  (compiled)
    """``out = g / (1 + exp(-g)) * u`` in one pass (a SwiGLU's gate): as ``silu_in_place``
    for the SiLU, then times ``u``."""
    for i in range(out.shape[0]):
        v = g[i]
        out[i] = v / (_ONE + _exp(-v)) * u[i]


# silu_mul_step's context: g, u, out (addresses), length
SILU_MUL_G, SILU_MUL_U, SILU_MUL_OUT, SILU_MUL_LENGTH = range(4)
SILU_MUL_WORDS = 4


@numba.cfunc(numba.int64(numba.int64), nogil=True, cache=True)
def silu_mul_step(c):  # pragma: no cover  (compiled)
    """``silu_mul`` as a step of a compiled program (``_numba_parallel.run_program``)."""
    context = numba.carray(int64_pointer(c), SILU_MUL_WORDS)
    length = context[SILU_MUL_LENGTH]
    silu_mul(
        numba.carray(float32_pointer(context[SILU_MUL_G]), (length,)),
        numba.carray(float32_pointer(context[SILU_MUL_U]), (length,)),
        numba.carray(float32_pointer(context[SILU_MUL_OUT]), (length,)),
    )
    return 0


# -- a fused Conv's activation over a block of its output, on the thread that computed it --

#: What ``activation_rows`` applies: a code, with Clip's two bounds.
ACT_NONE, ACT_SILU, ACT_HARD_SWISH, ACT_CLIP = 0, 1, 2, 3


@numba.njit(fastmath=_FAST, nogil=True, boundscheck=False, error_model="numpy", cache=True)
def _silu_run(row, count):  # pragma: no cover  (compiled)
    """``silu_in_place`` over ``row[:count]`` (its own function: its fastmath flags are not
    the caller's)."""
    for j in range(count):
        v = row[j]
        row[j] = v / (_ONE + _exp(-v))


@numba.njit(
    [numba.void(_MATRIX, *_RANGE, numba.int64, numba.float32, numba.float32)],
    nogil=True,
    boundscheck=False,
    error_model="numpy",
    cache=True,
)
def activation_rows(c, r0, r1, j0, j1, code, low, high):  # pragma: no cover  (compiled)
    """The activation ``code`` over ``c[r0:r1, j0:j1]`` in place, with the values its own
    ``*_in_place`` loop gives (Clip between ``low`` and ``high``): for a block of a Conv's
    output still in this thread's cache."""
    count = j1 - j0
    for i in range(r0, r1):
        row = c[i, j0:j1]
        if code == ACT_SILU:
            _silu_run(row, count)
        elif code == ACT_HARD_SWISH:
            for j in range(count):
                v = row[j]
                gate = v * _SIXTH + _HALF
                gate = _ZERO if gate < _ZERO else gate
                gate = _ONE if gate > _ONE else gate
                row[j] = v * gate
        elif code == ACT_CLIP:
            for j in range(count):
                v = row[j]
                v = low if v < low else v
                row[j] = high if v > high else v


# -- an activation over a whole tensor, shared out on the compiled pool ----------------------

# activation_job's context: source, target (addresses; the same for in place), length,
# values a unit, the activation (ACT_*), Clip's bounds (float32 bits in the low half)
ACTIVATION_SOURCE, ACTIVATION_TARGET, ACTIVATION_LENGTH, ACTIVATION_PER_UNIT, ACTIVATION_CODE = range(5)
ACTIVATION_LOW, ACTIVATION_HIGH = 5, 6
ACTIVATION_WORDS = 7


@numba.njit(fastmath=_FAST, nogil=True, boundscheck=False, error_model="numpy", cache=True)
def _copy_run(source, target):  # pragma: no cover  (compiled)
    for j in range(target.shape[0]):
        target[j] = source[j]


@numba.cfunc(numba.void(numba.int64, numba.int64, numba.int64, numba.int64), nogil=True, cache=True)
def activation_job(c, start, stop, slot):  # pragma: no cover  (compiled)
    """Units [start, stop) of ``target = activation(source)`` over a flat float32 run on
    the compiled pool, ``ACTIVATION_PER_UNIT`` values a unit: each unit's values copied
    (unless in place), then ``activation_rows``'s loop over them while they are in cache.
    A standalone SiLU (``plugrt.cpu::Silu``) or a Conv's activation the Conv did not apply."""
    context = numba.carray(int64_pointer(c), ACTIVATION_WORDS)
    length, per_unit = context[ACTIVATION_LENGTH], context[ACTIVATION_PER_UNIT]
    target = numba.carray(float32_pointer(context[ACTIVATION_TARGET]), (1, length))
    source = numba.carray(float32_pointer(context[ACTIVATION_SOURCE]), (1, length))
    bounds = numba.carray(float32_pointer(c + ACTIVATION_LOW * 8), 3)  # low, (its high half), high
    j0 = start * per_unit
    j1 = min(length, stop * per_unit)
    if j0 >= j1:
        return
    if context[ACTIVATION_SOURCE] != context[ACTIVATION_TARGET]:
        _copy_run(source[0, j0:j1], target[0, j0:j1])
    activation_rows(target, 0, 1, j0, j1, context[ACTIVATION_CODE], bounds[0], bounds[2])


# -- squeeze-excitation in one call ----------------------------------------------------------

#: The SE step's hidden activations and gates (``squeeze_excite``'s names, in this order).
SE_RELU, SE_SILU, SE_HARD_SWISH = 0, 1, 2
SE_SIGMOID, SE_HARD_SIGMOID = 0, 1

_SE_IMAGE = numba.types.Array(numba.float32, 2, "C", readonly=True)  # (C, positions)
_SE_WEIGHT = numba.types.Array(numba.float32, 2, "C", readonly=True)
_SE_VECTOR = numba.types.Array(numba.float32, 1, "C", readonly=True)


@numba.njit(
    [numba.void(_SE_IMAGE, _SE_WEIGHT, _SE_VECTOR, _SE_WEIGHT, _SE_VECTOR, numba.int64, numba.int64, numba.float32,
                numba.float32, numba.float32[::1], numba.float32[::1], _MATRIX)],
    fastmath=_FAST,
    nogil=True,
    boundscheck=False,
    error_model="numpy",
    cache=True,
)
def squeeze_excite(x, w1, b1, w2, b2, hidden, gate, alpha, beta, h, g, out):  # pragma: no cover  (compiled)
    """``out = x * gate(act(mean(x) @ w1.T + b1) @ w2.T + b2)`` for one image ``x`` (C,
    positions): the channel means (summed in float64), the two small products, the hidden
    activation (``SE_*``: Relu, SiLU, HardSwish), the gate (Sigmoid, or HardSigmoid with
    ``alpha`` and ``beta``) and the scaling, in one call; ``h`` (hidden) and ``g`` (C) are
    work arrays. ``out`` may be ``x``'s buffer. Sigmoid and SiLU use the vectorised exp
    (within 2 ulp of numpy's)."""
    channels, positions = x.shape
    hidden_count = w1.shape[0]
    for c in range(channels):
        row = x[c]
        total = 0.0
        for j in range(positions):
            total += row[j]
        g[c] = np.float32(total / positions)
    for r in range(hidden_count):
        weights = w1[r]
        acc = b1[r]
        for c in range(channels):
            acc += weights[c] * g[c]
        if hidden == SE_RELU:
            acc = _ZERO if acc < _ZERO else acc
        elif hidden == SE_SILU:
            acc = acc / (_ONE + _exp(-acc))
        else:
            gate_value = acc * _SIXTH + _HALF
            gate_value = _ZERO if gate_value < _ZERO else gate_value
            gate_value = _ONE if gate_value > _ONE else gate_value
            acc = acc * gate_value
        h[r] = acc
    for c in range(channels):
        weights = w2[c]
        acc = b2[c]
        for r in range(hidden_count):
            acc += weights[r] * h[r]
        if gate == SE_SIGMOID:
            acc = _ONE / (_ONE + _exp(-acc))
        else:
            acc = acc * alpha + beta
            acc = _ZERO if acc < _ZERO else acc
            acc = _ONE if acc > _ONE else acc
        g[c] = acc
    if x.ctypes.data == out.ctypes.data:  # in place: one array a loop, so that it vectorises
        for c in range(channels):
            scale = g[c]
            target = out[c]
            for j in range(positions):
                target[j] = target[j] * scale
        return
    for c in range(channels):
        scale = g[c]
        source = x[c]
        target = out[c]
        for j in range(positions):
            target[j] = source[j] * scale

