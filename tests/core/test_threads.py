"""Tests for plugrt.threads: BLAS threads per call from work size, session limit and free cores."""

from __future__ import annotations

import os

import numpy as np
import onnx.parser
import pytest

import plugrt
from plugrt import threads

BIG = threads.PARALLEL_MIN_WORK * 4


@pytest.fixture
def monitor(monkeypatch):
    """The contention monitor with a fixed view: 4 usable cores, ``others`` busy ones."""
    state = {"others": 0.0}
    monkeypatch.setattr(threads._MONITOR, "cores", 4)
    monkeypatch.setattr(threads._MONITOR, "others_busy", lambda: state["others"])
    yield state
    threads.begin_run(0)


def test_small_products_get_one_thread(monitor):
    threads.begin_run(0)
    assert threads.threads_for(threads.PARALLEL_MIN_WORK - 1) == 1
    assert threads.threads_for(BIG) == 4


def test_cores_other_processes_keep_busy_are_not_used(monitor):
    threads.begin_run(0)
    monitor["others"] = 1.0
    assert threads.threads_for(BIG) == 3
    monitor["others"] = 3.5
    assert threads.threads_for(BIG) == 1
    monitor["others"] = 0.1  # a daemon waking now and then still leaves the core free
    assert threads.threads_for(BIG) == 4


def test_session_limit_caps_the_count(monitor):
    threads.begin_run(2)
    assert threads.threads_for(BIG) == 2
    threads.begin_run(1)
    assert threads.threads_for(BIG) == 1


def _numpys_openblas_count(threadpoolctl):
    numpys = os.path.realpath(threads.openblas_libraries()[0])
    # scipy's OpenBLAS may be loaded too (scikit-learn's tests import it)
    (entry,) = [i for i in threadpoolctl.threadpool_info() if os.path.realpath(i["filepath"]) == numpys]
    return entry["num_threads"]


def test_blas_threads_sets_openblas_per_thread(monitor, monkeypatch):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if threads._BLAS.resolve() is None:
        pytest.skip("numpy's BLAS has no per-thread thread count")
    monkeypatch.setitem(threads._SINGLE, "blas", False)  # no provider splits products here
    threads.begin_run(0)
    monitor["others"] = 2.0  # two cores free
    numpys = os.path.realpath(threads.openblas_libraries()[0])

    def numpys_count():
        # scipy's OpenBLAS may be loaded too (scikit-learn's tests import it)
        (entry,) = [i for i in threadpoolctl.threadpool_info() if os.path.realpath(i["filepath"]) == numpys]
        return entry["num_threads"]

    assert threads.blas_threads(BIG) == 2
    assert numpys_count() == 2
    assert threads.blas_threads(1) == 1
    assert numpys_count() == 1


def test_once_a_provider_splits_products_itself_openblas_stays_on_one_thread(monitor, monkeypatch):
    """OpenBLAS's threads spin on their cores after each call: with the CPU provider's
    compiled pool (which calls keep_blas_single) even a big product on free cores gets one."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if threads._BLAS.resolve() is None:
        pytest.skip("numpy's BLAS has no per-thread thread count")
    monkeypatch.setitem(threads._SINGLE, "blas", False)
    threads.begin_run(0)
    assert threads.blas_threads(BIG) == 4
    threads.keep_blas_single()
    assert _numpys_openblas_count(threadpoolctl) == 1
    threads.begin_run(0)
    assert threads.blas_threads(BIG) == 1
    assert _numpys_openblas_count(threadpoolctl) == 1
    assert threads.threads_for(BIG) == 4  # the cores stay free for the provider's own splits


def test_numpys_own_openblas_comes_before_another_packages():
    numpy_dir = os.path.join("site-packages", "numpy")
    scipys = os.path.join("site-packages", "scipy.libs", "libscipy_openblas.so")
    numpys = os.path.join("site-packages", "numpy.libs", "libscipy_openblas64_.so")
    assert threads._numpy_first([scipys, numpys], numpy_dir) == [numpys, scipys]


def test_monitor_counts_other_processes_busy_time(monkeypatch):
    monitor = threads._Monitor()
    monitor.has_stat = True
    clock = {"now": 100.0, "own": 10.0, "jiffies": (1000, 4000)}
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(threads.time, "process_time", lambda: clock["own"])
    monkeypatch.setattr(threads, "_machine_jiffies", lambda: clock["jiffies"])
    monkeypatch.setattr(threads, "_runnable_others", lambda: 0.0)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monitor.others_busy()  # the first sample
    # one second later: the machine's two CPUs were 75% busy (1.5 cores), we used 0.5 s
    clock.update(now=101.0, own=10.5, jiffies=(1000 + 150, 4000 + 200))
    assert monitor.others_busy() == pytest.approx(1.0)
    # within the sample interval the estimate is reused, not re-read
    clock.update(now=101.0 + threads.SAMPLE_INTERVAL / 2, jiffies=(0, 0))
    assert monitor.others_busy() == pytest.approx(1.0)


_MATMUL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[512, 512] a, float[512, 512] b) => (float[512, 512] y) { y = MatMul(a, b) }
"""


def test_intra_op_num_threads_holds_per_session(monitor):
    model = onnx.parser.parse_model(_MATMUL).SerializeToString()
    feeds = {"a": np.ones((512, 512), np.float32), "b": np.ones((512, 512), np.float32)}
    one = plugrt.load(model, device="cpu", intra_op_num_threads=1)
    free = plugrt.load(model, device="cpu")
    np.testing.assert_array_equal(one.run(feeds)["y"], np.full((512, 512), 512, np.float32))
    assert threads.threads_for(BIG) == 1
    free.run(feeds)
    assert threads.threads_for(BIG) == 4
    one.run(feeds)
    assert threads.threads_for(BIG) == 1


def test_parallel_for_covers_every_index_once_in_several_chunks(monitor):
    threads.begin_run(0)
    seen = np.zeros(1000, dtype=np.int64)
    chunks = []

    def body(start, stop):
        chunks.append((start, stop))
        seen[start:stop] += 1

    threads.parallel_for(1000, body, BIG)
    assert (seen == 1).all()
    assert len(chunks) > 1


def test_parallel_for_runs_inline_when_other_processes_hold_the_cores(monitor):
    threads.begin_run(0)
    monitor["others"] = 3.5
    calls = []
    threads.parallel_for(1000, lambda a, b: calls.append((a, b)), BIG)
    assert calls == [(0, 1000)]


def test_parallel_for_runs_inline_below_the_work_threshold(monitor):
    threads.begin_run(0)
    calls = []
    threads.parallel_for(1000, lambda a, b: calls.append((a, b)), threads.PARALLEL_MIN_WORK - 1)
    assert calls == [(0, 1000)]


def test_parallel_for_keeps_to_the_session_limit(monitor):
    threads.begin_run(1)
    calls = []
    threads.parallel_for(1000, lambda a, b: calls.append((a, b)), BIG)
    assert calls == [(0, 1000)]


def test_parallel_for_raises_what_a_chunk_raised(monitor):
    threads.begin_run(0)

    def body(start, stop):
        if start <= 500 < stop:
            raise ValueError("chunk failed")

    with pytest.raises(ValueError, match="chunk failed"):
        threads.parallel_for(1000, body, BIG)


def test_parallel_for_nested_in_a_chunk_runs_inline(monitor):
    threads.begin_run(0)
    out = np.zeros((8, 100))
    inner_calls = []

    def inner(row, a, b):
        inner_calls.append((row, a, b))
        out[row, a:b] += 1

    def inner_rows(start, stop):
        for row in range(start, stop):
            threads.parallel_for(100, lambda a, b, row=row: inner(row, a, b), BIG)

    threads.parallel_for(8, inner_rows, BIG)
    assert (out == 1).all()
    assert sorted(inner_calls) == [(row, 0, 100) for row in range(8)]  # one whole call per row: inline


def test_split_threads_use_every_core_in_the_limit_busy_or_not(monitor):
    threads.begin_run(0)
    monitor["others"] = 3.5  # OpenBLAS's own threads would get 1 here
    assert threads.split_threads(BIG) == 4
    assert threads.split_threads(threads.PARALLEL_MIN_WORK - 1) == 1
    threads.begin_run(2)
    assert threads.split_threads(BIG) == 2
    threads.begin_run(1)
    assert threads.split_threads(BIG) == 1


def test_parallel_for_takes_an_explicit_thread_and_chunk_count(monitor):
    threads.begin_run(0)
    monitor["others"] = 3.5  # parallel_threads alone would run it inline
    chunks = []
    threads.parallel_for(1000, lambda a, b: chunks.append((a, b)), BIG, threads=2, chunks_per_thread=3)
    assert sorted(chunks) == [(0, 166), (166, 333), (333, 500), (500, 666), (666, 833), (833, 1000)]
