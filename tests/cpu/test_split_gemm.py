"""split_gemm: a product split into output blocks over the pool's threads, one-thread BLAS each."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from plugrt import threads
from plugrt_cpu.kernels import _gemm


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(threads._MONITOR, "cores", 2)
    threads.begin_run(0)
    yield
    threads.begin_run(0)


@pytest.mark.parametrize(
    "m, k, n, transposed",
    [(256, 576, 784, False), (512, 2048, 49, False), (1, 4096, 1000, True), (64, 147, 3000, False), (3, 5, 7, False)],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_split_gemm_matches_numpy(two_cores, m, k, n, transposed, dtype):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((n, k)).astype(dtype).T if transposed else rng.standard_normal((k, n)).astype(dtype)
    c = rng.standard_normal((m, n)).astype(dtype)
    start = c.copy()
    _gemm.split_gemm(a, b, c, 1.0)
    expected = a.astype(np.float64) @ b.astype(np.float64) + start
    np.testing.assert_allclose(c, expected, rtol=1e-4 if dtype == np.float32 else 1e-10, atol=1e-3)


def test_split_gemm_shares_blocks_with_a_worker_thread(two_cores, monkeypatch):
    seen = set()
    product = _gemm.gemm

    def spy(a, b, c, beta=0.0):
        seen.add((threading.current_thread().name, c.shape))
        product(a, b, c, beta)
        time.sleep(0.05)  # long enough blocks that the worker, once woken, claims one

    monkeypatch.setattr(_gemm, "gemm", spy)
    a = np.ones((256, 512), np.float32)
    b = np.ones((512, 784), np.float32)
    c = np.empty((256, 784), np.float32)
    _gemm.split_gemm(a, b, c)
    assert (c == 512).all()
    names = {name for name, _ in seen}
    assert any(name.startswith("plugrt-worker") for name in names) and len(names) == 2
    assert all(shape[0] == 256 and shape[1] < 784 for _, shape in seen)  # column blocks


def test_small_products_stay_on_the_calling_thread(two_cores, monkeypatch):
    seen = []
    monkeypatch.setattr(_gemm, "gemm", lambda a, b, c, beta=0.0: seen.append(threading.current_thread().name))
    _gemm.split_gemm(np.ones((8, 8), np.float32), np.ones((8, 8), np.float32), np.empty((8, 8), np.float32))
    assert seen == [threading.current_thread().name]


def test_a_matrix_vector_product_by_a_large_weight_runs_on_blas_threads(two_cores, monkeypatch):
    """A classifier at batch 1 (1 x 1280 by 1280 x 1000) streams its weight from memory:
    counted by the weight's size, it gets both cores, as one call on BLAS's threads (1.28
    M multiply-adds alone are below the threshold for a second thread)."""
    assert 1280 * 1000 < threads.PARALLEL_MIN_WORK <= _gemm.product_work(1, 1000, 1280)
    counts, calls = [], []
    monkeypatch.setattr(_gemm, "blas_threads", lambda work: counts.append(threads.blas_threads(work)))
    product = _gemm.gemm
    monkeypatch.setattr(_gemm, "gemm", lambda a, b, c, beta=0.0: calls.append(c.shape) or product(a, b, c, beta))
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((1, 1280)).astype(np.float32), rng.standard_normal((1000, 1280)).astype(np.float32).T
    c = np.empty((1, 1000), np.float32)
    _gemm.split_gemm(a, b, c)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)
    assert counts == [2] and calls == [(1, 1000)]
    counts.clear()
    _gemm.split_gemm(a[:, :8], b[:8, :8], c[:, :8])  # a small one: one thread
    assert counts == [1]
