"""Counters of one compiled partition: kernel-plan cache look-ups and control-flow runs."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, Iterator

__all__ = ["PartitionCounters", "collecting", "track_cache", "track_runner", "counted"]

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
