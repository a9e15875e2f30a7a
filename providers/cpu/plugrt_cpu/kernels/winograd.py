"""3x3 convolution by Winograd's minimal filtering F(4x4, 3x3): 36 GEMMs of a quarter of the multiply-adds.

A 3x3 Conv with unit strides and dilations, one group, computes each 4x4 output tile from
a 6x6 input tile. Transformed (``V = B^T d B`` per input tile and channel, ``U = G g G^T``
per weight), the tile's outputs are ``A^T M A`` with ``M[xi] = U[xi] @ V[xi]`` for each of
the 36 transform points: 36 products of (M, C) by (C, tiles), 36 multiply-adds per 16
outputs and channel pair instead of 144. The transforms are compiled loops
(``_numba_winograd``); the products are one-thread BLAS calls shared out between the
threads. Errors stay at float32 rounding of the transformed values: measured at most 1e-5
of the largest output on ResNet, VGG and random layers against onnxruntime's direct
convolution.

Measured on one core of a 2-core AMD EPYC (Zen 4) against plugrt's im2col and tap-grid
GEMMs and onnxruntime's MLAS convolution, Conv + Relu, float32, batch 1 (ms):

===================  ==========  ========  ===========
C -> M, size          GEMM paths  Winograd  onnxruntime
===================  ==========  ========  ===========
64 -> 64, 56x56            3.18      1.76         2.32
128 -> 128, 28x28          3.07      1.83         2.26
128 -> 32, 56x56           3.55      2.21         2.49
16 -> 64, 55x55            1.06      0.85         0.66
256 -> 256, 56x56         40.7      15.1         33.5
256 -> 256, 14x14          3.46      3.59         2.45
64 -> 256, 13x13           0.80      0.85         0.56
===================  ==========  ========  ===========

Below about 48 tiles per call (a 14x14 output has 4 tile rows of 4 and a junk tile
each: 20) the products are too narrow for BLAS to run at speed, and the GEMM paths win.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType
from typing import Any, Sequence

import numpy as np
from plugrt.threads import parallel_for, split_threads

from ._compiled import compiled_module
from ._window import _copy_to_workspace, _workspace

__all__ = ["WinogradPlan", "winograd_loops", "winograd_plan"]

# Tiles per call (junk tiles counted, all images) below which the GEMM paths are faster.
_MIN_TILES = 48
# Input channels below which the products are too shallow (measured 16 -> 64 at 55x55:
# Winograd 0.80x the im2col path's time; 3 -> 64 has no gain to make).
_MIN_CHANNELS = 16
# A transform point's product is claimed alone: at least this many per chunk would idle
# a thread on the last ones.
_PRODUCT_CHUNKS_PER_THREAD = 4

# F(4x4, 3x3)'s weight transform G (6x3); B^T and A^T are in the compiled loops.
_G = np.array(
    [
        [1 / 4, 0, 0],
        [-1 / 6, -1 / 6, -1 / 6],
        [-1 / 6, 1 / 6, -1 / 6],
        [1 / 24, 1 / 12, 1 / 6],
        [1 / 24, -1 / 12, 1 / 6],
        [0, 0, 1],
    ],
    dtype=np.float32,
)


@functools.cache
def winograd_loops() -> ModuleType | None:
    """The compiled transforms (``_numba_winograd``), or None when numba is missing,
    unusable, or ``PLUGRT_NUMBA=0``: Conv then takes its GEMM paths."""
    return compiled_module("_numba_winograd")


class WinogradPlan:
    """The tiling of one input shape."""

    def __init__(self, x_shape: Sequence[int], w_shape: Sequence[int], pads_begin: Sequence[int], out: Sequence[int]):
        self.channels = x_shape[1]
        self.m = w_shape[0]
        self.out = (out[0], out[1])
        self.pad_top, self.pad_left = pads_begin[0], pads_begin[1]
        self.tile_rows = -(-out[0] // 4)
        self.tiles = -(-out[1] // 4)
        self.cells = self.tile_rows * (self.tiles + 1)  # per image, a junk tile closing each row
        pitch = 4 * (self.tiles + 1)
        self.input_work = (4 * self.tile_rows + 2) * pitch + 6 * self.tile_rows * pitch
        self.output_work = 40 * self.cells
        self.no_bias = np.zeros(self.m, np.float32)

    def __call__(
        self, x: np.ndarray, weight: Any, bias: np.ndarray | None, relu: bool, y: np.ndarray | None = None
    ) -> np.ndarray | None:
        """The Conv of float32 ``x`` (n, C, H, W) by the prepared ``weight`` plus ``bias``
        (M, 1), then a Relu when asked; into ``y`` (n, M, *out) when given. None when ``x``
        holds a NaN or an infinity: a tile would spread it further than a direct
        convolution does, so the caller computes this call the direct way."""
        loops = winograd_loops()
        assert loops is not None  # checked by winograd_plan's caller
        n, c, m = x.shape[0], self.channels, self.m
        cells = n * self.cells
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x) if y is None else _copy_to_workspace("winograd_x", x)
        u = winograd_weights(weight)
        v, _ = _workspace("winograd_v", (36, c, cells), x.dtype)
        products, _ = _workspace("winograd_m", (36, m, cells), x.dtype)
        b = self.no_bias if bias is None else bias.reshape(m)
        threads = split_threads(36 * m * c * cells)
        finite = [True]

        def transform_input(start: int, stop: int) -> None:
            work, _ = _workspace("winograd_input", (self.input_work,), x.dtype)
            if not loops.winograd_input(x, self.pad_top, self.pad_left, self.tile_rows, self.tiles, v, start, stop, work):
                finite[0] = False

        def multiply(start: int, stop: int) -> None:
            # one numpy call for the chunk's products: it loops over them in C (36 gemm
            # calls through ctypes cost ~0.4 ms more on 64 -> 64 at 56x56)
            np.matmul(u[start:stop], v[start:stop], out=products[start:stop])

        parallel_for(n * c, transform_input, n * c * self.input_work, threads=threads)
        if not finite[0]:
            return None
        parallel_for(36, multiply, 36 * m * c * cells, threads=threads, chunks_per_thread=_PRODUCT_CHUNKS_PER_THREAD)
        if y is None:
            y = np.empty((n, m, *self.out), dtype=x.dtype)

        def transform_output(start: int, stop: int) -> None:
            work, _ = _workspace("winograd_output", (self.output_work,), x.dtype)
            loops.winograd_output(products, b, relu, self.tile_rows, self.tiles, y, start, stop, work)

        parallel_for(n * m, transform_output, n * m * self.output_work, threads=threads)
        return y


def winograd_plan(
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    pads_begin: Sequence[int],
    out: Sequence[int],
    group: int,
) -> WinogradPlan | None:
    """The Winograd plan for a 2-D 3x3 Conv of these shapes with unit strides and
    dilations and one group, where it beats the GEMM paths; else None."""
    if len(x_shape) != 4 or tuple(w_shape[2:]) != (3, 3) or group != 1:
        return None
    if any(s != 1 for s in strides) or any(d != 1 for d in dilations) or any(p < 0 for p in pads_begin):
        return None
    if x_shape[1] < _MIN_CHANNELS or not math.prod(out) or not x_shape[0] or not w_shape[0]:
        return None
    plan = WinogradPlan(x_shape, w_shape, pads_begin, out)
    if x_shape[0] * plan.cells < _MIN_TILES:
        return None
    return plan


def _transform(gemm_weight: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``U = G g G^T`` for the weight (1, M, C * 9), into ``out`` (36, M, C); float32
    arithmetic in workspaces, the same for a constant and a weight fed at run time."""
    _, m, ck = gemm_weight.shape
    pairs = m * (ck // 9)
    g = gemm_weight.reshape(pairs, 3, 3)
    half, _ = _workspace("winograd_g", (pairs, 6, 3), np.dtype(np.float32))
    full, _ = _workspace("winograd_ggt", (pairs, 6, 6), np.dtype(np.float32))
    np.matmul(_G, g, out=half)
    np.matmul(half, _G.T, out=full)
    np.copyto(out, full.reshape(m, ck // 9, 36).transpose(2, 0, 1))
    return out


def winograd_weights(weight: Any) -> np.ndarray:
    """The transformed weight (36, M, C) of a prepared Conv weight (its ``gemm``: (1, M,
    C * 9)). A weight object a kernel uses a second time is a constant and keeps its
    transform; one fed at run time is transformed afresh each call into a workspace (so a
    replay allocates nothing)."""
    u = getattr(weight, "winograd", None)
    if u is not None:
        return u
    gemm_weight = weight.gemm
    _, m, ck = gemm_weight.shape
    if getattr(weight, "winograd_seen", False):
        u = weight.winograd = _transform(gemm_weight, np.empty((36, m, ck // 9), np.float32))
        return u
    weight.winograd_seen = True
    out, _ = _workspace("winograd_u", (36, m, ck // 9), np.dtype(np.float32))
    return _transform(gemm_weight, out)
