"""Placement: each node to a provider that supports it (by priority, or by estimate); partitions."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import onnx_ir as ir

from .errors import PlacementError, ProviderUnavailableError, UnsupportedOpError
from .ir_utils import implicit_inputs
from .provider import HOST_MEMORY, ExecutionProvider, Partition, Support, SupportContext, node_label

if TYPE_CHECKING:
    from .costs import CostModel
    from .registry import ProviderRegistry

__all__ = [
    "Fallback",
    "PartitionInfo",
    "Transfer",
    "PlacementEstimate",
    "PlacementReport",
    "assign",
    "assign_by_estimate",
    "make_partitions",
    "node_label",
]


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A node a preferred provider declined, and where it went instead."""

    node: str
    op_type: str
    declined_by: str
    reason: str
    placed_on: str
    # why: "unsupported" (supports_op said no), "estimate" (placement by estimate found the
    # claim slower than where the node runs), "compile" (the provider's compile failed)
    cause: str = "unsupported"


@dataclasses.dataclass(frozen=True)
class PartitionInfo:
    name: str
    provider: str
    nodes: int
    node_names: tuple[str, ...]
    restored: bool = False
    estimated_s: float | None = None  # compute and partition overhead, as placement estimated it
    measured_s: float | None = None  # its kernels' time per run, where placement="measure" timed it


@dataclasses.dataclass(frozen=True)
class Transfer:
    value: str
    source: str  # provider that produced it
    target: str  # provider that reads it
    estimated_s: float | None = None
    nbytes: int | None = None  # from the inferred shape (symbolic dimensions as 1)


@dataclasses.dataclass(frozen=True)
class PlacementEstimate:
    """How the placement was chosen: ``strategy`` "estimate" (the fastest assignment the
    estimates found), "measure" (the faster of the candidate plans timed) or "priority"
    (each node to the highest-priority provider that says yes: provider lists, names,
    devices, strict), the estimated seconds of the chosen
    assignment, and of the alternatives weighed (``"all on cpu"``, ``"priority order"``)."""

    strategy: str
    total_s: float | None = None
    alternatives: tuple[tuple[str, float], ...] = ()
    # placement="measure": the median seconds per run of each candidate plan timed (or, from
    # the cache, of the one chosen when it was timed)
    measured: tuple[tuple[str, float], ...] = ()


@dataclasses.dataclass
class PlacementReport:
    """Where every node runs, and why any node did not run where it was first offered."""

    providers: list[str]  # consulted, in priority order
    nodes_per_provider: dict[str, int]
    partitions: list[PartitionInfo]
    fallbacks: list[Fallback]
    transfers: list[Transfer]
    estimate: PlacementEstimate = PlacementEstimate("priority")

    def summary(self) -> str:
        lines = ["placement:", f"  chosen by: {self.estimate.strategy}"]
        for name in self.providers:
            lines.append(f"  {name}: {self.nodes_per_provider.get(name, 0)} node(s)")
        lines.append(f"  partitions: {len(self.partitions)}")
        for part in self.partitions:
            tag = " (restored)" if part.restored else ""
            cost = f", estimated {_ms(part.estimated_s)}" if part.estimated_s is not None else ""
            cost += f", measured {_ms(part.measured_s)}" if part.measured_s is not None else ""
            lines.append(f"    {part.name}: {part.provider}, {part.nodes} node(s){cost}{tag}")
        if self.fallbacks:
            lines.append(f"  fallbacks: {len(self.fallbacks)}")
            for fb in self.fallbacks:
                lines.append(
                    f"    {fb.node} ({fb.op_type}): {fb.declined_by} declined ({fb.reason}); ran on {fb.placed_on}"
                )
        if self.transfers:
            lines.append(f"  transfers: {len(self.transfers)}")
            for tr in self.transfers:
                cost = f", estimated {_ms(tr.estimated_s)}" if tr.estimated_s is not None else ""
                lines.append(f"    {tr.value}: {tr.source} -> {tr.target}{cost}")
        if self.estimate.total_s is not None:
            weighed = "".join(f"; {label}: {_ms(s)}" for label, s in self.estimate.alternatives)
            lines.append(f"  estimated: {_ms(self.estimate.total_s)} per run{weighed}")
        if self.estimate.measured:
            lines.append("  measured: " + "; ".join(f"{label}: {_ms(s)}" for label, s in self.estimate.measured))
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:.3f} ms"


def _ask(
    provider: ExecutionProvider,
    node: ir.Node,
    ctx: SupportContext,
    registry: "ProviderRegistry | None",
    pinned: frozenset[str] = frozenset(),
) -> Support:
    try:
        answer = provider.supports_op(node, ctx)
    except Exception as exc:  # a broken provider never breaks the runtime...
        if registry is not None:
            registry.record_failure(provider.name, "supports_op", exc)
        if provider.name in pinned:  # ...unless the user asked for it by name
            raise ProviderUnavailableError(
                provider.name,
                f"supports_op raised {type(exc).__name__}: {exc}",
                hint="report this to the provider's maintainers, or choose another device",
            ) from exc
        return Support.no(f"supports_op raised {type(exc).__name__}: {exc}")
    if not isinstance(answer, Support):
        answer = Support.yes() if answer else Support.no("declined (no reason given)")
    return answer


def _no_provider(
    node: ir.Node, providers: Sequence[ExecutionProvider], ctx: SupportContext, reasons: dict[str, str]
) -> UnsupportedOpError:
    return UnsupportedOpError(
        node.domain,
        node.op_type,
        ctx.opset(node.domain),
        node=node_label(node),
        providers_consulted=[p.name for p in providers],
        reasons=reasons,
    )


def assign(
    nodes: Sequence[ir.Node],
    providers: Sequence[ExecutionProvider],
    ctx: SupportContext,
    *,
    registry: "ProviderRegistry | None" = None,
    strict: bool = False,
    pinned: frozenset[str] = frozenset(),
) -> tuple[list[str], list[Fallback]]:
    """The provider name for each node, and the fallbacks along the way."""
    placed: list[str] = []
    fallbacks: list[Fallback] = []
    for node in nodes:
        declined: list[tuple[str, str]] = []
        chosen = None
        for provider in providers:
            answer = _ask(provider, node, ctx, registry, pinned)
            if answer.supported:
                chosen = provider.name
                break
            declined.append((provider.name, answer.reason))
        if chosen is None:
            raise _no_provider(node, providers, ctx, dict(declined))
        for name, reason in declined:
            fallbacks.append(Fallback(node_label(node), node.op_type, name, reason, chosen))
        placed.append(chosen)
    if strict and fallbacks:
        raise PlacementError(
            providers[0].name, [(fb.node, fb.op_type, fb.reason) for fb in fallbacks if fb.declined_by == providers[0].name]
        )
    return placed, fallbacks


def make_partitions(
    nodes: Sequence[ir.Node],
    placed: Sequence[str],
    graph_outputs: Sequence[ir.Value],
    opset_imports: dict[str, int],
) -> list[tuple[str, Partition]]:
    """Group consecutive nodes on one provider into partitions with their boundary values."""
    groups: list[tuple[str, list[ir.Node]]] = []
    for node, provider in zip(nodes, placed):
        if groups and groups[-1][0] == provider:
            groups[-1][1].append(node)
        else:
            groups.append((provider, [node]))

    reads: list[list[ir.Value]] = []
    for _, members in groups:
        seen: dict[ir.Value, None] = {}
        for node in members:
            for value in list(node.inputs) + implicit_inputs(node):
                if value is not None:
                    seen[value] = None
        reads.append(list(seen))
    outputs_needed = set(graph_outputs)
    result = []
    for index, (provider, members) in enumerate(groups):
        produced = {v for n in members for v in n.outputs if v is not None}
        inputs = [v for v in reads[index] if v not in produced]
        later_reads = {v for r in reads[index + 1 :] for v in r}
        outputs = [
            v
            for n in members
            for v in n.outputs
            if v is not None and (v in later_reads or v in outputs_needed)
        ]
        name = f"{provider}_{index}"
        result.append((provider, Partition(name, list(members), inputs, outputs, dict(opset_imports))))
    return result


# -- placement by estimate ---------------------------------------------------------------

#: Estimates closer than this (seconds) are a tie, which priority breaks.
_TIE = 1e-9


@dataclasses.dataclass
class _Value:
    producer: int  # index of the node that makes it; -1: a plan input (fed on the host)
    readers: list[int]
    nbytes: int
    is_output: bool


class _Problem:
    """One graph's assignment problem: per node and provider the estimated cost (inf where
    unsupported), per provider its partition overhead and memory space, per value who makes
    and reads it. An assignment is a list of provider indices, one per node."""

    def __init__(self, nodes: Sequence[ir.Node], providers: Sequence[ExecutionProvider], supported: list[list[bool]],
                 costs: "CostModel", graph_outputs: Sequence[ir.Value]):
        from .costs import value_bytes

        self.nodes = list(nodes)
        self.providers = list(providers)
        self.supported = supported
        self.model = costs
        inf = float("inf")
        self.cost = [
            [costs.node_cost(p, n) if ok else inf for n, ok in zip(self.nodes, row)]
            for p, row in zip(self.providers, supported)
        ]
        self.overhead = [costs.partition_overhead(p) for p in self.providers]
        self.memory = [costs.memory(p.name) for p in self.providers]
        index = {id(n): i for i, n in enumerate(self.nodes)}
        outputs = set(graph_outputs)
        found: dict[ir.Value, int] = {}
        self.values: list[_Value] = []
        self.node_values: list[list[int]] = [[] for _ in self.nodes]

        def entry(value: ir.Value) -> int | None:
            if value in found:
                return found[value]
            if value.const_value is not None and value.producer() is None:
                return None  # a constant reaches its memory once, at build
            producer = value.producer()
            at = index.get(id(producer), -1) if producer is not None else -1
            found[value] = len(self.values)
            self.values.append(_Value(at, [], value_bytes(value), value in outputs))
            return found[value]

        for i, node in enumerate(self.nodes):
            for made in node.outputs:
                if made is not None and (k := entry(made)) is not None:
                    self.node_values[i].append(k)
            for read in list(node.inputs) + implicit_inputs(node):
                if read is not None and (k := entry(read)) is not None:
                    self.values[k].readers.append(i)
                    self.node_values[i].append(k)
        self.node_values = [sorted(set(ks)) for ks in self.node_values]
        # fusions a provider states: (node, producer, provider, seconds saved when both run there)
        self.pairs: list[tuple[int, int, int, float]] = []
        self.node_pairs: list[list[int]] = [[] for _ in self.nodes]
        for i, node in enumerate(self.nodes):
            source = node.inputs[0] if node.inputs else None
            producer = source.producer() if source is not None else None
            j = index.get(id(producer), -1) if producer is not None else -1
            if producer is None or j < 0 or source is None or source.is_graph_output() or len(list(source.uses())) != 1:
                continue
            for q, provider in enumerate(self.providers):
                if not (supported[q][i] and supported[q][j]):
                    continue
                fused = costs.fused_cost(provider, node, producer)
                if fused is not None and fused < self.cost[q][i]:
                    self.node_pairs[i].append(len(self.pairs))
                    self.node_pairs[j].append(len(self.pairs))
                    self.pairs.append((i, j, q, self.cost[q][i] - fused))

    def _saved(self, pair_ids: Sequence[int], labels: list[int]) -> float:
        """Seconds the stated fusions among ``pair_ids`` save under ``labels``."""
        total = 0.0
        for k in pair_ids:
            i, j, q, saving = self.pairs[k]
            if labels[i] == q and labels[j] == q:
                total += saving
        return total

    def first_supported(self, order: Sequence[int]) -> list[int]:
        """Each node on the first provider of ``order`` (then of priority order) that supports it."""
        full = list(order) + [p for p in range(len(self.providers)) if p not in order]
        return [next(p for p in full if self.supported[p][i]) for i in range(len(self.nodes))]

    def _value_cost(self, k: int, labels: list[int]) -> float:
        value = self.values[k]
        source = self.memory[labels[value.producer]] if value.producer >= 0 else HOST_MEMORY
        targets = {self.memory[labels[r]] for r in value.readers}
        if value.is_output:
            targets.add(HOST_MEMORY)  # an unbound output is delivered to the host
        return sum(self.model.transfer_cost(source, t, value.nbytes) for t in targets if t != source)

    def _starts(self, labels: list[int], lo: int, hi: int) -> float:
        """Partition overheads of the partitions starting at nodes lo..hi."""
        total = 0.0
        for i in range(max(lo, 0), min(hi, len(labels) - 1) + 1):
            if i == 0 or labels[i] != labels[i - 1]:
                total += self.overhead[labels[i]]
        return total

    def total(self, labels: list[int]) -> float:
        compute = sum(self.cost[p][i] for i, p in enumerate(labels)) - self._saved(range(len(self.pairs)), labels)
        transfers = sum(self._value_cost(k, labels) for k in range(len(self.values)))
        return compute + self._starts(labels, 0, len(labels) - 1) + transfers

    def delta(self, labels: list[int], q: int, a: int, b: int) -> tuple[float, float, float]:
        """(compute, partition overhead, transfers): what moving nodes a..b to provider q
        changes, in seconds (negative: faster). ``labels`` is left as it was."""
        old = labels[a : b + 1]
        touched = sorted({k for i in range(a, b + 1) for k in self.node_values[i]})
        pairs = sorted({k for i in range(a, b + 1) for k in self.node_pairs[i]})
        compute = sum(self.cost[q][i] - self.cost[old[i - a]][i] for i in range(a, b + 1))
        compute += self._saved(pairs, labels)
        starts = -self._starts(labels, a, b + 1)
        moved = -sum(self._value_cost(k, labels) for k in touched)
        labels[a : b + 1] = [q] * (b - a + 1)
        compute -= self._saved(pairs, labels)
        starts += self._starts(labels, a, b + 1)
        moved += sum(self._value_cost(k, labels) for k in touched)
        labels[a : b + 1] = old
        return compute, starts, moved

    def _runs(self, q: int) -> list[tuple[int, int]]:
        """Maximal stretches of consecutive nodes provider q supports."""
        runs, i, n = [], 0, len(self.nodes)
        while i < n:
            if not self.supported[q][i]:
                i += 1
                continue
            j = i
            while j + 1 < n and self.supported[q][j + 1]:
                j += 1
            runs.append((i, j))
            i = j + 1
        return runs

    def _best_gain_stretch(self, labels: list[int], q: int, a: int, b: int) -> tuple[int, int]:
        """The stretch of a..b where moving to q gains the most compute (Kadane's)."""
        best, best_at, running, start = -float("inf"), (a, b), 0.0, a
        for i in range(a, b + 1):
            gain = self.cost[labels[i]][i] - self.cost[q][i]
            if running <= 0:
                running, start = gain, i
            else:
                running += gain
            if running > best:
                best, best_at = running, (start, i)
        return best_at

    def refine(self, labels: list[int], rounds: int = 4) -> list[int]:
        """Move stretches of nodes to the provider that supports them while the estimate
        says the whole is faster (a tie goes to the higher-priority provider)."""
        labels = list(labels)
        for _ in range(rounds):
            changed = False
            for q in range(len(self.providers)):
                for a, b in self._runs(q):
                    if all(labels[i] == q for i in range(a, b + 1)):
                        continue
                    choices = {(a, b), self._best_gain_stretch(labels, q, a, b)}
                    scored = sorted((sum(self.delta(labels, q, lo, hi)), lo, hi) for lo, hi in choices)
                    change, lo, hi = scored[0]
                    outranks = all(q < labels[i] for i in range(lo, hi + 1) if labels[i] != q)
                    if change < -_TIE or (abs(change) <= _TIE and outranks):
                        labels[lo : hi + 1] = [q] * (hi - lo + 1)
                        changed = True
            if not changed:
                break
        return labels


def assign_by_estimate(
    nodes: Sequence[ir.Node],
    providers: Sequence[ExecutionProvider],
    ctx: SupportContext,
    costs: "CostModel",
    graph_outputs: Sequence[ir.Value],
    *,
    registry: "ProviderRegistry | None" = None,
) -> tuple[list[str], list[Fallback], PlacementEstimate]:
    """The provider name for each node by estimate, the fallbacks (a declined claim says
    what it would have cost), and the estimates weighed.

    Candidates: the priority order's assignment and, for each provider, everything it
    supports on it (the rest in priority order); each refined by moving stretches of nodes
    where the estimate gains. The fastest wins (a tie: the earlier candidate, priority
    order first), so the result is never estimated slower than all on the most capable
    single provider."""
    nodes = list(nodes)
    if not nodes:
        return [], [], PlacementEstimate("estimate", 0.0)
    answers = [[_ask(p, n, ctx, registry) for n in nodes] for p in providers]
    supported = [[a.supported for a in row] for row in answers]
    for i, node in enumerate(nodes):
        if not any(row[i] for row in supported):
            raise _no_provider(node, providers, ctx, {p.name: row[i].reason for p, row in zip(providers, answers)})
    problem = _Problem(nodes, providers, supported, costs, graph_outputs)
    candidates = [("priority order", problem.first_supported([]))]
    candidates += [(f"all on {p.name}", problem.first_supported([q])) for q, p in enumerate(providers)]
    alternatives = [(label, problem.total(labels)) for label, labels in candidates]
    best_total, best = None, candidates[0][1]
    for _, labels in candidates:
        refined = problem.refine(labels)
        total = problem.total(refined)
        if best_total is None or total < best_total - _TIE:
            best_total, best = total, refined
    fallbacks = _estimate_fallbacks(problem, best, answers)
    estimate = PlacementEstimate("estimate", best_total, tuple(alternatives))
    return [providers[p].name for p in best], fallbacks, estimate


def _estimate_fallbacks(problem: _Problem, labels: list[int], answers: list[list[Support]]) -> list[Fallback]:
    """For each node, every provider ranked above the one it runs on: why not there (its
    supports_op's reason, or what the estimate said of moving its stretch there)."""
    reasons: dict[tuple[int, int], str] = {}
    for q, provider in enumerate(problem.providers):
        for a, b in problem._runs(q):
            stretch = [i for i in range(a, b + 1) if labels[i] > q]
            if not stretch:
                continue
            lo, hi = stretch[0], stretch[-1]
            compute, starts, moved = problem.delta(labels, q, lo, hi)
            here = sum(problem.cost[labels[i]][i] for i in range(lo, hi + 1))
            where = sorted({problem.providers[labels[i]].name for i in range(lo, hi + 1)})
            reason = (
                f"estimate: on {provider.name} these {hi - lo + 1} node(s) would take {_ms(here + compute)} against "
                f"{_ms(here)} on {', '.join(where)}, plus {_ms(starts)} of partition boundaries and {_ms(moved)} of "
                f"transfers: {(compute + starts + moved) * 1e3:+.3f} ms in all"
            )
            for i in stretch:
                reasons[(i, q)] = reason
    fallbacks = []
    for i, (node, p) in enumerate(zip(problem.nodes, labels)):
        for q in range(p):
            if problem.supported[q][i]:
                reason, cause = reasons.get((i, q), "estimate: slower in all"), "estimate"
            else:
                reason, cause = answers[q][i].reason, "unsupported"
            fallbacks.append(
                Fallback(node_label(node), node.op_type, problem.providers[q].name, reason, problem.providers[p].name, cause)
            )
    return fallbacks
