"""numba-compiled float32 loops for depthwise 2-D Conv (one input channel per group): each output plane summed in one long vectorised pass.

Imported only through :func:`plugrt_cpu.kernels.conv.depthwise_loops`, which returns
None when numba is missing or ``PLUGRT_NUMBA=0``; the numpy paths of conv.py then give
the same values to float32 rounding. Compiled code is cached on disk (``cache=True``), so
only the first process on a machine pays the compile (~3 s); later ones load it in ~0.2 s
(most of it numba starting its code generator), on the first depthwise Conv.

The layout (``conv._DepthwiseLayout`` computes it): input column ``c`` of row ``R`` goes
to column ``c // sx`` of row ``R`` in column phase ``c % sx``, a plane of rows ``pitch``
floats wide with zero rows above and below. Output ``(oy, ox)`` is grid position
``i = oy * sy * pitch + ox``, and tap ``(ky, kx)`` reads one phase at ``i`` plus a fixed
offset: the output plane is one loop over the grid with unit-stride loads that
vectorise, whatever the strides, dilations and pads, and no per-row work. Rows carry no
column padding: a tap that reads past a row's left or right end wraps into the
neighbouring row, and a per-column mask drops it (a select, so a NaN there stays out of
the sum, as in a zero-padded convolution). With grid rows as long as output rows (unit
vertical stride and an output that covers the input, e.g. 'same' pads) the loop writes
the output plane itself; otherwise the grid (whose rows for a vertical stride of 2 are
half junk, still cheaper than splitting the rows) is cropped into it. An input whose
rows are exactly ``sx * pitch`` wide is copied (and for ``sx == 2`` split into its two
phases) in one run.

The fastmath flags allow contraction and reassociation but not ``nnan``/``ninf``: NaN
and infinity propagate as in numpy. ``error_model="numpy"`` drops the division checks.
Every array is indexed from a view that starts where the loop starts: an index that
counts up from zero needs no wraparound check, which would stop the loop vectorising.
"""

from __future__ import annotations

import numba
import numpy as np

from ._numba_epilogue import activation_rows
from ._numba_parallel import float32_pointer, int64_pointer

__all__ = ["JOB_WORDS", "depthwise_conv2d", "depthwise_job"]

_compiled = numba.njit(
    fastmath={"contract", "arcp", "nsz", "reassoc"}, nogil=True, boundscheck=False, error_model="numpy", cache=True
)

_ZERO = np.float32(0.0)


@_compiled
def _fill(src, height, width, phases, sx, pitch, row0, block):  # pragma: no cover  (compiled; inlined)
    """Input plane ``src`` (H * W floats from its first) into its column phases; the rest
    of ``phases`` stays zero."""
    if width == sx * pitch:  # the plane's rows end to end: one run
        count = height * pitch
        if sx == 1:
            dst = phases[row0:]
            for k in range(count):
                dst[k] = src[k]
        elif sx == 2:  # both phases in one loop: stride-2 loads that vectorise as shuffles
            even = phases[row0:]
            odd = phases[block + row0 :]
            for k in range(count):
                even[k] = src[2 * k]
                odd[k] = src[2 * k + 1]
        else:
            for px in range(sx):
                dst = phases[px * block + row0 :]
                run = src[px:]
                for k in range(count):
                    dst[k] = run[sx * k]
        return
    for r in range(height):
        for px in range(sx):
            dst = phases[px * block + row0 + r * pitch :]
            run = src[r * width + px :]
            for j in range((width - px + sx - 1) // sx):
                dst[j] = run[sx * j]


@_compiled
def _relu(out):  # pragma: no cover  (compiled; inlined)
    for i in range(out.shape[0]):
        v = out[i]
        out[i] = _ZERO if v < _ZERO else v  # NaN is not below zero: it stays


@_compiled
def _generic_taps(phases, w, offsets, masks, bias, out):  # pragma: no cover  (compiled; inlined)
    """out[i] = bias + sum over taps k of w[k] * phases[offsets[k] + i], each kernel
    column's taps under its mask (``masks`` has a row per kernel column): a pass per
    kernel column and three kernel rows."""
    length = out.shape[0]
    width = masks.shape[0]
    height = offsets.shape[0] // width
    for i in range(length):
        out[i] = bias
    for kx in range(width):
        mask = masks[kx]
        ky = 0
        while ky < height:  # up to three taps a pass (never a zero weight: 0 * inf is NaN)
            k = ky * width + kx
            a0, w0 = phases[offsets[k] :], w[k]
            if height - ky >= 3:
                a1, w1 = phases[offsets[k + width] :], w[k + width]
                a2, w2 = phases[offsets[k + 2 * width] :], w[k + 2 * width]
                for i in range(length):
                    s = w0 * a0[i] + w1 * a1[i] + w2 * a2[i]
                    out[i] += s if mask[i] > _ZERO else _ZERO
                ky += 3
            elif height - ky == 2:
                a1, w1 = phases[offsets[k + width] :], w[k + width]
                for i in range(length):
                    s = w0 * a0[i] + w1 * a1[i]
                    out[i] += s if mask[i] > _ZERO else _ZERO
                ky += 2
            else:
                for i in range(length):
                    s = w0 * a0[i]
                    out[i] += s if mask[i] > _ZERO else _ZERO
                ky += 1


@_compiled
def _rows_of_five(phases, w, offsets, masks, bias, out):  # pragma: no cover  (compiled; inlined)
    """``_generic_taps`` for kernels five columns wide: a pass per kernel row, its five taps
    in one expression (measured on 672 planes of 14 x 14, 5x5: 26 G multiply-adds/s
    against 6 for passes of up to three taps down a column, whose every pass loads and
    stores the whole output)."""
    length = out.shape[0]
    height = offsets.shape[0] // 5
    m0, m1, m2, m3, m4 = masks[0], masks[1], masks[2], masks[3], masks[4]
    for i in range(length):
        out[i] = bias
    for ky in range(height):
        k = ky * 5
        a0, a1, a2 = phases[offsets[k] :], phases[offsets[k + 1] :], phases[offsets[k + 2] :]
        a3, a4 = phases[offsets[k + 3] :], phases[offsets[k + 4] :]
        w0, w1, w2, w3, w4 = w[k], w[k + 1], w[k + 2], w[k + 3], w[k + 4]
        for i in range(length):
            v = out[i]
            v += w0 * a0[i] if m0[i] > _ZERO else _ZERO
            v += w1 * a1[i] if m1[i] > _ZERO else _ZERO
            v += w2 * a2[i] if m2[i] > _ZERO else _ZERO
            v += w3 * a3[i] if m3[i] > _ZERO else _ZERO
            v += w4 * a4[i] if m4[i] > _ZERO else _ZERO
            out[i] = v


@_compiled
def _rows_of_seven(phases, w, offsets, masks, bias, out):  # pragma: no cover  (compiled; inlined)
    """``_rows_of_five`` for kernels seven columns wide (ConvNeXt's 7x7)."""
    length = out.shape[0]
    height = offsets.shape[0] // 7
    m0, m1, m2, m3, m4, m5, m6 = masks[0], masks[1], masks[2], masks[3], masks[4], masks[5], masks[6]
    for i in range(length):
        out[i] = bias
    for ky in range(height):
        k = ky * 7
        a0, a1, a2 = phases[offsets[k] :], phases[offsets[k + 1] :], phases[offsets[k + 2] :]
        a3, a4, a5 = phases[offsets[k + 3] :], phases[offsets[k + 4] :], phases[offsets[k + 5] :]
        a6 = phases[offsets[k + 6] :]
        w0, w1, w2, w3, w4, w5, w6 = w[k], w[k + 1], w[k + 2], w[k + 3], w[k + 4], w[k + 5], w[k + 6]
        for i in range(length):
            v = out[i]
            v += w0 * a0[i] if m0[i] > _ZERO else _ZERO
            v += w1 * a1[i] if m1[i] > _ZERO else _ZERO
            v += w2 * a2[i] if m2[i] > _ZERO else _ZERO
            v += w3 * a3[i] if m3[i] > _ZERO else _ZERO
            v += w4 * a4[i] if m4[i] > _ZERO else _ZERO
            v += w5 * a5[i] if m5[i] > _ZERO else _ZERO
            v += w6 * a6[i] if m6[i] > _ZERO else _ZERO
            out[i] = v


_SIGNATURE = numba.void(
    numba.types.Array(numba.float32, 4, "C", readonly=True),  # x
    numba.types.Array(numba.float32, 2, "C", readonly=True),  # weights
    numba.types.Array(numba.float32, 1, "C", readonly=True),  # bias
    numba.types.Array(numba.int64, 1, "C", readonly=True),  # layout
    numba.types.Array(numba.float32, 2, "C", readonly=True),  # masks
    numba.boolean,  # relu
    numba.int64,  # a fused activation after it (``_numba_epilogue.ACT_*``; 0: none)
    numba.float32,  # Clip's low bound
    numba.float32,  # Clip's high bound
    numba.float32[::1],  # work
    numba.float32[:, :, :, ::1],  # y
    numba.int64,  # start
    numba.int64,  # stop
)


# One signature, compiled (or loaded from the cache) at import: writable arrays convert to
# the read-only ones, so a frozen weight or a protected input compiles nothing new.
@numba.njit(
    [_SIGNATURE],
    fastmath={"contract", "arcp", "nsz", "reassoc"},
    nogil=True,
    boundscheck=False,
    error_model="numpy",
    cache=True,
)
def depthwise_conv2d(x, weights, bias, layout, masks, relu, activation, low, high, work, y, start, stop):  # pragma: no cover  (compiled)
    """Output planes [start, stop) of y (n, M, out_h, out_w), counted over (image, output
    channel): channel m reads input channel ``m // (M // C)`` of x (n, C, H, W) through
    the taps ``weights[m]`` (row-major over the kernel), adds ``bias[m]`` and clamps at
    zero when ``relu`` (NaN stays NaN), then applies ``activation`` (Clip between ``low``
    and ``high``) to the plane while it is in cache.

    ``layout`` is ``(sy, sx, pitch, row0, block, three_by_three, tap offsets...)``: a
    column phase holds rows of ``pitch`` floats, input row 0 at ``row0``, ``block``
    floats in all; grid rows are ``sy * pitch`` apart; ``three_by_three`` marks a 3x3
    kernel whose middle column needs no mask. ``masks`` (kernel width, grid length) keeps
    (> 0) or drops a kernel column's taps at each grid position. ``work`` is the calling
    thread's: the phases (``sx * block`` floats), then the grid when it is cropped.
    """
    channels, height, width = x.shape[1], x.shape[2], x.shape[3]
    outputs, out_h, out_w = y.shape[1], y.shape[2], y.shape[3]
    # planes as runs of flat views (a reshape per plane would cost a call each)
    x_flat = x.reshape(-1)
    y_flat = y.reshape(-1)
    in_size = height * width
    out_size = out_h * out_w
    multiplier = outputs // channels
    sy, sx, pitch, row0, block = layout[0], layout[1], layout[2], layout[3], layout[4]
    offsets = layout[6:]
    apart = sy * pitch
    crop = apart != out_w
    length = (out_h - 1) * apart + pitch
    phases = work[: sx * block]
    grid = work[sx * block :]
    phases[:] = _ZERO  # the padding rows and guards; the fills write only input rows
    # 3x3 with the middle kernel column inside every row (pads of 1, say): one pass over
    # the nine taps, only the outer columns masked
    three_by_three = layout[5] != 0
    # the 3x3 taps' views and masks, made once for every plane (the phases are refilled in place)
    a0, a1, a2 = phases[offsets[0] :], phases[offsets[1] :], phases[offsets[2] :]
    if three_by_three:
        a3, a4, a5 = phases[offsets[3] :], phases[offsets[4] :], phases[offsets[5] :]
        a6, a7, a8 = phases[offsets[6] :], phases[offsets[7] :], phases[offsets[8] :]
    else:
        a3 = a4 = a5 = a6 = a7 = a8 = a0
    m0, m2 = masks[0], masks[masks.shape[0] - 1]
    last = -1
    for plane in range(start, stop):
        image = plane // outputs
        m = plane - image * outputs
        source = image * channels + m // multiplier
        if source != last:
            _fill(x_flat[source * in_size :], height, width, phases, sx, pitch, row0, block)
            last = source
        out = grid[:length] if crop else y_flat[plane * out_size : (plane + 1) * out_size]
        b = bias[m]
        if three_by_three:
            w = weights[m]
            w0, w1, w2, w3, w4, w5, w6, w7, w8 = w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8]
            for i in range(length):
                left = w0 * a0[i] + w3 * a3[i] + w6 * a6[i]
                right = w2 * a2[i] + w5 * a5[i] + w8 * a8[i]
                v = b + w1 * a1[i] + w4 * a4[i] + w7 * a7[i]
                v += left if m0[i] > _ZERO else _ZERO
                v += right if m2[i] > _ZERO else _ZERO
                if relu:
                    v = _ZERO if v < _ZERO else v  # NaN is not below zero: it stays
                out[i] = v
        else:
            if masks.shape[0] == 5:
                _rows_of_five(phases, weights[m], offsets, masks, b, out)
            elif masks.shape[0] == 7:
                _rows_of_seven(phases, weights[m], offsets, masks, b, out)
            else:
                _generic_taps(phases, weights[m], offsets, masks, b, out)
            if relu:
                _relu(out)
        if crop:
            target = y_flat[plane * out_size :]
            for r in range(out_h):
                row = grid[r * apart :]
                dst = target[r * out_w :]
                for j in range(out_w):
                    dst[j] = row[j]
        if activation != 0:
            done = y_flat[plane * out_size : (plane + 1) * out_size].reshape((1, out_size))
            activation_rows(done, 0, 1, 0, out_size, activation, low, high)


# The context of ``depthwise_job`` (int64 words; see ``conv._Convolution._depthwise_compiled``).
(
    JOB_X, JOB_IMAGES, JOB_CHANNELS, JOB_HEIGHT, JOB_WIDTH, JOB_WEIGHTS, JOB_OUTPUTS, JOB_TAPS, JOB_BIAS, JOB_LAYOUT,
    JOB_LAYOUT_WORDS, JOB_MASKS, JOB_MASK_ROWS, JOB_MASK_COLUMNS, JOB_RELU, JOB_ACTIVATION, JOB_LOW, JOB_HIGH,
    JOB_WORK, JOB_WORK_FLOATS, JOB_Y, JOB_OUT_HEIGHT, JOB_OUT_WIDTH, JOB_PLANES_PER_UNIT, JOB_PLANES,
) = range(25)
JOB_WORDS = 25  # JOB_LOW and JOB_HIGH: float32 bits in the low half of the word


@numba.cfunc(numba.void(numba.int64, numba.int64, numba.int64, numba.int64), nogil=True, cache=True)
def depthwise_job(c, start, stop, slot):  # pragma: no cover  (compiled)
    """Units [start, stop) of a depthwise Conv on the compiled pool: each unit
    ``JOB_PLANES_PER_UNIT`` output planes by :func:`depthwise_conv2d`, in this slot's
    work array, without the GIL."""
    context = numba.carray(int64_pointer(c), JOB_WORDS)
    n, channels = context[JOB_IMAGES], context[JOB_CHANNELS]
    m = context[JOB_OUTPUTS]
    x = numba.carray(float32_pointer(context[JOB_X]), (n, channels, context[JOB_HEIGHT], context[JOB_WIDTH]))
    weights = numba.carray(float32_pointer(context[JOB_WEIGHTS]), (m, context[JOB_TAPS]))
    bias = numba.carray(float32_pointer(context[JOB_BIAS]), m)
    layout = numba.carray(int64_pointer(context[JOB_LAYOUT]), context[JOB_LAYOUT_WORDS])
    masks = numba.carray(float32_pointer(context[JOB_MASKS]), (context[JOB_MASK_ROWS], context[JOB_MASK_COLUMNS]))
    bounds = numba.carray(float32_pointer(c + JOB_LOW * 8), 3)  # low, (its high half), high
    floats = context[JOB_WORK_FLOATS]
    work = numba.carray(float32_pointer(context[JOB_WORK] + slot * floats * 4), floats)
    y = numba.carray(float32_pointer(context[JOB_Y]), (n, m, context[JOB_OUT_HEIGHT], context[JOB_OUT_WIDTH]))
    group = context[JOB_PLANES_PER_UNIT]
    first = start * group
    last = min(context[JOB_PLANES], stop * group)
    if first < last:
        depthwise_conv2d(
            x, weights, bias, layout, masks, context[JOB_RELU] != 0, context[JOB_ACTIVATION], bounds[0], bounds[2],
            work, y, first, last,
        )
