"""A session's counters: runs, kernel-plan caches, control flow, captures, shared weights, activation memory."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from .memory_budget import PlannedSession, SessionMemory
from .weights import WeightStore

if TYPE_CHECKING:
    from .capture import CaptureStats
    from .graphs import PlainRunGraphs
    from .intent import Selection
    from .provider import CompiledPartition

__all__ = ["SessionStats", "session_stats", "KERNEL_CACHE_HITS", "KERNEL_CACHE_MISSES", "SUBGRAPH_RUNS"]

#: Counter names a provider's ``counters(compiled)`` reports (see ``CountersCapability``);
#: control-flow executions are ``"control_flow.<op_type>"``.
KERNEL_CACHE_HITS = "kernel_cache.hits"
KERNEL_CACHE_MISSES = "kernel_cache.misses"
SUBGRAPH_RUNS = "subgraph_runs"
_CONTROL_FLOW = "control_flow."


@dataclasses.dataclass
class SessionStats:
    """What a session has done since it was built (``Session.stats()``; a snapshot).

    - ``runs``: plan runs: ``run``, ``run_list``, warm-up runs, and replays that ran eagerly.
    - ``kernel_cache_hits``, ``kernel_cache_misses``: look-ups of the plans kernels keep per
      input shape (a miss builds one: a new shape, or a cache that was full), summed over
      the providers that count them.
    - ``control_flow``: executions of control-flow ops by op type, e.g. ``{"If": 3, "Loop": 1}``
      (nested ones included).
    - ``subgraph_runs``: runs of their subgraphs (the If branch taken, each Loop or Scan
      iteration).
    - ``replays``, ``eager_fallbacks``, ``fallback_reasons``, ``bytes_allocated_during_replay``:
      the capture counters, as :attr:`Session.capture_stats`.
    - ``graph_hits``, ``graph_misses``, ``graph_captures``, ``graph_evictions``,
      ``graph_refusals``, ``graph_fallbacks``: the plain-run graphs' counters (all 0 when
      the session's runs stay eager; see :class:`plugrt.graphs.GraphStats`).
    - ``capture_sites``: per capture site (a slot, a plain-run graph's signature) its
      replays, allocations during them and stream errors (:class:`plugrt.capture.SiteStats`).
    - ``weights``: the counters of the session's :class:`plugrt.WeightStore` (shared with
      every session that uses it; see :class:`plugrt.weights.WeightStats`), empty without one.
    - ``providers``: every counter as each provider reports it, by provider name.
    - ``memory_plan``: the activation memory plan (:class:`plugrt.memory_plan.MemoryPlan`
      as a dict: ``peak_bytes``, ``total_bytes``, ``buffers``, ``buffers_reused``,
      ``values``, ``unsized``, and the ``inputs`` shapes and ``dims`` it is for) of the
      latest run's input shapes, planned once per shape and kept; before any run, the plan
      the ``memory_limit`` check made at build; empty without either, or when the model
      has no intermediate values.
    """

    runs: int = 0
    kernel_cache_hits: int = 0
    kernel_cache_misses: int = 0
    control_flow: dict[str, int] = dataclasses.field(default_factory=dict)
    subgraph_runs: int = 0
    replays: int = 0
    eager_fallbacks: int = 0
    fallback_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes_allocated_during_replay: int = 0
    graph_hits: int = 0
    graph_misses: int = 0
    graph_captures: int = 0
    graph_evictions: int = 0
    graph_refusals: dict[str, int] = dataclasses.field(default_factory=dict)
    graph_fallbacks: dict[str, int] = dataclasses.field(default_factory=dict)
    capture_sites: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    weights: dict[str, int] = dataclasses.field(default_factory=dict)
    providers: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    memory_plan: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The counters as plain dicts and ints (for JSON or logging)."""
        return dataclasses.asdict(self)


class _Counted(PlannedSession, Protocol):
    """What the counters are read from: a :class:`plugrt.Session`."""

    selection: "Selection"
    weights: WeightStore | None
    _runs: int
    _graphs: "PlainRunGraphs | None"
    _memory: "SessionMemory"

    @property
    def compiled_partitions(self) -> list["CompiledPartition"]: ...

    @property
    def capture_stats(self) -> "CaptureStats": ...


def session_stats(session: _Counted) -> SessionStats:
    """The session's counters now: see :class:`SessionStats`."""
    by_name = {p.name: p for p in session.selection.providers}
    providers: dict[str, dict[str, int]] = {}
    for compiled in session.compiled_partitions:
        count = getattr(by_name.get(compiled.provider), "counters", None)
        if count is None:
            continue
        totals = providers.setdefault(compiled.provider, {})
        _add(totals, count(compiled))
    merged: dict[str, int] = {}
    for counters in providers.values():
        _add(merged, counters)
    capture = session.capture_stats
    graphs = session._graphs.stats() if session._graphs is not None else None
    return SessionStats(
        runs=session._runs,
        kernel_cache_hits=merged.get(KERNEL_CACHE_HITS, 0),
        kernel_cache_misses=merged.get(KERNEL_CACHE_MISSES, 0),
        control_flow={k[len(_CONTROL_FLOW):]: n for k, n in merged.items() if k.startswith(_CONTROL_FLOW)},
        subgraph_runs=merged.get(SUBGRAPH_RUNS, 0),
        replays=capture.replays,
        eager_fallbacks=capture.eager_fallbacks,
        fallback_reasons=dict(capture.fallback_reasons),
        bytes_allocated_during_replay=capture.bytes_allocated_during_replay,
        graph_hits=graphs.hits if graphs else 0,
        graph_misses=graphs.misses if graphs else 0,
        graph_captures=graphs.captures if graphs else 0,
        graph_evictions=graphs.evictions if graphs else 0,
        graph_refusals=dict(graphs.refusals) if graphs else {},
        graph_fallbacks=dict(graphs.fallbacks) if graphs else {},
        capture_sites={name: dataclasses.asdict(site) for name, site in list(capture.sites.items())},
        weights=dataclasses.asdict(session.weights.stats()) if session.weights is not None else {},
        providers=providers,
        memory_plan=session._memory.latest(session),
    )


def _add(totals: dict[str, int], counters: Mapping[str, int]) -> None:
    for key, n in counters.items():
        totals[key] = totals.get(key, 0) + int(n)
