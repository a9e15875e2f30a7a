"""numba-compiled float32 loops of the dense layers' products (``x @ W + bias``, then a GELU): the activation packed as ``_numba_gemm`` reads its left operand, and the bias (+ GELU) epilogue of a block of columns.

Why: a transformer's Linear layers are ``(tokens, K) @ (K, N)`` with ``N`` the weight's
columns; ``_numba_gemm`` computes ``C = W @ X`` with ``W`` packed in row tiles and ``X``
read in place, so with the activation as ``W`` (packed per call: a copy of tokens x K
floats, small next to the tokens x K x N product) and the constant weight as ``X`` the
product lands in ``C`` row-major, in place, with nothing transposed.

Imported only through :func:`plugrt_cpu.kernels._compiled.compiled_module` (``None``
without numba or with ``PLUGRT_NUMBA=0``); the callers then run BLAS and numpy's ufuncs.
Compiled code is cached on disk (``cache=True``).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from ._numba_gemm import MR, _tile
from ._numba_loops import _gelu
from ._numba_parallel import float32_pointer, int64_pointer

__all__ = ["JOB_WORDS", "VECTOR", "bias_columns", "pack_rows", "panel_job", "panel_product"]

VECTOR = 16  # columns of one panel of the weight: one vector of the micro-kernel
_FLOAT = 4

_FLAGS: dict[str, Any] = dict(fastmath={"contract", "arcp", "nsz", "afn", "reassoc"}, nogil=True, boundscheck=False, error_model="numpy", cache=True)
_ROWS = numba.types.Array(numba.float32, 2, "A", readonly=True)  # any strides: a transposed input too
_PACKED = numba.float32[:, :, ::1]
_MATRIX = numba.float32[:, ::1]
_BIAS = numba.types.Array(numba.float32, 1, "C", readonly=True)
_PANELS = numba.types.Array(numba.float32, 3, "C", readonly=True)
_ZERO = np.float32(0.0)


@numba.njit([numba.void(_ROWS, _PACKED)], **_FLAGS)
def pack_rows(a, packed):  # pragma: no cover  (compiled)
    """``packed[b, k, r] = a[b * MR + r, k]`` (zero past a's last row): ``a`` (M, K) as
    ``_numba_gemm.pack_weight`` lays out its left operand, into ``packed`` (ceil(M / MR), K, MR)."""
    rows, depth = a.shape
    for b in range(packed.shape[0]):
        r0 = b * MR
        count = min(MR, rows - r0)
        tile = packed[b]
        for r in range(count):
            row = a[r0 + r]
            for k in range(depth):
                tile[k, r] = row[k]
        for r in range(count, MR):
            for k in range(depth):
                tile[k, r] = _ZERO


@numba.njit([numba.void(_MATRIX, _BIAS, numba.int64, numba.int64, numba.boolean)], **_FLAGS)
def bias_columns(c, bias, j0, j1, gelu):  # pragma: no cover  (compiled)
    """``c[:, j0:j1] += bias[j0:j1]``, then the erf GELU when ``gelu`` (as
    ``_numba_loops.bias_gelu_rows`` computes it), in place: the epilogue of one block of
    columns while it is in cache."""
    count = j1 - j0
    shift = bias[j0:j1]
    for i in range(c.shape[0]):
        row = c[i, j0:j1]
        if gelu:
            for j in range(count):
                row[j] = _gelu(row[j] + shift[j])
        else:
            for j in range(count):
                row[j] = row[j] + shift[j]


@numba.njit([numba.void(_PACKED, _PANELS, _MATRIX, _BIAS, numba.boolean, numba.int64, numba.int64, numba.int64)], **_FLAGS)
def panel_product(packed, panels, c, bias, gelu, t0, t1, depth):  # pragma: no cover  (compiled)
    """``c[:, j] = epilogue(a @ w)[:, j]`` for the columns of panels [t0, t1): ``packed`` is
    ``a`` (M, K) from :func:`pack_rows`, ``panels`` the weight (K, N) as (ceil(N / VECTOR),
    K, VECTOR) panels, zero past column N; the epilogue adds ``bias`` (N,) and then, when
    ``gelu``, the erf GELU.

    Each panel runs in slices of at most ``depth`` steps of K, every row tile of ``a`` over
    one slice of the panel before the next: the slice (``depth`` x VECTOR floats, one
    contiguous block: the weight was laid out once) stays in the L1 cache while the row
    tiles' slices stream from L2. A slice after the first adds the partial sums; the
    epilogue runs on the panel's columns while they are in cache."""
    rows, k = c.shape[0], packed.shape[1]
    n = c.shape[1]
    ldc = c.shape[1]
    w, x, out = packed.ctypes.data, panels.ctypes.data, c.ctypes.data
    slices = (k + depth - 1) // depth
    for t in range(t0, t1):
        j0 = t * VECTOR
        columns = min(VECTOR, n - j0)
        panel = x + t * k * VECTOR * _FLOAT
        for s in range(slices):
            k0 = s * k // slices
            steps = (s + 1) * k // slices - k0
            for r0 in range(0, rows, MR):
                offset = out + (r0 * ldc + j0) * _FLOAT
                _tile(
                    w + (r0 * k + k0 * MR) * _FLOAT,
                    panel + k0 * VECTOR * _FLOAT,
                    VECTOR,
                    steps,
                    offset,
                    ldc,
                    columns,
                    min(MR, rows - r0),
                    0,
                    offset if s > 0 else 0,
                    0,
                )
        shift = bias[j0 : j0 + columns]
        for i in range(rows):
            row = c[i, j0 : j0 + columns]
            if gelu:
                for j in range(columns):
                    row[j] = _gelu(row[j] + shift[j])
            else:
                for j in range(columns):
                    row[j] = row[j] + shift[j]


# The context of ``panel_job`` (int64 words; see ``kernels.dense.dense_product``).
(
    JOB_PACKED, JOB_ROW_TILES, JOB_DEPTH_K, JOB_PANELS, JOB_PANEL_COUNT, JOB_C, JOB_ROWS, JOB_COLUMNS, JOB_BIAS,
    JOB_GELU, JOB_SLICE, JOB_PANELS_PER_UNIT,
) = range(12)
JOB_WORDS = 12


@numba.cfunc(numba.void(numba.int64, numba.int64, numba.int64, numba.int64), nogil=True, cache=True)
def panel_job(c, start, stop, slot):  # pragma: no cover  (compiled)
    """Units [start, stop) of a dense product on the compiled pool: each unit
    ``JOB_PANELS_PER_UNIT`` weight panels by :func:`panel_product`, without the GIL."""
    context = numba.carray(int64_pointer(c), JOB_WORDS)
    k = context[JOB_DEPTH_K]
    count = context[JOB_PANEL_COUNT]
    packed = numba.carray(float32_pointer(context[JOB_PACKED]), (context[JOB_ROW_TILES], k, MR))
    panels = numba.carray(float32_pointer(context[JOB_PANELS]), (count, k, VECTOR))
    out = numba.carray(float32_pointer(context[JOB_C]), (context[JOB_ROWS], context[JOB_COLUMNS]))
    bias = numba.carray(float32_pointer(context[JOB_BIAS]), context[JOB_COLUMNS])
    group = context[JOB_PANELS_PER_UNIT]
    first = start * group
    last = min(count, stop * group)
    if first < last:
        panel_product(packed, panels, out, bias, context[JOB_GELU] != 0, first, last, context[JOB_SLICE])
