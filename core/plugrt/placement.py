"""Placement: each node to the highest-priority provider that supports it; partitions."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import onnx_ir as ir

from .errors import PlacementError, ProviderUnavailableError, UnsupportedOpError
from .ir_utils import implicit_inputs
from .provider import ExecutionProvider, Partition, Support, SupportContext, node_label

if TYPE_CHECKING:
    from .registry import ProviderRegistry

__all__ = ["Fallback", "PartitionInfo", "Transfer", "PlacementReport", "assign", "make_partitions", "node_label"]


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A node a preferred provider declined, and where it went instead."""

    node: str
    op_type: str
    declined_by: str
    reason: str
    placed_on: str


@dataclasses.dataclass(frozen=True)
class PartitionInfo:
    name: str
    provider: str
    nodes: int
    node_names: tuple[str, ...]
    restored: bool = False


@dataclasses.dataclass(frozen=True)
class Transfer:
    value: str
    source: str  # provider that produced it
    target: str  # provider that reads it


@dataclasses.dataclass
class PlacementReport:
    """Where every node runs, and why any node did not run where it was first offered."""

    providers: list[str]  # consulted, in priority order
    nodes_per_provider: dict[str, int]
    partitions: list[PartitionInfo]
    fallbacks: list[Fallback]
    transfers: list[Transfer]

    def summary(self) -> str:
        lines = ["placement:"]
        for name in self.providers:
            lines.append(f"  {name}: {self.nodes_per_provider.get(name, 0)} node(s)")
        lines.append(f"  partitions: {len(self.partitions)}")
        for part in self.partitions:
            tag = " (restored)" if part.restored else ""
            lines.append(f"    {part.name}: {part.provider}, {part.nodes} node(s){tag}")
        if self.fallbacks:
            lines.append(f"  fallbacks: {len(self.fallbacks)}")
            for fb in self.fallbacks:
                lines.append(
                    f"    {fb.node} ({fb.op_type}): {fb.declined_by} declined ({fb.reason}); ran on {fb.placed_on}"
                )
        if self.transfers:
            lines.append(f"  transfers: {len(self.transfers)}")
            for tr in self.transfers:
                lines.append(f"    {tr.value}: {tr.source} -> {tr.target}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


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
            raise UnsupportedOpError(
                node.domain,
                node.op_type,
                ctx.opset(node.domain),
                node=node_label(node),
                providers_consulted=[p.name for p in providers],
                reasons=dict(declined),
            )
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
