"""Convolution as one BLAS GEMM per kernel tap over flattened stride-phase planes, without im2col.

With the input zero-padded, split into its stride phases (``padded[..., p::stride]``, one
plane for unit strides) and each channel's plane flattened, kernel tap ``t`` reads, for
every output position on a grid as wide as the planes, one phase plane at a fixed offset:
a contiguous run. So the convolution is
``sum_t W_t @ planes[phase_t][:, offset_t : offset_t + grid]``: one GEMM per tap on a
strided view (leading dimension: the plane length), accumulated by BLAS (``beta=1``), and
the grid's junk columns (the planes' extra width) are cropped once. The input is copied
once instead of once per tap (im2col), at the price of re-reading the output per tap and
the junk columns. Measured on one core against im2col (3x3 kernels): 0.45-0.9x the time
with at most as many output as input channels on 28 and 56 wide planes, slower with more
outputs per input channel, with fewer than 16 channels per group, or on 14 wide planes.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from ._gemm import gemm, split_columns
from ._relu import relu_into
from ._window import _phase_fill, _workspace

__all__ = ["GridPlan", "grid_plan", "tap_weights"]

# Where one GEMM per tap beats im2col (see the module docstring): grid positions per output
# position at most, output rows at least this wide, channels per group at least, output
# channels per input channel at most (im2col's copy is amortised over the outputs, while
# every tap here re-reads and re-writes them).
_MAX_GRID_RATIO = 1.1
_MIN_WIDTH = 20
_MIN_DEPTH = 16
_MAX_FAN_OUT = 1


class GridPlan:
    """The geometry of one input shape: phase planes, tap offsets, output grid and crop."""

    def __init__(
        self,
        x_shape: Sequence[int],
        w_shape: Sequence[int],
        strides: Sequence[int],
        dilations: Sequence[int],
        pads_begin: Sequence[int],
        out: Sequence[int],
        group: int,
    ):
        channels, spatial = x_shape[1], list(x_shape[2:])
        kernel = list(w_shape[2:])
        rank = len(spatial)
        self.group, self.channels, self.m, self.out = group, channels, w_shape[0], list(out)
        self.ksize = math.prod(kernel)
        tap_phases, tap_shifts = [], []
        for tap in np.ndindex(*kernel):
            reach = [t * d for t, d in zip(tap, dilations)]
            tap_phases.append(tuple(r % s for r, s in zip(reach, strides)))
            tap_shifts.append([r // s for r, s in zip(reach, strides)])
        plane = [out[i] + max(shift[i] for shift in tap_shifts) for i in range(rank)]
        plane_strides = [math.prod(plane[i + 1 :]) for i in range(rank)]
        self.phases = sorted(set(tap_phases))
        phase_index = {phase: k for k, phase in enumerate(self.phases)}
        self.grid = out[0] * plane_strides[0]  # output rows as wide as the planes
        offsets = [sum(s * ps for s, ps in zip(shift, plane_strides)) for shift in tap_shifts]
        self.taps = [(phase_index[phase], offset) for phase, offset in zip(tap_phases, offsets)]
        # Each plane is long enough for the last tap's run: the tail past the plane is read
        # only into junk columns, and kept zero.
        self.length = max(math.prod(plane), max(offsets) + self.grid)
        self.plane = tuple(plane)
        # Per phase: the plane region the input fills, and the input region (strided) it reads.
        self.fills = []
        for phase in self.phases:
            dst, src = _phase_fill(spatial, phase, pads_begin, strides, plane)
            self.fills.append(((slice(None), *dst), (slice(None), *src)))
        self.crop = (slice(None), slice(None)) + tuple(slice(0, o) for o in out[1:])
        self.grid_shape = (self.m, out[0], *plane[1:])
        self.layout = (channels, self.length, self.plane, tuple(self.fills))
        # multiply-adds of one GEMM call: what BLAS threads are worth
        self.work = (self.m // group) * (channels // group) * self.grid

    def __call__(
        self,
        x: np.ndarray,
        weight: Any,
        bias: np.ndarray | None,
        relu: bool,
        y: np.ndarray | None = None,
        residual: np.ndarray | None = None,
    ) -> np.ndarray:
        """The convolution of ``x`` (n, C, *spatial) by the prepared ``weight`` (its ``gemm``:
        (group, M/group, C/group * K)), plus ``bias`` (M, 1) and ``residual`` (shaped like
        the output), then a Relu when asked; into ``y`` (n, M, *out) when given, else a new
        array."""
        n = x.shape[0]
        c, m = self.channels, self.m
        if y is None:
            y = np.empty((n, m, *self.out), dtype=x.dtype)
        planes, stale = _workspace("grid_planes", (len(self.phases), c, self.length), x.dtype, self.layout)
        if stale:
            planes.fill(0)  # the padding; only the regions below are written
        size = math.prod(self.plane)
        shaped = [planes[k, :, :size].reshape(c, *self.plane) for k in range(len(self.phases))]
        grid, _ = _workspace("grid_output", (m, self.grid), x.dtype)
        taps = tap_weights(weight, self.ksize)
        g = self.group
        cg, mg = c // g, m // g

        def columns(start: int, stop: int) -> None:
            """Every tap's product for grid columns [start, stop)."""
            block = grid[:, start:stop]
            if bias is not None:
                np.copyto(block, bias)
            for k, (phase, offset) in enumerate(self.taps):
                beta = 0.0 if k == 0 and bias is None else 1.0
                source = planes[phase, :, offset + start : offset + stop]
                for j in range(g):
                    gemm(taps[k, j], source[j * cg : (j + 1) * cg], block[j * mg : (j + 1) * mg], beta)

        for image in range(n):
            xi = x[image]
            for plane, (dst, src) in zip(shaped, self.fills):
                np.copyto(plane[dst], xi[src])
            split_columns(self.grid, columns, self.work * self.ksize * g)
            cropped = grid.reshape(self.grid_shape)[self.crop]
            target = y[image]
            if residual is not None:
                np.add(cropped, residual[image], out=target)
                if relu:
                    relu_into(target, target)
            else:
                if relu:  # on the contiguous grid: numpy's maximum is slow on strided views
                    relu_into(grid, grid)
                np.copyto(target, cropped)
        return y


def grid_plan(
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    pads_begin: Sequence[int],
    out: Sequence[int],
    group: int,
) -> GridPlan | None:
    """The grid plan for a Conv of these shapes, or None where im2col is the better way.
    The planes cover what the output reads, so the end padding needs no attention."""
    kernel = list(w_shape[2:])
    if not kernel or math.prod(kernel) < 2 or not math.prod(out) or not x_shape[0] or out[-1] < _MIN_WIDTH:
        return None
    channels, m = x_shape[1] // group, w_shape[0] // group
    if channels < _MIN_DEPTH or m > _MAX_FAN_OUT * channels:
        return None
    plan = GridPlan(x_shape, w_shape, strides, dilations, pads_begin, out, group)
    if plan.grid > _MAX_GRID_RATIO * math.prod(out):
        return None
    return plan


def tap_weights(weight: Any, kernel_size: int) -> np.ndarray:
    """The Conv weight (group, M/group, C/group * K) as (K, group, M/group, C/group).

    ``weight`` is a prepared weight object: one a kernel uses a second time is a constant
    and keeps its copy; a weight fed at run time is prepared afresh each call, and its copy
    goes to a workspace (so a replay allocates nothing)."""
    taps = getattr(weight, "grid_taps", None)
    if taps is not None:
        return taps
    gemm = weight.gemm
    g, mg, ck = gemm.shape
    view = gemm.reshape(g, mg, ck // kernel_size, kernel_size).transpose(3, 0, 1, 2)
    if getattr(weight, "grid_seen", False):
        taps = weight.grid_taps = np.ascontiguousarray(view)
        return taps
    weight.grid_seen = True
    taps, _ = _workspace("grid_taps", view.shape, gemm.dtype)
    np.copyto(taps, view)
    return taps
