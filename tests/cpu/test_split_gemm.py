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
