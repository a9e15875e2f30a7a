"""numba-compiled float32 one-pass loops over rows: the epilogue of a product block (``c +=
residual``, ``c += bias`` per row, then a Relu), the per-channel affine of a
BatchNormalization (+ Relu) step (``y = x * multiplier + shift``), and the Clip and
HardSwish that a fused Conv applies to its output in place.

Imported only through :func:`plugrt_cpu.kernels._gemm.epilogue_loops`, which returns None
when numba is missing or ``PLUGRT_NUMBA=0``; the callers then run numpy's ufuncs, with
the same values (the same operations in the same order, no fastmath: no fused
multiply-add). Compiled code is cached on disk (``cache=True``).

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

__all__ = ["bias_relu_rows", "bias_residual_relu_rows", "clip_in_place", "hard_swish_in_place", "scale_shift_relu_rows"]

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
    for r in range(r0, r1):
        source = x[r]
        target = y[r]
        m = multiplier[r % channels]
        s = shift[r % channels]
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
