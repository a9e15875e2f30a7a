"""The compiled body of a float32 Conv's GEMM units, for ``_compiled_parallel``'s pool:
per unit (an image, a group, a block of output rows and one of output channels) gather
the block's columns when the Conv is not pointwise, call the BLAS GEMM, then add the
residual and the bias and clamp, while the block is in cache; all without the GIL.

The context is an int64 array (see ``CONTEXT_WORDS`` and ``plugrt_cpu.kernels.conv``):
addresses and sizes. The columns of a 2-D im2col block come from the zero-padded
stride-phase planes ``_ConvPlan`` fills: for column row ``r`` (a channel and a tap) and
output row ``oh``, the ``OW`` values at ``planes[image] + offsets[r] + oh * plane_width``
are contiguous. The epilogue is ``_numba_epilogue``'s, so the values are those of the
``parallel_for`` path.
"""

from __future__ import annotations

import numba
from numba import types

from ._numba_epilogue import bias_relu_rows, bias_residual_relu_rows
from ._numba_parallel import float32_pointer, int64_pointer, sgemm32, sgemm64

__all__ = ["CONTEXT_WORDS", "conv_units", "gather_all"]

# context words
SGEMM, ILP64, WEIGHT, SOURCE, OUTPUT, BIAS, RESIDUAL, RELU = range(8)
IMAGES, GROUPS, ROW_BLOCKS, CHANNEL_BLOCKS, ROWS, REST, CHANNELS_PER_GROUP, DEPTH = range(8, 16)
POSITIONS, MODE, GROUP_STRIDE, IMAGE_STRIDE, OFFSETS, PLANE_WIDTH, WORKSPACE, ROOM = range(16, 24)
ZEROS = 24
CONTEXT_WORDS = 25
# MODE: where a unit's columns are
POINTWISE = 0  # the source itself: (images, channels, positions)
GATHER = 1  # gathered per unit from the planes into the slot's workspace
GATHERED = 2  # gathered once before the job, at the workspace (one image, one group)

_FLOAT = 4  # bytes


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _gather_unit(context, image, group, r0, r1, target):  # pragma: no cover  (compiled)
    """``_gather`` for one unit: the planes of ``image``, the channels of ``group``."""
    depth = context[DEPTH]
    width = context[REST]
    plane_width = context[PLANE_WIDTH]
    offsets = numba.carray(int64_pointer(context[OFFSETS]), depth)
    source = context[SOURCE] + (image * context[IMAGE_STRIDE] + group * context[GROUP_STRIDE]) * _FLOAT
    columns = (r1 - r0) * width
    out = numba.carray(float32_pointer(target), depth * columns)
    for r in range(depth):
        row = numba.carray(float32_pointer(source + offsets[r] * _FLOAT), (r1 - 1) * plane_width + width)
        base = r * columns
        for oh in range(r0, r1):
            start = oh * plane_width
            at = base + (oh - r0) * width
            target_row = out[at : at + width]  # indexed from 0 below: no wraparound checks, the loop vectorises
            source_row = row[start : start + width]
            for j in range(width):
                target_row[j] = source_row[j]


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
    m = groups * mg
    for unit in range(start, stop):
        image = unit // (groups * row_blocks * channel_blocks)
        within = unit % (groups * row_blocks * channel_blocks)
        group = within // (row_blocks * channel_blocks)
        block = within % (row_blocks * channel_blocks)
        k = block // channel_blocks
        h = block % channel_blocks
        r0 = k * rows // row_blocks
        r1 = (k + 1) * rows // row_blocks
        c0 = group * mg + h * mg // channel_blocks
        c1 = group * mg + (h + 1) * mg // channel_blocks
        columns = (r1 - r0) * rest
        if columns == 0 or c1 == c0:
            continue
        if mode == POINTWISE:
            b = context[SOURCE] + (image * context[IMAGE_STRIDE] + group * context[GROUP_STRIDE] + r0 * rest) * _FLOAT
            ldb = positions
        elif mode == GATHER:
            b = context[WORKSPACE] + slot * context[ROOM] * _FLOAT
            ldb = columns
            _gather_unit(context, image, group, r0, r1, b)
        else:
            b = context[WORKSPACE]
            ldb = columns
        a = context[WEIGHT] + c0 * depth * _FLOAT
        output = context[OUTPUT] + image * m * positions * _FLOAT
        target = output + (c0 * positions + r0 * rest) * _FLOAT
        if context[ILP64]:
            sgemm64(context[SGEMM], c1 - c0, columns, depth, a, depth, b, ldb, target, positions)
        else:
            sgemm32(context[SGEMM], c1 - c0, columns, depth, a, depth, b, ldb, target, positions)
        relu = context[RELU] != 0
        if context[BIAS] == 0 and context[RESIDUAL] == 0 and not relu:
            continue
        matrix = numba.carray(float32_pointer(output), (m, positions))
        bias = numba.carray(float32_pointer(context[BIAS] if context[BIAS] != 0 else context[ZEROS]), m)
        if context[RESIDUAL] == 0:
            bias_relu_rows(matrix, c0, c1, r0 * rest, r1 * rest, bias[c0:c1], relu)
        else:
            residual = numba.carray(float32_pointer(context[RESIDUAL] + image * m * positions * _FLOAT), (m, positions))
            bias_residual_relu_rows(matrix, c0, c1, r0 * rest, r1 * rest, bias[c0:c1], residual, relu)


@numba.cfunc(types.void(types.int64, types.int64, types.int64, types.int64), nogil=True, cache=True)
def gather_all(c, start, stop, slot):  # pragma: no cover  (compiled)
    """The columns of all output rows of image 0, group 0 into the workspace (``GATHERED``)."""
    context = numba.carray(int64_pointer(c), CONTEXT_WORDS)
    _gather_unit(context, 0, 0, 0, context[ROWS], context[WORKSPACE])
