"""Turn a graph into a runnable plan: placement, partitions, compile, transfers."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

import onnx_ir as ir

from .errors import PlugrtError, ProviderUnavailableError
from .ir_utils import tensor_array
from .placement import Fallback, PartitionInfo, PlacementReport, Transfer, assign, make_partitions, node_label
from .plan import Plan, StepInfo
from .provider import CompiledPartition, ExecutionProvider, Step, SupportContext

if TYPE_CHECKING:
    from .registry import ProviderRegistry

__all__ = ["BuiltGraph", "build_graph", "HOST"]

HOST = "host"
_RESTORED = "\0restored:"


@dataclasses.dataclass
class BuiltGraph:
    plan: Plan
    report: PlacementReport
    compiled: list[CompiledPartition]


def _memory(provider: ExecutionProvider) -> str:
    return getattr(provider, "memory", HOST)


def _compile_all(
    nodes: list[ir.Node],
    providers: list[ExecutionProvider],
    graph: ir.Graph,
    opset_imports: dict[str, int],
    registry: "ProviderRegistry | None",
    strict: bool,
    pinned: frozenset[str],
    devices: dict,
    restored: dict,
) -> tuple[list[CompiledPartition], list[Fallback]]:
    ctx = SupportContext(dict(opset_imports), graph)
    active = list(providers)
    compile_fallbacks: list[Fallback] = []
    placeable = [n for n in nodes if n not in restored]
    while True:
        placed_some, fallbacks = assign(placeable, active, ctx, registry=registry, strict=strict, pinned=pinned)
        by_node = dict(zip(placeable, placed_some))
        # each restored EPContext node is a partition of its own
        placed = [by_node[n] if n in by_node else f"{_RESTORED}{i}" for i, n in enumerate(nodes)]
        by_name = {p.name: p for p in active}
        compiled: list[CompiledPartition] = []
        failed: tuple[str, BaseException, list[ir.Node]] | None = None
        for provider_name, partition in make_partitions(nodes, placed, graph.outputs, opset_imports):
            if provider_name.startswith(_RESTORED):
                compiled.append(restored[partition.nodes[0]])
                continue
            provider = by_name[provider_name]
            partition.device = devices.get(provider_name)
            try:
                result = provider.compile(partition)
            except Exception as exc:
                if provider_name in pinned and not isinstance(exc, PlugrtError):
                    if registry is not None:
                        registry.record_failure(provider_name, "compile", exc)
                    raise ProviderUnavailableError(
                        provider_name,
                        f"compile raised {type(exc).__name__}: {exc}",
                        hint="report this to the provider's maintainers, or choose another device",
                    ) from exc
                if provider is active[-1] or strict or provider_name in pinned:
                    raise
                failed = (provider_name, exc, partition.nodes)
                break
            result.provider = result.provider or provider_name
            compiled.append(result)
        if failed is None:
            return compiled, compile_fallbacks + fallbacks
        name, exc, failed_nodes = failed
        if registry is not None and not isinstance(exc, PlugrtError):
            registry.record_failure(name, "compile", exc)
        reason = f"compile raised {type(exc).__name__}: {exc}"
        compile_fallbacks.extend(
            Fallback(node_label(n), n.op_type, name, reason, "?") for n in failed_nodes
        )
        active = [p for p in active if p.name != name]


def _transfer_fn(source: ExecutionProvider | None, target: ExecutionProvider | None):
    to_host = getattr(source, "to_host", None) if source is not None else None
    to_device = getattr(target, "to_device", None) if target is not None else None
    device = getattr(target, "default_device", None) if target is not None else None
    if to_host and to_device:
        return lambda x: to_device(to_host(x), device)
    if to_host:
        return to_host
    if to_device:
        return lambda x: to_device(x, device)
    return None


def build_graph(
    graph: ir.Graph,
    providers: Sequence[ExecutionProvider],
    opset_imports: dict[str, int],
    *,
    registry: "ProviderRegistry | None" = None,
    strict: bool = False,
    pinned: frozenset[str] = frozenset(),
    extra_inputs: Sequence[ir.Value] = (),
    profile: bool = False,
    precompiled: Sequence[CompiledPartition] | None = None,
    devices: dict | None = None,
    restored: dict | None = None,
) -> BuiltGraph:
    """Place, partition and compile ``graph`` on ``providers`` (priority order, fallback
    last) and return its plan. ``extra_inputs`` are outer-scope values a subgraph reads;
    the plan takes them after the graph's own inputs."""
    nodes = list(graph)
    providers = list(providers)
    if precompiled is not None:
        compiled, fallbacks = list(precompiled), []
    else:
        compiled, fallbacks = _compile_all(
            nodes, providers, graph, opset_imports, registry, strict, pinned, devices or {}, restored or {}
        )
    by_name = {p.name: p for p in providers}

    # Transfers where a value crosses between memory spaces.
    producer_of: dict[ir.Value, str] = {}
    for part in compiled:
        for value in part.partition.outputs:
            producer_of[value] = part.provider
    transfers: list[Transfer] = []
    steps: list[Step] = []
    infos: list[StepInfo] = []
    for part in compiled:
        provider = by_name.get(part.provider)
        target_memory = _memory(provider) if provider is not None else HOST
        remap: dict[ir.Value, ir.Value] = {}
        for value in part.partition.inputs:
            source_name = producer_of.get(value)
            source = by_name.get(source_name) if source_name else None
            source_memory = _memory(source) if source is not None else HOST
            if source_memory == target_memory or (source is None and value.is_initializer()):
                continue
            fn = _transfer_fn(source if source_memory != HOST else None, provider if target_memory != HOST else None)
            if fn is None:
                continue
            moved = ir.Value(name=f"{value.name}@{part.provider}")
            remap[value] = moved
            steps.append(Step(fn, [value], [moved], name=f"transfer:{value.name}", op_type="Transfer"))
            infos.append(StepInfo(f"transfer:{value.name}", "Transfer", part.provider))
            transfers.append(Transfer(value.name, source_name or "input", part.provider))
        for step in part.steps:
            if remap:
                step = dataclasses.replace(step, inputs=[remap.get(v, v) if v is not None else None for v in step.inputs])
            steps.append(step)
            infos.append(
                StepInfo(
                    step.name,
                    step.op_type,
                    part.provider,
                    step.domain,
                    opset_imports.get(step.domain, 1) if step.domain else opset_imports.get("", 0),
                    step.nodes,
                )
            )

    outputs = list(graph.outputs)
    for index, value in enumerate(outputs):
        source_name = producer_of.get(value)
        source = by_name.get(source_name) if source_name else None
        if source is not None and _memory(source) != HOST:
            moved = ir.Value(name=f"{value.name}@host")
            steps.append(Step(source.to_host, [value], [moved], name=f"transfer:{value.name}", op_type="Transfer"))
            infos.append(StepInfo(f"transfer:{value.name}", "Transfer", source_name))
            transfers.append(Transfer(value.name, source_name, HOST))
            outputs[index] = moved

    inputs = list(graph.inputs) + [v for v in extra_inputs if v not in graph.inputs]
    read = {v for s in steps for v in s.inputs if v is not None} | set(outputs)
    constants: dict[ir.Value, Any] = {}
    for value in graph.initializers.values():
        if value in read and value not in inputs and value.const_value is not None:
            constants[value] = tensor_array(value.const_value)

    plan = Plan(inputs, outputs, steps, constants, infos, profile=profile)
    counts: dict[str, int] = {}
    partitions = []
    for part in compiled:
        counts[part.provider] = counts.get(part.provider, 0) + len(part.partition.nodes)
        partitions.append(
            PartitionInfo(
                part.partition.name,
                part.provider,
                len(part.partition.nodes),
                tuple(node_label(n) for n in part.partition.nodes),
                part.restored,
            )
        )
    for index, fb in enumerate(fallbacks):
        if fb.placed_on == "?":
            placed = next((p.provider for p in compiled if any(node_label(n) == fb.node for n in p.partition.nodes)), "?")
            fallbacks[index] = dataclasses.replace(fb, placed_on=placed)
    report = PlacementReport([p.name for p in providers], counts, partitions, fallbacks, transfers)
    return BuiltGraph(plan, report, compiled)
