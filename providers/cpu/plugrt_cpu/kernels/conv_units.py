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
# A lone product is split by output channels into blocks of at least this many rows, two
# per thread.
_CHANNEL_GRAIN = 16
_CHANNEL_BLOCKS_PER_THREAD = 1


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
    offsets: np.ndarray | None = None,
    plane_width: int = 0,
) -> None:
    """``y`` (n, M, positions, float32, C order) = the Conv of ``plan`` over the units.
    ``source`` holds the columns: the input (n, C, positions) for a pointwise Conv
    (``offsets`` None), else the stride-phase planes, with ``offsets`` (int64, one per
    column row, within an image's and group's planes) and the planes' row length. The
    arrays must stay alive and unchanged for the call; ``residual`` is shaped like ``y``
    and does not overlap it. ``threads`` is the Python path's (``split_threads``)."""
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
    if offsets is not None:
        mode = loops.GATHER if channel_blocks == 1 else loops.GATHERED
        rows_per_block = -(-rows // blocks)
        room = depth * rows_per_block * rest
        slots = 1 if mode == loops.GATHERED else pool.slots(count, threads)
        buffer, _ = _workspace("conv-units", (slots * room,), _F32)
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
            0 if offsets is None else offsets.ctypes.data,
            plane_width,
            workspace,
            room,
            zeros,
        ],
        np.int64,
    )
    blas_threads(0)  # the units' GEMMs run on one BLAS thread each
    if mode == loops.GATHERED:
        pool.run(loops.gather_all.address, context, 1, 1)
    pool.run(loops.conv_units.address, context, count, threads)
