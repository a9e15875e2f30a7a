"""numba-compiled float32 loops for depthwise 2-D Conv (one input channel per group): each output plane summed in one long vectorised pass.

Imported only through :func:`plugrt_cpu.kernels.conv.depthwise_loops`, which returns
None when numba is missing or ``PLUGRT_NUMBA=0``; the numpy paths of conv.py then give
the same values to float32 rounding. Compiled code is cached on disk (``cache=True``), so
only the first process on a machine pays the compile (~3 s); later ones load it in ~0.2 s
(most of it numba starting its code generator), on the first depthwise Conv.

The layout (``conv._DepthwiseLayout`` computes it): the input is split into its column
stride phases, input column ``c`` going to column ``c // sx`` of phase ``c % sx``, and,
where rows are long, into its row stride phases too, input row ``R`` (counted from the zero
rows above it) going to row ``R // sy`` of row phase ``R % sy``: planes of rows ``pitch``
floats wide with zero rows above and below. Output ``(oy, ox)`` is grid position ``i =
oy * apart + ox``, and tap ``(ky, kx)`` reads one phase at ``i`` plus a fixed offset: the
output plane is one loop over the grid with unit-stride loads that vectorise, whatever
the strides, dilations and pads, and no per-row work. Rows carry no column padding: a
tap that reads past a row's left or right end wraps into the neighbouring row, and a
per-column mask drops it (a select, so a NaN there stays out of the sum, as in a
zero-padded convolution). With the row phases a grid row is an output row (``apart`` is
``pitch``); without them a vertical stride of ``sy`` puts ``sy`` plane rows between two
output rows, and the rows between are computed and dropped (on short rows that is cheaper
than splitting them: 576 planes of 14 x 14 to 7 x 7 took 95-133 us against 137-218; on
long ones it is not: 96 planes of 112 x 112 to 56 x 56, 308-358 against 236-246). With
grid rows as long as output rows the loop writes the output plane itself; otherwise the
grid is cropped into it. An input whose rows are exactly ``sx * pitch`` wide and that has
one row phase is copied (and for ``sx == 2`` split into its two column phases) in one run.

The channel-blocked loops (``blocked_depthwise``) also run grouped Convs of 2, 4, 8 or 16
channels a group in and out (RegNet's groups of 8): a block of 16 channels then holds
``16 // per_group`` groups side by side, its lanes ordered so that input channel ``j`` of
every group is adjacent (``lane_channels``); each output lane's group reads it as one
broadcast load, one multiply-add of 16 outputs an input channel and tap. RegNet-Y-400MF's
208 channels in groups of 8 on 14 x 14: 96 us on one thread, against 200-260 us on two
for im2col and products.

The fastmath flags allow contraction and reassociation but not ``nnan``/``ninf``: NaN
and infinity propagate as in numpy. ``error_model="numpy"`` drops the division checks.
Every array is indexed from a view that starts where the loop starts: an index that
counts up from zero needs no wraparound check, which would stop the loop vectorising.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._host_cpu import host_features
from ._numba_epilogue import ACT_CLIP, activation_rows
from ._numba_parallel import float32_pointer, int64_pointer, transpose_vectors

__all__ = [
    "BLOCKED_WORDS", "EXPAND_WORDS", "job_addresses", "GROUP_WIDTHS", "JOB_WORDS", "LANES", "block_weights", "blocked_depthwise", "blocked_job", "blocked_work",
    "WINDOW_SLACK", "depthwise_conv2d", "depthwise_job", "expand_depthwise", "expand_geometry", "expand_job", "lane_channels",
]

_compiled = numba.njit(
    fastmath={"contract", "arcp", "nsz", "reassoc"}, nogil=True, boundscheck=False, error_model="numpy", cache=True
)

_ZERO = np.float32(0.0)


@_compiled
def _fill(src, height, width, phases, ry, sx, pitch, front, top, block):  # pragma: no cover  (compiled; inlined)
    """Input plane ``src`` (H * W floats from its first) into its stride phases: input row
    ``r`` goes to row ``(r + top) // ry`` of the row phase ``(r + top) % ry``, its columns
    ``c`` to column ``c // sx`` of the column phase ``c % sx`` (phase ``py * sx + px`` is
    the block of ``block`` floats at ``(py * sx + px) * block``, rows ``pitch`` floats from
    ``front``); the rest of ``phases`` stays zero."""
    if ry == 1 and width == sx * pitch:  # the plane's rows end to end: one run
        count = height * pitch
        row0 = front + top * pitch
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
        q = r + top
        start = (q % ry) * sx * block + front + (q // ry) * pitch
        row = src[r * width :]
        if sx == 1:
            dst = phases[start:]
            for j in range(width):
                dst[j] = row[j]
        elif sx == 2:  # both column phases in one loop of constant strides, which vectorises
            even = phases[start:]
            odd = phases[start + block :]
            half = width // 2
            for j in range(half):
                even[j] = row[2 * j]
                odd[j] = row[2 * j + 1]
            if width % 2:
                even[half] = row[width - 1]
        else:
            for px in range(sx):
                dst = phases[start + px * block :]
                run = row[px:]
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

    ``layout`` is ``(ry, sx, pitch, front, block, three_by_three, top, apart, tap
    offsets...)``: ``ry`` row and ``sx`` column stride phases, each rows of ``pitch``
    floats from ``front``, ``block`` floats in all, the input's rows counted from ``top``
    zero rows above it (see ``_fill``); grid rows are ``apart`` floats apart, one an output
    row; ``three_by_three`` marks a 3x3 kernel whose middle column needs no mask.
    ``masks`` (kernel width, grid length) keeps (> 0) or drops a kernel column's taps at
    each grid position. ``work`` is the calling thread's: the phases (``ry * sx * block``
    floats), then the grid when it is cropped.
    """
    channels, height, width = x.shape[1], x.shape[2], x.shape[3]
    outputs, out_h, out_w = y.shape[1], y.shape[2], y.shape[3]
    # planes as runs of flat views (a reshape per plane would cost a call each)
    x_flat = x.reshape(-1)
    y_flat = y.reshape(-1)
    in_size = height * width
    out_size = out_h * out_w
    multiplier = outputs // channels
    ry, sx, pitch, front, block, top, apart = layout[0], layout[1], layout[2], layout[3], layout[4], layout[6], layout[7]
    offsets = layout[8:]
    crop = apart != out_w
    length = (out_h - 1) * apart + pitch
    phases = work[: ry * sx * block]
    grid = work[ry * sx * block :]
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
    # a Clip after the 3x3 taps (MobileNet v2's ReLU6) in their loop: as activation_rows
    # clips, compare and select, the same values without a second pass over the plane
    clip = three_by_three and activation == ACT_CLIP
    last = -1
    for plane in range(start, stop):
        image = plane // outputs
        m = plane - image * outputs
        source = image * channels + m // multiplier
        if source != last:
            _fill(x_flat[source * in_size :], height, width, phases, ry, sx, pitch, front, top, block)
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
                if clip:
                    v = low if v < low else v
                    v = high if v > high else v
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
        if activation != 0 and not clip:
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


# -- channels in blocks of 16: short planes ------------------------------------------------

LANES = 16  # channels a block: one 512-bit vector (two 256-bit ones) of float32
_GANG = 4  # output positions summed side by side: one weight load a tap for them all, four chains


def lane_channels(per_group: int) -> np.ndarray:
    """The channel (counted from the block's first) each of a block's LANES lanes holds
    when groups of ``per_group`` channels (1: depthwise) share the block: lane ``j *
    share + g`` holds channel ``j`` of the block's group ``g`` (``share = LANES //
    per_group`` groups side by side), so one input channel of every group is ``share``
    adjacent floats, and an output lane's group reads them as one broadcast load."""
    share = LANES // per_group
    lanes = np.arange(LANES)
    return (lanes % share) * per_group + lanes // share


def block_weights(weights: np.ndarray, bias: np.ndarray, per_group: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``weights`` (M, per_group * taps: each output channel's taps input channel by input
    channel) and ``bias`` (M,) as :func:`blocked_depthwise` reads them (or a 1x1 Conv's
    (M, K) as :func:`expand_depthwise` does): (ceil(M / LANES), taps * per_group, LANES),
    row ``t * per_group + j`` holding tap ``t`` of input channel ``j`` of each lane's
    output channel (:func:`lane_channels`), and (ceil(M / LANES), LANES), zero past
    channel M."""
    m, depth = weights.shape
    taps = depth // per_group
    blocks = -(-m // LANES)
    wb = np.zeros((blocks * LANES, depth), np.float32)
    wb[:m] = weights
    bb = np.zeros(blocks * LANES, np.float32)
    bb[:m] = bias
    rows = (np.arange(blocks)[:, None] * LANES + lane_channels(per_group)).reshape(-1)
    wb = wb[rows].reshape(blocks, LANES, per_group, taps).transpose(0, 3, 2, 1).reshape(blocks, taps * per_group, LANES)
    return np.ascontiguousarray(wb), bb[rows].reshape(blocks, LANES)


_BLOCKED = numba.void(
    numba.types.Array(numba.float32, 4, "C", readonly=True),  # x (n, M, H, W)
    numba.types.Array(numba.float32, 3, "C", readonly=True),  # blocked weights (blocks, taps, LANES)
    numba.types.Array(numba.float32, 2, "C", readonly=True),  # blocked bias (blocks, LANES)
    numba.types.Array(numba.int64, 1, "C", readonly=True),  # geometry: kh, kw, sy, sx, dy, dx, top, left, channels last, per group
    numba.boolean,  # relu
    numba.int64,  # a fused activation after it (``_numba_epilogue.ACT_*``; 0: none)
    numba.float32,  # Clip's low bound
    numba.float32,  # Clip's high bound
    numba.float32[::1],  # work
    numba.float32[:, :, :, ::1],  # y (n, M, out_h, out_w)
    numba.int64,  # first unit (image, channel block)
    numba.int64,  # units end
)


def _lane_vectors(builder):  # type: ignore[no-untyped-def]
    """What the sums' code uses: the LANES-float vector type, int64, LLVM's fused
    multiply-add of two vectors into a third, and ``at(address)``, an int64 address as a
    vector pointer."""
    vector = ir.VectorType(ir.FloatType(), LANES)
    pointer = vector.as_pointer()
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3), "llvm.fma.v16f32")

    def at(address):  # type: ignore[no-untyped-def]
        return builder.inttoptr(address, pointer)

    return vector, ir.IntType(64), fma, at


@intrinsic
def _sum_taps(typingctx, dst, src, w, offsets, taps, n, step, bias):  # type: ignore[no-untyped-def]
    """``n`` output positions of a block: ``dst[j] = bias + sum_t src[j * step + offsets[t]]
    * w[t]``, each term a LANES-wide vector (one fused multiply-add; the sum in registers
    over the taps). Addresses in bytes: ``dst`` (n x LANES floats), ``src`` the padded
    block at the row's first window, ``w`` (taps x LANES floats), ``offsets`` (taps int64,
    in floats), ``bias`` (LANES floats); ``step`` floats from one position's window to the
    next."""
    signature = types.void(*([types.int64] * 8))

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        dst, src, w, offsets, taps, n, step, bias = args
        vector, i64, fma, at = _lane_vectors(builder)
        table = builder.inttoptr(offsets, i64.as_pointer())
        four = ir.Constant(i64, 4)
        first = builder.load(at(bias), align=4)
        totals = [cgutils.alloca_once(builder, vector) for _ in range(_GANG)]

        def positions(start, gang):  # type: ignore[no-untyped-def]
            """``gang`` positions from ``start``, their sums side by side (one weight load a tap)."""
            windows = [builder.add(src, builder.mul(builder.mul(builder.add(start, ir.Constant(i64, g)), step), four))
                       for g in range(gang)]
            for g in range(gang):
                builder.store(first, totals[g])
            with cgutils.for_range(builder, taps) as inner:
                offset = builder.mul(builder.load(builder.gep(table, [inner.index])), four)
                weight = builder.load(at(builder.add(w, builder.mul(inner.index, ir.Constant(i64, LANES * 4)))), align=4)
                for g in range(gang):
                    value = builder.load(at(builder.add(windows[g], offset)), align=4)
                    builder.store(builder.call(fma, [value, weight, builder.load(totals[g])]), totals[g])
            for g in range(gang):
                target = builder.add(dst, builder.mul(builder.add(start, ir.Constant(i64, g)), ir.Constant(i64, LANES * 4)))
                builder.store(builder.load(totals[g]), at(target), align=4)

        gangs = builder.sdiv(n, ir.Constant(i64, _GANG))
        with cgutils.for_range(builder, gangs) as outer:
            positions(builder.mul(outer.index, ir.Constant(i64, _GANG)), _GANG)
        with cgutils.for_range(builder, builder.sub(n, builder.mul(gangs, ir.Constant(i64, _GANG)))) as rest:
            positions(builder.add(builder.mul(gangs, ir.Constant(i64, _GANG)), rest.index), 1)

    return signature, codegen


def _wide_registers() -> bool:
    """Whether numba compiles for this host and it has AVX-512's 32 vector registers (a
    LANES-wide vector then one register; elsewhere two of AVX2's 16)."""
    return bool(host_features().get("avx512f", False))


#: Output positions a windowed sum computes side by side, by (kernel width, stride):
#: each tap row's input vectors are loaded once for them all, ``(gang - 1) * stride +
#: width`` loads for ``gang * width`` multiply-adds (the per-tap way loads one vector a
#: multiply-add). Sized to AVX-512's 32 registers; with AVX2's 16 (two a vector) four.
_WINDOW_GANGS = {(3, 1): 8, (5, 1): 8, (7, 1): 8, (3, 2): 8, (5, 2): 8, (7, 2): 4}


def _window_gang(width: int, stride: int) -> int:
    return _WINDOW_GANGS[(width, stride)] if _wide_registers() else 4


def _window_body(builder, dst, src, w, kh, row_step, n, width, stride, bias):  # type: ignore[no-untyped-def]
    """The code of one windowed sum (see :func:`_windowed`) for a kernel ``width`` taps wide
    at column stride ``stride``: whole gangs, then the rest as one more gang that stores
    only its first positions (a 7-position row is one gang, not seven sums a position at
    a time; its reads run up to ``WINDOW_SLACK`` floats past the row, which the work arrays
    leave room for). Returns the positions it summed: all ``n``."""
    gang = _window_gang(width, stride)
    span = (gang - 1) * stride + width
    vector, i64, fma, at = _lane_vectors(builder)
    first = builder.load(at(bias), align=4)
    totals = [cgutils.alloca_once(builder, vector) for _ in range(gang)]

    def sums_from(start, count):  # type: ignore[no-untyped-def]
        """A gang's sums from position ``start``, the first ``count`` stored (None: all)."""
        window = builder.add(src, builder.mul(start, ir.Constant(i64, stride * LANES * 4)))
        for g in range(gang):
            builder.store(first, totals[g])
        with cgutils.for_range(builder, kh) as inner:
            row = builder.add(window, builder.mul(inner.index, row_step))
            values = [builder.load(at(builder.add(row, ir.Constant(i64, i * LANES * 4))), align=4) for i in range(span)]
            weights = builder.add(w, builder.mul(inner.index, ir.Constant(i64, width * LANES * 4)))
            sums = [builder.load(totals[g]) for g in range(gang)]
            for kx in range(width):
                weight = builder.load(at(builder.add(weights, ir.Constant(i64, kx * LANES * 4))), align=4)
                sums = [builder.call(fma, [values[g * stride + kx], weight, sums[g]]) for g in range(gang)]
            for g in range(gang):
                builder.store(sums[g], totals[g])
        for g in range(gang):
            target = builder.add(dst, builder.mul(builder.add(start, ir.Constant(i64, g)), ir.Constant(i64, LANES * 4)))
            if count is None:
                builder.store(builder.load(totals[g]), at(target), align=4)
            else:
                with builder.if_then(builder.icmp_signed("<", ir.Constant(i64, g), count)):
                    builder.store(builder.load(totals[g]), at(target), align=4)

    gangs = builder.sdiv(n, ir.Constant(i64, gang))
    with cgutils.for_range(builder, gangs) as outer:
        sums_from(builder.mul(outer.index, ir.Constant(i64, gang)), None)
    done = builder.mul(gangs, ir.Constant(i64, gang))
    rest = builder.sub(n, done)
    with builder.if_then(builder.icmp_signed(">", rest, ir.Constant(i64, 0))):
        sums_from(done, rest)
    return n


#: Floats past a padded block's last row that a windowed sum's last gang may read (its
#: positions past the row's: at most 7, two columns apart, of LANES floats); the work
#: arrays leave this much room after every padded block.
WINDOW_SLACK = 16 * LANES


@intrinsic
def _windowed(typingctx, dst, src, w, kh, kw, sx, dx, row_step, n, bias):  # type: ignore[no-untyped-def]
    """:func:`_sum_taps` of the first ``n`` positions of an output row, where the kernel
    is 3, 5 or 7 taps wide (``kw``) with dilation 1 (``dx``) at column stride 1 or 2
    (``sx``): returns how many positions it summed (``n``; 0 for other kernels, which the
    caller sums). ``w`` holds ``kh`` rows of ``kw`` taps; ``row_step`` bytes from
    one tap row's window to the next."""
    signature = types.int64(*([types.int64] * 10))

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        dst, src, w, kh, kw, sx, dx, row_step, n, bias = args
        i64 = ir.IntType(64)
        done = cgutils.alloca_once_value(builder, ir.Constant(i64, 0))
        unit = builder.icmp_signed("==", dx, ir.Constant(i64, 1))
        for width, stride in _WINDOW_GANGS:
            chosen = builder.and_(unit, builder.and_(builder.icmp_signed("==", kw, ir.Constant(i64, width)),
                                                     builder.icmp_signed("==", sx, ir.Constant(i64, stride))))
            with builder.if_then(chosen):
                builder.store(_window_body(builder, dst, src, w, kh, row_step, n, width, stride, bias), done)
        return builder.load(done)

    return signature, codegen


@_compiled
def _sum_row(dst, src, w, offsets, kh, kw, dx, sx, row_step, n, bias):  # pragma: no cover  (compiled; inlined)
    """One output row of a block's sums: by a windowed sum where the kernel is 3, 5 or 7
    taps wide (dilation 1) at column stride 1 or 2, else :func:`_sum_taps`."""
    done = _windowed(dst, src, w, kh, kw, sx, dx, row_step, n, bias)
    if done < n:
        _sum_taps(dst + done * LANES * 4, src + done * sx * LANES * 4, w, offsets, kh * kw, n - done, sx * LANES, bias)


#: Output positions a grouped sum computes side by side: one weight load a tap and input
#: channel for them all. Eight sums in AVX-512's registers; four where a sum takes two of
#: AVX2's sixteen.
_GROUPED_GANG = 8 if _wide_registers() else 4
GROUP_WIDTHS = (2, 4, 8, 16)  # channels a group the grouped sums take (1 is the depthwise sums)


def _grouped_body(builder, dst, src, w, offsets, taps, n, step, bias, per_group):  # type: ignore[no-untyped-def]
    """The code of :func:`_grouped_taps` for groups of ``per_group`` (a Python int) channels."""
    share = LANES // per_group
    vector, i64, fma, at = _lane_vectors(builder)
    narrow = ir.VectorType(ir.FloatType(), share)
    spread = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [lane % share for lane in range(LANES)])

    def broadcast(address):  # type: ignore[no-untyped-def]
        """The ``share`` floats at ``address`` repeated over the lanes (one broadcast load)."""
        if share == 1:
            value = builder.load(builder.inttoptr(address, ir.FloatType().as_pointer()), align=4)
            one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
            return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))
        part = builder.load(builder.inttoptr(address, narrow.as_pointer()), align=4)
        return builder.shuffle_vector(part, ir.Constant(narrow, ir.Undefined), spread)

    table = builder.inttoptr(offsets, i64.as_pointer())
    four = ir.Constant(i64, 4)
    first = builder.load(at(bias), align=4)
    totals = [cgutils.alloca_once(builder, vector) for _ in range(_GROUPED_GANG)]

    def positions(start, count):  # type: ignore[no-untyped-def]
        """``count`` (1 to the gang; None: all) positions from ``start``, their sums side by
        side: the lanes past ``count`` read the last position again and store nothing (a
        short row, 7 or 14 positions, is one or two gangs, not a position at a time)."""
        if count is None:
            count = ir.Constant(i64, _GROUPED_GANG)
            reads = [ir.Constant(i64, g) for g in range(_GROUPED_GANG)]
        else:
            last = builder.sub(count, ir.Constant(i64, 1))
            reads = [builder.select(builder.icmp_signed("<", ir.Constant(i64, g), count), ir.Constant(i64, g), last)
                     for g in range(_GROUPED_GANG)]
        windows = [builder.add(src, builder.mul(builder.mul(builder.add(start, reads[g]), step), four))
                   for g in range(_GROUPED_GANG)]
        for g in range(_GROUPED_GANG):
            builder.store(first, totals[g])
        with cgutils.for_range(builder, taps) as inner:
            offset = builder.mul(builder.load(builder.gep(table, [inner.index])), four)
            weights = builder.add(w, builder.mul(inner.index, ir.Constant(i64, per_group * LANES * 4)))
            sums = [builder.load(totals[g]) for g in range(_GROUPED_GANG)]
            for j in range(per_group):
                weight = builder.load(at(builder.add(weights, ir.Constant(i64, j * LANES * 4))), align=4)
                for g in range(_GROUPED_GANG):
                    value = broadcast(builder.add(builder.add(windows[g], offset), ir.Constant(i64, j * share * 4)))
                    sums[g] = builder.call(fma, [value, weight, sums[g]])
            for g in range(_GROUPED_GANG):
                builder.store(sums[g], totals[g])
        for g in range(_GROUPED_GANG):
            with builder.if_then(builder.icmp_signed("<", ir.Constant(i64, g), count), likely=True):
                target = builder.add(dst, builder.mul(builder.add(start, ir.Constant(i64, g)), ir.Constant(i64, LANES * 4)))
                builder.store(builder.load(totals[g]), at(target), align=4)

    gang = ir.Constant(i64, _GROUPED_GANG)
    gangs = builder.sdiv(n, gang)
    with cgutils.for_range(builder, gangs) as outer:
        positions(builder.mul(outer.index, gang), None)
    done = builder.mul(gangs, gang)
    rest = builder.sub(n, done)
    with builder.if_then(builder.icmp_signed(">", rest, ir.Constant(i64, 0))):
        positions(done, rest)


@intrinsic
def _grouped_taps(typingctx, dst, src, w, offsets, taps, n, step, bias, per_group):  # type: ignore[no-untyped-def]
    """:func:`_sum_taps` for a grouped Conv, groups of ``per_group`` (2, 4, 8 or 16)
    channels in and out side by side in a block (:func:`lane_channels`): ``dst[p] = bias
    + sum_t sum_j spread(src[p * step + offsets[t] + j * share]) * w[t * per_group + j]``,
    where ``spread`` repeats the ``share = LANES // per_group`` floats (input channel
    ``j`` of each group) over the lanes, one broadcast load, so that each output lane
    multiplies its own group's input."""
    signature = types.void(*([types.int64] * 9))

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        dst, src, w, offsets, taps, n, step, bias, per_group = args
        for width in GROUP_WIDTHS:
            with builder.if_then(builder.icmp_signed("==", per_group, ir.Constant(ir.IntType(64), width))):
                _grouped_body(builder, dst, src, w, offsets, taps, n, step, bias, width)

    return signature, codegen


def _lane_mask(builder, count):  # type: ignore[no-untyped-def]
    """Lanes below ``count`` (an int64)."""
    lanes = ir.Constant(ir.VectorType(ir.IntType(64), LANES), list(range(LANES)))
    splat = builder.insert_element(ir.Constant(ir.VectorType(ir.IntType(64), LANES), ir.Undefined), count, ir.Constant(ir.IntType(32), 0))
    splat = builder.shuffle_vector(splat, splat, ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))
    return builder.icmp_signed("<", lanes, splat)


def _masked(builder):  # type: ignore[no-untyped-def]
    vector = ir.VectorType(ir.FloatType(), LANES)
    mask = ir.VectorType(ir.IntType(1), LANES)
    load = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vector, [vector.as_pointer(), ir.IntType(32), mask, vector]), "llvm.masked.load.v16f32.p0"
    )
    store = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [vector, vector.as_pointer(), ir.IntType(32), mask]), "llvm.masked.store.v16f32.p0"
    )
    return vector, load, store


def _lane_channel(builder, lane, per_group):  # type: ignore[no-untyped-def]
    """The channel lane ``lane`` (a constant) holds, from ``per_group`` (an int64; see
    :func:`lane_channels`)."""
    i64 = ir.IntType(64)
    share = builder.sdiv(ir.Constant(i64, LANES), per_group)
    return builder.add(builder.mul(builder.srem(ir.Constant(i64, lane), share), per_group),
                       builder.sdiv(ir.Constant(i64, lane), share))


@intrinsic
def _interleave(typingctx, dst, src, plane, n, count, per_group):  # type: ignore[no-untyped-def]
    """``n`` (at most LANES) positions of ``count`` channel planes ``plane`` floats apart,
    from ``src`` (channel 0's first), as ``n`` LANES-wide vectors at ``dst``: position
    ``p`` holds the channels' values in the lane order of groups of ``per_group`` channels
    (:func:`lane_channels`; 1: lane ``c`` channel ``c``), zero past ``count``. Addresses
    in bytes."""
    signature = types.void(*([types.int64] * 6))

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        dst, src, plane, n, count, per_group = args
        vector, load, store = _masked(builder)
        i64 = ir.IntType(64)
        zero = ir.Constant(vector, [0.0] * LANES)
        within = _lane_mask(builder, n)
        four = ir.Constant(ir.IntType(32), 4)
        rows = []
        for c in range(LANES):
            channel = _lane_channel(builder, c, per_group)
            keep = builder.and_(within, _splat_bool(builder, builder.icmp_signed("<", channel, count)))
            address = builder.add(src, builder.mul(builder.mul(plane, channel), ir.Constant(i64, 4)))
            rows.append(builder.call(load, [builder.inttoptr(address, vector.as_pointer()), four, keep, zero]))
        columns = transpose_vectors(builder, rows)
        for p in range(LANES):
            with builder.if_then(builder.icmp_signed("<", ir.Constant(i64, p), n)):
                target = builder.inttoptr(builder.add(dst, ir.Constant(i64, p * LANES * 4)), vector.as_pointer())
                builder.store(columns[p], target, align=4)

    return signature, codegen


@intrinsic
def _deinterleave(typingctx, dst, src, plane, n, count, relu, per_group):  # type: ignore[no-untyped-def]
    """:func:`_interleave` turned around: ``n`` (at most LANES) position vectors at ``src``
    back to ``count`` channel planes ``plane`` floats apart from ``dst``, clamped at zero
    when ``relu`` is non-zero (NaN stays NaN)."""
    signature = types.void(*([types.int64] * 7))

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        dst, src, plane, n, count, relu, per_group = args
        vector, load, store = _masked(builder)
        i64 = ir.IntType(64)
        zero = ir.Constant(vector, [0.0] * LANES)
        within = _lane_mask(builder, n)
        four = ir.Constant(ir.IntType(32), 4)
        positions = []
        for p in range(LANES):
            keep = _splat_bool(builder, builder.icmp_signed("<", ir.Constant(i64, p), n))
            address = builder.add(src, ir.Constant(i64, p * LANES * 4))
            positions.append(builder.call(load, [builder.inttoptr(address, vector.as_pointer()), four, keep, zero]))
        rows = transpose_vectors(builder, positions)
        clamp = _splat_bool(builder, builder.icmp_signed("!=", relu, ir.Constant(i64, 0)))
        for c in range(LANES):
            channel = _lane_channel(builder, c, per_group)
            with builder.if_then(builder.icmp_signed("<", channel, count)):
                value = rows[c]
                negative = builder.and_(builder.fcmp_ordered("<", value, zero), clamp)
                address = builder.add(dst, builder.mul(builder.mul(plane, channel), ir.Constant(i64, 4)))
                builder.call(store, [builder.select(negative, zero, value), builder.inttoptr(address, vector.as_pointer()), four, within])

    return signature, codegen


@intrinsic
def _channels_at(typingctx, dst, src, step, n, count):  # type: ignore[no-untyped-def]
    """:func:`_interleave` for a channels-last input: ``n`` positions ``step`` floats apart
    from ``src``, each ``count`` (at most LANES) consecutive channels, one masked vector
    load and store a position (zero past ``count``). Addresses in bytes."""
    signature = types.void(*([types.int64] * 5))

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        dst, src, step, n, count = args
        vector, load, store = _masked(builder)
        i64 = ir.IntType(64)
        keep = _lane_mask(builder, count)
        zero = ir.Constant(vector, [0.0] * LANES)
        with cgutils.for_range(builder, n) as loop:
            address = builder.add(src, builder.mul(builder.mul(loop.index, step), ir.Constant(i64, 4)))
            value = builder.call(load, [builder.inttoptr(address, vector.as_pointer()), ir.Constant(ir.IntType(32), 4), keep, zero])
            target = builder.add(dst, builder.mul(loop.index, ir.Constant(i64, LANES * 4)))
            builder.store(value, builder.inttoptr(target, vector.as_pointer()), align=4)

    return signature, codegen


def _splat_bool(builder, flag):  # type: ignore[no-untyped-def]
    mask = ir.VectorType(ir.IntType(1), LANES)
    one = builder.insert_element(ir.Constant(mask, ir.Undefined), flag, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))


@numba.njit(
    [_BLOCKED],
    fastmath={"contract", "arcp", "nsz", "reassoc"},
    nogil=True,
    boundscheck=False,
    error_model="numpy",
    cache=True,
)
def blocked_depthwise(x, wb, bb, geometry, relu, activation, low, high, work, y, start, stop):  # pragma: no cover  (compiled)
    """Units [start, stop) of a depthwise Conv (one input channel per output channel), or
    of a grouped Conv whose groups have ``geometry[9]`` (2, 4, 8 or 16) channels in and
    out, of ``x`` (n, M, H, W), or (n, H, W, M) when ``geometry[8]`` is non-zero (channels
    last; depthwise only),
    counted over (image, block of LANES channels): the block's planes interleaved into a
    zero-padded (rows, columns, LANES) array in ``work``, every tap one multiply-add of a
    LANES-wide run per output position (no plane-long loop with a scalar remainder: a 7x7
    plane is 49 positions), the sums written back plane by plane with ``bias``, Relu
    (NaN stays NaN) and ``activation``.

    ``geometry``: kernel height and width, strides, dilations, the top and left pads,
    whether ``x`` is channels last (each position's channels then one vector load), and
    the channels a group (1: depthwise; else the block holds its groups side by side in
    the lane order of :func:`lane_channels`, and ``wb`` a tap's weights for each input
    channel of the group, :func:`block_weights`).
    ``work`` holds the padded block (its rows span the taps the outputs read) and then the
    block's outputs, (out_h * out_w, LANES) floats."""
    last = geometry[8] != 0
    per_group = geometry[9]
    channels, height, width = (x.shape[3], x.shape[1], x.shape[2]) if last else (x.shape[1], x.shape[2], x.shape[3])
    out_h, out_w = y.shape[2], y.shape[3]
    kh, kw, sy, sx, dy, dx, top, left = (
        geometry[0], geometry[1], geometry[2], geometry[3], geometry[4], geometry[5], geometry[6], geometry[7]
    )
    rows = (out_h - 1) * sy + (kh - 1) * dy + 1
    cols = (out_w - 1) * sx + (kw - 1) * dx + 1
    positions = out_h * out_w
    padded = work[: rows * cols * LANES]
    sums = work[rows * cols * LANES : (rows * cols + positions) * LANES]
    taps = kh * kw
    offsets = np.empty(taps, np.int64)  # each tap's window from the position's, in floats
    for ky in range(kh):
        for kx in range(kw):
            offsets[ky * kw + kx] = (ky * dy * cols + kx * dx) * LANES
    blocks = wb.shape[0]
    y_first = max(0, -top)
    y_last = min(height, rows - top)
    x_first = max(0, -left)
    x_last = min(width, cols - left)
    y_flat = y.reshape(-1)
    plane = height * width
    for unit in range(start, stop):
        image = unit // blocks
        block = unit - image * blocks
        c0 = block * LANES
        count = min(LANES, channels - c0)
        for r in range(rows):  # the border (the interleave writes every position inside it)
            if r < y_first + top or r >= y_last + top:
                padded[r * cols * LANES : (r + 1) * cols * LANES] = _ZERO
            else:
                padded[r * cols * LANES : (r * cols + left + x_first) * LANES] = _ZERO
                padded[(r * cols + left + x_last) * LANES : (r + 1) * cols * LANES] = _ZERO
        if last:
            source = x.ctypes.data + (image * plane * channels + c0) * 4
            for r in range(y_first, y_last):
                _channels_at(
                    padded.ctypes.data + ((r + top) * cols + left + x_first) * LANES * 4,
                    source + (r * width + x_first) * channels * 4, channels, x_last - x_first, count,
                )
        else:
            source = x.ctypes.data + (image * channels + c0) * plane * 4
            for r in range(y_first, y_last):
                for j0 in range(x_first, x_last, LANES):
                    _interleave(
                        padded.ctypes.data + ((r + top) * cols + left + j0) * LANES * 4, source + (r * width + j0) * 4,
                        plane, min(LANES, x_last - j0), count, per_group,
                    )
        weights = wb[block].ctypes.data
        shift = bb[block].ctypes.data
        for oy in range(out_h):
            if per_group == 1:
                _sum_row(
                    sums.ctypes.data + oy * out_w * LANES * 4, padded.ctypes.data + oy * sy * cols * LANES * 4, weights,
                    offsets.ctypes.data, kh, kw, dx, sx, dy * cols * LANES * 4, out_w, shift,
                )
            else:
                _grouped_taps(
                    sums.ctypes.data + oy * out_w * LANES * 4, padded.ctypes.data + oy * sy * cols * LANES * 4, weights,
                    offsets.ctypes.data, taps, out_w, sx * LANES, shift, per_group,
                )
        target = y.ctypes.data + (image * channels + c0) * positions * 4
        for p0 in range(0, positions, LANES):
            _deinterleave(
                target + p0 * 4, sums.ctypes.data + p0 * LANES * 4, positions, min(LANES, positions - p0), count, relu, per_group
            )
        if activation != 0:
            done = y_flat[image * channels * positions : (image + 1) * channels * positions].reshape((channels, positions))
            activation_rows(done, c0, c0 + count, 0, positions, activation, low, high)


# The context of ``blocked_job`` (int64 words; see ``conv._Convolution._depthwise_compiled``).
(
    BLOCKED_X, BLOCKED_IMAGES, BLOCKED_CHANNELS, BLOCKED_HEIGHT, BLOCKED_WIDTH, BLOCKED_WEIGHTS, BLOCKED_BLOCKS,
    BLOCKED_TAPS, BLOCKED_BIAS, BLOCKED_GEOMETRY, BLOCKED_RELU, BLOCKED_ACTIVATION, BLOCKED_LOW, BLOCKED_HIGH,
    BLOCKED_WORK, BLOCKED_WORK_FLOATS, BLOCKED_Y, BLOCKED_OUT_HEIGHT, BLOCKED_OUT_WIDTH,
) = range(19)
BLOCKED_WORDS = 19  # BLOCKED_LOW and BLOCKED_HIGH: float32 bits in the low half of the word


def blocked_work(geometry: np.ndarray, out_h: int, out_w: int) -> int:
    """Floats of work a thread needs for :func:`blocked_depthwise` of this geometry."""
    kh, kw, sy, sx, dy, dx = (int(v) for v in geometry[:6])
    rows = (out_h - 1) * sy + (kh - 1) * dy + 1
    cols = (out_w - 1) * sx + (kw - 1) * dx + 1
    return (rows * cols + out_h * out_w) * LANES + WINDOW_SLACK


@numba.cfunc(numba.void(numba.int64, numba.int64, numba.int64, numba.int64), nogil=True, cache=True)
def blocked_job(c, start, stop, slot):  # pragma: no cover  (compiled)
    """Units [start, stop) of a depthwise Conv on the compiled pool, each one (image, block
    of LANES channels) by :func:`blocked_depthwise`, in this slot's work array."""
    context = numba.carray(int64_pointer(c), BLOCKED_WORDS)
    n, channels, blocks = context[BLOCKED_IMAGES], context[BLOCKED_CHANNELS], context[BLOCKED_BLOCKS]
    geometry = numba.carray(int64_pointer(context[BLOCKED_GEOMETRY]), 10)
    height, width = context[BLOCKED_HEIGHT], context[BLOCKED_WIDTH]
    shape = (n, height, width, channels) if geometry[8] != 0 else (n, channels, height, width)
    x = numba.carray(float32_pointer(context[BLOCKED_X]), shape)
    wb = numba.carray(float32_pointer(context[BLOCKED_WEIGHTS]), (blocks, context[BLOCKED_TAPS], LANES))
    bb = numba.carray(float32_pointer(context[BLOCKED_BIAS]), (blocks, LANES))
    bounds = numba.carray(float32_pointer(c + BLOCKED_LOW * 8), 3)  # low, (its high half), high
    floats = context[BLOCKED_WORK_FLOATS]
    work = numba.carray(float32_pointer(context[BLOCKED_WORK] + slot * floats * 4), floats)
    y = numba.carray(
        float32_pointer(context[BLOCKED_Y]), (n, channels, context[BLOCKED_OUT_HEIGHT], context[BLOCKED_OUT_WIDTH])
    )
    blocked_depthwise(
        x, wb, bb, geometry, context[BLOCKED_RELU] != 0, context[BLOCKED_ACTIVATION], bounds[0], bounds[2], work, y,
        start, stop,
    )


# -- a 1x1 Conv and the depthwise Conv it feeds, in one pass ---------------------------------

# Positions of the 1x1 product side by side (one weight load a step for them all): sixteen
# sums in AVX-512's registers (against eight: 64 -> 384 channels on 14 x 14, 2.1 -> 2.6
# vector multiply-adds a ns); four where a sum takes two of AVX2's sixteen.
_EXPAND_GANG = 16 if _wide_registers() else 4
_EXPAND_AHEAD = 4 * _EXPAND_GANG  # input positions the 1x1 product computes a call at least


@intrinsic
def _expand(typingctx, dst, table, src, w, k, plane, start, n, bias, low, high):  # type: ignore[no-untyped-def]
    """Positions ``[start, start + n)`` of a 1x1 Conv's output block of LANES channels,
    each one LANES-wide vector ``bias + sum_i src[i * plane + p] * w[i]`` (``k`` input
    channels; one fused multiply-add a step by the broadcast input), clamped to ``[low,
    high]`` (NaN stays NaN), stored at ``dst + table[p]``. Addresses in bytes: ``dst`` the
    padded block, ``table`` (int64 byte offsets a position), ``src`` the image's first
    input channel, ``w`` (k x LANES floats), ``bias`` (LANES floats)."""
    signature = types.void(*([types.int64] * 9), types.float32, types.float32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        dst, table, src, w, k, plane, start, n, bias, low, high = args
        vector = ir.VectorType(ir.FloatType(), LANES)
        pointer = vector.as_pointer()
        i64 = ir.IntType(64)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3), "llvm.fma.v16f32")
        offsets = builder.inttoptr(table, i64.as_pointer())
        first = builder.load(builder.inttoptr(bias, pointer), align=4)
        undefined = ir.Constant(vector, ir.Undefined)
        lane0 = ir.Constant(ir.IntType(32), 0)
        broadcast = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)

        def splat(value):  # type: ignore[no-untyped-def]
            return builder.shuffle_vector(builder.insert_element(undefined, value, lane0), undefined, broadcast)

        floor, ceiling = splat(low), splat(high)
        four = ir.Constant(i64, 4)
        step = builder.mul(plane, four)
        totals = [cgutils.alloca_once(builder, vector) for _ in range(_EXPAND_GANG)]

        def positions(p0, count, gang):  # type: ignore[no-untyped-def]
            """``count`` (1 to ``gang``; None: all) positions from ``p0``, their sums side by
            side: the lanes past ``count`` read the last position again and store nothing."""
            base = builder.add(src, builder.mul(p0, four))
            if count is None:  # a whole gang
                count = ir.Constant(i64, gang)
                reads = [ir.Constant(i64, 4 * g) for g in range(gang)]
            else:
                last = builder.sub(count, ir.Constant(i64, 1))
                reads = [builder.mul(builder.select(builder.icmp_signed("<", ir.Constant(i64, g), count), ir.Constant(i64, g), last), four)
                         for g in range(gang)]
            for g in range(gang):
                builder.store(first, totals[g])
            with cgutils.for_range(builder, k) as inner:
                row = builder.add(base, builder.mul(inner.index, step))
                weight = builder.load(builder.inttoptr(builder.add(w, builder.mul(inner.index, ir.Constant(i64, LANES * 4))), pointer), align=4)
                for g in range(gang):
                    value = builder.load(builder.inttoptr(builder.add(row, reads[g]), ir.FloatType().as_pointer()), align=4)
                    builder.store(builder.call(fma, [splat(value), weight, builder.load(totals[g])]), totals[g])
            for g in range(gang):
                with builder.if_then(builder.icmp_signed("<", ir.Constant(i64, g), count), likely=True):
                    value = builder.load(totals[g])
                    value = builder.select(builder.fcmp_ordered("<", value, floor), floor, value)
                    value = builder.select(builder.fcmp_ordered(">", value, ceiling), ceiling, value)
                    offset = builder.load(builder.gep(offsets, [builder.add(p0, ir.Constant(i64, g))]))
                    builder.store(value, builder.inttoptr(builder.add(dst, offset), pointer), align=4)

        gang = ir.Constant(i64, _EXPAND_GANG)
        gangs = builder.sdiv(n, gang)
        with cgutils.for_range(builder, gangs) as outer:
            positions(builder.add(start, builder.mul(outer.index, gang)), None, _EXPAND_GANG)
        done = builder.mul(gangs, gang)
        rest = builder.sub(n, done)
        half = _EXPAND_GANG // 2  # a short rest (49 positions: 48 and 1) as a half gang, half the steps' work
        with builder.if_else(builder.icmp_signed(">", rest, ir.Constant(i64, half))) as (longer, shorter):
            with longer:
                positions(builder.add(start, done), rest, _EXPAND_GANG)
            with shorter:
                with builder.if_then(builder.icmp_signed(">", rest, ir.Constant(i64, 0))):
                    positions(builder.add(start, done), rest, half)

    return signature, codegen


_EXPAND_DEPTHWISE = numba.void(
    numba.types.Array(numba.float32, 4, "C", readonly=True),  # x (n, K, H, W)
    numba.types.Array(numba.float32, 3, "C", readonly=True),  # the 1x1 weights, blocked (blocks, K, LANES)
    numba.types.Array(numba.float32, 2, "C", readonly=True),  # the 1x1 bias, blocked (blocks, LANES)
    numba.int64,  # the 1x1 Conv's activation after its clamp (``_numba_epilogue.ACT_*``; 0: none)
    numba.float32,  # the 1x1 Conv's clamp: low (-inf: none; 0 for a Relu)
    numba.float32,  # and high
    numba.types.Array(numba.int64, 1, "C", readonly=True),  # byte offset of each input position in the padded block
    numba.types.Array(numba.float32, 3, "C", readonly=True),  # depthwise weights, blocked (blocks, taps, LANES)
    numba.types.Array(numba.float32, 2, "C", readonly=True),  # depthwise bias, blocked (blocks, LANES)
    numba.types.Array(numba.int64, 1, "C", readonly=True),  # geometry: kh, kw, sy, sx, dy, dx, top, left, rows, cols
    numba.boolean,  # relu after the depthwise Conv
    numba.int64,  # a fused activation after it
    numba.float32,  # Clip's low bound
    numba.float32,  # Clip's high bound
    numba.float32[::1],  # work
    numba.float32[:, :, :, ::1],  # y (n, M, out_h, out_w)
    numba.int64,  # first unit (image, channel block)
    numba.int64,  # units end
)


@numba.njit(
    [_EXPAND_DEPTHWISE],
    fastmath={"contract", "arcp", "nsz", "reassoc"},
    nogil=True,
    boundscheck=False,
    error_model="numpy",
    cache=True,
)
def expand_depthwise(x, we, be, expand_activation, expand_low, expand_high, table, wb, bb, geometry, relu, activation, low, high,
                     work, y, start, stop):  # pragma: no cover  (compiled)
    """Units [start, stop) of a 1x1 Conv (``we``, ``be``: K input channels to M, then its
    clamp and ``expand_activation``) and the depthwise Conv that alone reads its output
    (``wb``, ``bb``, ``geometry``; then ``relu`` and ``activation``), counted over (image,
    block of LANES channels of M). The 1x1 Conv's block of LANES channels is written
    interleaved into the zero-bordered padded block in ``work`` (``table`` maps each
    input position to its place there), input rows only as the next output row first
    needs them, so the depthwise sums read them from cache; its M channels never go to
    memory as planes. ``work``: the padded block (``geometry[8]`` rows of ``geometry[9]``
    positions) and one output row of sums."""
    channels = y.shape[1]
    height, width = x.shape[2], x.shape[3]
    inputs = x.shape[1]
    out_h, out_w = y.shape[2], y.shape[3]
    kh, kw, sy, sx, dy, dx, top, left = (
        geometry[0], geometry[1], geometry[2], geometry[3], geometry[4], geometry[5], geometry[6], geometry[7]
    )
    rows, cols = geometry[8], geometry[9]
    padded = work[: rows * cols * LANES]
    sums = work[rows * cols * LANES : (rows * cols + out_w) * LANES]
    grid = padded.reshape((rows, cols * LANES))
    taps = kh * kw
    offsets = np.empty(taps, np.int64)
    for ky in range(kh):
        for kx in range(kw):
            offsets[ky * kw + kx] = (ky * dy * cols + kx * dx) * LANES
    blocks = wb.shape[0]
    plane = height * width
    positions = out_h * out_w
    y_flat = y.reshape(-1)
    for unit in range(start, stop):
        image = unit // blocks
        block = unit - image * blocks
        c0 = block * LANES
        count = min(LANES, channels - c0)
        for r in range(rows):  # the zero border; the 1x1 Conv writes every position inside it
            if r < top or r >= top + height:
                grid[r, :] = _ZERO
            else:
                grid[r, : left * LANES] = _ZERO
                grid[r, (left + width) * LANES :] = _ZERO
        source = x.ctypes.data + image * inputs * plane * 4
        expand_w = we[block].ctypes.data
        expand_b = be[block].ctypes.data
        weights = wb[block].ctypes.data
        shift = bb[block].ctypes.data
        target = y.ctypes.data + (image * channels + c0) * positions * 4
        done = y_flat[image * channels * positions : (image + 1) * channels * positions].reshape((channels, positions))
        ready = 0  # input rows expanded so far
        for oy in range(out_h):
            needed = min(height, oy * sy - top + (kh - 1) * dy + 1)
            if needed > ready:  # at least _EXPAND_AHEAD positions a call: whole gangs on short rows
                needed = min(height, max(needed, ready + (_EXPAND_AHEAD + width - 1) // width))
                _expand(padded.ctypes.data, table.ctypes.data, source, expand_w, inputs, plane, ready * width,
                        (needed - ready) * width, expand_b, expand_low, expand_high)
                if expand_activation != 0:
                    activation_rows(grid, ready + top, needed + top, left * LANES, (left + width) * LANES, expand_activation,
                                    expand_low, expand_high)
                ready = needed
            _sum_row(sums.ctypes.data, padded.ctypes.data + oy * sy * cols * LANES * 4, weights, offsets.ctypes.data, kh, kw, dx,
                     sx, dy * cols * LANES * 4, out_w, shift)
            for p0 in range(0, out_w, LANES):
                _deinterleave(target + (oy * out_w + p0) * 4, sums.ctypes.data + p0 * LANES * 4, positions,
                              min(LANES, out_w - p0), count, relu, 1)
            if activation != 0:
                activation_rows(done, c0, c0 + count, oy * out_w, (oy + 1) * out_w, activation, low, high)


def expand_geometry(kernel: tuple[int, int], strides: tuple[int, int], dilations: tuple[int, int], pads: tuple[int, int],
                    height: int, width: int, out_h: int, out_w: int) -> tuple[np.ndarray, np.ndarray, int]:
    """For :func:`expand_depthwise` on (height, width) planes: its geometry words, the
    table of each input position's byte offset in the padded block, and the floats of work
    a thread needs. The padded block spans the rows and columns the outputs read and every
    input position (``pads``: top and left)."""
    (kh, kw), (sy, sx), (dy, dx), (top, left) = kernel, strides, dilations, pads
    rows = max((out_h - 1) * sy + (kh - 1) * dy + 1, top + height)
    cols = max((out_w - 1) * sx + (kw - 1) * dx + 1, left + width)
    geometry = np.array([kh, kw, sy, sx, dy, dx, top, left, rows, cols], np.int64)
    r, c = np.divmod(np.arange(height * width, dtype=np.int64), width)
    table = ((r + top) * cols + c + left) * (LANES * 4)
    return geometry, table, (rows * cols + out_w) * LANES + WINDOW_SLACK


# The context of ``expand_job`` (int64 words; see ``expand_depthwise.ExpandDepthwise``).
(
    EXPAND_X, EXPAND_IMAGES, EXPAND_INPUTS, EXPAND_HEIGHT, EXPAND_WIDTH, EXPAND_WEIGHTS, EXPAND_BIAS, EXPAND_ACTIVATION,
    EXPAND_LOW, EXPAND_HIGH, EXPAND_TABLE, EXPAND_DW_WEIGHTS, EXPAND_BLOCKS, EXPAND_TAPS, EXPAND_DW_BIAS, EXPAND_GEOMETRY,
    EXPAND_RELU, EXPAND_DW_ACTIVATION, EXPAND_DW_LOW, EXPAND_DW_HIGH, EXPAND_WORK, EXPAND_WORK_FLOATS, EXPAND_Y,
    EXPAND_CHANNELS, EXPAND_OUT_HEIGHT, EXPAND_OUT_WIDTH,
) = range(26)
EXPAND_WORDS = 26  # the LOW and HIGH words: float32 bits in the low half of the word


@numba.njit(
    [numba.void(numba.int64[::1], numba.int64, numba.types.Array(numba.float32, 4, "C", readonly=True), numba.int64,
                numba.types.Array(numba.float32, 1, "C", readonly=True), numba.int64, numba.float32[::1], numba.int64,
                numba.float32[:, :, :, ::1])],
    nogil=True,
    cache=True,
)
def job_addresses(context, at_x, x, at_bias, bias, at_work, work, at_y, y):  # pragma: no cover  (compiled)
    """A call's addresses into a kept job context (``blocked_job``'s, ``depthwise_job``'s,
    ``expand_job``'s), each at its word: the input, a bias (which may be a work array
    refilled each call; ``at_bias`` -1: none), the work arrays and the output. One compiled
    call: ``ndarray.ctypes`` took ~2 us an address."""
    context[at_x] = x.ctypes.data
    if at_bias >= 0:
        context[at_bias] = bias.ctypes.data
    context[at_work] = work.ctypes.data
    context[at_y] = y.ctypes.data


@numba.cfunc(numba.void(numba.int64, numba.int64, numba.int64, numba.int64), nogil=True, cache=True)
def expand_job(c, start, stop, slot):  # pragma: no cover  (compiled)
    """Units [start, stop) of :func:`expand_depthwise` on the compiled pool, in this slot's
    work array."""
    context = numba.carray(int64_pointer(c), EXPAND_WORDS)
    n, inputs, blocks = context[EXPAND_IMAGES], context[EXPAND_INPUTS], context[EXPAND_BLOCKS]
    height, width = context[EXPAND_HEIGHT], context[EXPAND_WIDTH]
    x = numba.carray(float32_pointer(context[EXPAND_X]), (n, inputs, height, width))
    we = numba.carray(float32_pointer(context[EXPAND_WEIGHTS]), (blocks, inputs, LANES))
    be = numba.carray(float32_pointer(context[EXPAND_BIAS]), (blocks, LANES))
    table = numba.carray(int64_pointer(context[EXPAND_TABLE]), height * width)
    wb = numba.carray(float32_pointer(context[EXPAND_DW_WEIGHTS]), (blocks, context[EXPAND_TAPS], LANES))
    bb = numba.carray(float32_pointer(context[EXPAND_DW_BIAS]), (blocks, LANES))
    geometry = numba.carray(int64_pointer(context[EXPAND_GEOMETRY]), 10)
    words = numba.carray(float32_pointer(c), 2 * EXPAND_WORDS)  # the float32 bounds, each in its word's low half
    floats = context[EXPAND_WORK_FLOATS]
    work = numba.carray(float32_pointer(context[EXPAND_WORK] + slot * floats * 4), floats)
    y = numba.carray(
        float32_pointer(context[EXPAND_Y]),
        (n, context[EXPAND_CHANNELS], context[EXPAND_OUT_HEIGHT], context[EXPAND_OUT_WIDTH]),
    )
    expand_depthwise(
        x, we, be, context[EXPAND_ACTIVATION], words[2 * EXPAND_LOW], words[2 * EXPAND_HIGH], table, wb, bb, geometry,
        context[EXPAND_RELU] != 0, context[EXPAND_DW_ACTIVATION], words[2 * EXPAND_DW_LOW], words[2 * EXPAND_DW_HIGH], work, y,
        start, stop,
    )
