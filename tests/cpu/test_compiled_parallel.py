"""The compiled jobs' pool (``plugrt_cpu.kernels._compiled_parallel``): every unit runs
once, pool workers take units without the GIL, Python jobs still run on the same
workers, concurrent callers each get their own job done, and a worker stops spinning."""

from __future__ import annotations

import functools
import threading
import time

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from plugrt import threads  # noqa: E402


@pytest.fixture(scope="module")
def bodies(pool):
    """Job bodies compiled for the tests. Context (int64): [counts address, slots address,
    units, a wait flag address]."""
    from plugrt_cpu.kernels._numba_parallel import fetch_add, int64_pointer, load, pause

    signature = numba.void(numba.int64, numba.int64, numba.int64, numba.int64)

    @numba.cfunc(signature, nogil=True)
    def count(c, start, stop, slot):  # each unit adds one to its count and records its thread
        context = numba.carray(int64_pointer(c), 4)
        for unit in range(start, stop):
            fetch_add(context[0] + 8 * unit, 1)
            fetch_add(context[1] + 8 * slot, 1)

    @numba.cfunc(signature, nogil=True)
    def meet(c, start, stop, slot):
        """A unit that holds its thread until a unit has run on another one (or ~2 s)."""
        context = numba.carray(int64_pointer(c), 4)
        for unit in range(start, stop):
            fetch_add(context[0] + 8 * unit, 1)
            fetch_add(context[1] + 8 * slot, 1)
            if fetch_add(context[3], 1) == 0:  # the first unit waits for a second thread
                for _ in range(100_000_000):
                    others = 0
                    for s in range(64):
                        if s != slot and load(context[1] + 8 * s) > 0:
                            others += 1
                    if others:
                        break
                    pause()

    return {"count": count, "meet": meet}


def _context(units: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    counts = np.zeros(units, np.int64)
    slots = np.zeros(64, np.int64)
    flag = np.zeros(1, np.int64)
    context = np.array([counts.ctypes.data, slots.ctypes.data, units, flag.ctypes.data], np.int64)
    return context, counts, slots, flag


def test_every_unit_runs_once_on_two_threads(pool, bodies):
    for units in (2, 3, 17, 1000):
        context, counts, slots, _ = _context(units)
        pool.run(bodies["count"].address, context, units, 2)
        assert counts.tolist() == [1] * units
        assert slots.sum() == units


def test_a_worker_takes_units_while_the_caller_holds_one(pool, bodies):
    """The first unit claimed waits until another thread has run a unit: the job only
    ends early if a worker took units, GIL-free, while the caller sat in compiled code."""
    context, counts, slots, _ = _context(8)
    started = time.perf_counter()
    pool.run(bodies["meet"].address, context, 8, 2)
    assert counts.tolist() == [1] * 8
    assert np.count_nonzero(slots) == 2, slots[:4]
    assert time.perf_counter() - started < 1.5  # not the unit's 2 s time-out


def test_one_thread_runs_every_unit_on_the_caller(pool, bodies):
    context, counts, slots, _ = _context(10)
    pool.run(bodies["count"].address, context, 10, 1)
    assert counts.tolist() == [1] * 10
    assert slots[0] == 10


def _add_one(out: np.ndarray, start: int, stop: int) -> None:
    out[start:stop] += 1


def test_python_jobs_still_run_on_the_workers_between_compiled_jobs(pool, bodies):
    for round_ in range(20):
        context, counts, _, _ = _context(16)
        pool.run(bodies["count"].address, context, 16, 2)
        assert counts.tolist() == [1] * 16
        out = np.zeros(64)
        threads.parallel_for(64, functools.partial(_add_one, out), 1 << 30, threads=2)
        assert out.tolist() == [1.0] * 64
        if round_ % 5 == 4:
            time.sleep(0.01)  # the worker has stopped spinning: it is woken from its queue


def test_callers_on_several_threads_each_get_their_job_done(pool, bodies):
    errors: list[BaseException] = []

    def caller(seed: int) -> None:
        try:
            for units in range(2, 60):
                context, counts, _, _ = _context(units + seed)
                pool.run(bodies["count"].address, context, units + seed, 2)
                assert counts.tolist() == [1] * (units + seed)
        except BaseException as e:  # re-raised below
            errors.append(e)

    callers = [threading.Thread(target=caller, args=(seed,)) for seed in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(60)
    assert not errors, errors[0]
    assert not any(t.is_alive() for t in callers)


def _worker_sleeping(pool) -> bool:
    return bool(pool.state[pool.loops.STATE_WORDS])  # worker 0's sleeping flag


def test_a_worker_stops_spinning_soon_after_its_last_job(pool, bodies):
    context, counts, _, _ = _context(8)
    pool.run(bodies["count"].address, context, 8, 2)
    deadline = time.monotonic() + 2.0  # the spin is SPIN_SECONDS (0.3 ms) of pauses
    while not _worker_sleeping(pool) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert _worker_sleeping(pool)


def test_workers_do_not_spin_while_other_processes_hold_the_cores(pool, bodies, monkeypatch):
    monkeypatch.setattr(threads, "free_cores", lambda: 1.0)
    context, counts, _, _ = _context(8)
    pool.run(bodies["count"].address, context, 8, 2)
    assert counts.tolist() == [1] * 8
    assert pool.state[32] == 0  # the job's spin count (_numba_parallel's _SPIN word)
    monkeypatch.setattr(threads, "free_cores", lambda: 2.0)
    pool.run(bodies["count"].address, context, 8, 2)
    assert pool.state[32] == pool.spin > 0


def test_workers_beyond_a_jobs_threads_take_no_unit(pool, bodies):
    """A job sized for two threads (its bodies' scratch has two slots) is not touched by
    the third and fourth workers another session started."""
    threads.start_workers(3)
    for _ in range(50):
        context, counts, slots, _ = _context(64)
        pool.run(bodies["count"].address, context, 64, 2)
        assert counts.tolist() == [1] * 64
        assert slots[2:].sum() == 0, slots[:4]
    assert pool.slots(64, 2) == 2 and pool.slots(1, 2) == 1 and pool.slots(64, 1) == 1


def test_the_worker_a_job_wakes_is_the_one_it_needs(pool, bodies):
    """With more workers asleep than a job uses, the wake-up reaches the job's own worker
    (a shared queue let another worker take it, and the job ran alone from then on)."""
    threads.start_workers(3)
    for _ in range(5):
        time.sleep(0.005)  # every worker has stopped spinning and sleeps on its queue
        context, counts, slots, _ = _context(8)
        pool.run(bodies["meet"].address, context, 8, 2)
        assert counts.tolist() == [1] * 8
        assert np.count_nonzero(slots) == 2 and slots[2:].sum() == 0, slots[:4]
