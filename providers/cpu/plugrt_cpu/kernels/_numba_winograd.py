"""numba-compiled float32 transforms of the Winograd 3x3 convolutions F(4x4, 3x3) and F(2x2, 3x3) (Lavin and Gray, 2016).

Imported only through :func:`plugrt_cpu.kernels.winograd.winograd_loops`, which returns
None when numba is missing or ``PLUGRT_NUMBA=0``; Conv then takes its GEMM paths. The
compiled code is cached on disk (``cache=True``): the first process on a machine
compiles (~2 s), later ones load it.

Each output tile of 4x4 reads a 6x6 input tile (tiles 4 apart). The input transform
``V = B^T d B`` and the output transform ``Y = A^T M A`` are separable: a vertical pass
over whole rows (unit steps, vectorised), then a horizontal one. The horizontal pass
runs over the tiles of every tile row at once: a tile row is laid out ``4 * (tiles +
1)`` floats wide, so tile ``g`` (counted over all tile rows, one junk tile closing
each row) starts at float ``4 * g``, an index that is affine in the loop counter and
vectorises. The input's horizontal pass first splits a row into its four phases
(``t[4 * g + r]``: one whole interleave group, which vectorises), then reads a tile's
six values from them with unit steps (reading ``t[4 * g + k]`` for k up to 5 directly
left that loop scalar: the input transform took 176 us on 128 channels of 28x28,
against 116 now). The junk tiles mix a row's end with the next row's start (finite values,
never read back from ``M``); the very last one, which would read past the pass, is zero.

The fastmath flags allow contraction and reassociation but not ``nnan``/``ninf``. A
tile mixes all its 36 inputs, so a NaN or infinity would spread over outputs a direct
convolution keeps finite: the input transform reports any non-finite input and the
caller computes that call the direct way.
"""

from __future__ import annotations

import numba
import numpy as np

from ._numba_gemm import MR, packed_product
from ._numba_parallel import float32_pointer, int64_pointer, sgemm32, sgemm64, store

__all__ = ["BAND_WORDS", "winograd_bands", "winograd_input", "winograd_output", "winograd2_input", "winograd2_output"]

_ZERO = np.float32(0.0)
_TWO = np.float32(2.0)
_FOUR = np.float32(4.0)
_FIVE = np.float32(5.0)
_EIGHT = np.float32(8.0)

_FLAGS = {"contract", "arcp", "nsz", "reassoc"}

_inline = numba.njit(fastmath=_FLAGS, nogil=True, boundscheck=False, error_model="numpy", cache=True)


@_inline
def _fill(source, top, first, last, plane, pitch, pad_left, count):  # pragma: no cover  (compiled; inlined)
    """Rows [first, last) of the padded ``plane`` from input plane ``source`` (plane row
    ``r`` is input row ``top + r``), each at ``pad_left`` and ``count`` floats long;
    False when one holds a NaN or an infinity."""
    check = _ZERO  # stays zero unless a value is NaN or infinite (0 * inf is NaN)
    for r in range(first, last):
        dst = plane[r * pitch + pad_left :]
        src = source[top + r]
        for j in range(count):
            value = src[j]
            dst[j] = value
            check += value * _ZERO
    return check == _ZERO


@_inline
def _crop(rows_out, tile, row0, rows, pitch, cells, plane, residual, add, relu):  # pragma: no cover  (compiled; inlined)
    """The output rows of a band (``tile`` rows of ``tile * cells`` floats, grid rows
    ``pitch`` apart) into the output ``plane``, without the junk tiles and the rows past
    its end; with ``add``, plus the same rows of the ``residual`` plane, then clamped at
    zero when ``relu`` (NaN stays NaN). Each value is read from ``residual`` before it is
    written to ``plane``, at the same place: the two may be one buffer."""
    out_h, out_w = plane.shape[0], plane.shape[1]
    for ty in range(rows):
        top = tile * (row0 + ty)
        for row in range(min(tile, out_h - top)):
            src = rows_out[row * tile * cells + ty * pitch :]
            dst = plane[top + row]
            if add:
                res = residual[top + row]
                for j in range(out_w):
                    value = src[j] + res[j]
                    dst[j] = _ZERO if relu and value < _ZERO else value
            else:
                for j in range(out_w):
                    dst[j] = src[j]

_INPUT = numba.boolean(
    numba.types.Array(numba.float32, 4, "C", readonly=True),  # x (n, C, H, W)
    numba.int64,  # pad_top
    numba.int64,  # pad_left
    numba.int64,  # tiles (per tile row)
    numba.float32[:, :, ::1],  # v (36 or 16 transform points, C, band cells)
    numba.int64,  # image
    numba.int64,  # row0
    numba.int64,  # row1
    numba.int64,  # first channel
    numba.int64,  # channel stop
    numba.float32[::1],  # work
)


@numba.njit([_INPUT], fastmath=_FLAGS, nogil=True, boundscheck=False, error_model="numpy", cache=True)
def winograd_input(x, pad_top, pad_left, tiles, v, image, row0, row1, c0, c1, work):  # pragma: no cover  (compiled)
    """``V = B^T d B`` for channels [c0, c1) of ``image`` over tile rows [row0, row1) (a
    band), into ``v`` (36, C, (row1 - row0) * (tiles + 1)). ``work`` holds the band's zero-padded
    plane (``4 * rows + 2`` rows of ``4 * (tiles + 1)``), the vertical pass (6 rows of
    ``rows * 4 * (tiles + 1)``) and one such row's four phases. Returns False when the
    input rows the band reads hold a NaN or an infinity (``v`` is then incomplete)."""
    height, width = x.shape[2], x.shape[3]
    rows = row1 - row0
    pitch = 4 * (tiles + 1)
    padded_rows = 4 * rows + 2
    cells = rows * (tiles + 1)
    plane = work[: padded_rows * pitch]
    vertical = work[padded_rows * pitch : padded_rows * pitch + 6 * rows * pitch]
    phases = work[padded_rows * pitch + 6 * rows * pitch : padded_rows * pitch + 7 * rows * pitch]
    p0, p1, p2, p3 = phases[:cells], phases[cells : 2 * cells], phases[2 * cells : 3 * cells], phases[3 * cells :]
    plane[:] = _ZERO  # the padding; every channel writes the same interior
    first = max(0, pad_top - 4 * row0)  # the plane's first row that holds an input row
    last = min(padded_rows, height + pad_top - 4 * row0)
    count = min(width, pitch - pad_left)
    for channel in range(c0, c1):
        if not _fill(x[image, channel], 4 * row0 - pad_top, first, last, plane, pitch, pad_left, count):
            return False
        for ty in range(rows):
            d = plane[4 * ty * pitch :]
            d0, d1, d2 = d[:pitch], d[pitch : 2 * pitch], d[2 * pitch : 3 * pitch]
            d3, d4, d5 = d[3 * pitch : 4 * pitch], d[4 * pitch : 5 * pitch], d[5 * pitch : 6 * pitch]
            t = vertical[ty * pitch :]
            t0, t1, t2 = t[:pitch], t[rows * pitch :], t[2 * rows * pitch :]
            t3, t4, t5 = t[3 * rows * pitch :], t[4 * rows * pitch :], t[5 * rows * pitch :]
            for j in range(pitch):
                a0, a1, a2, a3, a4, a5 = d0[j], d1[j], d2[j], d3[j], d4[j], d5[j]
                t0[j] = _FOUR * a0 - _FIVE * a2 + a4
                t1[j] = a3 + a4 - _FOUR * (a1 + a2)
                t2[j] = _FOUR * (a1 - a2) - a3 + a4
                t3[j] = _TWO * (a3 - a1) - a2 + a4
                t4[j] = _TWO * (a1 - a3) - a2 + a4
                t5[j] = _FOUR * a1 - _FIVE * a3 + a5
        for i in range(6):
            t = vertical[i * rows * pitch :]
            o0, o1, o2 = v[6 * i, channel], v[6 * i + 1, channel], v[6 * i + 2, channel]
            o3, o4, o5 = v[6 * i + 3, channel], v[6 * i + 4, channel], v[6 * i + 5, channel]
            for g in range(cells):  # the pass's four phases apart (a whole interleave group)
                p0[g] = t[4 * g]
                p1[g] = t[4 * g + 1]
                p2[g] = t[4 * g + 2]
                p3[g] = t[4 * g + 3]
            for g in range(cells - 1):  # the band's last tile is junk and would read past the pass
                a0, a1, a2, a3, a4, a5 = p0[g], p1[g], p2[g], p3[g], p0[g + 1], p1[g + 1]
                o0[g] = _FOUR * a0 - _FIVE * a2 + a4
                o1[g] = a3 + a4 - _FOUR * (a1 + a2)
                o2[g] = _FOUR * (a1 - a2) - a3 + a4
                o3[g] = _TWO * (a3 - a1) - a2 + a4
                o4[g] = _TWO * (a1 - a3) - a2 + a4
                o5[g] = _FOUR * a1 - _FIVE * a3 + a5
            last_cell = cells - 1
            o0[last_cell] = o1[last_cell] = o2[last_cell] = _ZERO
            o3[last_cell] = o4[last_cell] = o5[last_cell] = _ZERO
    return True


_OUTPUT = numba.void(
    numba.types.Array(numba.float32, 3, "C", readonly=True),  # m (36 or 16 transform points, K, band cells)
    numba.types.Array(numba.float32, 1, "C", readonly=True),  # bias (K,)
    numba.boolean,  # relu
    numba.int64,  # tiles
    numba.float32[:, :, :, ::1],  # y (n, K, OH, OW)
    numba.types.Array(numba.float32, 4, "C", readonly=True),  # residual (n, K, OH, OW), read where add
    numba.boolean,  # add: y = the Conv + residual (then the Relu)
    numba.int64,  # image
    numba.int64,  # row0
    numba.int64,  # row1
    numba.int64,  # first output channel
    numba.int64,  # output channel stop
    numba.float32[::1],  # work
)


@numba.njit([_OUTPUT], fastmath=_FLAGS, nogil=True, boundscheck=False, error_model="numpy", cache=True)
def winograd_output(m, bias, relu, tiles, y, residual, add, image, row0, row1, k0, k1, work):  # pragma: no cover  (compiled)
    """``Y = A^T M A + bias`` (with ``add``, plus ``residual``), clamped at zero when
    ``relu`` (NaN stays NaN), for output
    channels [k0, k1) of ``image`` over tile rows [row0, row1), from the band's products
    ``m`` (36, K, (row1 - row0) * (tiles + 1)). ``work`` holds the vertical pass (4 x 6
    rows of the band's cells) and the output rows (4 rows of 4 floats a cell)."""
    rows = row1 - row0
    cells = rows * (tiles + 1)
    pitch = 4 * (tiles + 1)
    vertical = work[: 24 * cells]
    rows_out = work[24 * cells : 24 * cells + 16 * cells]
    clamp = relu and not add  # with a residual the sum is clamped, in _crop
    for k in range(k0, k1):
        b = bias[k]
        for col in range(6):
            m0, m1, m2 = m[col, k], m[6 + col, k], m[12 + col, k]
            m3, m4, m5 = m[18 + col, k], m[24 + col, k], m[30 + col, k]
            r0, r1 = vertical[col * cells :], vertical[(6 + col) * cells :]
            r2, r3 = vertical[(12 + col) * cells :], vertical[(18 + col) * cells :]
            for g in range(cells):
                a0, a1, a2, a3, a4, a5 = m0[g], m1[g], m2[g], m3[g], m4[g], m5[g]
                r0[g] = a0 + a1 + a2 + a3 + a4
                r1[g] = a1 - a2 + _TWO * (a3 - a4)
                r2[g] = a1 + a2 + _FOUR * (a3 + a4)
                r3[g] = a1 - a2 + _EIGHT * (a3 - a4) + a5
        for row in range(4):
            q = vertical[6 * row * cells :]
            q0, q1, q2 = q[:cells], q[cells : 2 * cells], q[2 * cells : 3 * cells]
            q3, q4, q5 = q[3 * cells : 4 * cells], q[4 * cells : 5 * cells], q[5 * cells : 6 * cells]
            out = rows_out[row * 4 * cells :]
            for g in range(cells):
                a0, a1, a2, a3, a4, a5 = q0[g], q1[g], q2[g], q3[g], q4[g], q5[g]
                v0 = b + a0 + a1 + a2 + a3 + a4
                v1 = b + a1 - a2 + _TWO * (a3 - a4)
                v2 = b + a1 + a2 + _FOUR * (a3 + a4)
                v3 = b + a1 - a2 + _EIGHT * (a3 - a4) + a5
                if clamp:  # NaN is not below zero: it stays
                    v0 = _ZERO if v0 < _ZERO else v0
                    v1 = _ZERO if v1 < _ZERO else v1
                    v2 = _ZERO if v2 < _ZERO else v2
                    v3 = _ZERO if v3 < _ZERO else v3
                out[4 * g] = v0
                out[4 * g + 1] = v1
                out[4 * g + 2] = v2
                out[4 * g + 3] = v3
        _crop(rows_out, 4, row0, rows, pitch, cells, y[image, k], residual[image, k], add, relu)


# F(2x2, 3x3): 2x2 output tiles from 4x4 input tiles, 16 transform points, for outputs
# too small to give F(4x4, 3x3)'s products enough tiles (14x14: 20 tiles, here 56).


@numba.njit([_INPUT], fastmath=_FLAGS, nogil=True, boundscheck=False, error_model="numpy", cache=True)
def winograd2_input(x, pad_top, pad_left, tiles, v, image, row0, row1, c0, c1, work):  # pragma: no cover  (compiled)
    """F(2x2, 3x3)'s ``V = B^T d B``, as :func:`winograd_input` (tiles 2 apart, rows of
    ``2 * (tiles + 1)`` floats; ``work``: ``(7 * rows + 2) * pitch`` floats)."""
    height, width = x.shape[2], x.shape[3]
    rows = row1 - row0
    pitch = 2 * (tiles + 1)
    padded_rows = 2 * rows + 2
    cells = rows * (tiles + 1)
    plane = work[: padded_rows * pitch]
    vertical = work[padded_rows * pitch : padded_rows * pitch + 4 * rows * pitch]
    phases = work[padded_rows * pitch + 4 * rows * pitch : padded_rows * pitch + 5 * rows * pitch]
    p0, p1 = phases[:cells], phases[cells:]
    plane[:] = _ZERO
    first = max(0, pad_top - 2 * row0)
    last = min(padded_rows, height + pad_top - 2 * row0)
    count = min(width, pitch - pad_left)
    for channel in range(c0, c1):
        if not _fill(x[image, channel], 2 * row0 - pad_top, first, last, plane, pitch, pad_left, count):
            return False
        for ty in range(rows):
            d = plane[2 * ty * pitch :]
            d0, d1, d2, d3 = d[:pitch], d[pitch : 2 * pitch], d[2 * pitch : 3 * pitch], d[3 * pitch : 4 * pitch]
            t = vertical[ty * pitch :]
            t0, t1, t2, t3 = t[:pitch], t[rows * pitch :], t[2 * rows * pitch :], t[3 * rows * pitch :]
            for j in range(pitch):
                a0, a1, a2, a3 = d0[j], d1[j], d2[j], d3[j]
                t0[j] = a0 - a2
                t1[j] = a1 + a2
                t2[j] = a2 - a1
                t3[j] = a1 - a3
        for i in range(4):
            t = vertical[i * rows * pitch :]
            o0, o1, o2, o3 = v[4 * i, channel], v[4 * i + 1, channel], v[4 * i + 2, channel], v[4 * i + 3, channel]
            for g in range(cells):  # the pass's two phases apart (a whole interleave group)
                p0[g] = t[2 * g]
                p1[g] = t[2 * g + 1]
            for g in range(cells - 1):  # the band's last tile is junk and would read past the pass
                a0, a1, a2, a3 = p0[g], p1[g], p0[g + 1], p1[g + 1]
                o0[g] = a0 - a2
                o1[g] = a1 + a2
                o2[g] = a2 - a1
                o3[g] = a1 - a3
            last_cell = cells - 1
            o0[last_cell] = o1[last_cell] = o2[last_cell] = o3[last_cell] = _ZERO
    return True


@numba.njit([_OUTPUT], fastmath=_FLAGS, nogil=True, boundscheck=False, error_model="numpy", cache=True)
def winograd2_output(m, bias, relu, tiles, y, residual, add, image, row0, row1, k0, k1, work):  # pragma: no cover  (compiled)
    """F(2x2, 3x3)'s ``Y = A^T M A + bias (+ residual)``, as :func:`winograd_output` (``work``: 12
    floats a tile)."""
    rows = row1 - row0
    cells = rows * (tiles + 1)
    pitch = 2 * (tiles + 1)
    vertical = work[: 8 * cells]
    rows_out = work[8 * cells : 12 * cells]
    clamp = relu and not add  # with a residual the sum is clamped, in _crop
    for k in range(k0, k1):
        b = bias[k]
        for col in range(4):
            m0, m1, m2, m3 = m[col, k], m[4 + col, k], m[8 + col, k], m[12 + col, k]
            r0, r1 = vertical[col * cells :], vertical[(4 + col) * cells :]
            for g in range(cells):
                a0, a1, a2, a3 = m0[g], m1[g], m2[g], m3[g]
                r0[g] = a0 + a1 + a2
                r1[g] = a1 - a2 - a3
        for row in range(2):
            q = vertical[4 * row * cells :]
            q0, q1, q2, q3 = q[:cells], q[cells : 2 * cells], q[2 * cells : 3 * cells], q[3 * cells : 4 * cells]
            out = rows_out[row * 2 * cells :]
            for g in range(cells):
                a0, a1, a2, a3 = q0[g], q1[g], q2[g], q3[g]
                v0 = b + a0 + a1 + a2
                v1 = b + a1 - a2 - a3
                if clamp:  # NaN is not below zero: it stays
                    v0 = _ZERO if v0 < _ZERO else v0
                    v1 = _ZERO if v1 < _ZERO else v1
                out[2 * g] = v0
                out[2 * g + 1] = v1
        _crop(rows_out, 2, row0, rows, pitch, cells, y[image, k], residual[image, k], add, relu)


# The context of ``winograd_bands`` (int64 words; see ``winograd.WinogradPlan``).
(
    BAND_SGEMM, BAND_ILP64, BAND_X, BAND_IMAGES, BAND_CHANNELS, BAND_HEIGHT, BAND_WIDTH, BAND_PAD_TOP, BAND_PAD_LEFT,
    BAND_TILES, BAND_TILE_ROWS, BAND_BANDS, BAND_TILE, BAND_M, BAND_U, BAND_BIAS, BAND_RELU, BAND_Y, BAND_OUT_HEIGHT,
    BAND_OUT_WIDTH, BAND_WORKSPACE, BAND_ROOM, BAND_WORK_FLOATS, BAND_FINITE, BAND_PACKED, BAND_RESIDUAL,
) = range(26)
# BAND_PACKED: the transformed weight packed for ``_numba_gemm`` (0: BLAS); BAND_RESIDUAL:
# the residual (n, M, OH, OW) the output adds before the Relu (0: none)
BAND_WORDS = 26


@numba.cfunc(numba.void(numba.int64, numba.int64, numba.int64, numba.int64), nogil=True, cache=True)
def winograd_bands(c, start, stop, slot):  # pragma: no cover  (compiled)
    """Bands of tile rows, each from the input to the output on this thread (the compiled
    ``_by_bands`` of ``winograd.WinogradPlan``): its input transform, its products (one
    BLAS GEMM per transform point, as numpy's batched matmul makes them) and its output
    transform (adding the residual where the context has one), in the slot's workspace.
    A non-finite input clears the context's finite word and leaves the band."""
    context = numba.carray(int64_pointer(c), BAND_WORDS)
    n, channels = context[BAND_IMAGES], context[BAND_CHANNELS]
    tiles, tile_rows, bands = context[BAND_TILES], context[BAND_TILE_ROWS], context[BAND_BANDS]
    tile, m = context[BAND_TILE], context[BAND_M]
    points = (tile + 2) * (tile + 2)
    x = numba.carray(float32_pointer(context[BAND_X]), (n, channels, context[BAND_HEIGHT], context[BAND_WIDTH]))
    y = numba.carray(float32_pointer(context[BAND_Y]), (n, m, context[BAND_OUT_HEIGHT], context[BAND_OUT_WIDTH]))
    bias = numba.carray(float32_pointer(context[BAND_BIAS]), m)
    relu = context[BAND_RELU] != 0
    add = context[BAND_RESIDUAL] != 0
    residual = y  # read only where add
    if add:
        residual = numba.carray(float32_pointer(context[BAND_RESIDUAL]), y.shape)
    for unit in range(start, stop):
        image = unit // bands
        k = unit % bands
        r0 = k * tile_rows // bands
        r1 = (k + 1) * tile_rows // bands
        cells = (r1 - r0) * (tiles + 1)
        base = context[BAND_WORKSPACE] + slot * context[BAND_ROOM] * 4
        v = numba.carray(float32_pointer(base), (points, channels, cells))
        products_at = base + points * channels * cells * 4
        products = numba.carray(float32_pointer(products_at), (points, m, cells))
        work = numba.carray(float32_pointer(products_at + points * m * cells * 4), context[BAND_WORK_FLOATS])
        if tile == 4:
            finite = winograd_input(x, context[BAND_PAD_TOP], context[BAND_PAD_LEFT], tiles, v, image, r0, r1, 0, channels, work)
        else:
            finite = winograd2_input(x, context[BAND_PAD_TOP], context[BAND_PAD_LEFT], tiles, v, image, r0, r1, 0, channels, work)
        if not finite:
            store(c + BAND_FINITE * 8, 0)
            continue
        u = context[BAND_U]
        packed = context[BAND_PACKED]
        packed_point = ((m + MR - 1) // MR) * MR * channels * 4
        for point in range(points):
            a = u + point * m * channels * 4
            b = base + point * channels * cells * 4
            target = products_at + point * m * cells * 4
            if packed != 0:
                packed_product(packed + point * packed_point, b, cells, channels, target, cells, m, cells, 0, 0, 0)
            elif context[BAND_ILP64]:
                sgemm64(context[BAND_SGEMM], m, cells, channels, a, channels, b, cells, target, cells)
            else:
                sgemm32(context[BAND_SGEMM], m, cells, channels, a, channels, b, cells, target, cells)
        if tile == 4:
            winograd_output(products, bias, relu, tiles, y, residual, add, image, r0, r1, 0, m, work)
        else:
            winograd2_output(products, bias, relu, tiles, y, residual, add, image, r0, r1, 0, m, work)
