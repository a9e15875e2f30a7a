"""Unit-stride convolution as a sum of shifted GEMMs over the zero-padded input, without im2col.

With the input zero-padded and each channel's plane flattened, kernel tap ``t`` of a
unit-stride convolution reads, for every output position on a grid as wide as the padded
plane, the flattened plane at a fixed offset: a contiguous run. So the convolution is
``sum_t W_t @ planes[:, offset_t : offset_t + grid]``: one GEMM per tap on a strided view
(leading dimension: the plane length), accumulated by BLAS (``beta=1``), and the grid is
cropped to the output once. Next to im2col this copies the input once instead of once per
tap; the price is the grid's junk columns (the padding width), so it is chosen only where
they are few and each GEMM's depth (channels per group) keeps BLAS efficient.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from plugrt.threads import blas_threads

from . import _gemm
from ._window import _workspace

__all__ = ["ShiftedPlan", "shifted_plan"]

# Grid positions per output position above which the junk columns cost more than im2col saves.
_MAX_GRID_RATIO = 1.15
# Channels per group below which each tap's GEMM is too shallow to beat one deep im2col GEMM.
_MIN_DEPTH = 16


class ShiftedPlan:
    """The geometry of one input shape: padded plane, tap offsets, output grid and crop."""

    def __init__(
        self,
        channels: int,
        spatial: Sequence[int],
        kernel: Sequence[int],
        dilations: Sequence[int],
        pads_begin: Sequence[int],
        pads_end: Sequence[int],
        out: Sequence[int],
        group: int,
        m: int,
    ):
        rank = len(spatial)
        plane = [spatial[i] + pads_begin[i] + pads_end[i] for i in range(rank)]
        plane_strides = [math.prod(plane[i + 1 :]) for i in range(rank)]
        self.group = group
        self.channels = channels
        self.m = m
        self.out = list(out)
        self.grid = out[0] * plane_strides[0]  # output rows as wide as the plane
        self.offsets = [
            sum(t * d * ps for t, d, ps in zip(tap, dilations, plane_strides))
            for tap in np.ndindex(*kernel)
        ]
        # Each plane is long enough for the last tap's run: the tail past the padded plane
        # is read only into junk columns, and kept zero.
        self.length = max(math.prod(plane), max(self.offsets) + self.grid)
        self.plane = tuple(plane)
        self.interior = (slice(None),) + tuple(slice(b, b + s) for b, s in zip(pads_begin, spatial))
        self.crop = (slice(None), slice(None)) + tuple(slice(0, o) for o in out[1:])
        self.grid_shape = (m, out[0], *plane[1:])
        self.layout = (channels, self.length, self.plane, tuple(pads_begin))
        # multiply-adds of one tap's GEMM: what BLAS threads are worth
        self.tap_work = (m // group) * (channels // group) * self.grid

    def __call__(
        self,
        x: np.ndarray,
        taps: np.ndarray,
        bias: np.ndarray | None,
        relu: bool,
        y: np.ndarray | None = None,
        residual: np.ndarray | None = None,
    ) -> np.ndarray:
        """The convolution of ``x`` (n, C, *spatial) by ``taps`` (K, group, M/group, C/group),
        plus ``bias`` (M, 1) and ``residual`` (shaped like the output), then a Relu when
        asked; into ``y`` (n, M, *out) when given, else a new array."""
        n = x.shape[0]
        c, g, m = self.channels, self.group, self.m
        if y is None:
            y = np.empty((n, m, *self.out), dtype=x.dtype)
        padded, stale = _workspace("shifted_planes", (c, self.length), x.dtype, self.layout)
        if stale:
            padded.fill(0)  # the padding; only the interior is written below
        interior = padded[:, : math.prod(self.plane)].reshape(c, *self.plane)[self.interior]
        grid, _ = _workspace("shifted_grid", (m, self.grid), x.dtype)
        blas_threads(self.tap_work)
        cg, mg = c // g, m // g
        for image in range(n):
            np.copyto(interior, x[image])
            if bias is not None:
                np.copyto(grid, bias)
            for k, offset in enumerate(self.offsets):
                beta = 0.0 if k == 0 and bias is None else 1.0
                for j in range(g):
                    _gemm.gemm(
                        taps[k, j], padded[j * cg : (j + 1) * cg, offset : offset + self.grid],
                        grid[j * mg : (j + 1) * mg], beta,
                    )
            cropped = grid.reshape(self.grid_shape)[self.crop]
            target = y[image]
            if residual is not None:
                np.add(cropped, residual[image], out=target)
                if relu:
                    np.maximum(target, 0, out=target)
            elif relu:
                np.maximum(cropped, 0, out=target)
            else:
                np.copyto(target, cropped)
        return y


def shifted_plan(
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    pads_begin: Sequence[int],
    pads_end: Sequence[int],
    out: Sequence[int],
    group: int,
) -> ShiftedPlan | None:
    """The shifted-GEMM plan for a Conv of these shapes, or None where im2col is the better
    way (strides, a 1-wide kernel, shallow groups, many junk columns, empty shapes)."""
    channels = x_shape[1]
    kernel = list(w_shape[2:])
    if not kernel or any(s != 1 for s in strides) or math.prod(kernel) < 2 or channels // group < _MIN_DEPTH:
        return None
    if not math.prod(out) or not x_shape[0]:
        return None
    plan = ShiftedPlan(channels, x_shape[2:], kernel, dilations, pads_begin, pads_end, out, group, w_shape[0])
    if plan.grid > _MAX_GRID_RATIO * math.prod(out):
        return None
    return plan


def tap_weights(weight: Any, kernel_size: int) -> np.ndarray:
    """The Conv weight (group, M/group, C/group * K) as (K, group, M/group, C/group).

    ``weight`` is a prepared weight object: one a kernel uses a second time is a constant
    and keeps its copy; a weight fed at run time is prepared afresh each call, and its copy
    goes to a workspace (so a replay allocates nothing)."""
    taps = getattr(weight, "shifted_taps", None)
    if taps is not None:
        return taps
    gemm = weight.gemm
    g, mg, ck = gemm.shape
    view = gemm.reshape(g, mg, ck // kernel_size, kernel_size).transpose(3, 0, 1, 2)
    if getattr(weight, "shifted_seen", False):
        taps = weight.shifted_taps = np.ascontiguousarray(view)
        return taps
    weight.shifted_seen = True
    taps, _ = _workspace("shifted_taps", view.shape, gemm.dtype)
    np.copyto(taps, view)
    return taps


def usable(plan: ShiftedPlan | None, dtype: np.dtype) -> bool:
    """Whether ``plan`` exists and BLAS is called directly for ``dtype``."""
    return plan is not None and _gemm.available(dtype)
