"""Counters of one compiled partition (kernel-plan cache look-ups and control-flow runs),
and of the arrays a capture's replay allocates."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from typing import Any, Callable, Iterator

__all__ = [
    "PartitionCounters",
    "collecting",
    "track_cache",
    "track_runner",
    "counted",
    "AllocationCount",
    "counting_allocations",
    "note_allocations",
]

# The counters of the partition being compiled (kernel builders run inside compile).
_current: contextvars.ContextVar["PartitionCounters | None"] = contextvars.ContextVar(
    "plugrt_cpu_counters", default=None
)


class PartitionCounters:
    """What the kernels of one compiled partition count, its subgraphs' included.

    Shape caches count their own hits and misses, subgraph runners their runs, and
    control-flow steps their executions; this object only keeps hold of them, so the
    per-node path pays one integer increment and no look-up.
    """

    def __init__(self) -> None:
        self.caches: list[Any] = []  # objects with .hits and .misses
        self.runners: list[Any] = []  # objects with .runs
        self.control_flow: list[tuple[str, list[int]]] = []  # (op_type, [executions])
        self.children: list[PartitionCounters] = []  # the partitions of its subgraphs

    def snapshot(self) -> dict[str, int]:
        """``kernel_cache.hits``, ``kernel_cache.misses``, ``subgraph_runs`` and
        ``control_flow.<op_type>``, summed over this partition and its subgraphs."""
        totals = {"kernel_cache.hits": 0, "kernel_cache.misses": 0, "subgraph_runs": 0}
        self._add_to(totals)
        return totals

    def _add_to(self, totals: dict[str, int]) -> None:
        totals["kernel_cache.hits"] += sum(c.hits for c in self.caches)
        totals["kernel_cache.misses"] += sum(c.misses for c in self.caches)
        totals["subgraph_runs"] += sum(r.runs for r in self.runners)
        for op_type, executions in self.control_flow:
            key = f"control_flow.{op_type}"
            totals[key] = totals.get(key, 0) + executions[0]
        for child in self.children:
            child._add_to(totals)


@contextlib.contextmanager
def collecting(counters: PartitionCounters) -> Iterator[PartitionCounters]:
    """Track what is made while a partition compiles; a partition compiled inside another
    (a subgraph) is counted as part of it too."""
    parent = _current.get()
    if parent is not None:
        parent.children.append(counters)
    token = _current.set(counters)
    try:
        yield counters
    finally:
        _current.reset(token)


def track_cache(cache: Any) -> None:
    """Count ``cache`` (with ``hits`` and ``misses``) in the partition being compiled."""
    counters = _current.get()
    if counters is not None:
        counters.caches.append(cache)


def track_runner(runner: Any) -> None:
    """Count ``runner`` (with ``runs``) in the partition being compiled."""
    counters = _current.get()
    if counters is not None:
        counters.runners.append(runner)


def counted(op_type: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, counting its calls as executions of ``op_type`` in the partition being compiled."""
    counters = _current.get()
    if counters is None:
        return fn
    executions = [0]
    counters.control_flow.append((op_type, executions))

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        executions[0] += 1
        return fn(*args)

    return run


# -- allocations during a replay ---------------------------------------------------------------

# The counts being kept on this thread (a replay runs on one thread; nesting is allowed).
_counting = threading.local()


class AllocationCount:
    """Allocations (``count``) and bytes a replay made, as the CPU provider's capture counts
    them: an eager seam makes its outputs afresh on every replay (one each); a captured
    step writes into its preallocated buffer, and counts one allocation per replay of
    the bytes its kernel's temporaries took when the capture ran it (when over 1 KiB;
    measured with tracemalloc). Use as a context manager around the replay."""

    __slots__ = ("count", "bytes")

    def __init__(self) -> None:
        self.count = 0
        self.bytes = 0

    def __enter__(self) -> "AllocationCount":
        active = getattr(_counting, "active", None)
        if active is None:
            active = _counting.active = []
        active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _counting.active.remove(self)


def counting_allocations() -> AllocationCount:
    """A counter of what replays on this thread allocate while it is entered."""
    return AllocationCount()


def note_allocations(count: int, nbytes: int) -> None:
    """Add ``count`` arrays of ``nbytes`` in all to every counter entered on this thread."""
    active = getattr(_counting, "active", None)
    if active:
        for counter in active:
            counter.count += count
            counter.bytes += nbytes
