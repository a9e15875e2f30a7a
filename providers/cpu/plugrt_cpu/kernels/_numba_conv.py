"""The compiled body of a float32 Conv's GEMM units, for ``_compiled_parallel``'s pool:
per unit (an image, a group, a block of output rows and one of output channels) gather
the block's columns when the Conv is not pointwise, call the BLAS GEMM, then add the
residual and the bias and clamp, while the block is in cache; all without the GIL.

The context is an int64 array (see ``CONTEXT_WORDS`` and ``plugrt_cpu.kernels.conv``):
addresses and sizes. The columns of a 2-D im2col block are gathered straight from the
input: column row ``r`` is a channel and a tap (kh, kw), and its values for output row
``oh`` are input row ``oh * sh + kh * dh - pad_top``, every ``sw``-th value from column
``kw * dw - pad_left`` (a run of one stride phase of that row), zero where the window
reaches into the padding (the Python path
copies the input into zero-padded stride-phase planes first: a serial pass, 0.25 ms on
ResNet's 128 channels of 56x56). The epilogue is ``_numba_epilogue``'s, so the values are
those of the ``parallel_for`` path.
"""

from __future__ import annotations

import numba
from numba import types

from ._numba_epilogue import activation_rows, bias_relu_rows, bias_residual_relu_rows
from ._numba_gemm import MR, READ_ROWS_MAX_DEPTH, gathered_product, packed_product, read_product
from ._numba_parallel import float32_pointer, int64_pointer, sgemm32, sgemm64

__all__ = ["CONTEXT_WORDS", "addresses", "conv_units", "gather_all", "pad_planes"]

# context words
SGEMM, ILP64, WEIGHT, SOURCE, OUTPUT, BIAS, RESIDUAL, RELU = range(8)
IMAGES, GROUPS, ROW_BLOCKS, CHANNEL_BLOCKS, ROWS, REST, CHANNELS_PER_GROUP, DEPTH = range(8, 16)
POSITIONS, MODE, GROUP_STRIDE, IMAGE_STRIDE, WORKSPACE, ROOM, ZEROS = range(16, 23)
# the geometry of a 2-D gather
HEIGHT, WIDTH, KERNEL_H, KERNEL_W, STRIDE_H, STRIDE_W, DILATION_H, DILATION_W, PAD_TOP, PAD_LEFT = range(23, 33)
GATHER_UNITS = 33  # units of channels of the gather job before a GATHERED product
PACKED = 34  # the weight packed for ``_numba_gemm`` (0: the BLAS GEMM)
# READ_DIRECT: the zero-padded input (in the workspace, written by ``pad_planes``): its
# planes' height and width, and the int64 offsets of the (channel, kh, kw) taps
PADDED_H, PADDED_W, TAPS = 35, 36, 37
# a fused activation each unit applies to its block (``_numba_epilogue.ACT_*``, 0: none),
# and Clip's bounds: float32 bits in the low half of each word
ACTIVATION, ACTIVATION_LOW, ACTIVATION_HIGH = 38, 39, 40
CONTEXT_WORDS = 41
# MODE: where a unit's columns are
POINTWISE = 0  # the source itself: (images, channels, positions)
GATHER = 1  # gathered per unit from the input into the slot's workspace
GATHERED = 2  # gathered once before the job, at the workspace (one image, one group)
READ_DIRECT = 3  # read by the packed-weight GEMM from the padded input (``pad_planes``)

_FLOAT = 4  # bytes


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _copy_run(row, lo, hi, read):  # pragma: no cover  (compiled; inlined by LLVM)
    """``row[:lo] = 0``, ``row[lo:hi] = read[:hi - lo]``, ``row[hi:] = 0``."""
    zero = numba.float32(0.0)
    for j in range(lo):
        row[j] = zero
    span = row[lo:hi]  # indexed from 0: the loop vectorises
    for j in range(hi - lo):
        span[j] = read[j]
    for j in range(hi, row.shape[0]):
        row[j] = zero


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _gather_unit(context, image, group, r0, r1, target, c0, c1, scratch):  # pragma: no cover  (compiled)
    """The im2col columns of output rows ``[r0, r1)`` of ``image`` and ``group``, the rows
    of its channels ``[c0, c1)``, into ``target``: (depth, (r1 - r0) * OW), C order, rows
    in (channel, kh, kw) order. With a column stride, each input row a window row reads
    is first split into its stride phases (at ``scratch``: stride * ceil(W / stride)
    floats), so that every kernel column copies a contiguous run of one phase (a strided
    read per kernel column was 3x slower)."""
    depth = context[DEPTH]
    width = context[REST]  # OW
    height_in, width_in = context[HEIGHT], context[WIDTH]
    kh_size, kw_size = context[KERNEL_H], context[KERNEL_W]
    sh, sw = context[STRIDE_H], context[STRIDE_W]
    dh, dw = context[DILATION_H], context[DILATION_W]
    top, left = context[PAD_TOP], context[PAD_LEFT]
    plane = height_in * width_in
    source = context[SOURCE] + (image * context[IMAGE_STRIDE] + group * context[GROUP_STRIDE]) * _FLOAT
    columns = (r1 - r0) * width
    out = numba.carray(float32_pointer(target), depth * columns)
    pitch = (width_in + sw - 1) // sw  # values per phase of an input row
    phases = numba.carray(float32_pointer(scratch), sw * pitch)
    zero = numba.float32(0.0)
    for channel in range(c0, c1):
        values = numba.carray(float32_pointer(source + channel * plane * _FLOAT), plane)
        for kh in range(kh_size):
            first = (channel * kh_size + kh) * kw_size  # the column row of (channel, kh, 0)
            for oh in range(r0, r1):
                at = (oh - r0) * width
                ih = oh * sh + kh * dh - top
                if ih < 0 or ih >= height_in:
                    for kw in range(kw_size):
                        row = out[(first + kw) * columns + at : (first + kw) * columns + at + width]
                        for j in range(width):
                            row[j] = zero
                    continue
                line = values[ih * width_in : (ih + 1) * width_in]
                if sw > 1:
                    for p in range(sw):
                        phase = phases[p * pitch : (p + 1) * pitch]
                        count = (width_in - p + sw - 1) // sw
                        for j in range(count):
                            phase[j] = line[j * sw + p]
                for kw in range(kw_size):
                    row = out[(first + kw) * columns + at : (first + kw) * columns + at + width]
                    shift = kw * dw - left  # input column of output column 0
                    lo = 0 if shift >= 0 else min(width, (-shift + sw - 1) // sw)
                    hi = 0 if width_in - 1 - shift < 0 else min(width, (width_in - 1 - shift) // sw + 1)
                    hi = max(hi, lo)
                    if sw == 1:
                        _copy_run(row, lo, hi, line[lo + shift :])
                    else:
                        p = shift % sw  # iw = ow * sw + shift: phase p, index ow + (shift - p) // sw
                        _copy_run(row, lo, hi, phases[p * pitch + lo + (shift - p) // sw :])


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _activate(context, output, m, positions, c0, c1, j0, j1):  # pragma: no cover  (compiled)
    """The context's fused activation over a unit's block of the output (channels [c0,
    c1), positions [j0, j1)), right after its product, while the block is in cache."""
    code = context[ACTIVATION]
    if code == 0:
        return
    bounds = numba.carray(float32_pointer(context.ctypes.data + ACTIVATION_LOW * 8), 3)  # low, (pad), high
    matrix = numba.carray(float32_pointer(output), (m, positions))
    activation_rows(matrix, c0, c1, j0, j1, code, bounds[0], bounds[2])


@numba.cfunc(types.void(types.int64, types.int64, types.int64, types.int64), nogil=True, cache=True)
def conv_units(c, start, stop, slot):  # pragma: no cover  (compiled)
    context = numba.carray(int64_pointer(c), CONTEXT_WORDS)
    groups = context[GROUPS]
    row_blocks = context[ROW_BLOCKS]
    channel_blocks = context[CHANNEL_BLOCKS]
    rows = context[ROWS]
    rest = context[REST]
    mg = context[CHANNELS_PER_GROUP]
    depth = context[DEPTH]
    positions = context[POSITIONS]
    mode = context[MODE]
    taps = context[KERNEL_H] * context[KERNEL_W]
    m = groups * mg
    packed = context[PACKED]
    tiles = (mg + MR - 1) // MR  # a packed weight's channel blocks start on its row tiles
    for unit in range(start, stop):
        image = unit // (groups * row_blocks * channel_blocks)
        within = unit % (groups * row_blocks * channel_blocks)
        group = within // (row_blocks * channel_blocks)
        block = within % (row_blocks * channel_blocks)
        k = block // channel_blocks
        h = block % channel_blocks
        r0 = k * rows // row_blocks
        r1 = (k + 1) * rows // row_blocks
        if packed != 0:
            c0 = group * mg + (h * tiles // channel_blocks) * MR
            c1 = group * mg + min(mg, ((h + 1) * tiles // channel_blocks) * MR)
        else:
            c0 = group * mg + h * mg // channel_blocks
            c1 = group * mg + (h + 1) * mg // channel_blocks
        columns = (r1 - r0) * rest
        if columns == 0 or c1 == c0:
            continue
        output = context[OUTPUT] + image * m * positions * _FLOAT
        target = output + (c0 * positions + r0 * rest) * _FLOAT
        # the packed-weight GEMM applies the epilogue as it stores: its residual and bias here
        added = context[RESIDUAL]
        if added != 0:
            added += image * m * positions * _FLOAT + (target - output)
        row_bias = context[BIAS] + c0 * _FLOAT if context[BIAS] != 0 else 0
        weight = packed + c0 * depth * _FLOAT
        if packed != 0 and mode == READ_DIRECT:
            plane = context[PADDED_H] * context[PADDED_W]
            first = context[WORKSPACE] + (
                (image * groups + group) * (depth // taps) * plane + r0 * context[STRIDE_H] * context[PADDED_W]
            ) * _FLOAT
            shallow = depth < READ_ROWS_MAX_DEPTH and context[STRIDE_W] <= 2  # conv_units reads no other shallow Conv directly
            product = read_product if shallow else gathered_product
            product(
                weight,
                first,
                context[TAPS],
                depth,
                context[STRIDE_W],
                context[STRIDE_H] * context[PADDED_W],
                target,
                positions,
                c1 - c0,
                r1 - r0,
                rest,
                row_bias,
                added,
                context[RELU],
            )
            _activate(context, output, m, positions, c0, c1, r0 * rest, r1 * rest)
            continue
        if mode == POINTWISE:
            b = context[SOURCE] + (image * context[IMAGE_STRIDE] + group * context[GROUP_STRIDE] + r0 * rest) * _FLOAT
            ldb = positions
        elif mode == GATHER:
            b = context[WORKSPACE] + slot * context[ROOM] * _FLOAT
            ldb = columns
            _gather_unit(context, image, group, r0, r1, b, 0, depth // taps, b + depth * columns * _FLOAT)
        else:
            b = context[WORKSPACE]
            ldb = columns
        if packed != 0:
            packed_product(weight, b, ldb, depth, target, positions, c1 - c0, columns, row_bias, added, context[RELU])
            _activate(context, output, m, positions, c0, c1, r0 * rest, r1 * rest)
            continue
        a = context[WEIGHT] + c0 * depth * _FLOAT
        if context[ILP64]:
            sgemm64(context[SGEMM], c1 - c0, columns, depth, a, depth, b, ldb, target, positions)
        else:
            sgemm32(context[SGEMM], c1 - c0, columns, depth, a, depth, b, ldb, target, positions)
        relu = context[RELU] != 0
        if context[BIAS] == 0 and context[RESIDUAL] == 0 and not relu:
            _activate(context, output, m, positions, c0, c1, r0 * rest, r1 * rest)
            continue
        matrix = numba.carray(float32_pointer(output), (m, positions))
        bias = numba.carray(float32_pointer(context[BIAS] if context[BIAS] != 0 else context[ZEROS]), m)
        if context[RESIDUAL] == 0:
            bias_relu_rows(matrix, c0, c1, r0 * rest, r1 * rest, bias[c0:c1], relu)
        else:
            residual = numba.carray(float32_pointer(context[RESIDUAL] + image * m * positions * _FLOAT), (m, positions))
            bias_residual_relu_rows(matrix, c0, c1, r0 * rest, r1 * rest, bias[c0:c1], residual, relu)
        _activate(context, output, m, positions, c0, c1, r0 * rest, r1 * rest)



@numba.cfunc(types.void(types.int64, types.int64, types.int64, types.int64), nogil=True, cache=True)
def gather_all(c, start, stop, slot):  # pragma: no cover  (compiled)
    """Units of channels (``GATHERED``): unit ``u`` gathers the column rows of channels
    ``[u * C // units, (u + 1) * C // units)`` of image 0 and group 0, all output rows,
    into the workspace (``units``: the context's ``GATHER_UNITS``), each slot with its
    own phase scratch after the columns."""
    context = numba.carray(int64_pointer(c), CONTEXT_WORDS)
    taps = context[KERNEL_H] * context[KERNEL_W]
    channels = context[DEPTH] // taps
    units = context[GATHER_UNITS]
    columns = context[ROWS] * context[REST]
    pitch = (context[WIDTH] + context[STRIDE_W] - 1) // context[STRIDE_W]
    scratch = context[WORKSPACE] + (context[DEPTH] * columns + slot * context[STRIDE_W] * pitch) * _FLOAT
    for unit in range(start, stop):
        c0 = unit * channels // units
        c1 = (unit + 1) * channels // units
        if c1 > c0:
            _gather_unit(context, 0, 0, 0, context[ROWS], context[WORKSPACE], c0, c1, scratch)


@numba.cfunc(types.void(types.int64, types.int64, types.int64, types.int64), nogil=True, cache=True)
def pad_planes(c, start, stop, slot):  # pragma: no cover  (compiled)
    """Units of input planes (``READ_DIRECT``): unit ``u`` copies planes ``[u * P // units,
    (u + 1) * P // units)`` of the input (P: images times channels; units: the context's
    ``GATHER_UNITS``) into the workspace, each inside a border of ``PAD_TOP`` rows and
    ``PAD_LEFT`` columns before, to ``PADDED_H`` x ``PADDED_W``. Only the input's rows are
    written: the caller zeroes the border once per buffer (``conv_units.run_units``)."""
    context = numba.carray(int64_pointer(c), CONTEXT_WORDS)
    height, width = context[HEIGHT], context[WIDTH]
    padded_h, padded_w = context[PADDED_H], context[PADDED_W]
    top, left = context[PAD_TOP], context[PAD_LEFT]
    planes = context[IMAGES] * (context[DEPTH] // (context[KERNEL_H] * context[KERNEL_W])) * context[GROUPS]
    units = context[GATHER_UNITS]
    for unit in range(start, stop):
        for p in range(unit * planes // units, (unit + 1) * planes // units):
            source = numba.carray(float32_pointer(context[SOURCE] + p * height * width * _FLOAT), height * width)
            target = numba.carray(float32_pointer(context[WORKSPACE] + p * padded_h * padded_w * _FLOAT), padded_h * padded_w)
            for ih in range(height):
                row = target[(top + ih) * padded_w + left :]  # indexed from 0: the loop vectorises
                line = source[ih * width :]
                for j in range(width):
                    row[j] = line[j]


def _any(ndim: int):  # type: ignore[no-untyped-def]
    return types.Array(types.float32, ndim, "A", readonly=True)  # only the address is read: any layout


@numba.njit(
    # a pointwise Conv's columns are (n, C, positions), a 2-D one's input (n, C, H, W); the
    # workspace is its own buffer or the output
    [types.void(types.int64[::1], _any(s), _any(3), _any(r), _any(w)) for s in (3, 4) for r in (3, 4) for w in (1, 3)],
    nogil=True,
    cache=True,
)
def addresses(context, source, output, residual, workspace):  # pragma: no cover  (compiled)
    """A call's addresses into its prepared context: the source, the output, the residual
    (where the context was prepared with one: its word is then non-zero) and the
    workspace."""
    context[SOURCE] = source.ctypes.data
    context[OUTPUT] = output.ctypes.data
    if context[RESIDUAL] != 0:
        context[RESIDUAL] = residual.ctypes.data
    context[WORKSPACE] = workspace.ctypes.data
