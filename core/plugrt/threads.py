"""Host threads per call: how many BLAS threads a product may use, from its size, the session's limit and the cores free now.

numpy's OpenBLAS splits every large GEMM statically between its threads, so when another
process holds a core each call waits for the descheduled thread: 5-20x slower than one
thread, whatever the size. Here a call gets two or more threads only when it is big
enough to gain from them and when the cores are free: this process's affinity, minus what
other processes used over the last ~100 ms (``/proc/stat`` less our own CPU time, sampled
at most every ``SAMPLE_INTERVAL`` seconds, a few microseconds each). OpenBLAS 0.3.27+
takes the count per calling thread (``openblas_set_num_threads_local``), so sessions on
different threads keep their own; the call is made only when the count changes.

Kernels call ``blas_threads(work)`` before a BLAS call of ``work`` multiply-adds; a
session calls ``begin_run(limit)`` before each run (``intra_op_num_threads``, 0 = every
usable core), which also sets the count for products no kernel sized.

Products big enough to split are split by the kernels themselves instead
(``split_threads``): blocks of the output claimed by this thread and sleeping pool
workers, each with one-thread BLAS. A worker that sleeps is scheduled as soon as it is
woken, even on a core another process keeps busy, and leaves no spinning thread behind
to slow whatever runs next (OpenBLAS's own threads spin for a while after each call).

Where a provider splits every product it can over a pool of its own
(``keep_blas_single``: the CPU provider's compiled pool), OpenBLAS stays on one thread
for every call: after each call its threads spin on their cores for OpenBLAS's thread
timeout (~0.1 s), taking them from the pool's next step and from whatever else the
process runs next (measured: onnxruntime's MobileViT run 18-21 ms beside plugrt with
one-thread BLAS, 29 ms beside OpenBLAS's spinning threads; plugrt's own 27-33 against
33-51 ms).

``parallel_for(count, body, work)`` is the other way to use several cores: ``body(start,
stop)`` runs over chunks of ``range(count)`` that the calling thread and pool workers
claim one at a time, each with one BLAS thread, so work BLAS does not thread (many small
products, numpy's elementwise loops) uses the free cores too.

A provider may lend the pool's workers a GIL-free wait (``set_worker_wait``): the CPU
provider's compiled jobs (``plugrt_cpu.kernels._compiled_parallel``) run there, and the
workers spin a bounded time between them, only while the cores are free.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import queue
import threading
import time
from typing import Any, Callable

__all__ = [
    "SAMPLE_INTERVAL",
    "PARALLEL_MIN_WORK",
    "begin_run",
    "blas_threads",
    "threads_for",
    "split_threads",
    "free_cores",
    "keep_blas_single",
    "parallel_for",
    "parallel_threads",
    "openblas_libraries",
    "set_worker_wait",
    "start_workers",
    "wake_worker",
]

SAMPLE_INTERVAL = 0.1  # seconds between two readings of /proc/stat
# Multiply-adds below which a second BLAS thread costs about what it saves (a 2-core Zen3
# / Xeon: ~68 GFLOP/s on one thread, ~130 on two, tens of microseconds to wake a thread).
PARALLEL_MIN_WORK = 1 << 22
# Another process's use of a core, in cores, that still counts the core as free: short
# daemons and our own accounting noise (jiffies) stay below it, a busy process does not.
_BUSY_TOLERANCE = 0.3
# Chunks per participating thread in parallel_for: enough that a thread which loses its
# core leaves little behind, few enough that claiming them (~2 us each) stays negligible.
_CHUNKS_PER_THREAD = 4


class _Monitor:
    """Cores other processes keep busy, measured lazily and shared by every thread (a race
    between two threads only takes one extra sample)."""

    def __init__(self) -> None:
        self.sampled_at = -1.0
        self.machine: tuple[int, int] | None = None  # busy and total jiffies at the last sample
        self.own = 0.0  # this process's CPU seconds at the last sample
        self.cores = _affinity()
        self.others = 0.0  # cores busy with other processes over the last interval
        self.has_stat = os.path.exists("/proc/stat")

    def others_busy(self) -> float:
        now = time.monotonic()
        if now - self.sampled_at < SAMPLE_INTERVAL:
            return self.others
        previous_at, previous, previous_own = self.sampled_at, self.machine, self.own
        self.sampled_at = now
        self.cores = _affinity()
        own = time.process_time()
        machine = _machine_jiffies() if self.has_stat else None
        self.machine, self.own = machine, own
        if machine is None or previous is None:
            self.others = _runnable_others()  # first call (or no /proc/stat): an instantaneous count
            return self.others
        busy, total = machine[0] - previous[0], machine[1] - previous[1]
        elapsed = now - previous_at
        if total <= 0 or elapsed <= 0:
            return self.others
        online = os.cpu_count() or 1
        machine_busy = busy / total * online  # cores busy over the interval, everyone
        self.others = max(0.0, machine_busy - (own - previous_own) / elapsed)
        return self.others


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _read_head(path: str, size: int = 512) -> bytes:
    """The first ``size`` bytes of a /proc file, without a buffered file object (a replay
    that happens to take a sample then allocates a few hundred bytes, not kilobytes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


def _machine_jiffies() -> tuple[int, int] | None:
    """Busy and total jiffies of all CPUs (the first line of /proc/stat)."""
    try:
        fields = _read_head("/proc/stat").split(b"\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu":
        return None
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    total = sum(values)
    return total - values[3] - values[4], total


def _runnable_others() -> float:
    """Other runnable threads right now (``/proc/loadavg``'s running count, less this one),
    or the 1-minute load average where there is none."""
    try:
        running = int(_read_head("/proc/loadavg").split()[3].split(b"/")[0])
        return float(max(0, running - 1))
    except (OSError, IndexError, ValueError):
        pass
    try:
        return max(0.0, os.getloadavg()[0] - 1)
    except (AttributeError, OSError):
        return 0.0


_MONITOR = _Monitor()


class _Blas:
    """The per-thread thread count of numpy's OpenBLAS, when it has one."""

    def __init__(self) -> None:
        self.set_local: Any = None
        self.resolved = False
        self.lock = threading.Lock()

    def resolve(self) -> Any:
        with self.lock:
            if not self.resolved:
                self.set_local = _find_set_local()
                self.resolved = True
        return self.set_local


def _numpy_first(paths: list[str], numpy_dir: str) -> list[str]:
    """``paths`` with the libraries numpy's wheel bundles (in ``numpy/`` or ``numpy.libs/``)
    first: another package's OpenBLAS (scipy's, which scikit-learn loads) may lie at a lower
    address, and only numpy's runs numpy's products."""
    roots = (numpy_dir + os.sep, numpy_dir + ".libs" + os.sep)
    return sorted(paths, key=lambda path: not path.startswith(roots))


def openblas_libraries() -> list[str]:
    """Paths of the OpenBLAS shared libraries mapped into this process (numpy's first, once
    it is imported), from /proc/self/maps; empty without /proc or another BLAS."""
    import numpy  # (loads its BLAS)

    paths: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if "openblas" in os.path.basename(path).lower() and ".so" in path and path not in paths:
                    paths.append(path)
    except OSError:
        return []
    return _numpy_first(paths, os.path.dirname(os.path.realpath(numpy.__file__)))


def _find_set_local() -> Any:
    """``openblas_set_num_threads_local`` of the OpenBLAS numpy loaded, or None (another
    BLAS, an older OpenBLAS, no /proc): then counts are left to the library."""
    for path in openblas_libraries():
        try:
            function = ctypes.CDLL(path).openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        function.argtypes = [ctypes.c_int]
        function.restype = ctypes.c_int
        return function
    return None


_BLAS = _Blas()
_LOCAL = threading.local()  # .limit: the running session's; .count: what OpenBLAS has for this thread


def free_cores() -> float:
    """Usable cores minus those other processes kept busy over the last ~100 ms."""
    return max(0.0, _MONITOR.cores - _MONITOR.others_busy())


def threads_for(work: int) -> int:
    """Threads worth using for ``work`` multiply-adds (or comparable element operations)
    on this thread now: 1 for small work, else the free cores within the session's limit."""
    limit = getattr(_LOCAL, "limit", 0) or _MONITOR.cores
    if work < PARALLEL_MIN_WORK or limit <= 1:
        return 1
    return max(1, min(limit, int(free_cores() + _BUSY_TOLERANCE)))


def split_threads(work: int) -> int:
    """Threads to split a product of ``work`` multiply-adds over, each running one-thread
    BLAS on its own block (``plugrt_cpu``'s ``split_gemm``): 1 for small work or inside a
    parallel chunk, else every usable core within the session's limit, busy or not. The
    pool's workers sleep between jobs, so one woken on a core another process keeps busy
    is scheduled at once and takes its share; the blocks are claimed dynamically, so a
    slower core does fewer (OpenBLAS's own threads spin between calls and split
    statically, which is why they are gated by the free cores instead)."""
    if getattr(_LOCAL, "in_parallel", False) or work < PARALLEL_MIN_WORK:
        return 1
    limit = getattr(_LOCAL, "limit", 0) or _MONITOR.cores
    return max(1, min(limit, _MONITOR.cores))


_SINGLE = {"blas": False}  # keep_blas_single() was called: OpenBLAS never threads


def keep_blas_single() -> None:
    """From now on every BLAS call of this process runs on one OpenBLAS thread: a provider
    that splits products over its own pool calls this once it has the pool (see the module)."""
    _SINGLE["blas"] = True
    _set_blas_count(1)


def blas_threads(work: int) -> int:
    """Set this thread's BLAS thread count for a product of ``work`` multiply-adds; returns
    it (always 1 after ``keep_blas_single``)."""
    count = 1 if _SINGLE["blas"] or getattr(_LOCAL, "in_parallel", False) else threads_for(work)
    _set_blas_count(count)
    return count


def begin_run(limit: int) -> None:
    """A session's run starts on this thread: its limit (0: every usable core) holds until
    the next ``begin_run``, and BLAS calls no kernel sized get the count for a large product."""
    _LOCAL.limit = limit
    blas_threads(PARALLEL_MIN_WORK)


def parallel_threads(work: int) -> int:
    """Threads ``parallel_for`` uses for ``work`` element operations or multiply-adds: as
    many as a BLAS call of that size would get (``threads_for``), and 1 inside a chunk.
    Busy cores lower it too: with another process on a core, a worker that is descheduled
    holds its chunk for a time slice, and one thread measured faster."""
    if getattr(_LOCAL, "in_parallel", False):
        return 1
    return threads_for(work)


class _Job:
    """One parallel_for call: chunks claimed through an atomic counter, bounds computed
    from the chunk index (a replay's parallel_for allocates a few hundred bytes, no list)."""

    __slots__ = ("body", "count", "chunks", "claims", "left", "lock", "done", "error")

    def __init__(self, body: Callable[[int, int], Any], count: int, chunks: int) -> None:
        self.body = body
        self.count = count
        self.chunks = chunks
        self.claims = itertools.count()  # next() is atomic under the GIL
        self.left = chunks
        self.lock = threading.Lock()
        self.done = threading.Lock()  # held until the last chunk finishes
        self.done.acquire()
        self.error: BaseException | None = None

    def work(self) -> None:
        count, chunks = self.count, self.chunks
        while True:
            index = next(self.claims)
            if index >= chunks:
                return
            try:
                if self.error is None:
                    self.body(index * count // chunks, (index + 1) * count // chunks)
            except BaseException as e:  # re-raised on the calling thread
                self.error = e
            finally:
                with self.lock:
                    self.left -= 1
                    if self.left == 0:
                        self.done.release()

    def wait(self) -> None:
        self.done.acquire()


class _Pool:
    """Daemon worker threads that run parallel_for jobs, started on first use; each has
    its own queue, so that a job (or a wake-up) reaches the workers it is meant for.

    A provider may give the workers a GIL-free wait (``set_worker_wait``): a worker then
    calls ``wait(index)`` before it blocks on its queue, and that call may run the
    provider's own compiled jobs and spin for a bounded time; it returns when Python jobs
    may be queued (``submit`` calls ``notify``) or when it stops waiting. The provider wakes
    a blocked worker with ``wake_worker``: the worker then calls ``wait`` again."""

    def __init__(self) -> None:
        self.queues: list[queue.SimpleQueue] = []
        self.lock = threading.Lock()
        self.wait: Callable[[int], Any] | None = None
        self.notify: Callable[[], Any] | None = None

    @property
    def size(self) -> int:
        return len(self.queues)

    def grow(self, workers: int) -> None:
        if len(self.queues) < workers:
            with self.lock:
                while len(self.queues) < workers:
                    tasks: queue.SimpleQueue = queue.SimpleQueue()
                    index = len(self.queues)
                    self.queues.append(tasks)
                    threading.Thread(target=self._serve, args=(index, tasks), name=f"plugrt-worker-{index}", daemon=True).start()

    def submit(self, job: _Job, helpers: int) -> None:
        self.grow(helpers)
        for tasks in self.queues[:helpers]:
            tasks.put(job)
        notify = self.notify
        if notify is not None:
            notify()

    def _serve(self, index: int, tasks: queue.SimpleQueue) -> None:
        _LOCAL.in_parallel = True  # a body that calls parallel_for runs it inline
        _set_blas_count(1)
        while True:
            wait = self.wait
            if wait is not None:
                wait(index)
            task = tasks.get()
            if task is not None:  # None: a wake-up, to wait again
                task.work()


_POOL = _Pool()


def set_worker_wait(wait: Callable[[int], Any] | None, notify: Callable[[], Any] | None) -> None:
    """Give the pool's workers a wait to call before they block (see ``_Pool``), and the
    call that tells it Python jobs are queued; ``None, None`` removes them."""
    _POOL.wait, _POOL.notify = wait, notify


def start_workers(count: int) -> int:
    """Start pool workers until there are ``count``; returns how many there are."""
    _POOL.grow(count)
    return _POOL.size


def wake_worker(index: int) -> None:
    """Wake worker ``index`` if it is blocked on its queue, so that it calls the wait given
    to ``set_worker_wait`` again."""
    _POOL.queues[index].put(None)


def _set_blas_count(count: int) -> None:
    if getattr(_LOCAL, "count", None) != count:
        set_local = _BLAS.set_local if _BLAS.resolved else _BLAS.resolve()
        if set_local is not None:
            set_local(count)
        _LOCAL.count = count


def parallel_for(
    count: int,
    body: Callable[[int, int], Any],
    work: int,
    *,
    grain: int = 1,
    threads: int | None = None,
    chunks_per_thread: int = _CHUNKS_PER_THREAD,
) -> None:
    """Run ``body(start, stop)`` over ``range(count)`` in chunks of at least ``grain``, on
    this thread and ``threads - 1`` pool workers (by default ``parallel_threads(work)``),
    each chunk with one BLAS thread; ``chunks_per_thread`` chunks per thread. Chunks must
    write disjoint outputs. The first exception a chunk raises is raised here once every
    claimed chunk has finished."""
    if threads is None:
        threads = parallel_threads(work)
    if count <= grain:
        threads = 1
    if threads <= 1:
        body(0, count)
        return
    chunks = max(1, min(threads * chunks_per_thread, count // max(1, grain)))
    if chunks == 1:
        body(0, count)
        return
    job = _Job(body, count, chunks)
    previous = getattr(_LOCAL, "count", None)
    _set_blas_count(1)
    _LOCAL.in_parallel = True
    try:
        _POOL.submit(job, min(threads, chunks) - 1)
        job.work()
        job.wait()
    finally:
        _LOCAL.in_parallel = False
        if previous is not None:
            _set_blas_count(previous)
    if job.error is not None:
        raise job.error
