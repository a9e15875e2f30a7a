"""Compiled jobs over the host threads without the GIL (see ``_numba_parallel``).

``compiled_pool()`` is the process's pool, or None without numba (``PLUGRT_NUMBA=0``),
while its loops are being built, without an x86 CPU (the spin uses ``pause``), or without
a BLAS GEMM to call directly; callers then run their Python ``parallel_for`` path. Its
workers are ``plugrt.threads``' pool workers: between jobs they wait in the compiled
spin, and they still run Python ``parallel_for`` jobs.

The spin is bounded and taken only when the cores are free: a worker spins at most
``SPIN_SECONDS`` after its last job, and not at all while other processes keep the cores
busy (``plugrt.threads.free_cores``), where it blocks at once, as the Python pool's do.
"""

from __future__ import annotations

import ctypes
import platform
import threading
import time
from typing import Any, Callable

import numpy as np
from plugrt import threads

from ._compiled import compiled_module

__all__ = ["CompiledPool", "compiled_pool", "SPIN_SECONDS"]

# How long a worker spins after a job before it sleeps: longer than the Python steps
# between two Convs of a model (10-100 us), short enough that a run's end leaves a core
# busy for a fraction of a millisecond.
SPIN_SECONDS = 300e-6
# How long the calling thread spins for the workers' last units before it yields its core
# at each look (a worker another process took the core from then gets it back sooner).
_PATIENCE_SECONDS = 200e-6
_MAX_WORKERS = 63


class CompiledPool:
    """Runs compiled job bodies over the calling thread and the pool's workers."""

    def __init__(self, loops: Any) -> None:
        self.loops = loops
        words = loops.STATE_WORDS + loops.WORKER_WORDS * _MAX_WORKERS
        buffer = np.zeros(words + 8, np.int64)
        first = (-int(buffer.ctypes.data) % 64) // 8  # the fields' lines on 64-byte lines: no false sharing
        self.state = buffer[first : first + words]
        self.address = int(self.state.ctypes.data)
        # every worker counts as asleep until it first waits here, so that the first job
        # wakes the workers already blocked on the Python queue
        for worker in range(_MAX_WORKERS):
            self.state[loops.STATE_WORDS + loops.WORKER_WORDS * worker] = 1
        self.lock = threading.Lock()  # one job at a time; a second caller runs its own alone
        pause_seconds = self._pause_seconds()
        self.spin = max(1, int(SPIN_SECONDS / pause_seconds))
        self.patience = max(1, int(_PATIENCE_SECONDS / pause_seconds))
        self.sched_yield = _sched_yield_address()
        wait, address = loops.wait, self.address

        def worker_wait(worker: int) -> None:
            if worker < _MAX_WORKERS:  # the state has a line for each of these; the others only run Python jobs
                wait(address, worker)

        threads.set_worker_wait(worker_wait, lambda: loops.signal(address))
        threads.keep_blas_single()  # products split here (``_gemm.pooled_matmul``): OpenBLAS's threads would spin beside the workers

    def _pause_seconds(self) -> float:
        """Seconds one ``pause`` takes here (5-150 cycles, by CPU), measured once."""
        self.loops.spin(self.address, 64)  # compiled already; warms the call
        pauses = 4096
        started = time.perf_counter()
        self.loops.spin(self.address, pauses)
        return max(1e-9, (time.perf_counter() - started) / pauses)

    @staticmethod
    def slots(count: int, threads_: int) -> int:
        """The scratch slots a job of ``count`` units on ``threads_`` threads may use: its
        bodies get a ``slot`` below this."""
        return 1 if threads_ <= 1 or count <= 1 else min(threads_, count, _MAX_WORKERS + 1)

    def run(self, body: int, context: np.ndarray | int, count: int, threads_: int) -> None:
        """``body(context, u, u + 1, slot)`` for every unit ``u`` in ``[0, count)``, on
        this thread (slot 0) and up to ``threads_ - 1`` workers (slots from 1), every slot
        below ``slots(count, threads_)``. ``context`` (int64, or its address, when the
        caller keeps it alive) stays referenced until every unit has run."""
        loops = self.loops
        address = context if isinstance(context, int) else int(context.ctypes.data)
        if threads_ <= 1 or count <= 1 or not self.lock.acquire(blocking=False):
            loops.run_alone(body, address, count)
            return
        try:
            helpers = self.slots(count, threads_) - 1
            workers = threads.start_workers(helpers)
            spin = self.spin if threads.free_cores() >= threads_ - 0.7 else 0
            asleep = loops.publish(self.address, body, address, count, spin, workers, helpers)
            worker = 0
            while asleep:
                if asleep & 1:
                    threads.wake_worker(worker)
                asleep >>= 1
                worker += 1
            sequence = int(self.state[0])
            loops.participate(self.address, sequence, body, address, count, self.patience, self.sched_yield)
        finally:
            self.lock.release()


    def run_program(self, program: np.ndarray, answer: np.ndarray, refused: Callable[[int], None]) -> None:
        """The steps of ``program`` (rows of ``PROGRAM_WORDS``: see
        ``_numba_parallel.run_program``) in one compiled call, on the threads a job gets
        now (``plugrt.threads.threads_for``); ``refused(i)`` for a step whose serial
        function refused, which the caller runs its own way (or raises from) before the
        program goes on with the next step. ``answer``: two int64 words of the caller's
        (a replay allocates nothing)."""
        loops = self.loops
        count = min(threads.threads_for(threads.PARALLEL_MIN_WORK), _MAX_WORKERS + 1)
        locked = count > 1 and self.lock.acquire(blocking=False)  # else a job at a time: this one alone
        try:
            if locked:
                workers = threads.start_workers(count - 1)
                spin = self.spin if threads.free_cores() >= count - 0.7 else 0
            else:
                count, workers, spin = 1, 0, 0
            steps, start = len(program), 0
            while start < steps:
                at = loops.run_program(
                    program, start, self.address, count, spin, workers, self.patience, self.sched_yield, answer
                )
                if at == steps:
                    return
                if at < 0:
                    refused(-at - 1)
                    start = -at
                    continue
                asleep, worker = int(answer[0]), 0  # step ``at`` was published to sleeping workers
                while asleep:
                    if asleep & 1:
                        threads.wake_worker(worker)
                    asleep >>= 1
                    worker += 1
                body, context = int(program[at, 1]), int(program[at, 2])
                loops.participate(
                    self.address, int(self.state[0]), body, context, int(answer[1]), self.patience, self.sched_yield
                )
                start = at + 1
        finally:
            if locked:
                self.lock.release()


def _sched_yield_address() -> int:
    try:
        return int(ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value or 0)
    except (OSError, AttributeError):
        return 0


_POOL: list[CompiledPool] = []  # the process's pool, once made
_POOL_LOCK = threading.Lock()


def compiled_pool() -> CompiledPool | None:
    """The compiled pool, made on first use once its loops are ready, or None where it
    cannot run (see the module) or before then. Kept once made: its workers wait in its
    state."""
    if _POOL:
        return _POOL[0]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    loops = compiled_module("_numba_parallel")
    if loops is None:
        return None
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(CompiledPool(loops))
    return _POOL[0]
