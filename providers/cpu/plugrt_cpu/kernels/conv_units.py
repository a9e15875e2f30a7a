"""A float32 Conv's GEMM units as one compiled job (``_numba_conv.conv_units``) on
``_compiled_parallel``'s pool: the pointwise and 2-D im2col paths of ``conv``, where numba
is there. Each unit gathers its columns, calls the GEMM and runs its epilogue without the
GIL, so the pool's workers take units as soon as they are published (see
``_numba_parallel``); the Python path takes the GIL around every block.

Same units as the Python path (``_ConvPlan.block_count``), same BLAS, same epilogue loop:
the same values. A product that is one unit (one image, one group, one block of rows) is
split by output channels instead, as ``split_gemm`` would.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import numpy as np
from plugrt.threads import blas_threads

from ._compiled import compiled_module
from ._compiled_parallel import CompiledPool, compiled_pool
from ._gemm import sgemm_address
from ._window import _workspace

__all__ = ["compiled_units", "run_units"]

_F32 = np.dtype(np.float32)
_ZEROS: dict[int, np.ndarray] = {}  # float32 zeros by length: the bias of a Conv without one
# A lone product is split by output channels into blocks of at least this many rows, one
# per thread (each block packs all of the wide operand: two a thread measured 5-15% slower).
_CHANNEL_GRAIN = 16
_CHANNEL_BLOCKS_PER_THREAD = 1
_GATHER_UNITS_PER_THREAD = 2  # units of input channels per thread of the gather before a lone product


@functools.cache
def _loops() -> ModuleType | None:
    return compiled_module("_numba_conv")


def compiled_units() -> tuple[ModuleType, CompiledPool, tuple[int, bool]] | None:
    """The compiled Conv body, the pool and the GEMM, or None where any is missing."""
    loops = _loops()
    if loops is None:
        return None
    pool = compiled_pool()
    gemm = sgemm_address()
    if pool is None or gemm is None:
        return None
    return loops, pool, gemm


def run_units(
    found: tuple[ModuleType, CompiledPool, tuple[int, bool]],
    plan: Any,
    n: int,
    group: int,
    wg: np.ndarray,
    bias: np.ndarray | None,
    y: np.ndarray,
    residual: np.ndarray | None,
    relu: bool,
    source: np.ndarray,
    image_stride: int,
    group_stride: int,
    threads: int,
    geometry: tuple[int, ...] | None = None,
) -> None:
    """``y`` (n, M, positions, float32, C order) = the Conv of ``plan`` over the units.
    ``source`` holds the columns: the input (n, C, positions) for a pointwise Conv
    (``geometry`` None), else the input (n, C, H, W) of a 2-D Conv, with ``geometry``
    (H, W, kh, kw, strides, dilations, pads top and left) to gather the columns from.
    ``image_stride`` and ``group_stride`` are floats between images and groups of the
    source. The arrays must stay alive and unchanged for the call; ``residual`` is shaped
    like ``y`` and does not overlap it. ``threads`` is the Python path's (``split_threads``)."""
    if y.size == 0:
        return
    loops, pool, (gemm, ilp64) = found
    m = plan.m
    mg = m // group
    depth = wg.shape[2]
    positions = plan.out_size
    rows, rest = plan.out[0], plan.rest
    blocks = plan.block_count(n * group, threads)
    channel_blocks = 1
    if n * group * blocks == 1 and threads > 1:
        channel_blocks = max(1, min(threads * _CHANNEL_BLOCKS_PER_THREAD, mg // _CHANNEL_GRAIN))
    count = n * group * blocks * channel_blocks
    mode = loops.POINTWISE
    room = 0
    workspace = 0
    gather_units = 0
    if geometry is not None:
        mode = loops.GATHER if channel_blocks == 1 else loops.GATHERED
        rows_per_block = -(-rows // blocks)
        width, stride = geometry[1], geometry[5]
        phases = stride * -(-width // stride)  # a slot's scratch for an input row's stride phases
        if mode == loops.GATHER:  # per slot: a block's columns, then its phases
            room = depth * rows_per_block * rest + phases
            size = pool.slots(count, threads) * room
        else:  # all the columns, then each slot's phases
            gather_units = min(depth // (geometry[2] * geometry[3]), threads * _GATHER_UNITS_PER_THREAD)
            size = depth * rows * rest + pool.slots(gather_units, threads) * phases
        buffer, _ = _workspace("conv-units", (size,), _F32)
        workspace = int(buffer.ctypes.data)
    zeros = 0
    if bias is None and (relu or residual is not None):
        values = _ZEROS.get(m)
        if values is None:
            values = _ZEROS[m] = np.zeros(m, _F32)
        zeros = int(values.ctypes.data)
    context = np.array(
        [
            gemm,
            int(ilp64),
            wg.ctypes.data,
            source.ctypes.data,
            y.ctypes.data,
            0 if bias is None else bias.ctypes.data,
            0 if residual is None else residual.ctypes.data,
            int(relu),
            n,
            group,
            blocks,
            channel_blocks,
            rows,
            rest,
            mg,
            depth,
            positions,
            mode,
            group_stride,
            image_stride,
            workspace,
            room,
            zeros,
            *(geometry or (0,) * 10),
            gather_units,
        ],
        np.int64,
    )
    blas_threads(0)  # the units' GEMMs run on one BLAS thread each
    if mode == loops.GATHERED:  # the columns first, shared out by channels
        pool.run(loops.gather_all.address, context, gather_units, threads)
    pool.run(loops.conv_units.address, context, count, threads)
