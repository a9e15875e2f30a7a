"""Convolution kernels: Conv, CausalConvWithState, ConvTranspose, Col2Im and DeformConv."""

from __future__ import annotations

import itertools
import math
import threading
from types import ModuleType
from typing import Any, Callable, Sequence

import numpy as np
from plugrt.threads import PARALLEL_MIN_WORK, blas_threads, parallel_for, split_threads, threads_for
from plugrt.provider import shared_transform

from .._registry import KernelContext, kernel, kernel_builder, declare_into
from ._compiled import CONV_LOOPS, compiled_module, generation as compiled_generation
from ._window import (
    _auto_pad,
    _call,
    _cast_into_scratch,
    _compute_dtype,
    _copied,
    _copy_to_workspace,
    _fresh,
    _ints,
    _pads,
    _phase_fill,
    _ShapeCache,
    _Tap,
    _taps,
    _window_geometry,
    _workspace,
    _zeroed,
)
from ._gemm import available, epilogue, gemm, split_gemm, splits_columns
from .conv_gemm import grid_plan
from ._compiled_parallel import compiled_pool
from ._first_call import faster as _faster
from .conv_units import compiled_units, packed_weight, run_units
from .winograd import winograd_loops, winograd_plan
from ._relu import relu_into
from .elementwise import scratch, with_small_buffers

# ---------------------------------------------------------------------------
# Conv
# ---------------------------------------------------------------------------

# The im2col and pointwise paths run in blocks of output rows, one block on one thread from
# its columns to its Relu (see _ConvPlan._plan_blocks). A block's columns and output stay
# within _BLOCK_BYTES: measured 1-8 MiB on ResNet's 7x7 and Inception's 3x3 Conv, 4 MiB as
# fast as 1-2 and 5-15% faster than 8; cache-sized blocks (256-512 KiB) were 1.2-1.6x
# slower than one block, from the numpy and BLAS calls each block makes (a few us each,
# more with two threads taking turns at the GIL), so blocks are made smaller only to give
# every thread one. A GEMM on fewer columns than _MIN_BLOCK_POSITIONS runs 15-50% slower
# per multiply-add (measured on 64 x 144 by 64-3025 columns: 1.5x at 64, 1.15x at 256).
_BLOCK_BYTES = 4 << 20
_F32 = np.dtype(np.float32)
# Multiply-adds from which the compiled units share a product out (``split_threads``
# waits for PARALLEL_MIN_WORK: a woken Python worker cost what a smaller product saved)
_COMPILED_SPLIT_WORK = 1 << 19
_MIN_BLOCK_POSITIONS = 256
_DEPTHWISE_BLOCK_BYTES = 1 << 20  # depthwise columns per block (measured: 32 planes of 28 x 30 beat 8 and 128)
# A multiply-add of the compiled depthwise loops costs about this many of a BLAS product's
# (measured: 7-21 G/s by shape against ~34 G/s for one-thread sgemm): parallel_for's work
# counts the latter.
_DEPTHWISE_COMPILED_COST = 3
_DEPTHWISE_COMPILED_GRAIN = 8  # planes per parallel_for chunk at least: each costs a call (~5 us)
_LANES = 16  # channels a block of the channel-blocked depthwise loops (``_numba_depthwise.LANES``)
_WINDOW_SLACK = 16 * _LANES  # floats after a padded block its windowed sums may read (``_numba_depthwise.WINDOW_SLACK``)
_GROUP_WIDTHS = (2, 4, 8, 16)  # channels a group their grouped sums take (``_numba_depthwise.GROUP_WIDTHS``)
# Rows at least this many floats wide are split into their stride phases (``_DepthwiseLayout``):
# two 16-float vectors a row for the fill's loops.
_DEPTHWISE_ROW_PHASES_MIN_PITCH = 32
_DEPTHWISE_UNITS_PER_THREAD = 4  # units of planes per thread of a compiled-pool job


def _compiled_threads(work: int) -> int:
    """Threads for the compiled units of a product of ``work`` multiply-adds: the compiled
    pool hands a job over in microseconds, so products down to ``_COMPILED_SPLIT_WORK``
    (~12 us on one thread) are split too (SqueezeNet, Inception v2 and ShuffleNet on 2
    threads: 3-5% faster runs than at PARALLEL_MIN_WORK)."""
    return split_threads(max(work, PARALLEL_MIN_WORK)) if work >= _COMPILED_SPLIT_WORK else 1


def _depthwise_threads(work: int) -> int:
    """Threads for a depthwise job on the compiled pool (``work`` as ``_DepthwiseLayout``
    counts it): split from the Conv units' threshold, which the pool's hand-off allows
    (MobileNet v2's 144 planes of 56 x 56 to 28 x 28: 175 us on one thread, 111-121 on
    two), but only over the cores other processes leave free (``threads_for``): a short
    job split onto a busy core waits for it (beside one busy process, EfficientNet-B0 and
    EfficientViT-B0 ran 5-25% slower split on every core)."""
    return threads_for(PARALLEL_MIN_WORK) if work >= _COMPILED_SPLIT_WORK else 1


def depthwise_loops() -> ModuleType | None:
    """The numba-compiled depthwise loops (``_numba_depthwise``), or None when numba is
    missing, unusable, ``PLUGRT_NUMBA=0`` or still being built (``compiled_module``): the
    numpy paths run instead."""
    return compiled_module("_numba_depthwise")


class _DepthwiseLayout:
    """Where the compiled depthwise loops put an input plane and read each tap, for one
    2-D shape (see ``_numba_depthwise``): the input split into its column stride phases,
    and into its row stride phases too where rows are long, each a plane of rows ``pitch``
    floats wide with zero rows above and below; the output computed on a grid of rows
    ``apart`` floats apart, a kernel column's taps masked where they wrap past a row's end."""

    def __init__(
        self,
        spatial: list[int],
        kernel: list[int],
        strides: list[int],
        dilations: list[int],
        pb: list[int],
        out: list[int],
        images: int,
        channels: int,
        per_group: int = 1,
    ) -> None:
        (height, width), (kh, kw), (sy, sx), (dy, dx) = spatial, kernel, strides, dilations
        out_h, out_w = out
        pitch = max(out_w, -(-width // sx))  # holds every input column of a phase
        # Row phases (``ry`` of them) where rows are long enough for the fill's row loops to
        # vectorise; else one, the grid then ``sy`` plane rows an output row (the rows
        # between are computed and dropped). 96 planes of 112 x 112 to 56 x 56: 236-246 us
        # split against 308-358; 576 planes of 14 x 14 to 7 x 7: 137-218 against 95-133.
        ry = sy if pitch >= _DEPTHWISE_ROW_PHASES_MIN_PITCH else 1
        step = sy // ry  # plane rows from one output row to the next
        # tap (ky, kx) of output (oy, ox) reads input row sy * oy + rows_at[ky] and column
        # sx * ox + columns_at[kx]: with the input's rows counted from ``top`` zero rows
        # above it, row phase (rows_at + top) % ry at plane row step * oy + (rows_at + top)
        # // ry, column phase columns_at % sx at ox + shifts[kx]
        rows_at = [ky * dy - pb[0] for ky in range(kh)]
        columns_at = [kx * dx - pb[1] for kx in range(kw)]
        shifts = [c // sx for c in columns_at]
        top = max(0, -min(rows_at))
        plane_rows = 1 + max((top + height - 1) // ry, step * (out_h - 1) + (top + max(rows_at)) // ry)
        front = max(0, -min(shifts))  # a tap wrapping before the first row stays inside
        block = front + plane_rows * pitch + max(0, max(shifts))
        offsets = [
            ((r + top) % ry * sx + c % sx) * block + front + (r + top) // ry * pitch + shift
            for r in rows_at
            for c, shift in zip(columns_at, shifts)
        ]
        apart = step * pitch
        length = (out_h - 1) * apart + pitch
        column = np.arange(length) % apart
        self.masks = np.stack([(column + shift >= 0) & (column + shift < pitch) for shift in shifts]).astype(np.float32)
        three_by_three = (kh, kw) == (3, 3) and shifts[1] == 0  # the middle column needs no mask
        self.layout = np.array([ry, sx, pitch, front, block, int(three_by_three), top, apart, *offsets], dtype=np.int64)
        self.work_size = ry * sx * block + (length if apart != out_w else 0)
        self.work = images * channels * out_h * out_w * kh * kw * per_group * _DEPTHWISE_COMPILED_COST
        self.no_bias = np.zeros(channels, dtype=np.float32)
        # the channel-blocked loops (``_numba_depthwise.blocked_depthwise``): the geometry,
        # a thread's work floats, and whether they beat the planes' (timed on the first call);
        # for a grouped Conv (``per_group`` channels a group in and out), the loops' grouped sums
        self.geometry = np.array([kh, kw, sy, sx, dy, dx, pb[0], pb[1], 0, per_group], dtype=np.int64)
        self.geometry_last = self.geometry.copy()  # the same for a channels-last input
        self.geometry_last[8] = 1
        spanned = ((out_h - 1) * sy + (kh - 1) * dy + 1) * ((out_w - 1) * sx + (kw - 1) * dx + 1)
        self.blocked_floats = (spanned + out_h * out_w) * _LANES + _WINDOW_SLACK
        self.blocked_wins: bool | None = None
        self.bias_lanes: np.ndarray | None = None  # a grouped Conv's bias index for each lane of the blocks
        # the compiled jobs' contexts kept between calls, per job, calling thread, thread
        # count and what else sets their fixed words, with the weight array they point at:
        # made each call, their ``ndarray.ctypes`` reads took ~2 us an address
        self.contexts: dict[tuple[Any, ...], tuple[np.ndarray, int, np.ndarray]] = {}
        for array in (self.masks, self.layout, self.no_bias, self.geometry, self.geometry_last):
            array.flags.writeable = False


class _ConvPlan:
    """Everything a Conv call needs that depends only on the input shape."""

    def __init__(self, conv: "_Convolution", x_shape: tuple[int, ...], w_shape: tuple[int, ...], itemsize: int):
        self.units: dict[tuple[Any, ...], Any] = {}  # the compiled units' prepared contexts (conv_units)
        self.gather: tuple[int, ...] | None = None
        self.grouped: _DepthwiseLayout | None = None
        n, c = x_shape[:2]
        spatial = list(x_shape[2:])
        rank = len(spatial)
        kernel = list(w_shape[2:])
        strides = _ints(conv.strides, rank, 1)
        dilations = _ints(conv.dilations, rank, 1)
        pb, pe = _pads(conv.pads, rank)
        out, pb, pe = _window_geometry(spatial, kernel, strides, dilations, pb, pe, conv.auto_pad)
        group = conv.group
        m = w_shape[0]
        if c != w_shape[1] * group or m % group:
            raise ValueError(f"Conv: input {x_shape} and weight {w_shape} do not match group={group}")
        self.out = out
        self.out_size = math.prod(out)
        self.m = m
        ksize = math.prod(kernel)
        pointwise = ksize == 1 and not any(pb) and all(
            (o - 1) * s + 1 <= size for o, s, size in zip(out, strides, spatial)
        )
        if pointwise:
            self.kind = "pointwise"
            self.src = (slice(None), slice(None)) + tuple(
                slice(0, (o - 1) * s + 1, s) for o, s in zip(out, strides)
            )
            self.copy_input = any(s != 1 for s in strides) or out != spatial
            self._plan_blocks(c // group, m // group, itemsize)
            return
        if w_shape[1] == 1 and group > 1:
            self.kind = "depthwise"
            self._plan_depthwise(spatial, kernel, strides, dilations, pb, out, n * group, group, itemsize)
            return
        self.kind = "im2col"
        # a 2-D Conv's compiled units gather their columns straight from the input
        self.gather = (*spatial, *kernel, *strides, *dilations, *pb) if rank == 2 else None
        self._plan_columns(spatial, kernel, strides, dilations, pb, c)
        self._plan_blocks(c // group * ksize, m // group, itemsize)
        self.grid = grid_plan(x_shape, w_shape, strides, dilations, pb, out, group)
        self.winograd = winograd_plan(x_shape, w_shape, strides, dilations, pb, out, group)
        # A 2-D Conv of 2 to 16 channels a group in and out (RegNet's, ResNeXt's): the
        # channel-blocked loops' grouped sums, where its first call finds them faster.
        if rank == 2 and 1 < group and m == c and w_shape[1] in _GROUP_WIDTHS:
            self.grouped = _DepthwiseLayout(spatial, kernel, strides, dilations, pb, out, n, m, w_shape[1])

    def _plan_columns(
        self,
        spatial: list[int],
        kernel: list[int],
        strides: list[int],
        dilations: list[int],
        pb: list[int],
        channels: int,
    ) -> None:
        """The im2col path's geometry. The input is copied once into zero-padded planes,
        one per stride phase (``padded[..., phase::stride]``); on its plane the taps of a
        phase read at offsets that form a grid (a step per axis), so one strided view of
        the plane holds all of them and a block of output rows gathers its columns with
        one copy per phase. No tap reads outside the planes: the columns need no zeros."""
        out = self.out
        rank = len(spatial)
        # per axis, per phase of it: the taps reading it (a slice), their count, first shift and shift step
        per_axis: list[dict[int, tuple[slice, int, int, int]]] = []
        for size, dilation, stride in zip(kernel, dilations, strides):
            reach = [t * dilation for t in range(size)]
            axis = {}
            for residue in sorted({r % stride for r in reach}):
                members = [t for t in range(size) if reach[t] % stride == residue]
                shifts = [reach[t] // stride for t in members]  # evenly spaced, as the members are
                step, shift_step = (members[1] - members[0], shifts[1] - shifts[0]) if len(members) > 1 else (1, 0)
                axis[residue] = (slice(members[0], members[-1] + 1, step), len(members), shifts[0], shift_step)
            per_axis.append(axis)
        plane = [o + (k - 1) * d // s for o, k, d, s in zip(out, kernel, dilations, strides)]
        self.plane_shape = plane
        self.plane_size = math.prod(plane)
        self.plane_strides = [math.prod(plane[i + 1 :]) for i in range(rank)]
        self.kernel = list(kernel)
        whole = (slice(None), slice(None))
        self.plane_fills = []  # per phase k: (its region of the planes (n, phases, C, *plane), the input's)
        self.phase_windows = []  # per phase: (its taps' columns, tap counts, steps and first offset on its plane)
        for k, phase in enumerate(itertools.product(*(list(axis) for axis in per_axis))):
            dst, src = _phase_fill(spatial, phase, pb, strides, plane)
            self.plane_fills.append(((slice(None), k, slice(None)) + dst, whole + src))
            entries = [axis[residue] for axis, residue in zip(per_axis, phase)]
            start = sum(entry[2] * ps for entry, ps in zip(entries, self.plane_strides))
            self.phase_windows.append(
                (
                    (slice(None), *(entry[0] for entry in entries)),
                    [entry[1] for entry in entries],
                    [entry[3] * ps for entry, ps in zip(entries, self.plane_strides)],
                    start,
                )
            )
        self.planes_layout = ("im2col", channels, tuple(plane), tuple(self.plane_fills))
        # the windows of the last planes they were made on: (planes' address, batch, dtype), windows
        self.windows: tuple[tuple[int, int, np.dtype], list[tuple[tuple[slice, ...], np.ndarray]]] | None = None

    def _plan_blocks(self, depth: int, mg: int, itemsize: int) -> None:
        """Bounds on the blocks of output rows (rows of the first output axis) the products
        run in, for ``depth`` rows of columns and ``mg`` output channels per group: at least
        ``_MIN_BLOCK_POSITIONS`` output positions each, and as few as keep a block's columns
        and output within ``_BLOCK_BYTES`` (see ``block_count``)."""
        rows = self.out[0]
        self.rest = math.prod(self.out[1:])  # output positions per row
        least_rows = max(1, -(-_MIN_BLOCK_POSITIONS // max(1, self.rest)))
        fitting_rows = max(least_rows, _BLOCK_BYTES // max(1, self.rest * (depth + mg) * itemsize))
        self.most_blocks = max(1, rows // least_rows)
        self.fitting_blocks = min(self.most_blocks, -(-rows // fitting_rows))
        # a lone product with more output channels than positions is better split by its
        # channels (split_gemm) than into blocks of positions that each pack all the weights
        self.split_positions = splits_columns(mg, self.rest * rows)

    def block_count(self, outer: int, threads: int) -> int:
        """Blocks of output rows per image and group, for ``outer`` images times groups on
        ``threads`` threads: as few as fit ``_BLOCK_BYTES``, raised (while the blocks keep
        ``_MIN_BLOCK_POSITIONS``) until the units, ``outer`` times the count, share out evenly."""
        count = self.fitting_blocks
        if outer * count == 1 and not self.split_positions:
            return 1
        count = max(count, -(-threads // outer))
        while (outer * count) % threads:
            count += 1
        return min(count, self.most_blocks)

    def _plan_depthwise(
        self,
        spatial: list[int],
        kernel: list[int],
        strides: list[int],
        dilations: list[int],
        pb: list[int],
        out: list[int],
        rows: int,
        group: int,
        itemsize: int,
    ) -> None:
        """Depthwise taps as flat shifts of stride-phase planes.

        Every tap reads one phase plane (``padded[..., phase::stride]``) at a fixed
        offset, so on planes flattened to one axis it is a contiguous run: the output is
        computed on a grid as wide as the planes and cropped once.
        """
        rank = len(spatial)
        # the compiled loops' layout (used for float32 when numba is there)
        self.compiled = None
        if rank == 2:
            self.compiled = _DepthwiseLayout(spatial, kernel, strides, dilations, pb, out, rows // group, self.m)
        phases, shifts = [], []
        for tap in itertools.product(*(range(k) for k in kernel)):
            offsets = [t * d for t, d in zip(tap, dilations)]
            phases.append(tuple(o % st for o, st in zip(offsets, strides)))
            shifts.append([o // st for o, st in zip(offsets, strides)])
        most = [max(sh[i] for sh in shifts) for i in range(rank)]
        plane = [out[i] + most[i] + (1 if i == 0 and rank > 1 else 0) for i in range(rank)]
        plane_strides = [math.prod(plane[i + 1 :]) for i in range(rank)]
        self.plane_shape = plane
        self.plane_grid = out[0] * plane_strides[0]  # outputs (and junk columns) per channel
        self.phase_fill = {}  # phase -> (plane region, input region)
        for phase in sorted(set(phases)):
            dst, src = _phase_fill(spatial, phase, pb, strides, plane)
            self.phase_fill[phase] = ((slice(None),) + dst, (slice(None),) + src)
        self.depthwise_taps = [
            (index, phase, sum(sh * ps for sh, ps in zip(shift, plane_strides)))
            for index, (phase, shift) in enumerate(zip(phases, shifts))
        ]
        self.crop = (slice(None),) + tuple(slice(0, o) for o in out)
        # Without strides every tap reads the one plane at offsets that form a grid, so all
        # taps are one strided view (grid position, *kernel, channel) of a channels-last plane.
        self.tap_grid_steps = None
        if all(st == 1 for st in strides):
            self.tap_grid_steps = [d * ps for d, ps in zip(dilations, plane_strides)]
        self.kernel = list(kernel)
        # The product path: taps gathered into columns, one product per group. The taps of
        # one phase read its plane at offsets forming a grid (a step per axis), so one
        # strided view copies them all; the columns hold the taps phase by phase, in
        # ``tap_order``. The product's grid (group, multiplier, out[0], *plane[1:]) is
        # cropped to the output.
        self.product_plane_shape = list(plane)
        self.product_grid = self.plane_grid
        self.product_layout: tuple[Any, ...] = (tuple(plane), tuple(self.phase_fill))
        self.product_crop = (slice(None), slice(None)) + tuple(slice(0, o) for o in out)
        self.phase_grids = []
        order: list[int] = []
        for phase in self.phase_fill:
            members = [(index, shift) for index, (ph, shift) in enumerate(zip(phases, shifts)) if ph == phase]
            per_axis = [sorted({shift[i] for _, shift in members}) for i in range(rank)]
            steps = [(a[1] - a[0] if len(a) > 1 else 0) * ps for a, ps in zip(per_axis, plane_strides)]
            start = sum(a[0] * ps for a, ps in zip(per_axis, plane_strides))
            self.phase_grids.append(([len(a) for a in per_axis], steps, start))
            order += [index for index, _ in members]
        self.tap_order = tuple(order)
        self.wrap_zeros: list[tuple[slice | int, ...]] | None = None
        if all(st == 1 for st in strides) and out == spatial:
            self._plan_unpadded(spatial, kernel, dilations, pb)
        # One product per group beats a multiply-add pass per tap, unless the planes are
        # short for the channel count and need a crop: then the per-group calls and the
        # short rows of the crop cost more (measured, A/B in one process: the product is
        # faster at 3x3 on 136x28x28 stride 2, 0.65 rows per grid position, and slower on
        # 272x14x14 stride 2, 4.9; without a crop it is as fast or faster even at 544x7x7).
        self.depthwise_product = self.wrap_zeros is not None or rows <= self.product_grid
        # Blocks of groups whose columns stay in cache; the work sizes the threads.
        column_bytes = len(phases) * self.product_grid * itemsize
        self.depthwise_block = max(1, min(group, _DEPTHWISE_BLOCK_BYTES // max(1, column_bytes)))
        self.depthwise_work = group * len(phases) * self.product_grid * (1 + self.m // group)

    def _plan_unpadded(self, spatial: list[int], kernel: list[int], dilations: list[int], pb: list[int]) -> None:
        """The product path for unit strides with the output the input's size: its grid is
        the plane itself. Each channel is copied whole between zeros (contiguous, no
        padded rows); a tap reads it at a flat offset, so on the axes after the first it
        wraps into the neighbouring row: those columns are zeroed (``wrap_zeros``, regions
        of the columns viewed as (group, *kernel, *spatial)). No crop follows."""
        rank = len(spatial)
        plane_strides = [math.prod(spatial[i + 1 :]) for i in range(rank)]
        size = math.prod(spatial)
        reach = [
            sum(((k - 1) * d * c - p) * ps for k, d, c, p, ps in zip(kernel, dilations, corner, pb, plane_strides))
            for corner in itertools.product((0, 1), repeat=rank)
        ]
        self.front = max(0, -min(reach))
        self.product_plane_shape = [self.front + size + max(0, max(reach))]
        self.product_grid = size
        self.product_layout = ("unpadded", tuple(self.product_plane_shape), self.front)
        start = self.front - sum(p * ps for p, ps in zip(pb, plane_strides))
        self.phase_grids = [(list(kernel), [d * ps for d, ps in zip(dilations, plane_strides)], start)]
        self.tap_order = tuple(range(math.prod(kernel)))
        self.wrap_zeros = []
        for i in range(1, rank):
            for t in range(kernel[i]):
                offset = t * dilations[i] - pb[i]
                for bad in (slice(0, max(0, min(spatial[i], -offset))), slice(max(0, spatial[i] - offset), spatial[i])):
                    if bad.stop > bad.start:
                        region: list[slice | int] = [slice(None)] * (1 + 2 * rank)
                        region[1 + i] = t
                        region[1 + rank + i] = bad
                        self.wrap_zeros.append(tuple(region))


class _ConvWeight:
    """A Conv weight prepared for the GEMM: (group, M/group, C/group * kernel)."""

    def __init__(self, w: np.ndarray, group: int, dtype: np.dtype):
        self.shape = tuple(w.shape)
        m = w.shape[0]
        self.gemm = np.ascontiguousarray(w.reshape(group, m // group, -1), dtype=dtype)
        self._reordered: dict[tuple[int, ...], np.ndarray] = {}
        self.constant = False  # set by ConvConstants for a weight prepared once
        self._packed: tuple[np.ndarray | None, int] | None = None  # and the compiled generation it saw
        self._blocked: np.ndarray | None = None

    def packed(self) -> np.ndarray | None:
        """A constant float32 weight packed for the compiled units' GEMM
        (``conv_units.packed_weight``), made once; None for a weight fed at run time (packing
        it each call would allocate, and a replay must not) or where that GEMM is not
        there (asked again once more compiled loops are loaded: it may be built by then)."""
        if not self.constant:
            return None
        packed = self._packed
        if packed is None or (packed[0] is None and packed[1] != compiled_generation()):
            packed = self._packed = (packed_weight(self.gemm), compiled_generation())
        return packed[0]

    def blocked(self, loops: ModuleType) -> np.ndarray | None:
        """A constant depthwise (or grouped) weight as the channel-blocked loops read it
        (``loops.block_weights``: (ceil(M / 16), taps * C/group, 16)), made once; None for a
        weight fed at run time."""
        if not self.constant:
            return None
        if self._blocked is None:
            m = self.shape[0]
            self._blocked = loops.block_weights(self.gemm.reshape(m, -1), np.zeros(m, np.float32), self.shape[1])[0]
        return self._blocked

    def taps_in(self, order: tuple[int, ...]) -> np.ndarray:
        """``gemm`` with its taps (last axis) in ``order``, made once per order."""
        if order == tuple(range(len(order))):
            return self.gemm
        taps = self._reordered.get(order)
        if taps is None:
            taps = self._reordered[order] = np.ascontiguousarray(self.gemm[:, :, list(order)])
        return taps


class _Convolution:
    """A Conv node: attributes parsed once, weights reshaped once when constant."""

    def __init__(self, attributes: dict[str, Any], relu: bool = False):
        self.auto_pad = _auto_pad(attributes.get("auto_pad"))
        self.dilations = attributes.get("dilations")
        self.group = int(attributes.get("group", 1))
        self.pads = attributes.get("pads")
        self.strides = attributes.get("strides")
        self.relu = relu  # a fused Relu, applied to each output block while it is in cache
        # a fused activation the compiled paths apply to each block after the Relu (the
        # ``fused`` of a ``conv_activation.activation_in_place`` body: code, Clip's bounds;
        # code 0: none); the paths that do say so through ``applied``
        self.activation: tuple[int, float, float] = (0, 0.0, 0.0)
        self._plans = _ShapeCache(lambda xs, ws, item: _ConvPlan(self, xs, ws, item))

    def prepare_weight(self, w: np.ndarray, dtype: np.dtype) -> "_ConvWeight":
        return _ConvWeight(w, self.group, dtype)

    def prepare_bias(self, b: np.ndarray | None, dtype: np.dtype) -> np.ndarray | None:
        return None if b is None else np.ascontiguousarray(b, dtype=dtype).reshape(-1, 1)

    def __call__(
        self,
        x: np.ndarray,
        weight: "_ConvWeight",
        bias: np.ndarray | None,
        y: np.ndarray | None = None,
        applied: list | None = None,
    ) -> np.ndarray:
        """The convolution, into the C-contiguous ``y`` (n, M, *out) when given (the
        ``into`` variant: the same arithmetic, its copies in thread workspaces). A path
        that applied ``self.activation`` itself appends True to ``applied``."""
        plan: _ConvPlan = self._plans(x.shape, weight.shape, x.dtype.itemsize)
        if plan.kind != "depthwise":
            blas_threads(0)  # the products split themselves over threads (split_gemm)
        if y is not None and plan.kind != "depthwise":  # no reductions but BLAS ones: see with_small_buffers
            return with_small_buffers(self._convolve, x, weight, bias, y, plan, applied)
        return self._convolve(x, weight, bias, y, plan, applied)

    def _convolve(
        self,
        x: np.ndarray,
        weight: "_ConvWeight",
        bias: np.ndarray | None,
        y: np.ndarray | None,
        plan: _ConvPlan,
        applied: list | None = None,
    ) -> np.ndarray:
        n = x.shape[0]
        m = plan.m
        wg = weight.gemm
        if plan.kind == "pointwise":
            y = self._pointwise(x, wg, plan, bias, y, packed=weight.packed(), applied=applied)
        elif plan.kind == "depthwise" and plan.compiled is not None and x.dtype == np.float32 and depthwise_loops():
            activation = self.activation if applied is not None else (0, 0.0, 0.0)
            y = self._depthwise_compiled(x, weight, plan, bias, y, activation)
            if activation[0]:
                applied.append(True)  # type: ignore[union-attr]
        elif plan.kind == "depthwise" and plan.depthwise_product:
            y = self._depthwise_product(x, weight.taps_in(plan.tap_order), plan, bias, y)
        elif plan.kind == "depthwise":
            y = self._depthwise_taps(x, wg, plan, bias, y)
        elif plan.grouped is None or (done := self._grouped(x, weight, bias, y, plan, applied)) is None:
            y = self._general(x, weight, bias, y, plan, applied)
        else:
            y = done
        return y.reshape(n, m, *plan.out)

    def _general(
        self,
        x: np.ndarray,
        weight: "_ConvWeight",
        bias: np.ndarray | None,
        y: np.ndarray | None,
        plan: _ConvPlan,
        applied: list | None,
    ) -> np.ndarray:
        """A Conv that is neither pointwise nor depthwise: Winograd, the compiled units'
        grid, or im2col and products."""
        if (done := self._winograd(x, weight, bias, y, plan)) is not None:
            return done
        if plan.grid is not None and available(x.dtype) and not self._gathers(x, plan):
            return plan.grid(x, weight, bias, self.relu, None if y is None else y.reshape(x.shape[0], plan.m, *plan.out))
        return self._im2col(x, weight.gemm, plan, bias, y, packed=weight.packed(), applied=applied)

    def _grouped(
        self,
        x: np.ndarray,
        weight: "_ConvWeight",
        bias: np.ndarray | None,
        y: np.ndarray | None,
        plan: _ConvPlan,
        applied: list | None,
    ) -> np.ndarray | None:
        """A 2-D float32 Conv of 2 to 16 channels a group in and out by the channel-blocked
        loops (``_numba_depthwise.blocked_depthwise``'s grouped sums: each block of 16
        channels holds its groups side by side, and an input channel of every group is one
        broadcast load a multiply-add of 16 outputs), as one job on the compiled pool. Its
        first call times them against :meth:`_general` and keeps the faster (the blocks
        copy the input padded, which a few wide groups on large planes may not repay).
        None where they cannot run: not float32, no numba or pool, a weight fed at run
        time, an empty output, or the general way chosen."""
        layout = plan.grouped
        assert layout is not None  # checked by the dispatch
        if layout.blocked_wins is False or x.dtype != np.float32 or plan.out_size == 0 or x.shape[0] == 0:
            return None
        loops = depthwise_loops()
        pool = compiled_pool()
        if loops is None or pool is None or (blocked := weight.blocked(loops)) is None:
            return None
        n, m = x.shape[0], plan.m
        y = np.empty((n, m, *plan.out), dtype=x.dtype) if y is None else y.reshape(n, m, *plan.out)
        if not x.flags.c_contiguous:
            x = _copy_to_workspace("depthwise-input", x)
        b = layout.no_bias if bias is None else bias.reshape(m)
        activation = self.activation if applied is not None else (0, 0.0, 0.0)

        def blocked_run() -> None:
            self._depthwise_blocked(loops, pool, x, False, blocked, b, layout, self.relu, activation, y)

        if layout.blocked_wins is None:  # the first call times both; each writes all of y, the general way last
            general_applied: list | None = None if applied is None else []

            def general_run() -> None:
                if general_applied is not None:
                    general_applied.clear()
                self._general(x, weight, bias, y, plan, general_applied)

            layout.blocked_wins = _faster(blocked_run, general_run)
            if not layout.blocked_wins:
                if applied is not None and general_applied:
                    applied.extend(general_applied)
                return y
        blocked_run()  # on the first call too: every call's output is the chosen way's, bitwise
        if activation[0]:
            applied.append(True)  # type: ignore[union-attr]
        return y

    def _winograd(
        self, x: np.ndarray, weight: "_ConvWeight", bias: np.ndarray | None, y: np.ndarray | None, plan: _ConvPlan
    ) -> np.ndarray | None:
        """The 3x3 float32 Conv by Winograd's F(4x4, 3x3) or F(2x2, 3x3) where it is planned
        and numba is there; None otherwise, or when ``x`` holds a NaN or an infinity (a tile would spread
        it over outputs the direct ways keep finite)."""
        if plan.winograd is None or x.dtype != np.float32 or winograd_loops() is None:
            return None
        return plan.winograd(x, weight, bias, self.relu, None if y is None else y.reshape(x.shape[0], plan.m, *plan.out))

    def _depthwise_compiled(
        self,
        x: np.ndarray,
        weight: "_ConvWeight",
        plan: _ConvPlan,
        bias: np.ndarray | None,
        y: np.ndarray | None,
        activation: tuple[int, float, float] = (0, 0.0, 0.0),
    ) -> np.ndarray:
        """2-D float32 depthwise by the compiled loops: the output planes shared out as one
        job on the compiled pool (``_numba_depthwise.depthwise_job``: no GIL, a hand-off of
        microseconds; where there is no pool, by ``parallel_for``), each thread with its
        own work array, the results written straight into ``y`` when it is given. On
        ``parallel_for`` two threads ran no faster than one (384 planes of 14 x 14, 7x7:
        0.35-0.38 ms either way): each chunk took the GIL to start."""
        loops = depthwise_loops()
        layout = plan.compiled
        assert loops is not None and layout is not None  # checked by the dispatch
        n = x.shape[0]
        m = plan.m
        given_y = y
        y = np.empty((n, m, *plan.out), dtype=x.dtype) if y is None else y.reshape(n, m, *plan.out)
        if n * m == 0 or plan.out_size == 0:
            return y
        weights = weight.gemm.reshape(m, -1)
        b = layout.no_bias if bias is None else bias.reshape(m)
        relu = self.relu
        code, low, high = activation
        pool = compiled_pool()
        ready = pool is not None and weights.flags.c_contiguous and b.flags.c_contiguous and y.flags.c_contiguous
        blocked = weight.blocked(loops) if ready and x.shape[1] == m and layout.blocked_wins is not False else None
        last = x.transpose(0, 2, 3, 1)  # a channels-last input (ConvNeXt's) the blocked loops read as it is
        channels_last = blocked is not None and not x.flags.c_contiguous and last.flags.c_contiguous
        if not x.flags.c_contiguous and not channels_last:
            x = np.ascontiguousarray(x) if given_y is None else _copy_to_workspace("depthwise-input", x)
        if blocked is not None:
            def planes_run() -> None:  # their planes from a C-contiguous copy of a channels-last input
                planes = x if x.flags.c_contiguous else _copy_to_workspace("depthwise-input", x)
                self._depthwise_planes(loops, pool, planes, weights, b, layout, plan, relu, activation, y)

            def blocked_run() -> None:
                self._depthwise_blocked(loops, pool, last if channels_last else x, channels_last, blocked, b, layout, relu,
                                        activation, y)

            if layout.blocked_wins is None:  # the first call times both; each writes all of y, the planes last
                layout.blocked_wins = _faster(blocked_run, planes_run)
                if layout.blocked_wins:  # every call's output is the chosen way's, bitwise
                    blocked_run()
            else:
                (blocked_run if layout.blocked_wins else planes_run)()
            return y
        if ready:
            self._depthwise_planes(loops, pool, x, weights, b, layout, plan, relu, activation, y)
            return y

        def chunk(start: int, stop: int) -> None:
            work, _ = _workspace("depthwise-compiled", (layout.work_size,), x.dtype)
            loops.depthwise_conv2d(x, weights, b, layout.layout, layout.masks, relu, code, low, high, work, y, start, stop)

        parallel_for(n * m, chunk, layout.work, grain=_DEPTHWISE_COMPILED_GRAIN)
        return y

    @staticmethod
    def _depthwise_blocked(
        loops: ModuleType, pool: Any, x: np.ndarray, channels_last: bool, blocked: np.ndarray, b: np.ndarray,
        layout: "_DepthwiseLayout", relu: bool, activation: tuple[int, float, float], y: np.ndarray,
    ) -> None:
        """The channel-blocked loops as one job on the compiled pool: a unit per (image,
        block of 16 channels). ``x`` is C-contiguous, (n, M, H, W), or (n, H, W, M) when
        ``channels_last``."""
        n = x.shape[0]
        m, height, width = (x.shape[3], x.shape[1], x.shape[2]) if channels_last else x.shape[1:]
        blocks = blocked.shape[0]
        code, low, high = activation
        per_group = int(layout.geometry[9])
        if per_group > 1:  # the bias in the blocks' lane order (lanes past M are never written)
            if layout.bias_lanes is None:
                lanes = (np.arange(blocks)[:, None] * _LANES + loops.lane_channels(per_group)).reshape(-1)
                layout.bias_lanes = np.minimum(lanes, m - 1)
            padded, _ = _workspace("depthwise-blocked-bias", (blocks * _LANES,), np.dtype(np.float32))
            np.take(b, layout.bias_lanes, out=padded)
            b = padded
        elif m % _LANES:  # the bias padded to whole blocks (zeros past M)
            padded, _ = _workspace("depthwise-blocked-bias", (blocks * _LANES,), np.dtype(np.float32))
            padded[m:] = 0.0
            padded[:m] = b
            b = padded
        units = n * blocks
        threads = min(units, _depthwise_threads(layout.work))
        slots = pool.slots(units, threads)
        work, _ = _workspace("depthwise-blocked", (slots * layout.blocked_floats,), np.dtype(np.float32))
        # the context kept on the layout (see ``_DepthwiseLayout.contexts``): a call sets the
        # input's, bias's, work arrays' and output's addresses
        key = ("blocked", threading.get_ident(), threads, n, channels_last, relu, activation)
        kept = layout.contexts.get(key)
        if kept is None or kept[2] is not blocked:
            context = np.array(
                [
                    0, n, m, height, width, blocked.ctypes.data, blocks, blocked.shape[1], 0,
                    (layout.geometry_last if channels_last else layout.geometry).ctypes.data, int(relu), code,
                    int(np.float32(low).view(np.uint32)), int(np.float32(high).view(np.uint32)), 0, layout.blocked_floats, 0,
                    y.shape[2], y.shape[3],
                ],
                np.int64,
            )
            kept = layout.contexts[key] = (context, int(context.ctypes.data), blocked)
        loops.job_addresses(kept[0], loops.BLOCKED_X, x, loops.BLOCKED_BIAS, b, loops.BLOCKED_WORK, work, loops.BLOCKED_Y, y)
        pool.run(loops.blocked_job.address, kept[1], units, threads)

    @staticmethod
    def _depthwise_planes(
        loops: ModuleType, pool: Any, x: np.ndarray, weights: np.ndarray, b: np.ndarray, layout: "_DepthwiseLayout",
        plan: "_ConvPlan", relu: bool, activation: tuple[int, float, float], y: np.ndarray,
    ) -> None:
        """The plane-by-plane loops as one job on the compiled pool."""
        n, m = x.shape[0], plan.m
        code, low, high = activation
        planes = n * m
        threads = _depthwise_threads(layout.work)
        # units of several planes, a few a thread, so that a thread that finishes first takes over
        per_unit = max(1, planes // (threads * _DEPTHWISE_UNITS_PER_THREAD)) if threads > 1 else planes
        units = -(-planes // per_unit)
        slots = pool.slots(units, threads)
        work, _ = _workspace("depthwise-job", (slots * layout.work_size,), np.dtype(np.float32))
        owner = weights if weights.base is None else weights.base  # the weight's array, the same every call
        key = ("planes", threading.get_ident(), threads, n, relu, activation)
        kept = layout.contexts.get(key)
        if kept is None or kept[2] is not owner:
            context = np.array(
                [
                    0, n, x.shape[1], x.shape[2], x.shape[3], weights.ctypes.data, m, weights.shape[1],
                    0, layout.layout.ctypes.data, layout.layout.shape[0], layout.masks.ctypes.data,
                    layout.masks.shape[0], layout.masks.shape[1], int(relu), code,
                    int(np.float32(low).view(np.uint32)), int(np.float32(high).view(np.uint32)),
                    0, layout.work_size, 0, plan.out[0], plan.out[1], per_unit, planes,
                ],
                np.int64,
            )
            kept = layout.contexts[key] = (context, int(context.ctypes.data), owner)
        loops.job_addresses(kept[0], loops.JOB_X, x, loops.JOB_BIAS, b, loops.JOB_WORK, work, loops.JOB_Y, y)
        pool.run(loops.depthwise_job.address, kept[1], units, threads)

    def _depthwise_product(
        self, x: np.ndarray, wg: np.ndarray, plan: _ConvPlan, bias: np.ndarray | None, y: np.ndarray | None = None
    ) -> np.ndarray:
        """Depthwise (one input channel per group) as a batched product per group:
        the taps gathered from stride-phase planes into columns (group, taps, grid),
        then weights (group, multiplier, taps) @ columns, cropped from the grid.

        Every tap is one contiguous copy per group, and the products run in BLAS, which
        beats a multiply-add pass per tap. Groups go in blocks that stay in cache, spread
        over the cores by ``parallel_for``; the work arrays are this thread's workspaces,
        so the ``into`` variant (``y`` given) allocates nothing once they have grown.
        """
        n, g = x.shape[:2]
        mult = wg.shape[1]
        into = y is not None
        if y is None:
            y = np.empty((n, g * mult, plan.out_size), dtype=x.dtype)
        y = y.reshape(n, g * mult, plan.out_size)
        if n * g == 0 or plan.out_size == 0:
            y.fill(0)
            return y
        blas_threads(0)  # one product per group is far too small for BLAS threads
        block = plan.depthwise_block
        out_rank = len(plan.out)
        bias_rows = None if bias is None else bias.reshape(g, mult, *([1] * out_rank))
        for image in range(n):
            xi = x[image]
            yi = y[image].reshape(g, mult, *plan.out)

            def blocks(start: int, stop: int, xi: np.ndarray = xi, yi: np.ndarray = yi) -> None:
                for g0 in range(start, stop, block):
                    g1 = min(stop, g0 + block)
                    if into:
                        with_small_buffers(self._depthwise_block, xi, wg, plan, bias_rows, yi, g0, g1)
                    else:
                        self._depthwise_block(xi, wg, plan, bias_rows, yi, g0, g1)

            parallel_for(g, blocks, plan.depthwise_work, grain=block)
        return y

    def _depthwise_block(
        self,
        xi: np.ndarray,
        wg: np.ndarray,
        plan: _ConvPlan,
        bias_rows: np.ndarray | None,
        yi: np.ndarray,
        g0: int,
        g1: int,
    ) -> None:
        """Groups [g0, g1) of one image, into ``yi`` (group, multiplier, *out); ``wg``
        holds the taps in column order (plan.tap_order)."""
        count = g1 - g0
        phases = len(plan.phase_grids)
        planes, stale = _workspace(
            "depthwise-planes", (phases, count, *plan.product_plane_shape), xi.dtype, plan.product_layout
        )
        if stale:  # the padding around each plane's filled region must read as zero
            planes.fill(0)
        flat = planes.reshape(phases, count, -1)
        if plan.wrap_zeros is not None:
            inside = flat[0, :, plan.front : plan.front + plan.product_grid]
            np.copyto(inside.reshape(count, *plan.out), xi[g0:g1])
        else:
            for k, (dst, src) in enumerate(plan.phase_fill.values()):
                planes[k][dst] = xi[(slice(g0, g1),) + src[1:]]
        length = plan.product_grid
        cols, _ = _workspace("depthwise-cols", (count, len(plan.depthwise_taps), length), xi.dtype)
        item = xi.dtype.itemsize
        column = 0
        for k, (counts, steps, start) in enumerate(plan.phase_grids):
            taps = math.prod(counts)
            plane = flat[k, :, start:]
            windows = np.lib.stride_tricks.as_strided(
                plane,
                shape=(count, *counts, length),
                strides=(plane.strides[0], *(step * item for step in steps), item),
                writeable=False,
            )
            np.copyto(cols[:, column : column + taps].reshape(count, *counts, length), windows)
            column += taps
        target = yi[g0:g1]
        if plan.wrap_zeros is not None:
            by_tap = cols.reshape(count, *plan.kernel, *plan.out)
            for region in plan.wrap_zeros:
                by_tap[region] = 0
            np.matmul(wg[g0:g1], cols, out=target.reshape(count, wg.shape[1], length))
            if bias_rows is not None:
                target += bias_rows[g0:g1]
        else:
            grid, _ = _workspace("depthwise-grid", (count, wg.shape[1], length), xi.dtype)
            np.matmul(wg[g0:g1], cols, out=grid)
            cropped = grid.reshape(count, wg.shape[1], plan.out[0], *plan.product_plane_shape[1:])[plan.product_crop]
            if bias_rows is None:
                np.copyto(target, cropped)
            else:
                np.add(cropped, bias_rows[g0:g1], out=target)
        if self.relu:
            relu_into(target, target)

    def _depthwise_taps(
        self, x: np.ndarray, wg: np.ndarray, plan: _ConvPlan, bias: np.ndarray | None, y: np.ndarray | None = None
    ) -> np.ndarray:
        """Per (image, channel) row: the sum over taps of weight * shifted phase plane.

        With more rows than grid positions the planes are laid out channels-last, so that
        every elementwise step runs along the long axis. With ``y`` (the ``into`` variant)
        the planes and sums are work arrays of ``y`` and the elementwise steps run with
        small ufunc buffers; the arithmetic is the same.
        """
        n, g = x.shape[:2]
        mult = wg.shape[1]
        rows = n * g
        if rows == 0 or plan.out_size == 0:
            if y is not None:
                y.fill(0)
                return y.reshape(n, g * mult, plan.out_size)
            return np.zeros((n, g * mult, plan.out_size), dtype=x.dtype)
        into = y is not None
        if into:
            anchor = y

            def allocate(slot: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
                return scratch(anchor, ("depthwise", slot), shape, dtype)

            def elementwise(fn: Callable[..., Any], *args: Any) -> Any:
                return with_small_buffers(fn, *args)

        else:
            allocate, elementwise = _fresh, _call
        xr = x.reshape(rows, *x.shape[2:])
        taps = wg.shape[2]
        weights = np.broadcast_to(wg, (n, g, mult, taps))
        if into:  # what the reshape below copies, in a work array
            weights = _copied(allocate("weights", weights.shape, wg.dtype), weights)
        weights = weights.reshape(rows, mult, taps)
        biases = None
        if bias is not None:
            biases = np.broadcast_to(bias.reshape(g, mult), (n, g, mult))
            if into:
                biases = _copied(allocate("biases", biases.shape, bias.dtype), biases)
            biases = biases.reshape(rows, mult)
        length = plan.plane_grid
        channels_last = rows * 8 >= length  # measured: channels-last wins unless the planes are much longer
        planes = {}
        for phase, (dst, src) in plan.phase_fill.items():
            shape = (*plan.plane_shape, rows) if channels_last else (rows, *plan.plane_shape)
            buf = _zeroed(allocate(("plane", phase), shape, x.dtype)) if into else np.zeros(shape, dtype=x.dtype)
            if channels_last:
                buf[dst[1:]] = np.moveaxis(xr[src], 0, -1)
                planes[phase] = buf.reshape(-1, rows)
            else:
                buf[dst] = xr[src]
                planes[phase] = buf.reshape(rows, -1)
        y = np.empty((n, g, mult, *plan.out), dtype=x.dtype) if y is None else y.reshape(n, g, mult, *plan.out)
        yr = y.reshape(rows, mult, *plan.out)
        grid_shape = (plan.out[0], *plan.plane_shape[1:])
        for j in range(mult):
            if channels_last:
                wj = weights[:, j].T  # (K, rows)
                wj = np.ascontiguousarray(wj) if not into else _copied(allocate(("wj", j), wj.shape, wj.dtype), wj)
                if plan.tap_grid_steps is not None:
                    acc_out = allocate("acc", (length, rows), x.dtype) if into else None
                    acc = self._grid_taps_sum(planes[next(iter(planes))], wj, plan, length, rows, acc_out)
                else:
                    acc = elementwise(
                        self._taps_sum, planes, plan, lambda p, off: p[off : off + length], lambda i, wj=wj: wj[i],
                        length, rows, False, allocate,
                    )
                if biases is not None:
                    elementwise(np.add, acc, biases[:, j], acc)
            else:
                wj = weights[:, j]  # (rows, K)
                acc = elementwise(
                    self._taps_sum,
                    planes, plan, lambda p, off: p[:, off : off + length], lambda i, wj=wj: wj[:, i, None], rows, length, True,
                    allocate,
                )
                if biases is not None:
                    elementwise(np.add, acc, biases[:, j, None], acc)
            if self.relu:
                relu_into(acc, acc)
            if channels_last:
                yr[:, j] = np.moveaxis(acc.reshape(*grid_shape, rows)[plan.crop[1:]], -1, 0)
            else:
                yr[:, j] = acc.reshape(rows, *grid_shape)[plan.crop]
        return y.reshape(n, g * mult, plan.out_size)

    @staticmethod
    def _grid_taps_sum(
        plane: np.ndarray, weights: np.ndarray, plan: _ConvPlan, length: int, rows: int, out: np.ndarray | None = None
    ) -> np.ndarray:
        """All taps at once: one einsum over a strided (position, *kernel, channel) view of a
        channels-last plane, against weights (K, rows)."""
        rank = len(plan.kernel)
        item = plane.itemsize
        assert plan.tap_grid_steps is not None  # called only for unit strides, where they are set
        windows = np.lib.stride_tricks.as_strided(
            plane,
            shape=(length, *plan.kernel, rows),
            strides=(rows * item, *(step * rows * item for step in plan.tap_grid_steps), item),
            writeable=False,
        )
        taps = list(range(1, rank + 1))
        channel = rank + 1
        kernel = weights.reshape(*plan.kernel, rows)
        return np.einsum(windows, [0, *taps, channel], kernel, [*taps, channel], [0, channel], out=out)

    @staticmethod
    def _taps_sum(
        planes, plan, window, weight, outer: int, inner: int, weight_per_outer: bool, allocate=None
    ) -> np.ndarray:
        """Sum over the depthwise taps of weight(tap) * window(plane, offset), an (outer, inner)
        array, in blocks of the outer axis that stay in cache."""
        allocate = allocate or _fresh
        dtype = next(iter(planes.values())).dtype
        acc = allocate("acc", (outer, inner), dtype)
        block = max(1, (64 << 10) // max(1, inner))
        tmp = allocate("tmp", (min(block, outer), inner), dtype)
        for o0 in range(0, outer, block):
            o1 = min(outer, o0 + block)
            a, t = acc[o0:o1], tmp[: o1 - o0]
            for k, (index, phase, offset) in enumerate(plan.depthwise_taps):
                src = window(planes[phase], offset)[o0:o1]
                w = weight(index)[o0:o1] if weight_per_outer else weight(index)
                if k == 0:
                    np.multiply(src, w, out=a)
                else:
                    np.multiply(src, w, out=t)
                    a += t
        return acc

    def _pointwise(
        self,
        x: np.ndarray,
        wg: np.ndarray,
        plan: _ConvPlan,
        bias: np.ndarray | None,
        y: np.ndarray | None = None,
        residual: np.ndarray | None = None,
        relu: bool | None = None,
        packed: np.ndarray | None = None,
        applied: list | None = None,
    ) -> np.ndarray:
        """A 1x1 Conv: the input's channels are the columns (strided inputs copied once).
        With ``residual`` (shaped like the output, not overlapping ``y``) each output
        block adds its share of it before the bias and the Relu, while it is in cache.
        ``relu`` overrides the node's fused Relu (a residual Conv clamps the sum)."""
        n, c = x.shape[:2]
        xs = x[plan.src] if plan.copy_input else x
        if not xs.flags.c_contiguous:
            xs = np.ascontiguousarray(xs) if y is None else _copy_to_workspace("pointwise", xs)
        y = np.empty((n, plan.m, plan.out_size), x.dtype) if y is None else y.reshape(n, plan.m, plan.out_size)
        columns = xs.reshape(n, c, plan.out_size)
        cg, rest = c // self.group, plan.rest
        relu = self.relu if relu is None else relu
        found = self._compiled_units(x, wg, bias, y, residual)
        if found is not None:
            size = plan.out_size
            threads = _compiled_threads(n * plan.m * size * wg.shape[2])
            activation = self.activation if applied is not None else (0, 0.0, 0.0)
            run_units(
                found, plan, n, self.group, wg, packed, bias, y, residual, relu, columns, c * size, cg * size, threads,
                activation=activation,
            )
            if activation[0]:
                applied.append(True)  # type: ignore[union-attr]
            return y

        def block(image: int, group: int, r0: int, r1: int) -> np.ndarray:
            return columns[image, group * cg : (group + 1) * cg, r0 * rest : r1 * rest]

        self._products(plan, n, block, wg, bias, y, None if residual is None else residual.reshape(y.shape), relu)
        return y

    def _im2col(
        self,
        x: np.ndarray,
        wg: np.ndarray,
        plan: _ConvPlan,
        bias: np.ndarray | None,
        y: np.ndarray | None = None,
        packed: np.ndarray | None = None,
        residual: np.ndarray | None = None,
        relu: bool | None = None,
        found: Any = None,
        applied: list | None = None,
    ) -> np.ndarray:
        """im2col block by block: the input copied into zero-padded stride-phase planes once
        (in this thread's workspace, its zeros written once per layout), then each block's
        columns gathered from them, one strided copy per phase (see ``_plan_columns``), into
        the workspace of the thread that runs its products. A 2-D float32 Conv takes the
        compiled units instead where numba is there: each gathers its block's columns
        straight from the input (``conv_units``). ``residual`` (float32, C order, the
        output's shape, apart from ``y``) and ``relu`` only with ``found``, the compiled
        units' parts: each tile adds its share of it, then clamps when ``relu``."""
        n, c = x.shape[:2]
        y = np.empty((n, plan.m, plan.out_size), dtype=x.dtype) if y is None else y.reshape(n, plan.m, plan.out_size)
        if y.size == 0:
            return y
        cg = c // self.group
        if found is None and plan.gather is not None:
            found = self._compiled_units(x, wg, bias, y, None)
        if found is not None:
            if not x.flags.c_contiguous:
                x = _copy_to_workspace("im2col-input", x)
            size = math.prod(x.shape[2:])
            threads = _compiled_threads(n * plan.m * plan.out_size * wg.shape[2])
            activation = self.activation if applied is not None else (0, 0.0, 0.0)
            run_units(found, plan, n, self.group, wg, packed, bias, y, residual, self.relu if relu is None else relu,
                      x, c * size, cg * size, threads, plan.gather, activation=activation)
            if activation[0]:
                applied.append(True)  # type: ignore[union-attr]
            return y
        assert residual is None, "a residual is added by the compiled units only"
        phases = len(plan.phase_windows)
        planes, stale = _workspace("im2col-planes", (n, phases, c, plan.plane_size), x.dtype, plan.planes_layout)
        if stale:
            planes.fill(0)  # the padding: only the regions below are ever written
        shaped = planes.reshape(n, phases, c, *plan.plane_shape)
        for dst, src in plan.plane_fills:
            shaped[dst] = x[src]
        key = (planes.__array_interface__["data"][0], n, x.dtype)
        made = plan.windows  # read once: another thread may replace it
        if made is None or made[0] != key:
            made = plan.windows = (key, self._windows(plan, planes))
        windows = made[1]
        depth = cg * math.prod(plan.kernel)
        kernel_axes = (slice(None),) * len(plan.kernel)
        # every block asks for the room of the largest, so that a thread's workspace grows
        # once, whichever blocks it is handed
        room = depth * -(-plan.out[0] // plan.fitting_blocks) * plan.rest

        def block(image: int, group: int, r0: int, r1: int) -> np.ndarray:
            flat, _ = _workspace("im2col", (room,), x.dtype)
            cols = flat[: depth * (r1 - r0) * plan.rest].reshape(cg, *plan.kernel, r1 - r0, *plan.out[1:])
            channels = (image, slice(group * cg, (group + 1) * cg))
            for taps, window in windows:
                np.copyto(cols[taps], window[channels + kernel_axes + (slice(r0, r1),)])
            return cols.reshape(depth, -1)

        self._products(plan, n, block, wg, bias, y)
        return y

    @staticmethod
    def _gathers(x: np.ndarray, plan: _ConvPlan) -> bool:
        """Whether the compiled units take this im2col Conv (2-D float32, numba there):
        they gather from the input on every thread, measured faster on two threads than
        the tap grid (ResNet's 128 -> 128 3x3/2 at 56x56: 2.02 against 2.21 ms)."""
        return plan.gather is not None and x.dtype == _F32 and compiled_units() is not None

    @staticmethod
    def _compiled_units(
        x: np.ndarray, wg: np.ndarray, bias: np.ndarray | None, y: np.ndarray, residual: np.ndarray | None
    ) -> Any:
        """The compiled units' parts (``conv_units.compiled_units``) where they take this
        call: float32 throughout, C-order arrays; else None (the Python units run)."""
        if x.dtype != _F32 or wg.dtype != _F32 or not wg.flags.c_contiguous or not y.flags.c_contiguous:
            return None
        if bias is not None and (bias.dtype != _F32 or not bias.flags.c_contiguous):
            return None
        if residual is not None and (residual.dtype != _F32 or not residual.flags.c_contiguous):
            return None
        return compiled_units()

    @staticmethod
    def _windows(plan: _ConvPlan, planes: np.ndarray) -> list[tuple[tuple[slice, ...], np.ndarray]]:
        """Per phase: the columns its taps fill, and a read-only view (n, C, *tap counts,
        *out) of ``planes`` (n, phases, C, plane size) holding what they read. Made once per
        planes buffer and kept in the plan: a replay makes no views but the blocks'."""
        item = planes.itemsize
        windows = []
        for k, (columns, counts, steps, start) in enumerate(plan.phase_windows):
            base = planes[:, k, :, start:]
            shape = (*base.shape[:2], *counts, *plan.out)
            strides = (*base.strides[:2], *(st * item for st in steps), *(ps * item for ps in plan.plane_strides))
            window = np.lib.stride_tricks.as_strided(base, shape=shape, strides=strides, writeable=False)
            windows.append((columns, window))
        return windows

    def _products(
        self,
        plan: _ConvPlan,
        n: int,
        columns: Callable[[int, int, int, int], np.ndarray],
        wg: np.ndarray,
        bias: np.ndarray | None,
        y: np.ndarray,
        residual: np.ndarray | None = None,
        relu: bool | None = None,
    ) -> None:
        """``y[i, group j's channels, block] = wg[j] @ columns(i, j, r0, r1) + bias`` (plus
        the same block of ``residual``, shaped like ``y``, when given), then the fused
        Relu (or ``relu`` where given), for every image ``i``, group ``j`` and block ``[r0, r1)`` of output
        rows (``plan.block_count``). Each such unit runs on one thread, from gathering its
        columns (into that thread's workspace) to clamping its output while it is still in
        cache; ``parallel_for`` shares the units out, one chunk each. A lone unit splits its
        product over the threads instead (``split_gemm``), then adds the bias and clamps the
        whole output at once (measured faster than doing so in each of split_gemm's blocks
        on SqueezeNet's small 1x1 Conv, 64-1000 outputs on 13x13, by 20-90 us on two
        threads: four blocks' calls in turn at the GIL against two calls)."""
        if y.size == 0:
            return
        g = self.group
        mg = plan.m // g
        work = n * plan.m * plan.out_size * wg.shape[2]
        threads = split_threads(work)
        blocks = plan.block_count(n * g, threads)
        count = n * g * blocks
        rows, rest = plan.out[0], plan.rest
        relu = self.relu if relu is None else relu
        whole = slice(None)
        if count == 1:
            split_gemm(wg[0], columns(0, 0, 0, rows), y[0])
            epilogue(y[0], whole, whole, bias, relu, None if residual is None else residual[0])
            return

        def units(start: int, stop: int) -> None:
            for unit in range(start, stop):
                image, within = divmod(unit, g * blocks)
                j, k = divmod(within, blocks)
                r0, r1 = k * rows // blocks, (k + 1) * rows // blocks
                channels = slice(j * mg, (j + 1) * mg)
                positions = slice(r0 * rest, r1 * rest)
                gemm(wg[j], columns(image, j, r0, r1), y[image, channels, positions])
                epilogue(
                    y[image],
                    channels,
                    positions,
                    None if bias is None else bias[channels],
                    relu,
                    None if residual is None else residual[image],
                )

        parallel_for(count, units, work, threads=threads, chunks_per_thread=count)


@kernel_builder("Conv", 1, compiled=CONV_LOOPS)
def conv(ctx: KernelContext) -> Callable[..., np.ndarray]:
    """Conv: im2col in cache-sized blocks and one GEMM per block (per group batch)."""
    return build_conv(ctx)


class ConvConstants:
    """A Conv node's weight and bias in the form and dtype of the arithmetic: prepared once
    at build when the weight is constant (one prepared weight for every session of a
    WeightStore, keyed on all that shapes it), else at each call."""

    def __init__(self, ctx: KernelContext, op: "_Convolution") -> None:
        self.op = op
        self.w_const = ctx.constant_inputs[1] if len(ctx.constant_inputs) > 1 else None
        b_const = ctx.constant_inputs[2] if len(ctx.constant_inputs) > 2 else None
        self.b_const = b_const
        self.weight: _ConvWeight | None = None
        self.bias: np.ndarray | None = None
        w_const = self.w_const
        if w_const is not None:
            dtype = _compute_dtype(w_const.dtype)
            how = ("Conv.W", repr(sorted(ctx.attributes.items())), dtype.str)
            self.weight = shared_transform(w_const, how, lambda: op.prepare_weight(w_const, dtype))
            self.weight.constant = True
            self.bias = op.prepare_bias(b_const, dtype) if b_const is not None else None

    def __call__(
        self, x_dtype: np.dtype, w: np.ndarray, b: np.ndarray | None
    ) -> tuple[np.dtype, "_ConvWeight", np.ndarray | None]:
        """The compute dtype for input ``x_dtype``, the prepared weight and the bias."""
        dtype = _compute_dtype(x_dtype)
        if self.weight is not None:
            return dtype, self.weight, self.bias if self.b_const is not None else self.op.prepare_bias(b, dtype)
        return dtype, self.op.prepare_weight(w, dtype), self.op.prepare_bias(b, dtype)


def build_conv(
    ctx: KernelContext, relu: bool = False, activation: Callable[[np.ndarray, Any], None] | None = None
) -> Callable[..., np.ndarray]:
    """The Conv kernel for ``ctx``; with ``relu`` it also applies a Relu block by block
    (for a fused Conv + Relu node: the output is clamped while still in cache); with
    ``activation`` (``conv_activation.activation_in_place``) it applies that to the whole
    output in place, in the compute dtype, before any cast back."""
    op = _Convolution(ctx.attributes, relu)
    op.activation = getattr(activation, "fused", (0, 0.0, 0.0))  # what the compiled paths apply block by block
    constants = ConvConstants(ctx, op)

    def run(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        dtype, weight, bias = constants(x.dtype, w, b)
        applied: list = []
        y = op(x.astype(dtype, copy=False), weight, bias, applied=applied)
        if activation is not None and not applied:
            activation(y, None)
        return y.astype(x.dtype, copy=False)

    def run_into(out: np.ndarray, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> None:
        dtype, weight, bias = constants(x.dtype, w, b)
        x = _cast_into_scratch(out, "x", x, dtype)
        y = out if out.dtype == dtype and out.flags.c_contiguous else scratch(out, "y", out.shape, dtype)
        applied: list = []
        op(x, weight, bias, y, applied=applied)
        if activation is not None and not applied:
            activation(y, out)
        if y is not out:
            np.copyto(out, y, casting="unsafe")

    declare_into(run_into, run)
    return run


@kernel("CausalConvWithState", 27, multi_output=True)
def causal_conv_with_state(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None = None,
    past_state: np.ndarray | None = None,
    *,
    activation: str = "none",
) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal 1-D convolution carrying the last k-1 inputs as state."""
    if activation not in ("none", "silu", "swish"):
        raise NotImplementedError(f"CausalConvWithState: activation={activation!r} is not one of none, silu, swish")
    if x.ndim != 3 or w.ndim != 3 or w.shape[1] != 1:
        raise ValueError(f"CausalConvWithState expects input (B, C, L) and weight (C, 1, k), got {x.shape} and {w.shape}")
    batch, channels, length = x.shape
    k = w.shape[2]
    if past_state is None:
        past_state = np.zeros((batch, channels, k - 1), dtype=x.dtype)
    padded = np.concatenate([past_state.astype(x.dtype, copy=False), x], axis=2)
    dtype = _compute_dtype(x.dtype)
    xp = padded.astype(dtype, copy=False)
    wk = w.astype(dtype, copy=False)[:, 0, :, None]  # (C, k, 1)
    y = xp[:, :, 0:length] * wk[:, 0]
    for j in range(1, k):
        y += xp[:, :, j : j + length] * wk[:, j]
    if b is not None:
        y += b.astype(dtype, copy=False)[:, None]
    if activation != "none":
        with np.errstate(over="ignore"):  # exp(-y) overflows to inf for very negative y: silu -> 0
            y *= 1.0 / (1.0 + np.exp(-y))
    return y.astype(x.dtype, copy=False), padded[:, :, length:]


# ---------------------------------------------------------------------------
# ConvTranspose and Col2Im: a GEMM to columns, then scatter-add the columns
# ---------------------------------------------------------------------------


def _scatter_taps(
    image: Sequence[int],
    blocks: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    pads_begin: Sequence[int],
) -> list[_Tap]:
    """Taps for adding columns (N, C, K, *blocks) into images (N, C, *image), the adjoint of
    im2col: block position ``i`` of tap ``t`` lands on image position
    ``i * stride + t * dilation - pad``, the im2col ranges with image and blocks swapped
    (``tap.src`` slices the image, ``tap.dst`` the blocks)."""
    taps = _taps(image, kernel, strides, dilations, pads_begin, [0] * len(blocks), blocks)
    return [t for t in taps if not t.empty]


def _scatter_columns(cols: np.ndarray, out: np.ndarray, taps: list[_Tap]) -> None:
    lead = (slice(None), slice(None))
    for tap in taps:
        out[lead + tap.src] += cols[lead + (tap.index,) + tap.dst]


class _ConvTransposePlan:
    def __init__(self, op: "_ConvTransposition", x_shape: tuple[int, ...], w_shape: tuple[int, ...]):
        spatial = list(x_shape[2:])
        rank = len(spatial)
        kernel = list(w_shape[2:])
        strides = _ints(op.strides, rank, 1)
        dilations = _ints(op.dilations, rank, 1)
        out_pad = _ints(op.output_padding, rank, 0)
        pb, pe = _pads(op.pads, rank)
        full = [
            strides[i] * (spatial[i] - 1) + out_pad[i] + (kernel[i] - 1) * dilations[i] + 1 for i in range(rank)
        ]
        if op.output_shape is not None and len(op.output_shape):
            out = [int(v) for v in op.output_shape][-rank:]
        elif op.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out = [spatial[i] * strides[i] for i in range(rank)]
        else:
            out = None
        if out is not None:
            # The spec puts the extra odd padding at the end for SAME_UPPER, at the start otherwise.
            pb = []
            for i in range(rank):
                total = full[i] - out[i]
                pb.append(total // 2 if op.auto_pad == "SAME_UPPER" else total - total // 2)
        else:
            out = [full[i] - pb[i] - pe[i] for i in range(rank)]
        self.out = out
        self.kernel = kernel
        self.taps = _scatter_taps(out, spatial, kernel, strides, dilations, pb)


class _ConvTransposition:
    def __init__(self, attributes: dict[str, Any]):
        self.auto_pad = _auto_pad(attributes.get("auto_pad"))
        self.dilations = attributes.get("dilations")
        self.group = int(attributes.get("group", 1))
        self.output_padding = attributes.get("output_padding")
        self.output_shape = attributes.get("output_shape")
        self.pads = attributes.get("pads")
        self.strides = attributes.get("strides")
        self._plans = _ShapeCache(lambda xs, ws: _ConvTransposePlan(self, xs, ws))

    def prepare_weight(self, w: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, tuple[int, ...]]:
        """W (C, M/group, *k) as (group, M/group * K, C/group): the GEMM's left operand."""
        g = self.group
        c = w.shape[0]
        wt = w.reshape(g, c // g, -1).transpose(0, 2, 1)
        return np.ascontiguousarray(wt, dtype=dtype), w.shape

    def __call__(self, x: np.ndarray, wt: np.ndarray, w_shape: tuple[int, ...], b: np.ndarray | None) -> np.ndarray:
        n, c = x.shape[:2]
        if c != w_shape[0] or c % self.group:
            raise ValueError(f"ConvTranspose: input {x.shape} and weight {w_shape} do not match group={self.group}")
        plan: _ConvTransposePlan = self._plans(x.shape, w_shape)
        g = self.group
        m = w_shape[1] * g
        ksize = math.prod(plan.kernel)
        in_size = math.prod(x.shape[2:])
        if g == 1:
            cols = np.matmul(wt[0], x.reshape(n, c, in_size))
        else:
            cols = np.matmul(wt, x.reshape(n, g, c // g, in_size))
        cols = cols.reshape(n, m, ksize, *x.shape[2:])
        y = np.zeros((n, m, *plan.out), dtype=x.dtype)
        _scatter_columns(cols, y, plan.taps)
        if b is not None:
            y += b.astype(x.dtype, copy=False).reshape(m, *([1] * len(plan.out)))
        return y


@kernel_builder("ConvTranspose", 1)
def conv_transpose(ctx: KernelContext) -> Callable[..., np.ndarray]:
    """ConvTranspose: one GEMM from input channels to columns, then a scatter-add per tap."""
    op = _ConvTransposition(ctx.attributes)
    w_const = ctx.constant_inputs[1] if len(ctx.constant_inputs) > 1 else None
    if w_const is not None:
        w_prepared = op.prepare_weight(w_const, _compute_dtype(w_const.dtype))

    def run(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        dtype = _compute_dtype(x.dtype)
        wt, w_shape = w_prepared if w_const is not None else op.prepare_weight(w, dtype)
        y = op(x.astype(dtype, copy=False), wt, w_shape, b)
        return y.astype(x.dtype, copy=False)

    return run


@kernel("Col2Im", 18)
def col2im(
    x: np.ndarray,
    image_shape: np.ndarray,
    block_shape: np.ndarray,
    *,
    dilations: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> np.ndarray:
    """Col2Im: sum the sliding blocks (N, C*K, L) back into images (N, C, *image_shape)."""
    image = [int(v) for v in np.asarray(image_shape).reshape(-1)]
    kernel = [int(v) for v in np.asarray(block_shape).reshape(-1)]
    rank = len(image)
    if len(kernel) != rank:
        raise ValueError(f"Col2Im: image_shape {image} and block_shape {kernel} differ in rank")
    stride_list = _ints(strides, rank, 1)
    dilation_list = _ints(dilations, rank, 1)
    pb, pe = _pads(pads, rank)
    blocks, _, _ = _window_geometry(image, kernel, stride_list, dilation_list, pb, pe, "NOTSET")
    n, ck, length = x.shape
    ksize = math.prod(kernel)
    if ck % ksize or length != math.prod(blocks):
        raise ValueError(
            f"Col2Im: input {x.shape} does not hold C*{ksize} rows of {math.prod(blocks)} blocks {blocks}"
        )
    c = ck // ksize
    dtype = _compute_dtype(x.dtype)
    cols = x.astype(dtype, copy=False).reshape(n, c, ksize, *blocks)
    y = np.zeros((n, c, *image), dtype=dtype)
    _scatter_columns(cols, y, _scatter_taps(image, blocks, kernel, stride_list, dilation_list, pb))
    return y.astype(x.dtype, copy=False)


@kernel("DeformConv", 19)
def deform_conv(
    x: np.ndarray,
    w: np.ndarray,
    offset: np.ndarray,
    b: np.ndarray | None = None,
    mask: np.ndarray | None = None,
    *,
    dilations: Sequence[int] | None = None,
    group: int = 1,
    kernel_shape: Sequence[int] | None = None,
    offset_group: int = 1,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> np.ndarray:
    """DeformConv: sample every tap at its offset position (multilinear, zero outside), then GEMM."""
    n, c = x.shape[:2]
    spatial = list(x.shape[2:])
    rank = len(spatial)
    kernel = list(w.shape[2:])
    m = w.shape[0]
    if c != w.shape[1] * group or m % group or c % offset_group:
        raise ValueError(f"DeformConv: input {x.shape}, weight {w.shape}, group={group}, offset_group={offset_group}")
    stride_list = _ints(strides, rank, 1)
    dilation_list = _ints(dilations, rank, 1)
    pb, pe = _pads(pads, rank)
    out, _, _ = _window_geometry(spatial, kernel, stride_list, dilation_list, pb, pe, "NOTSET")
    ksize = math.prod(kernel)
    size = math.prod(out)
    if tuple(offset.shape) != (n, offset_group * ksize * rank, *out):
        raise ValueError(f"DeformConv: offset shape {offset.shape} != {(n, offset_group * ksize * rank, *out)}")
    dtype = _compute_dtype(x.dtype)
    pos_dtype = np.result_type(dtype, offset.dtype, np.float32)
    off = offset.astype(pos_dtype, copy=False).reshape(n, offset_group, ksize, rank, size)
    # Undisplaced sample position of every (tap, output) pair on each axis.
    taps = np.array(list(itertools.product(*(range(k) for k in kernel))), dtype=np.int64).reshape(ksize, rank)
    grids = np.meshgrid(*(np.arange(o) for o in out), indexing="ij")
    base = [
        (taps[:, i, None] * dilation_list[i] + grids[i].reshape(1, size) * stride_list[i] - pb[i]).astype(pos_dtype)
        for i in range(rank)
    ]
    pos = [base[i] + off[:, :, :, i] for i in range(rank)]  # each (n, og, K, P)
    floor = [np.floor(p) for p in pos]
    frac = [p - f for p, f in zip(pos, floor)]
    floor = [f.astype(np.int64) for f in floor]
    cog = c // offset_group
    xf = x.astype(dtype, copy=False).reshape(n, offset_group, cog, math.prod(spatial))
    cols = np.zeros((n, offset_group, cog, ksize * size), dtype=dtype)
    plane_strides = [math.prod(spatial[i + 1 :]) for i in range(rank)]
    for corner in itertools.product((0, 1), repeat=rank):
        weight = np.ones((n, offset_group, ksize, size), dtype=pos_dtype)
        flat = np.zeros((n, offset_group, ksize, size), dtype=np.int64)
        valid = np.ones((n, offset_group, ksize, size), dtype=bool)
        for i, bit in enumerate(corner):
            idx = floor[i] + bit
            weight *= frac[i] if bit else 1 - frac[i]
            valid &= (idx >= 0) & (idx < spatial[i])
            flat += np.clip(idx, 0, spatial[i] - 1) * plane_strides[i]
        weight = np.where(valid, weight, 0).astype(dtype, copy=False)
        values = np.take_along_axis(xf, flat.reshape(n, offset_group, 1, ksize * size), axis=3)
        cols += values * weight.reshape(n, offset_group, 1, ksize * size)
    cols = cols.reshape(n, offset_group, cog, ksize, size)
    if mask is not None:
        cols *= mask.astype(dtype, copy=False).reshape(n, offset_group, 1, ksize, size)
    wg = w.astype(dtype, copy=False).reshape(group, m // group, -1)
    y = np.matmul(wg, cols.reshape(n, group, (c // group) * ksize, size)).reshape(n, m, size)
    if b is not None:
        y += b.astype(dtype, copy=False).reshape(m, 1)
    return y.reshape(n, m, *out).astype(x.dtype, copy=False)
