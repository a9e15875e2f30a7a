"""3x3 convolution by Winograd's minimal filtering F(4x4, 3x3) and F(2x2, 3x3): GEMMs of a quarter (a half) of the multiply-adds.

A 3x3 Conv with unit strides and dilations, one group, computes each 4x4 output tile from
a 6x6 input tile. Transformed (``V = B^T d B`` per input tile and channel, ``U = G g G^T``
per weight), the tile's outputs are ``A^T M A`` with ``M[xi] = U[xi] @ V[xi]`` for each of
the 36 transform points: 36 products of (M, C) by (C, tiles), 36 multiply-adds per 16
outputs and channel pair instead of 144. Outputs too small for enough 4x4 tiles (14x14
gives 20) take 2x2 tiles from 4x4 input tiles: 16 products, 16 multiply-adds per 4
outputs instead of 36. The transforms are compiled loops (``_numba_winograd``), the
products one numpy matmul (one-thread BLAS calls).

Threads share the work by bands of tile rows, each band carried from input to output by
one thread in its own workspaces: one hand-off per call, and a band's transforms and
products stay in cache. Every band reads all of the transformed weight, so where that is
large (over 8 MB) or the images have too few tile rows for a band per thread, each step is
shared out instead: the input transform by channels, the products by transform point,
the output transform by output channel.

Errors stay at float32 rounding of the transformed values: measured at most 1e-5 of the
largest output on ResNet, VGG and random layers against onnxruntime's direct convolution.

Measured on one core of a 2-core AMD EPYC (Zen 4) against plugrt's im2col and tap-grid
GEMMs and onnxruntime's MLAS convolution, Conv + Relu, float32, batch 1 (ms; the first
version, whose products were 36 ctypes GEMM calls: one numpy matmul now, 0.6 against
1.0 ms of products on 64 -> 64 at 56x56):

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
each: 20) the products are too narrow for BLAS to run at speed: there F(2x2, 3x3) takes
over (measured on one core, the other engineers' benchmarks running: 256 -> 256 at
14x14 3.49 ms against 4.04 for the GEMM paths, 128 -> 128 at 14x14 0.89 against 1.21,
64 -> 256 at 13x13 0.77 against 0.90; onnxruntime 2.79, 0.75, 0.62), down to 48 of its
tiles (7x7 gives 20: the GEMM paths).
"""

from __future__ import annotations

import dataclasses
import math
from types import ModuleType
from typing import Any, Sequence

import numpy as np
from plugrt.threads import blas_threads, parallel_for, threads_for

from ._compiled import compiled_module
from ._compiled_parallel import CompiledPool, compiled_pool
from .conv_units import packing
from ._gemm import sgemm_address
from ._window import _copy_to_workspace, _workspace

__all__ = ["WinogradPlan", "winograd_loops", "winograd_plan"]

# Tiles per call (junk tiles counted, all images) below which the GEMM paths are faster.
_MIN_TILES = 48
# Input channels below which the products are too shallow (measured 16 -> 64 at 55x55:
# Winograd 0.80x the im2col path's time; 3 -> 64 has no gain to make).
_MIN_CHANNELS = 16
# A band of tile rows runs from input to output on one thread, and reads all of the
# transformed weight. Bigger weights than this share out each step instead (measured on 2
# threads: 256 -> 256 at 56x56, 9.4 MB, 10.6 ms by steps against 10.9 by a band per
# thread and 14.3 by two; 128 -> 160 at 28x28, 2.9 MB, 1.18 ms by two bands a thread
# against 1.44 by steps).
_BANDED_WEIGHT_BYTES = 8 << 20
# Multiply-adds a band at least for two bands a thread, which let a thread that finishes
# first take over (measured: 64 -> 192 at 56x56, 23 M a band, 2.12 ms against 2.53 for one
# band a thread; 64 -> 96 at 28x28, 3 M a band, 0.42 against 0.39).
_BAND_WORK = 6 << 20



@dataclasses.dataclass(frozen=True)
class _Variant:
    """One of the two tilings: output tiles ``tile`` x ``tile``, input tiles ``tile + 2``
    square, one transform point per input tile value. G is the weight transform; B^T and
    A^T live in the compiled loops ``<loops>_input`` and ``<loops>_output``."""

    tile: int
    g: np.ndarray
    loops: str

    @property
    def points(self) -> int:
        return (self.tile + 2) ** 2

    def work_floats(self, rows: int, pitch: int) -> int:
        """Scratch floats of the compiled transforms for a band of ``rows`` tile rows: the
        input's padded plane (``tile * rows + 2`` rows), vertical pass (``tile + 2`` rows
        of ``rows * pitch``) and the horizontal pass's phases (``rows * pitch``), which
        also hold the output's."""
        return ((2 * self.tile + 3) * rows + 2) * pitch


_F4 = _Variant(
    4,
    np.array(
        [
            [1 / 4, 0, 0],
            [-1 / 6, -1 / 6, -1 / 6],
            [-1 / 6, 1 / 6, -1 / 6],
            [1 / 24, 1 / 12, 1 / 6],
            [1 / 24, -1 / 12, 1 / 6],
            [0, 0, 1],
        ],
        dtype=np.float32,
    ),
    "winograd",
)
_F2 = _Variant(2, np.array([[1, 0, 0], [1 / 2, 1 / 2, 1 / 2], [1 / 2, -1 / 2, 1 / 2], [0, 0, 1]], dtype=np.float32), "winograd2")


def winograd_loops() -> ModuleType | None:
    """The compiled transforms (``_numba_winograd``), or None when numba is missing,
    unusable, ``PLUGRT_NUMBA=0`` or still being built (``compiled_module``): Conv then takes
    its GEMM paths."""
    return compiled_module("_numba_winograd")


class WinogradPlan:
    """The tiling of one input shape."""

    def __init__(self, x_shape: Sequence[int], w_shape: Sequence[int], pads_begin: Sequence[int], out: Sequence[int], variant: _Variant):
        self.variant = variant
        tile = variant.tile
        self.channels = x_shape[1]
        self.m = w_shape[0]
        self.out = (out[0], out[1])
        self.pad_top, self.pad_left = pads_begin[0], pads_begin[1]
        self.tile_rows = -(-out[0] // tile)
        self.tiles = -(-out[1] // tile)
        self.cells = self.tile_rows * (self.tiles + 1)  # per image, a junk tile closing each row
        self.pitch = tile * (self.tiles + 1)
        self.no_bias = np.zeros(self.m, np.float32)
        self.banded = variant.points * self.m * self.channels * 4 <= _BANDED_WEIGHT_BYTES

    def __call__(
        self,
        x: np.ndarray,
        weight: Any,
        bias: np.ndarray | None,
        relu: bool,
        y: np.ndarray | None = None,
        residual: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """The Conv of float32 ``x`` (n, C, H, W) by the prepared ``weight`` plus ``bias``
        (M, 1), plus ``residual`` (float32, C order, the output's shape; it may be ``y``'s
        own buffer) when given, then a Relu when asked; into ``y`` (n, M, *out) when given.
        None when ``x`` holds a NaN or an infinity: a tile would spread it further than a
        direct convolution does, so the caller computes this call the direct way."""
        loops = winograd_loops()
        assert loops is not None  # checked by winograd_plan's caller
        n, m = x.shape[0], self.m
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x) if y is None else _copy_to_workspace("winograd_x", x)
        if y is None:
            y = np.empty((n, m, *self.out), dtype=x.dtype)
        u = winograd_weights(weight, self.variant)
        packed = packed_winograd_weights(weight, self.variant, u)
        b = self.no_bias if bias is None else bias.reshape(m)
        work = self.variant.points * m * self.channels * n * self.cells
        # Threads only while other processes leave the cores free: with one busy core, one
        # thread measured 15-25% faster than two (a worker waits for the busy core).
        threads = threads_for(work)
        # a band per thread, two where each still has _BAND_WORK; a band is a tile row at least
        bands = -(-threads // n)
        if threads > 1 and work >= 2 * threads * _BAND_WORK:
            bands = -(-2 * threads // n)
        transforms = getattr(loops, self.variant.loops + "_input"), getattr(loops, self.variant.loops + "_output")
        if residual is not None:
            residual = residual.reshape(y.shape)
        if threads == 1 or (self.banded and bands <= self.tile_rows):
            finite = self._by_bands(
                transforms, x, u, packed, b, relu, y, threads, work, min(bands, self.tile_rows), residual
            )
        else:
            finite = self._by_steps(transforms, x, u, b, relu, y, threads, work, residual)
        return y if finite else None

    def _by_bands(
        self,
        transforms: tuple[Any, Any],
        x: np.ndarray,
        u: np.ndarray,
        packed: np.ndarray | None,
        b: np.ndarray,
        relu: bool,
        y: np.ndarray,
        threads: int,
        work: int,
        bands: int,
        residual: np.ndarray | None,
    ) -> bool:
        """Bands of tile rows, each from input to output on one thread: its transforms and
        products in that thread's workspaces, in cache, and no thread waits for another."""
        pool, gemm = compiled_pool(), sgemm_address()
        if pool is not None and gemm is not None and u.flags.c_contiguous and b.flags.c_contiguous:
            return self._compiled_bands(pool, gemm, x, u, packed, b, relu, y, threads, bands, residual)
        add = residual is not None
        added = y if residual is None else residual
        n, c, m = x.shape[0], self.channels, self.m
        rows, tiles, pitch = self.tile_rows, self.tiles, self.pitch
        points = self.variant.points
        transform_input, transform_output = transforms
        finite = [True]

        def band(start: int, stop: int) -> None:
            for unit in range(start, stop):
                image, k = divmod(unit, bands)
                r0, r1 = k * rows // bands, (k + 1) * rows // bands
                cells = (r1 - r0) * (tiles + 1)
                v, _ = _workspace("winograd_v", (points, c, cells), x.dtype)
                products, _ = _workspace("winograd_m", (points, m, cells), x.dtype)
                scratch, _ = _workspace("winograd_work", (self.variant.work_floats(r1 - r0, pitch),), x.dtype)
                if not transform_input(x, self.pad_top, self.pad_left, tiles, v, image, r0, r1, 0, c, scratch):
                    finite[0] = False
                    return
                np.matmul(u, v, out=products)
                transform_output(products, b, relu, tiles, y, added, add, image, r0, r1, 0, m, scratch)

        parallel_for(n * bands, band, work, threads=threads, chunks_per_thread=n * bands)  # a chunk per band
        return finite[0]

    def _compiled_bands(
        self,
        pool: CompiledPool,
        gemm: tuple[int, bool],
        x: np.ndarray,
        u: np.ndarray,
        packed: np.ndarray | None,
        b: np.ndarray,
        relu: bool,
        y: np.ndarray,
        threads: int,
        bands: int,
        residual: np.ndarray | None,
    ) -> bool:
        """``_by_bands`` as one compiled job (``_numba_winograd.winograd_bands``): the
        same transforms, and the same GEMMs or (``packed``, a constant weight's transform
        packed for it) the packed-weight GEMM, without the GIL, on the compiled pool."""
        loops = winograd_loops()
        assert loops is not None
        n, c, m = x.shape[0], self.channels, self.m
        points = self.variant.points
        most_rows = -(-self.tile_rows // bands)
        most_cells = most_rows * (self.tiles + 1)
        work_floats = self.variant.work_floats(most_rows, self.pitch)
        room = points * (c + m) * most_cells + work_floats
        slots = pool.slots(n * bands, threads)
        workspace, _ = _workspace("winograd_bands", (slots * room,), np.dtype(np.float32))
        context = np.array(
            [
                gemm[0], int(gemm[1]), x.ctypes.data, n, c, x.shape[2], x.shape[3], self.pad_top, self.pad_left,
                self.tiles, self.tile_rows, bands, self.variant.tile, m, u.ctypes.data, b.ctypes.data, int(relu),
                y.ctypes.data, self.out[0], self.out[1], workspace.ctypes.data, room, work_floats, 1,
                0 if packed is None else packed.ctypes.data,
                0 if residual is None else residual.ctypes.data,
            ],
            np.int64,
        )
        blas_threads(0)
        pool.run(loops.winograd_bands.address, context, n * bands, threads)
        return bool(context[loops.BAND_FINITE])

    def _by_steps(
        self,
        transforms: tuple[Any, Any],
        x: np.ndarray,
        u: np.ndarray,
        b: np.ndarray,
        relu: bool,
        y: np.ndarray,
        threads: int,
        work: int,
        residual: np.ndarray | None,
    ) -> bool:
        """Whole images, each step shared out between the threads: the input transform by
        channels, the products by transform point, the output transform by output channel
        (for images too few to give every thread bands of their own)."""
        n, c, m = x.shape[0], self.channels, self.m
        rows, tiles, cells = self.tile_rows, self.tiles, self.cells
        points = self.variant.points
        v, _ = _workspace("winograd_v", (n, points, c, cells), x.dtype)
        products, _ = _workspace("winograd_m", (n, points, m, cells), x.dtype)
        forward, backward = transforms
        add = residual is not None
        added = y if residual is None else residual
        scratch_floats = self.variant.work_floats(rows, self.pitch)
        finite = [True]

        def transform_input(start: int, stop: int) -> None:
            scratch, _ = _workspace("winograd_work", (scratch_floats,), x.dtype)
            for image in range(start // c, (stop - 1) // c + 1):
                c0, c1 = max(start - image * c, 0), min(stop - image * c, c)
                if not forward(x, self.pad_top, self.pad_left, tiles, v[image], image, 0, rows, c0, c1, scratch):
                    finite[0] = False

        def multiply(start: int, stop: int) -> None:
            for image in range(start // points, (stop - 1) // points + 1):
                p0, p1 = max(start - image * points, 0), min(stop - image * points, points)
                np.matmul(u[p0:p1], v[image, p0:p1], out=products[image, p0:p1])

        def transform_output(start: int, stop: int) -> None:
            scratch, _ = _workspace("winograd_work", (scratch_floats,), x.dtype)
            for image in range(start // m, (stop - 1) // m + 1):
                k0, k1 = max(start - image * m, 0), min(stop - image * m, m)
                backward(products[image], b, relu, tiles, y, added, add, image, 0, rows, k0, k1, scratch)

        parallel_for(n * c, transform_input, work, threads=threads)
        if not finite[0]:
            return False
        parallel_for(n * points, multiply, work, threads=threads)
        parallel_for(n * m, transform_output, work, threads=threads)
        return True


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
    for variant in (_F4, _F2):  # the larger tiles save more, where they give enough tiles
        plan = WinogradPlan(x_shape, w_shape, pads_begin, out, variant)
        if x_shape[0] * plan.cells >= _MIN_TILES:
            return plan
    return None


def _transform(gemm_weight: np.ndarray, variant: _Variant, out: np.ndarray) -> np.ndarray:
    """``U = G g G^T`` for the weight (1, M, C * 9), into ``out`` (points, M, C); float32
    arithmetic in workspaces, the same for a constant and a weight fed at run time."""
    _, m, ck = gemm_weight.shape
    pairs = m * (ck // 9)
    side = variant.tile + 2
    g = gemm_weight.reshape(pairs, 3, 3)
    half, _ = _workspace("winograd_g", (pairs, side, 3), np.dtype(np.float32))
    full, _ = _workspace("winograd_ggt", (pairs, side, side), np.dtype(np.float32))
    np.matmul(variant.g, g, out=half)
    np.matmul(half, variant.g.T, out=full)
    np.copyto(out, full.reshape(m, ck // 9, side * side).transpose(2, 0, 1))
    return out


def packed_winograd_weights(weight: Any, variant: _Variant, u: np.ndarray) -> np.ndarray | None:
    """A constant weight's transform ``u`` (points, M, C) packed point by point for the
    packed-weight GEMM (``_numba_gemm``), kept beside it; None for a weight fed at run
    time (its transform is a workspace, rewritten each call) or where that GEMM is not
    there."""
    kernel = packing()
    kept = getattr(weight, "winograd", None)
    if kernel is None or kept is None or kept.get(variant.tile) is not u:
        return None
    packed = kept.get(("packed", variant.tile))
    if packed is None:
        packed = np.stack([kernel.pack_weight(point) for point in u])
        kept[("packed", variant.tile)] = packed
    return packed


def winograd_weights(weight: Any, variant: _Variant) -> np.ndarray:
    """The transformed weight (points, M, C) of a prepared Conv weight (its ``gemm``: (1,
    M, C * 9)). A weight object a kernel uses a second time is a constant and keeps its
    transform; one fed at run time is transformed afresh each call into a workspace (so a
    replay allocates nothing)."""
    kept = getattr(weight, "winograd", None)
    if kept is None:
        kept = {}
    u = kept.get(variant.tile)
    if u is not None:
        return u
    gemm_weight = weight.gemm
    _, m, ck = gemm_weight.shape
    shape = (variant.points, m, ck // 9)
    if getattr(weight, "winograd_seen", False):
        kept[variant.tile] = u = _transform(gemm_weight, variant, np.empty(shape, np.float32))
        weight.winograd = kept
        return u
    weight.winograd_seen = True
    out, _ = _workspace("winograd_u", shape, np.dtype(np.float32))
    return _transform(gemm_weight, variant, out)
