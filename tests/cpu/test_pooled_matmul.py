"""Products split on the compiled pool with one-thread BLAS each (``_gemm.pooled_matmul``):
the values of a float64 numpy product, every layout cblas reads, a batch with one operand
shared, and the cases it leaves to numpy (without numba, all of them: numpy's matmul,
OpenBLAS's threads included, as before)."""

from __future__ import annotations

import os

import numpy as np
import onnx.parser
import pytest

import plugrt
from plugrt import threads
from plugrt_cpu.kernels import _gemm
from plugrt_cpu.kernels._compiled import compiled_module

from cpu.numba_paths import PATHS, numba_or_numpy

BIG = threads.PARALLEL_MIN_WORK * 2


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    yield from numba_or_numpy(request, monkeypatch, lambda: compiled_module("_numba_dense"))


@pytest.fixture
def two_cores(monkeypatch):
    """Two usable cores, both free, so that a big product splits."""
    monkeypatch.setattr(threads._MONITOR, "cores", 2)
    monkeypatch.setattr(threads._MONITOR, "others_busy", lambda: 0.0)
    threads.begin_run(0)
    yield
    threads.begin_run(0)


def _operand(rng: np.random.Generator, shape: tuple[int, ...], transposed: bool) -> np.ndarray:
    """A float32 array of ``shape``, stored with its last two axes swapped when ``transposed``."""
    values = rng.standard_normal(shape).astype(np.float32)
    if not transposed:
        return values
    return np.ascontiguousarray(np.swapaxes(values, -1, -2)).swapaxes(-1, -2)


# (a's shape, b's shape): one product of either aspect, a batch, a batch with b shared,
# and a batch of fewer matrices than threads (each split in blocks)
SHAPES = [
    ((300, 200), (200, 500)),  # more columns: blocks of columns
    ((700, 300), (300, 40)),  # far more rows: blocks of rows
    ((6, 4, 64, 48), (6, 4, 48, 80)),
    ((5, 197, 64), (64, 197)),
    ((1, 160, 300), (1, 300, 140)),
]


@pytest.mark.parametrize("a_shape, b_shape", SHAPES)
@pytest.mark.parametrize("transposed", [(False, False), (True, False), (False, True), (True, True)])
def test_split_product_matches_numpys_in_float64(path, two_cores, a_shape, b_shape, transposed):
    rng = np.random.default_rng(7)
    a, b = _operand(rng, a_shape, transposed[0]), _operand(rng, b_shape, transposed[1])
    out = np.full(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), np.nan, np.float32)
    assert _gemm.pooled_matmul(a, b, out) == (path == "numba")  # no compiled pool: numpy's matmul
    if path == "numpy":
        _gemm.matmul(a, b, out=out)
    expected = np.matmul(a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def _pool_jobs(pool, monkeypatch) -> list[tuple[int, int]]:
    """The (units, threads) of every job the compiled pool runs from now on."""
    calls: list[tuple[int, int]] = []
    original = type(pool).run

    def run(self, body, context, count, threads_):
        calls.append((count, threads_))
        return original(self, body, context, count, threads_)

    monkeypatch.setattr(type(pool), "run", run)
    return calls


def test_a_big_product_runs_as_several_units_on_the_pool(two_cores, pool, monkeypatch):
    calls = _pool_jobs(pool, monkeypatch)
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((256, 256)).astype(np.float32), rng.standard_normal((256, 512)).astype(np.float32)
    out = np.empty((256, 512), np.float32)
    assert _gemm.pooled_matmul(a, b, out)
    assert calls == [(2, 2)]  # one block of columns a thread
    np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)
    calls.clear()
    batch = rng.standard_normal((3, 64, 64)).astype(np.float32)
    assert _gemm.pooled_matmul(batch, batch, np.empty((3, 64, 64), np.float32)) is False  # small: numpy's
    big = rng.standard_normal((12, 128, 128)).astype(np.float32)
    assert _gemm.pooled_matmul(big, big, np.empty((12, 128, 128), np.float32))
    assert calls == [(24, 2)]  # 12 products in two blocks each: 8 units a thread at least


@pytest.mark.parametrize("rows", [1, 3])
def test_a_classifiers_few_rows_by_a_big_weight_split_by_columns(two_cores, pool, monkeypatch, rows):
    """1 x 1280 @ 1280 x 1000 (a CNN's classifier, 5 MB of weight) has 1.3 M multiply-adds,
    under ``PARALLEL_MIN_WORK``, but takes as long as the weight's read: it is split in a
    block of columns a thread, by MatMul's ``pooled_matmul`` and by Gemm's ``split_gemm``,
    with float64 numpy's values; a small weight (64 x 64) is not split."""
    calls = _pool_jobs(pool, monkeypatch)
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((rows, 1280)).astype(np.float32), rng.standard_normal((1280, 1000)).astype(np.float32)
    assert rows * 1280 * 1000 < threads.PARALLEL_MIN_WORK
    expected = a.astype(np.float64) @ b
    out = np.full((rows, 1000), np.nan, np.float32)
    assert _gemm.pooled_matmul(a, b, out)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-3)
    out[:] = np.nan
    _gemm.split_gemm(a, b, out)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-3)
    assert calls == [(2, 2), (2, 2)]
    small = np.empty((rows, 64), np.float32)
    assert not _gemm.pooled_matmul(a[:, :64], b[:64, :64], small)


def test_heads_of_a_transposed_projection_are_one_job(path, two_cores, pool, monkeypatch):
    """Attention's heads cut from one projection and transposed ((4, 256, 4, 24) viewed as
    (4, 4, 256, 24): batch strides that do not fold into one) are one job on the pool, each
    matrix found by its two batch indices, with float64 numpy's values; three batch axes
    that fold into no fewer than three strides are left to numpy."""
    calls = _pool_jobs(pool, monkeypatch)
    rng = np.random.default_rng(5)
    q = rng.standard_normal((4, 256, 4, 24)).astype(np.float32).transpose(0, 2, 1, 3)
    k = rng.standard_normal((4, 256, 4, 24)).astype(np.float32).transpose(0, 2, 3, 1)  # (4, 4, 24, 256)
    out = np.full((4, 4, 256, 256), np.nan, np.float32)
    assert _gemm.pooled_matmul(q, k, out) == (path == "numba")
    if path == "numba":
        assert [count for count, _ in calls] == [16]
        np.testing.assert_allclose(out, np.matmul(q.astype(np.float64), k), rtol=1e-4, atol=1e-3)
    mixed = rng.standard_normal((3, 64, 2, 5, 64)).astype(np.float32).transpose(2, 0, 3, 1, 4)  # (2, 3, 5, 64, 64)
    other = rng.standard_normal((2, 3, 5, 64, 64)).astype(np.float32)
    assert not _gemm.pooled_matmul(mixed, other, np.empty((2, 3, 5, 64, 64), np.float32))
    # the same product with the left operand contiguous is taken: only the layout refused it
    assert _gemm.pooled_matmul(np.ascontiguousarray(mixed), other, np.empty((2, 3, 5, 64, 64), np.float32)) == (path == "numba")


def test_what_it_does_not_take_is_left_to_numpy(two_cores):
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((256, 256)), rng.standard_normal((256, 256))
    assert not _gemm.pooled_matmul(a, b, np.empty((256, 256)))  # float64
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    assert not _gemm.pooled_matmul(a32[:, ::2], b32[::2], np.empty((256, 256), np.float32))  # no unit-step axis
    assert not _gemm.pooled_matmul(a32, b32, np.empty((256, 512), np.float32)[:, ::2])  # out not C-contiguous
    batch_a = rng.standard_normal((2, 1, 128, 256)).astype(np.float32)
    batch_b = rng.standard_normal((1, 3, 256, 128)).astype(np.float32)  # broadcast batch axes on both
    assert not _gemm.pooled_matmul(batch_a, batch_b, np.empty((2, 3, 128, 128), np.float32))
    got = _gemm.matmul(batch_a, batch_b)  # the helper falls back to numpy's matmul
    np.testing.assert_allclose(got, np.matmul(batch_a.astype(np.float64), batch_b), rtol=1e-4, atol=1e-3)


_MATMUL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[4, 8, 96, 64] a, float[4, 8, 64, 96] b) => (float[4, 8, 96, 96] y) { y = MatMul(a, b) }
"""


def test_a_sessions_batched_matmul_is_split_and_leaves_blas_on_one_thread(path, two_cores, monkeypatch):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if path == "numpy":  # no provider's pool: OpenBLAS may thread a big product
        monkeypatch.setitem(threads._SINGLE, "blas", False)
    rng = np.random.default_rng(3)
    feeds = {"a": rng.standard_normal((4, 8, 96, 64)).astype(np.float32), "b": rng.standard_normal((4, 8, 64, 96)).astype(np.float32)}
    session = plugrt.load(onnx.parser.parse_model(_MATMUL).SerializeToString(), device="cpu")
    got = session.run(feeds)["y"]
    np.testing.assert_allclose(got, np.matmul(feeds["a"].astype(np.float64), feeds["b"]), rtol=1e-4, atol=1e-3)
    if threads._BLAS.resolve() is not None:
        numpys = os.path.realpath(threads.openblas_libraries()[0])
        mine = [i["num_threads"] for i in threadpoolctl.threadpool_info() if os.path.realpath(i["filepath"]) == numpys]
        assert mine == ([1] if path == "numba" else [2])  # the monitor's two free cores
