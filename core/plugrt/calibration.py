"""placement="measure": candidate plans timed on generated inputs once, the verdict kept per model.

A session built with ``placement="measure"`` (under an intent placed by estimate) builds the
plan by estimate and the plan of its fallback provider alone, each on its own copy of the
model, times each on inputs generated from the declared shapes (symbols as 1), and keeps
the faster. The verdict is kept for the process, per (model file or bytes, providers,
devices, input shapes): a later session of the same key builds the chosen plan alone. The
chosen plan's kernels are timed per partition too (``PartitionInfo.measured_s``).
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Hashable

if TYPE_CHECKING:
    from .build import BuiltGraph

__all__ = ["verdict_key", "time_runs", "partition_times", "VERDICTS"]

#: verdict key -> (the chosen candidate's label, ((label, median seconds per run), ...)).
VERDICTS: dict[Hashable, tuple[str, tuple[tuple[str, float], ...]]] = {}
#: Runs timed per candidate, after one untimed run.
TIMED_RUNS = 3


def _model_identity(source: Any) -> Hashable | None:
    """The model's identity: a file's real path, size and modification time, or the
    SHA-256 of bytes; None for anything else (then nothing is cached)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return ("bytes", hashlib.sha256(bytes(source)).hexdigest())
    if isinstance(source, (str, os.PathLike)):
        try:
            stat = os.stat(source)
        except OSError:
            return None
        return ("file", os.path.realpath(source), stat.st_size, stat.st_mtime_ns)
    return None


def verdict_key(source: Any, providers: list[str], devices: list[str], shapes: dict[str, tuple[int, ...]]) -> Hashable | None:
    identity = _model_identity(source)
    if identity is None:
        return None
    return (identity, tuple(providers), tuple(devices), tuple(sorted(shapes.items())))


def time_runs(run: Callable[[], Any], runs: int = TIMED_RUNS) -> float:
    """Median seconds of ``runs`` calls of ``run`` after one untimed call."""
    run()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def partition_times(built: "BuiltGraph", args: list, runs: int = TIMED_RUNS) -> list[float | None]:
    """Mean seconds per run of each compiled partition's kernels, from a profiled copy of
    the plan run ``runs`` times on ``args`` (None for a partition without steps)."""
    plan = built.plan.profiled()
    for _ in range(runs):
        plan.run(*args)
    owner: list[int] = []  # plan step index -> compiled partition index (-1: a transfer)
    partition_index = {id(cp): i for i, cp in enumerate(built.compiled)}
    for stage in built.stages:
        at = partition_index.get(id(stage.compiled), -1) if stage.compiled is not None else -1
        owner.extend([at] * len(stage.steps))
    totals: list[float | None] = [None] * len(built.compiled)
    for record in plan.profile_records or ():
        index, start, end = record[:3]
        if 0 <= index < len(owner) and owner[index] >= 0:
            at = owner[index]
            totals[at] = (totals[at] or 0.0) + (end - start) / runs
    return totals
