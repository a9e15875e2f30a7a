"""Graphs for plain runs: ``Session.run`` replays a capture of the plan per input signature.

A signature is the fed names with each array's type, dtype and shape. The first run with
a signature runs eagerly; the second runs eagerly too, then records a capture
(:class:`plugrt.capture.CapturedPlan`) and replays it once, comparing that replay with
the eager outputs within the providers' tolerance: a capture that differs is dropped and
its signature runs eagerly from then on (a refusal, with the reason in the stats). From
the third run on the feeds are copied into the capture's input buffers, the capture is
replayed and its outputs are copied out, so the caller owns what it gets, as from an
eager run.

At most ``max_graphs`` captures are kept per session; the least recently used is dropped
when another is recorded (an eviction) and recorded again if its signature comes back.
A capture's buffers are shared, so each graph has a lock: a run that finds its graph busy
(another thread replaying it) runs eagerly instead of waiting. Data-dependent shapes stay
eager seams inside a capture; a replay whose seam no longer fits runs eagerly.

Which sessions use them: ``graphs="auto"`` (the default) when a provider the plan uses
says its captures beat eager runs (``capture_plain_runs = True``, e.g. the CUDA
provider's graphs); ``graphs=True`` for any provider that can capture (the CPU
provider's replays are measured no faster than its eager runs, so it says False);
``graphs=False`` never. Profiling sessions run eagerly (a replay has no per-node events),
and so does a session whose device plan is still joining.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

from .capture import CapturedPlan, SiteStats
from .errors import ReplayStreamError
from .threads import begin_run

if TYPE_CHECKING:
    from .provider import ExecutionProvider

#: the session whose runs the graphs serve (a plugrt.Session; not imported: it imports this module)
Session = Any

__all__ = ["GraphStats", "PlainRunGraphs", "graphs_wanted", "replay_tolerance", "DEFAULT_TOLERANCE"]

#: (rtol, atol) a replay is checked to within when no provider declares ``replay_tolerance``:
#: none, as a capture replays the same kernels on the same buffers.
DEFAULT_TOLERANCE = (0.0, 0.0)
#: signatures remembered as seen once or refused (beyond captured ones), oldest forgotten first
_SEEN_LIMIT = 256
_SEEN = ""  # a signature seen once; any other string in ``_seen`` is why it was refused


@dataclasses.dataclass
class GraphStats:
    """What a session's plain-run graphs did (``Session.stats()``, ``graph_*`` counters).

    - ``hits``: runs served by replaying a graph.
    - ``misses``: runs with graphs on that ran eagerly (a signature seen for the first or
      second time, a refused one, a busy graph, a seam that no longer fit).
    - ``captures``: graphs recorded and checked equal to the eager run.
    - ``evictions``: graphs dropped for a newer one (``max_graphs``).
    - ``refusals``: signatures left eager, by reason (not capturable, the check at capture
      differed, the capture raised, non-tensor outputs).
    - ``fallbacks``: runs of a captured signature that ran eagerly, by reason (busy, a seam
      that no longer fit).
    """

    hits: int = 0
    misses: int = 0
    captures: int = 0
    evictions: int = 0
    refusals: dict[str, int] = dataclasses.field(default_factory=dict)
    fallbacks: dict[str, int] = dataclasses.field(default_factory=dict)


def graphs_wanted(setting: Any, providers: Iterable["ExecutionProvider"]) -> bool:
    """Whether plain runs use graphs: ``setting`` is the ``graphs`` option (True, False or
    "auto"); ``providers`` those the plan uses."""
    if setting is False:
        return False
    from .provider import CaptureCapability

    capturing = [p for p in providers if isinstance(p, CaptureCapability)]
    if setting is True:
        return bool(capturing)
    return any(getattr(p, "capture_plain_runs", False) is True for p in capturing)


def replay_tolerance(providers: Iterable["ExecutionProvider"]) -> tuple[float, float]:
    """The loosest (rtol, atol) the providers declare (``replay_tolerance``), else none."""
    rtol, atol = DEFAULT_TOLERANCE
    for provider in providers:
        declared = getattr(provider, "replay_tolerance", None)
        if isinstance(declared, tuple) and len(declared) == 2:
            rtol, atol = max(rtol, float(declared[0])), max(atol, float(declared[1]))
    return rtol, atol


def _describe(key: tuple) -> str:
    """A signature as a capture-site name: ``run(x: float32[1, 3], ...)``."""
    return "run(" + ", ".join(f"{name}: {dtype}{list(shape)}" for name, _, dtype, shape in key) + ")"


class _Graph:
    """One captured signature: its capture, the buffers feeds are copied into, its lock."""

    __slots__ = ("plan", "inputs", "lock", "site", "name", "hits")

    def __init__(self, plan: CapturedPlan, feeds: Mapping[str, Any], site: SiteStats, name: str):
        self.plan = plan
        buffers = plan.current_feeds()
        self.inputs = [(n, buffers[n]) for n in feeds]
        self.lock = threading.Lock()
        self.site = site
        self.name = name
        self.hits = 0


class PlainRunGraphs:
    """A session's plain-run graphs (see the module's docstring)."""

    def __init__(self, session: Session, max_graphs: int, tolerance: tuple[float, float]) -> None:
        self._session = session
        self.max_graphs = max_graphs
        self.tolerance = tolerance
        self._graphs: collections.OrderedDict[tuple, _Graph] = collections.OrderedDict()
        self._seen: collections.OrderedDict[tuple, str] = collections.OrderedDict()
        self._lock = threading.Lock()  # the dicts' changes and the counters of runs without a graph
        self._capturing = threading.Lock()  # one capture at a time; others run eagerly meanwhile
        self._generation = 0  # bumped by reset(): a capture begun before it is not kept
        self._stats = GraphStats()
        self._evicted_hits = 0

    # -- the run path ------------------------------------------------------------------

    def run(self, feeds: Mapping[str, Any], indexes: Sequence[int] | None) -> list | None:
        """The outputs (``indexes`` of them, all when None) the caller owns, from a replay
        or from the eager run that recorded a graph; None when the caller runs eagerly."""
        try:
            key = tuple([(name, type(a), a.dtype, a.shape) for name, a in feeds.items()])
        except (AttributeError, TypeError):  # a list, a scalar, a sequence: no graph
            return None
        graph = self._graphs.get(key)
        if graph is not None:
            return self._replay(key, graph, feeds, indexes)
        with self._lock:
            state = self._seen.get(key)
            if state is None:
                self._remember(key, _SEEN)
            self._stats.misses += 1
        if state != _SEEN:  # first sight (None) or refused: eager
            return None
        return self._capture(key, feeds, indexes)

    def _replay(self, key: tuple, graph: _Graph, feeds: Mapping[str, Any], indexes: Sequence[int] | None) -> list | None:
        try:
            self._graphs.move_to_end(key)
        except KeyError:  # evicted meanwhile: this run still replays the graph it found
            pass
        if not graph.lock.acquire(blocking=False):
            self._fallback("busy: another thread was replaying this graph")
            return None
        try:
            begin_run(self._session._intra_op_threads)
            plan = graph.plan
            spaces = plan._spaces
            for (_name, buffer), value in zip(graph.inputs, feeds.values()):
                if type(buffer) is np.ndarray and type(value) is np.ndarray:
                    np.copyto(buffer, value)
                else:
                    spaces.copy_into(value, buffer)
            values = plan.measured_replay(graph.site, graph.name)
            if values is None:
                miss = f"an eager seam no longer fits the graph ({plan.last_miss})"
            else:
                graph.hits += 1
                self._session._signature.note(feeds)
                return _owned(values, indexes, spaces)
        except ReplayStreamError:
            self._drop(key, "the device stream recorded an error during a replay")
            raise
        finally:
            graph.lock.release()
        self._fallback(miss)
        return None

    def _fallback(self, reason: str) -> None:
        with self._lock:
            self._stats.misses += 1
            self._stats.fallbacks[reason] = self._stats.fallbacks.get(reason, 0) + 1

    # -- recording ---------------------------------------------------------------------

    def _capture(self, key: tuple, feeds: Mapping[str, Any], indexes: Sequence[int] | None) -> list | None:
        """Run eagerly (the caller's outputs), then record a graph and check it against them."""
        session = self._session
        if not self._capturing.acquire(blocking=False):
            return None  # another thread is recording: this run stays eager, the next may record
        try:
            with self._lock:
                if self._seen.get(key) != _SEEN:  # recorded or refused by a thread that got here first
                    return None
                generation = self._generation
            args, values = session._run_host(feeds)
            from .bindings import deliver

            outputs = [deliver(v, args, session._spaces) for v in values]
            graph, why = self._record(key, dict(feeds), outputs)
            with self._lock:
                if generation != self._generation:
                    pass  # the plan changed while recording: keep neither graph nor verdict
                elif graph is None:
                    self._seen[key] = why
                    self._stats.refusals[why] = self._stats.refusals.get(why, 0) + 1
                else:
                    self._seen.pop(key, None)
                    self._graphs[key] = graph
                    self._stats.captures += 1
                    while len(self._graphs) > self.max_graphs:
                        old_key, old = self._graphs.popitem(last=False)
                        self._evicted_hits += old.hits
                        self._stats.evictions += 1
                        self._remember(old_key, _SEEN)  # seen before: recorded again when it comes back
            return outputs if indexes is None else [outputs[i] for i in indexes]
        finally:
            self._capturing.release()

    def _record(self, key: tuple, feeds: dict[str, Any], eager: list) -> tuple[_Graph | None, str]:
        """A checked graph, or None and why not."""
        session = self._session
        name = _describe(key)
        if not all(_is_tensor(v, session) for v in eager):
            return None, "an output is not a tensor (a sequence, a map or an optional)"
        try:
            plan = CapturedPlan(
                session._built, session._signature, session._output_names, session.selection.providers, feeds, ()
            )
        except Exception as exc:  # the eager run served this call: refuse, never fail it
            return None, f"the capture failed: {type(exc).__name__}: {exc}"
        if not plan.report.segments:
            why = "; ".join(sorted({reason for _, reason in plan.report.seams})) or "no provider captured a node"
            return None, f"not capturable: {why}"
        site = session._captures.stats.site(name)
        try:
            replayed = plan.measured_replay(site, name)
        except ReplayStreamError:
            return None, "the device stream recorded an error during the checked replay"
        except Exception as exc:  # as above: this run's outputs came from the eager run
            return None, f"the first replay failed: {type(exc).__name__}: {exc}"
        if replayed is None:
            return None, f"an eager seam did not fit the first replay ({plan.last_miss})"
        spaces = plan._spaces
        for output, ours, theirs in zip(session._output_names, replayed, eager):
            problem = _differs(spaces.to_host(ours) if spaces.owner(ours) is not None else np.asarray(ours), theirs, self.tolerance)
            if problem:
                return None, f"the replay differed from the eager run at capture ({output}: {problem})"
        return _Graph(plan, feeds, site, name), ""

    def _remember(self, key: tuple, state: str) -> None:
        self._seen[key] = state
        self._seen.move_to_end(key)
        while len(self._seen) > _SEEN_LIMIT:
            self._seen.popitem(last=False)

    def _drop(self, key: tuple, why: str) -> None:
        with self._lock:
            graph = self._graphs.pop(key, None)
            if graph is not None:
                self._evicted_hits += graph.hits
            self._remember(key, why)
            self._stats.refusals[why] = self._stats.refusals.get(why, 0) + 1

    # -- management ---------------------------------------------------------------------

    def reset(self) -> None:
        """Drop every graph and verdict (the plan changed)."""
        with self._lock:
            for graph in self._graphs.values():
                self._evicted_hits += graph.hits
            self._graphs.clear()
            self._seen.clear()
            self._generation += 1

    @property
    def signatures(self) -> list[str]:
        """The captured signatures, least recently used first."""
        return [graph.name for graph in list(self._graphs.values())]

    def stats(self) -> GraphStats:
        with self._lock:
            stats = dataclasses.replace(
                self._stats, refusals=dict(self._stats.refusals), fallbacks=dict(self._stats.fallbacks)
            )
            stats.hits = self._evicted_hits + sum(g.hits for g in self._graphs.values())
        return stats


def _is_tensor(value: Any, session: Session) -> bool:
    return type(value) is np.ndarray or session._spaces.owner(value) is not None


def _owned(values: Sequence[Any], indexes: Sequence[int] | None, spaces: Any) -> list:
    """Copies of a replay's output buffers (``indexes`` of them), on the host."""
    picked = values if indexes is None else [values[i] for i in indexes]
    return [v.copy() if type(v) is np.ndarray else spaces.to_host(v) for v in picked]


def _differs(ours: np.ndarray, theirs: Any, tolerance: tuple[float, float]) -> str:
    """Why a replayed output is not the eager one within ``tolerance`` ("" when it is)."""
    theirs = np.asarray(theirs)
    if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
        return f"{ours.dtype}{list(ours.shape)} against {theirs.dtype}{list(theirs.shape)}"
    rtol, atol = tolerance
    if ours.dtype.kind in "fc" and (rtol or atol):
        close = np.isclose(ours, theirs, rtol=rtol, atol=atol, equal_nan=True)
    elif ours.dtype.kind in "fc":
        close = (ours == theirs) | (np.isnan(ours) & np.isnan(theirs))
    else:
        close = ours == theirs
    if bool(np.all(close)):
        return ""
    wrong = int(np.size(close) - np.count_nonzero(close))
    return f"{wrong} of {ours.size} value(s) outside rtol={rtol}, atol={atol}"
