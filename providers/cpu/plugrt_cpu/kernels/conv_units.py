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

import threading
from types import ModuleType
from typing import Any

import numpy as np

from ._compiled import compiled_module
from ._compiled_parallel import CompiledPool, compiled_pool
from ._gemm import sgemm_address
from ._window import _workspace

__all__ = ["compiled_units", "packed_weight", "packing", "run_units"]

_F32 = np.dtype(np.float32)
_ZEROS: dict[int, np.ndarray] = {}  # float32 zeros by length: the bias of a Conv without one
# A lone product is split by output channels into blocks of at least this many rows, one
# per thread (each block packs all of the wide operand: two a thread measured 5-15% slower).
_CHANNEL_GRAIN = 16
_CHANNEL_BLOCKS_PER_THREAD = 1
_GATHER_UNITS_PER_THREAD = 2  # units of input channels (planes) per thread of a gather (a pad) job
# With the packed-weight GEMM, a 2-D im2col Conv of this many taps or more reads its
# columns from the zero-padded input (READ_DIRECT) instead of gathering blocks of them, by
# tiles of 7 positions stored a float at a time; below, it does so only at column stride
# 1 or 2, by tiles of 16 positions of a row stored as vectors (``_numba_gemm.read_product``):
# the 7-position tiles' scalar stores cost too much against few steps (SqueezeNet's first
# Conv, 27 taps, ran 5% slower by them).
_READ_DIRECT_MIN_DEPTH = 64  # ``_numba_gemm.READ_ROWS_MAX_DEPTH`` (a test checks they agree)


def _loops() -> ModuleType | None:
    return compiled_module("_numba_conv")


def packing() -> ModuleType | None:
    """``_numba_gemm`` (the packed-weight GEMM) where numba is there and the host has the
    vector unit it is written for, else None (the BLAS GEMM runs)."""
    module = compiled_module("_numba_gemm")
    return module if module is not None and module.available() else None


def packed_weight(wg: np.ndarray) -> np.ndarray | None:
    """A float32 ``wg`` (group, M / group, depth) packed for ``_numba_gemm``; None where
    that GEMM is not there or a group's channels do not start on its row tiles."""
    kernel = packing()
    if kernel is None or wg.dtype != _F32 or (wg.shape[0] > 1 and wg.shape[1] % kernel.MR):
        return None
    return kernel.pack_weight(wg.reshape(wg.shape[0] * wg.shape[1], wg.shape[2]))


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


class _Prepared:
    """A call's context with every word but the per-call addresses filled, kept on the
    plan per calling thread and arguments: a call then sets four addresses in one
    compiled call (~0.5 us) instead of building 34 words and reading six addresses
    through ``ndarray.ctypes`` (~9 us, on Convs that take 20-100 us)."""

    __slots__ = ("wg", "bias", "packed", "taps", "padding", "context", "address", "count", "mode", "size", "gather_units")

    def __init__(
        self,
        wg: np.ndarray,
        bias: np.ndarray | None,
        packed: np.ndarray | None,
        taps: np.ndarray | None,
        context: np.ndarray,
        count: int,
        mode: int,
        size: int,
        gather_units: int,
        padding: tuple[int, ...] = (),
    ):
        self.wg, self.bias, self.packed, self.taps = wg, bias, packed, taps  # kept: the context holds their addresses
        self.padding = padding  # READ_DIRECT: the padded input's layout (a buffer whose border stays zero)
        self.context, self.count, self.mode, self.size, self.gather_units = context, count, mode, size, gather_units
        self.address = int(context.ctypes.data)


def run_units(
    found: tuple[ModuleType, CompiledPool, tuple[int, bool]],
    plan: Any,
    n: int,
    group: int,
    wg: np.ndarray,
    packed: np.ndarray | None,
    bias: np.ndarray | None,
    y: np.ndarray,
    residual: np.ndarray | None,
    relu: bool,
    source: np.ndarray,
    image_stride: int,
    group_stride: int,
    threads: int,
    geometry: tuple[int, ...] | None = None,
    activation: tuple[int, float, float] = (0, 0.0, 0.0),
) -> None:
    """``y`` (n, M, positions, float32, C order) = the Conv of ``plan`` over the units.
    ``source`` holds the columns: the input (n, C, positions) for a pointwise Conv
    (``geometry`` None), else the input (n, C, H, W) of a 2-D Conv, with ``geometry``
    (H, W, kh, kw, strides, dilations, pads top and left) to gather the columns from.
    ``image_stride`` and ``group_stride`` are floats between images and groups of the
    source. The arrays must stay alive and unchanged for the call; ``residual`` is shaped
    like ``y`` and does not overlap it. ``activation`` (``_numba_epilogue.ACT_*``, with Clip's
    bounds) is applied by each unit to its block after the Relu (a fused Conv's SiLU,
    HardSwish or Clip). ``threads`` is the Python path's (``split_threads``).
    The calling thread's BLAS count must be 1 (``blas_threads(0)``, as Conv sets it): its
    units call the GEMM on it."""
    if y.size == 0:
        return
    loops, pool, _ = found
    # one entry per thread and call shape: a weight fed at run time replaces it each call
    key = (threading.get_ident(), residual is None, relu, threads, image_stride, group_stride, activation)
    cache = plan.units
    prepared = cache.get(key)
    if prepared is None or prepared.wg is not wg or prepared.bias is not bias or prepared.packed is not packed:
        prepared = cache[key] = _prepare(
            found, plan, n, group, wg, packed, bias, residual is not None, relu, image_stride, group_stride, threads, geometry,
            activation,
        )
    context = prepared.context
    if prepared.mode == loops.READ_DIRECT:  # a buffer per padded shape: its border is zeroed once
        workspace, fresh = _workspace(f"conv-padded-{prepared.size}", (prepared.size,), _F32, prepared.padding)
        if fresh:
            workspace.fill(0.0)
    else:
        workspace = _workspace("conv-units", (prepared.size,), _F32)[0] if prepared.size else y
    loops.addresses(context, source, y, y if residual is None else residual, workspace)
    if prepared.mode == loops.GATHERED:  # the columns first, shared out by channels
        pool.run(loops.gather_all.address, prepared.address, prepared.gather_units, threads)
    elif prepared.mode == loops.READ_DIRECT:  # the padded input first, shared out by planes
        pool.run(loops.pad_planes.address, prepared.address, prepared.gather_units, threads)
    pool.run(loops.conv_units.address, prepared.address, prepared.count, threads)


def _prepare(
    found: tuple[ModuleType, CompiledPool, tuple[int, bool]],
    plan: Any,
    n: int,
    group: int,
    wg: np.ndarray,
    packed: np.ndarray | None,
    bias: np.ndarray | None,
    residual: bool,
    relu: bool,
    image_stride: int,
    group_stride: int,
    threads: int,
    geometry: tuple[int, ...] | None,
    activation: tuple[int, float, float],
) -> _Prepared:
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
    size = 0
    gather_units = 0
    taps = None
    padded_h = padded_w = 0
    if geometry is not None and packed is not None and (depth >= _READ_DIRECT_MIN_DEPTH or geometry[5] in (1, 2)):
        # the packed-weight GEMM reads the columns from the zero-padded input itself
        mode = loops.READ_DIRECT
        height, width, kh, kw, sh, sw, dh, dw, top, left = geometry
        padded_h = max(height + top, (rows - 1) * sh + (kh - 1) * dh + 1)
        padded_w = max(width + left, (rest - 1) * sw + (kw - 1) * dw + 1)
        channels = depth // (kh * kw)
        c_, r_, s_ = np.meshgrid(np.arange(channels), np.arange(kh), np.arange(kw), indexing="ij")
        taps = np.ascontiguousarray((c_ * padded_h * padded_w + r_ * dh * padded_w + s_ * dw).reshape(-1), np.int64)
        size = n * group * channels * padded_h * padded_w
        gather_units = min(n * group * channels, threads * _GATHER_UNITS_PER_THREAD)
    elif geometry is not None:
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
    zeros = 0
    if bias is None and (relu or residual):
        values = _ZEROS.get(m)
        if values is None:
            values = _ZEROS[m] = np.zeros(m, _F32)
        zeros = int(values.ctypes.data)
    context = np.array(
        [
            gemm,
            int(ilp64),
            wg.ctypes.data,
            0,  # the source, the output, the residual (when there is one) and the workspace: set per call
            0,
            0 if bias is None else bias.ctypes.data,
            int(residual),
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
            0,
            room,
            zeros,
            *(geometry or (0,) * 10),
            gather_units,
            0 if packed is None else packed.ctypes.data,
            padded_h,
            padded_w,
            0 if taps is None else taps.ctypes.data,
            activation[0],
            *(int(np.float32(bound).view(np.uint32)) for bound in activation[1:]),
        ],
        np.int64,
    )
    padding = (*geometry, padded_h, padded_w) if taps is not None and geometry is not None else ()
    return _Prepared(wg, bias, packed, taps, context, count, mode, size, gather_units, padding)
