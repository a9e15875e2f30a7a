"""Dense layers' products: ``a @ w + bias`` (then a GELU, erf or tanh) for a constant weight, by the packed micro-kernel where the host has it, else BLAS.

A transformer's Linear layer is one GEMM of (tokens, K) by a constant (K, N). Two
bodies, chosen per call from what the host offers:

- float32 where numba is there and the host has AVX-512 (``_numba_gemm.available``):
  the weight is laid out once, by the first call, in panels of 16 columns
  (:class:`WeightPanels`, each panel one contiguous K x 16 block), ``a`` is read where
  it is (rows of contiguous floats; any other layout is copied once), and
  ``_numba_dense.panel_product`` runs every row tile over a slice of a panel while that
  slice stays in the L1 cache, then the bias (+ GELU) on the panel's columns; fewer rows
  than a row tile take ``_numba_dense.few_rows_product``. OpenBLAS
  packs both operands on every call, and numpy's wheels run its AVX2 kernels on some
  AVX-512 hosts: one thread of this body ran 1.6-2x faster than one of OpenBLAS's on the
  shapes of ViT, BERT, Swin and ConvNeXt layers.
- otherwise numpy's matmul (BLAS) and numpy's bias add; the GELU is then the caller's
  (``dense_product`` returns False).

Both use as many threads as BLAS would get (:func:`plugrt.threads.parallel_threads`: the
free cores): the packed body splits the panels over them.

Which is faster depends on the host: on a Zen 4 EPYC, where numpy's OpenBLAS runs its
AVX2 kernels, the packed body was 1.6-2x faster; on an AVX-512 Xeon, where OpenBLAS runs
its SkylakeX kernels, BLAS was 1.1-1.5x faster on one thread and 1.5-2.9x on two (ViT's
197 x 768 x 768: 195 against 104 GFLOP/s). So the first product of a process times both
bodies, and every product keeps the faster (:func:`preferred_body`). The packed body's
panels run as one job on the compiled pool (``_numba_dense.panel_job``), where there is
one: on ``parallel_for``'s Python threads two threads ran it little faster than one.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Callable

import numpy as np
from plugrt.threads import blas_threads, parallel_for, parallel_threads

from ._compiled import compiled_module
from ._gemm import _STREAMED_WEIGHT_COST, matmul
from ._compiled_parallel import compiled_pool
from ._host_cpu import data_cache_bytes
from .normalization import zero_vector

__all__ = [
    "GELU_ERF", "GELU_NONE", "GELU_TANH", "Allocate", "WeightPanels", "dense_product", "matrix_rows", "new_array", "packed_kernels", "packs", "preferred_body",
]

_F32 = np.dtype(np.float32)
#: multiply-adds below which the packed body runs on one thread where there is no compiled
#: pool (its chunks then go to ``parallel_for``). There, OpenBLAS keeps its own threads, which
#: spin for a while after each call: split over both cores beside them, BERT-sized products
#: (128 rows, K and N 256 to 1024) made bert_small and the encoders 1.3-2x slower than one
#: thread did. With the compiled pool OpenBLAS stays on one thread
#: (``plugrt.threads.keep_blas_single``), and the packed body splits every product big
#: enough for two threads (``parallel_threads``): GPT-2's 64-row products in the model, one
#: thread against two (2-core EPYC), 268 -> 172 us (64 x 256 x 768), 353 -> 213 (x 1024),
#: 377 -> 259 (64 x 1024 x 256).
PACKED_PARALLEL_MIN_WORK = 1 << 26
_VECTOR = 16  # columns of a weight panel (_numba_dense.VECTOR)
_UNITS_PER_THREAD = 4  # units of panels per thread of a compiled-pool job
_JOB_LIMIT = 16  # job contexts kept per weight (one per call shape; past this, made each call)
#: The GELU after the bias (``dense_product``'s ``gelu``; ``_numba_dense``'s codes): none,
#: erf (True means this one), or the tanh approximation.
GELU_NONE, GELU_ERF, GELU_TANH = 0, 1, 2
Allocate = Callable[[str, tuple[int, ...], Any], np.ndarray]


def new_array(slot: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """The :data:`Allocate` of an eager call: a new array every time."""
    return np.empty(shape, dtype)


def packed_kernels() -> tuple[Any, Any] | None:
    """(``_numba_gemm``, ``_numba_dense``) where both are ready and the host has the vector
    unit the micro-kernel is written for; else None (BLAS runs)."""
    gemm = compiled_module("_numba_gemm")
    if gemm is None or not gemm.available():
        return None
    loops = compiled_module("_numba_dense")
    return None if loops is None else (gemm, loops)


@functools.cache
def slice_depth() -> int:
    """Steps of K per slice of a panel: the slice (depth x 16 floats) and a row tile's
    slice (as many) fill half the L1 data cache, as this host's sysfs reports it (32 KiB
    where it reports nothing)."""
    return max(64, data_cache_bytes(1, 32 * 1024) // (2 * 2 * _VECTOR * _F32.itemsize))


def cache_rows(m: int, k: int, mr: int) -> int:
    """Rows of the activation ``panel_product`` takes through all its panel groups
    before the next rows: where K fits one slice, as many as fill half the L2 cache (a
    multiple of ``mr``), so that the groups after the first read them from there and each
    group's epilogue finds its columns in cache; with several slices, every row (each
    slice of the weight is then kept in L1 over all the rows, and blocks of rows would
    read the weight again per block: 197 x 3072 @ 3072 x 768 took 5.3-5.6 ms in blocks of
    32-16 rows against 5.0 in one)."""
    if k > slice_depth():
        return max(m, mr)
    return max(mr, data_cache_bytes(2, 512 * 1024) // 2 // (k * _F32.itemsize) // mr * mr)


def _panels(w: np.ndarray) -> np.ndarray:
    """``w`` (K, N) as (ceil(N / 16), K, 16) panels, zero past column N."""
    k, n = w.shape
    tiles = -(-n // _VECTOR)
    padded = np.zeros((k, tiles * _VECTOR), _F32)
    padded[:, :n] = w
    return np.ascontiguousarray(padded.reshape(k, tiles, _VECTOR).transpose(1, 0, 2))


class WeightPanels:
    """A constant float32 (K, N) weight's panels for the packed body, laid out by the first
    call that runs it (so a model whose products never reach it, a CNN's classifier at
    batch 1, keeps no second copy of its weights)."""

    def __init__(self, weight: np.ndarray | None) -> None:
        self.weight = weight if weight is not None and weight.ndim == 2 and weight.dtype == _F32 else None
        self.panels: np.ndarray | None = None
        #: the pooled body's job contexts but the activation's and output's addresses, with
        #: their units, by call shape (building the 15 words took ~5 us a call)
        self.jobs: dict[tuple, tuple[np.ndarray, int]] = {}

    def get(self, w: np.ndarray) -> np.ndarray | None:
        """The panels of ``w`` when it is the weight they were made of; else None."""
        weight = self.weight
        if weight is None or w.shape != weight.shape or w.dtype != weight.dtype:
            return None
        if w is not weight and (w.ctypes.data != weight.ctypes.data or w.strides != weight.strides):
            return None
        if self.panels is None:
            self.panels = _panels(weight)
        return self.panels


#: Whether the packed body was the faster here (None: not measured yet), and the shape of
#: the product that measured it
_PREFERRED: dict[str, Any] = {"packed": None, "measured": None}
#: timed runs of each body when measuring (after an untimed one each)
TRIAL_CALLS = 2
#: BLAS is kept only when its best trial time is under this fraction of the packed body's.
#: The trial repeats one product with its weight hot in the cache, which favours BLAS (it
#: packs the weight again every call, from the cache here, from memory in a model) over the
#: packed body (panels laid out once, streamed). In models the packed body was ahead on
#: every transformer and hybrid export measured (2-core EPYC, beside onnxruntime: BERT-small
#: 1.09-1.10 against 1.21-1.29 on BLAS, GPT-2 prefill 1.36-1.37 against 1.40-1.49, ViT-B
#: 1.09-1.11 against 1.17-1.19), and a process whose trial picked BLAS ran BERT-small at
#: 1.23 where the others ran it at 1.01-1.08.
BLAS_CLEARLY_FASTER = 0.85


def preferred_body(key: tuple[int, int, int, int, bool], packed: Callable[[], Any], blas: Callable[[], Any]) -> bool:
    """Runs this call's product by the body that is faster on this host, and returns
    whether that was the packed one. The first product of the process measures: each
    body once untimed (their buffers' first touch, their threads' start), then
    ``TRIAL_CALLS`` timed runs of each in turn; the packed body is kept unless BLAS's best
    time is clearly faster (``BLAS_CLEARLY_FASTER``), for every later product of every
    shape (``key``, the measuring product's shape, is kept for reports). One choice for
    all: what decides it is the host's BLAS (its vector kernels), and a model whose
    products mixed the two bodies measured slower than either alone (ViT-B 345 ms a run,
    252 all on BLAS, 281 all packed, when OpenBLAS's workers still spun after each call
    beside the pool's jobs). Deciding within one call keeps later calls, and a capture's
    replays, on one body."""
    choice = _PREFERRED["packed"]
    if choice is None:
        packed()
        blas()
        best: dict[bool, float] = {}
        for _ in range(TRIAL_CALLS):
            for body in (True, False):
                started = time.perf_counter()
                (packed if body else blas)()
                elapsed = time.perf_counter() - started
                best[body] = min(elapsed, best.get(body, elapsed))
        choice = not best[False] < BLAS_CLEARLY_FASTER * best[True]
        _PREFERRED.update(packed=choice, measured=key)
    (packed if choice else blas)()
    return choice


def unit_shape(m: int, n: int, tiles: int, threads: int, mr: int) -> tuple[int, int]:
    """(rows, panels) of a unit of an (m, K) @ (K, n) product on the compiled pool (``tiles``
    weight panels, ``mr`` rows a packed tile): about ``_UNITS_PER_THREAD`` units a thread,
    cut along the operand that is read again by every unit of the other cut. Blocks of rows
    (each unit all the panels) where the activation has more rows than the weight has
    columns, so that each unit reads its own rows of it and the whole weight (Swin's and
    ConvNeXt's MLPs: 3136 x 96 @ 96 x 384); else blocks of panels (each unit every row and
    its own panels: ViT-B's 197 x 768 @ 768 x 3072, whose weight is the larger)."""
    units = threads * _UNITS_PER_THREAD
    row_tiles = -(-m // mr)
    if m > n and row_tiles >= 2 * threads:
        return mr * max(1, -(-row_tiles // units)), tiles
    return row_tiles * mr, max(1, tiles // units)


def packs(rows: int) -> bool:
    """Whether a product of ``rows`` rows by a constant weight runs the packed bodies: their
    modules ready, and at least one row. Under a row tile of the micro-kernel the few-row
    tiles stream the weight's panels once (``_numba_dense.few_rows_product``): a CNN's
    classifier at batch 1 went through BLAS's product, which packed its weight again every
    call (ResNet-50's 2048 x 1000 at 2.7-3x onnxruntime's time)."""
    return rows >= 1 and packed_kernels() is not None


def matrix_rows(
    out: np.ndarray, a: np.ndarray, w: np.ndarray, bias: np.ndarray | None, allocate: Allocate | None = None
) -> np.ndarray | None:
    """``a`` as the (rows, K) matrix :func:`dense_product` takes, where ``out = a @ w + bias``
    is one such product: ``w`` 2-D, ``bias`` None or one value per column, ``out``
    C-contiguous and of their dtype; else None. A stack of rows that is not C-contiguous
    (a channels-last transpose before a ConvNeXt block's Linear layers) is copied into the
    work array ``allocate`` gives (without one: None): one copy, where numpy's matmul of a
    strided stack runs its loop without BLAS."""
    if w.ndim != 2 or a.ndim < 2 or a.shape[-1] != w.shape[0] or not out.flags.c_contiguous:
        return None
    if bias is not None and bias.shape != (w.shape[1],):
        return None
    if not (out.dtype == a.dtype == w.dtype) or (bias is not None and bias.dtype != out.dtype):
        return None
    if a.ndim == 2:
        return a
    if a.flags.c_contiguous:
        return a.reshape(-1, a.shape[-1])
    if allocate is None:
        return None
    rows = allocate("rows", (math.prod(a.shape[:-1]), a.shape[-1]), a.dtype)
    np.copyto(rows.reshape(a.shape), a)
    return rows


def dense_product(
    out: np.ndarray,
    a: np.ndarray,
    w: np.ndarray,
    bias: np.ndarray | None,
    *,
    panels: WeightPanels | None = None,
    gelu: int = GELU_NONE,
    allocate: Allocate = new_array,
    gelu_pass: Callable[[np.ndarray], Any] | None = None,
) -> bool:
    """``out = a @ w + bias`` for 2-D ``a`` (M, K), ``w`` (K, N), ``out`` (M, N) C-contiguous,
    then the GELU ``gelu`` names (``GELU_ERF`` or True, ``GELU_TANH``) when the packed body
    ran (``panels`` of ``w`` given): returns whether the GELU was applied. ``allocate(slot, shape, dtype)`` gives the work
    array (the packed ``a``). ``gelu_pass(out)``, where given, applies the GELU after a
    BLAS product and says whether it did (so that the two bodies are timed alike)."""
    m, k = a.shape
    n = w.shape[1]
    work = m * n * k
    kernels = packed_kernels() if panels is not None and n and k and packs(m) else None
    laid_out = panels.get(w) if kernels is not None and panels is not None else None
    if laid_out is not None and kernels is not None and out.dtype == a.dtype == _F32 and out.flags.c_contiguous:
        gemm, loops = kernels
        if not (a.strides[1] == a.itemsize and a.strides[0] % a.itemsize == 0):  # the loops read rows of contiguous floats
            rows = allocate("contiguous-rows", a.shape, _F32)
            np.copyto(rows, a)
            a = rows
        if m < gemm.MR:
            if bias is None or bias.dtype == _F32:
                return _few_rows(loops, out, a, laid_out, bias, gelu)
            _blas_product(out, a, w, bias, work)
            return False
        lda = a.strides[0] // a.itemsize
        fused = bias is None or (bias.dtype == _F32 and bias.flags.c_contiguous)
        shift = bias if fused and bias is not None else zero_vector(n)
        activate = int(gelu) if fused else GELU_NONE  # the GELU comes after the bias: in the kernel only with it
        depth = slice_depth()
        block_rows = cache_rows(m, k, gemm.MR)

        def block(t0: int, t1: int) -> None:
            loops.panel_product(a.ctypes.data, lda, laid_out, out, shift, activate, t0, t1, depth, 0, m, block_rows)

        tiles = laid_out.shape[0]
        pool = compiled_pool()
        threads = parallel_threads(work) if pool is not None or work >= PACKED_PARALLEL_MIN_WORK else 1

        def packed_body() -> None:
            if threads <= 1 or tiles < 2:
                block(0, tiles)
            elif pool is not None:  # one job without the GIL: parallel_for's chunks each took it to start
                assert panels is not None  # laid_out came from it
                key = (m, lda, n, activate, threads, id(shift))
                job = panels.jobs.get(key)
                if job is None or job[0][loops.JOB_BIAS] != shift.ctypes.data:
                    row_block, per_unit = unit_shape(m, n, tiles, threads, gemm.MR)
                    chunks = -(-tiles // per_unit)
                    template = np.array(
                        [
                            0, lda, k, laid_out.ctypes.data, tiles, 0, m, n,
                            shift.ctypes.data, activate, depth, per_unit, row_block, chunks, block_rows,
                        ],
                        np.int64,
                    )
                    job = (template, -(-m // row_block) * chunks)
                    if len(panels.jobs) < _JOB_LIMIT:
                        panels.jobs[key] = job
                context = job[0].copy()
                context[loops.JOB_A] = a.ctypes.data
                context[loops.JOB_C] = out.ctypes.data
                pool.run(loops.panel_job.address, context, job[1], threads)
            else:
                parallel_for(tiles, block, work, threads=threads, chunks_per_thread=2)
            if bias is not None and not fused:
                np.add(out, bias, out=out)

        def blas_body() -> bool:
            _blas_product(out, a, w, bias, work)
            return bool(activate and gelu_pass is not None and gelu_pass(out))

        finished: list[bool] = []
        if preferred_body(
            (m, k, n, threads, bool(activate)), packed_body, lambda: finished.append(blas_body())
        ):
            return bool(activate)
        return bool(finished and finished[0])
    _blas_product(out, a, w, bias, work)
    return False


def _few_rows(loops: Any, out: np.ndarray, a: np.ndarray, panels: np.ndarray, bias: np.ndarray | None, gelu: int) -> bool:
    """``out = a @ w + bias`` (then the GELU ``gelu`` names) for ``a`` of fewer rows than a packed row
    tile, its rows contiguous: the weight's panels streamed once, split over the threads
    by blocks of panels (``_numba_dense.few_rows_job``). Returns whether the GELU ran."""
    m, k = a.shape
    tiles, n = panels.shape[0], out.shape[1]
    fused = bias is None or bias.flags.c_contiguous
    shift = bias if fused and bias is not None else zero_vector(n)
    activate = int(gelu) if fused else GELU_NONE  # the GELU comes after the bias: in the loops only with it
    pool = compiled_pool()
    threads = min(tiles, parallel_threads(max(m, _STREAMED_WEIGHT_COST) * n * k))  # a weight read, not its few multiply-adds if pool is not None else 1
    lda = a.strides[0] // a.itemsize
    if threads <= 1 or pool is None:
        loops.few_rows_product(a.ctypes.data, lda, m, panels, out, shift, activate, 0, tiles)
    else:
        per_unit = -(-tiles // threads)
        context = np.array(
            [a.ctypes.data, lda, m, k, panels.ctypes.data, tiles, out.ctypes.data, n, shift.ctypes.data, activate, per_unit],
            np.int64,
        )
        pool.run(loops.few_rows_job.address, context, -(-tiles // per_unit), threads)
    if bias is not None and not fused:
        np.add(out, bias, out=out)
    return bool(activate)


def _blas_product(out: np.ndarray, a: np.ndarray, w: np.ndarray, bias: np.ndarray | None, work: int) -> None:
    blas_threads(work)
    matmul(a, w, out=out)
    if bias is not None:
        np.add(out, bias, out=out)
