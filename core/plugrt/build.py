"""Turn a graph into a runnable plan: placement, partitions, compile, transfers."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

import onnx_ir as ir

from ._guard import check_compiled, guard_step
from .errors import PlugrtError, ProviderNameMismatchError, ProviderUnavailableError
from .ir_utils import tensor_array
from .placement import (
    Fallback,
    PartitionInfo,
    PlacementEstimate,
    PlacementReport,
    Transfer,
    assign,
    assign_by_estimate,
    make_partitions,
    node_label,
)
from .plan import Plan, StepInfo
from .provider import (
    HOST_MEMORY,
    CompiledPartition,
    ExecutionProvider,
    MemoryCapability,
    PassesCapability,
    Step,
    SupportContext,
    memory_of,
)
from .tracing import instant, span
from .transfers import MemorySpaces
from .weights import shared_transform

if TYPE_CHECKING:
    from .costs import CostModel
    from .intent import Selection
    from .registry import ProviderRegistry

__all__ = ["BuiltGraph", "BuiltModel", "Stage", "build_graph", "HOST"]

HOST = HOST_MEMORY
_RESTORED = "\0restored:"


class BuiltModel(Protocol):
    """What a built session shows to code that saves it (EPContext export): the model
    after passes, the providers chosen, and the compiled partitions in order."""

    selection: "Selection"

    @property
    def model(self) -> ir.Model: ...

    @property
    def compiled_partitions(self) -> list[CompiledPartition]: ...


@dataclasses.dataclass
class Stage:
    """Consecutive plan steps of one kind: a compiled partition's steps (their inputs
    renamed to moved values), or the transfers staged before it (``compiled`` is None)."""

    provider: str
    steps: list[Step]
    compiled: CompiledPartition | None
    memory: MemoryCapability | None  # where the stage's results live; None: host


@dataclasses.dataclass
class BuiltGraph:
    plan: Plan
    report: PlacementReport
    compiled: list[CompiledPartition]
    stages: list[Stage]
    spaces: MemorySpaces
    # plan inputs read only by partitions of one device memory (their defaults move there once)
    input_homes: dict[ir.Value, MemoryCapability]
    # what each provider's own passes did to the nodes placed on it: pass name -> count
    pass_stats: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Placed:
    """What _compile_all hands back: the compiled partitions, every fallback, how the
    placement was chosen, each partition's estimate and what the providers' passes did."""

    compiled: list[CompiledPartition]
    fallbacks: list[Fallback]
    estimate: PlacementEstimate
    partition_estimates: list[float | None] | None
    pass_stats: dict[str, int]


def _run_provider_passes(
    model: ir.Model, providers: Sequence[ExecutionProvider], placed: dict[ir.Node, str], stats: dict[str, int]
) -> None:
    """Each provider's own passes (fusions) over the nodes placed on it: every node is
    marked with its provider (``plugrt.passes.CLAIMED_BY``) first, and a node a provider's
    pass writes without a mark is that provider's."""
    from .passes import CLAIMED_BY

    for node, name in placed.items():
        node.meta[CLAIMED_BY] = name
    used = set(placed.values())
    for provider in providers:
        make = provider.passes if isinstance(provider, PassesCapability) and provider.name in used else None
        if make is None:
            continue
        for graph_pass in make(model):
            with span(f"pass:{type(graph_pass).__name__}", provider=provider.name) as args:
                result = graph_pass(model)
                args["modified"] = bool(result.modified)
            stats[type(graph_pass).__name__] = stats.get(type(graph_pass).__name__, 0) + int(result.modified)
        for node in model.graph:
            node.meta.setdefault(CLAIMED_BY, provider.name)


def _compile_all(
    graph: ir.Graph,
    providers: list[ExecutionProvider],
    opset_imports: dict[str, int],
    registry: "ProviderRegistry | None",
    strict: bool,
    pinned: frozenset[str],
    devices: dict,
    restored: dict,
    costs: "CostModel | None",
    by_estimate: bool,
    passes_model: ir.Model | None,
    provider_options: Mapping[str, Any] | None = None,
) -> _Placed:
    ctx = SupportContext(dict(opset_imports), graph)
    active = list(providers)
    compile_fallbacks: list[Fallback] = []
    stats: dict[str, int] = {}
    while True:
        nodes = list(graph)  # the providers' passes of an earlier round may have rewritten it
        placeable = [n for n in nodes if n not in restored]
        with span("placement", nodes=len(placeable), providers=[p.name for p in active]) as args:
            if costs is not None and by_estimate and not strict and len(active) > 1:
                placed_some, fallbacks, estimate = assign_by_estimate(
                    placeable, active, ctx, costs, graph.outputs, registry=registry
                )
            else:
                placed_some, fallbacks = assign(placeable, active, ctx, registry=registry, strict=strict, pinned=pinned)
                estimate = PlacementEstimate("priority")
            args["strategy"] = estimate.strategy
        by_node = dict(zip(placeable, placed_some))
        # each restored EPContext node is a partition of its own
        placed = [by_node[n] if n in by_node else f"{_RESTORED}{i}" for i, n in enumerate(nodes)]
        estimates: list[float | None] | None = None
        if costs is not None:
            by_name = {p.name: p for p in active}
            estimates = [
                None if name.startswith(_RESTORED) else costs.partition_cost(by_name[name], part.nodes)
                for name, part in make_partitions(nodes, placed, graph.outputs, opset_imports)
            ]
        if passes_model is not None:
            # the providers' own fusions, after placement: each sees only the nodes placed on it
            from .passes import CLAIMED_BY

            _run_provider_passes(passes_model, active, by_node, stats)
            opset_imports.update({("" if d == "ai.onnx" else d): v for d, v in passes_model.opset_imports.items()})
            before = len(nodes)
            nodes = list(graph)
            placed = [
                f"{_RESTORED}{i}" if n in restored else str(n.meta[CLAIMED_BY]) for i, n in enumerate(nodes)
            ]
            if len(nodes) != before and estimates is not None:
                regrouped = make_partitions(nodes, placed, graph.outputs, opset_imports)
                if len(regrouped) != len(estimates):
                    estimates = None  # a fusion merged partitions: their estimates no longer line up
        by_name = {p.name: p for p in active}
        compiled: list[CompiledPartition] = []
        failed: tuple[str, BaseException, list[ir.Node]] | None = None
        for provider_name, partition in make_partitions(nodes, placed, graph.outputs, opset_imports):
            if provider_name.startswith(_RESTORED):
                compiled.append(restored[partition.nodes[0]])
                continue
            provider = by_name[provider_name]
            partition.device = devices.get(provider_name)
            partition.options = _options_of(provider_name, provider_options)
            partition.build_subgraph = functools.partial(
                _build_subgraph, provider=provider, opset_imports=opset_imports, provider_options=provider_options
            )
            try:
                with span("compile", partition=partition.name, provider=provider_name, nodes=len(partition.nodes)):
                    result = provider.compile(partition)
                check_compiled(result, partition, provider_name)  # garbage falls back like a raise
                if result.provider and result.provider != provider_name:
                    raise ProviderNameMismatchError(provider_name, result.provider)
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
            result.provider = provider_name  # filled in here: a provider need not repeat its name
            compiled.append(result)
        if failed is None:
            return _Placed(compiled, compile_fallbacks + fallbacks, estimate, estimates, stats)
        name, error, failed_nodes = failed
        if registry is not None and not isinstance(error, PlugrtError):
            registry.record_failure(name, "compile", error)
        reason = f"compile raised {type(error).__name__}: {error}"
        compile_fallbacks.extend(
            Fallback(node_label(n), n.op_type, name, reason, "?", "compile") for n in failed_nodes
        )
        active = [p for p in active if p.name != name]


def _constant_on(target: MemoryCapability, array: Any) -> Any:
    """A constant moved to ``target``'s default device, once for every session of a WeightStore."""
    device = target.default_device
    return shared_transform(array, ("to_device", target.memory, str(device)), lambda: target.to_device(array, device))


def _options_of(provider_name: str, provider_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The options that belong to ``provider_name``: keys ``<name>.<option>``."""
    prefix = provider_name + "."
    return {k: v for k, v in (provider_options or {}).items() if k.startswith(prefix)}


def _build_subgraph(
    graph: ir.Graph, outer: Sequence[ir.Value], *, provider: ExecutionProvider, opset_imports: dict[str, int],
    provider_options: Mapping[str, Any] | None = None,
) -> Plan:
    """A subgraph (an If branch, a Loop body) planned on ``provider`` alone."""
    return build_graph(
        graph, [provider], opset_imports, extra_inputs=outer, pinned=frozenset({provider.name}),
        provider_options=provider_options,
    ).plan


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
    spaces: MemorySpaces | None = None,
    costs: "CostModel | None" = None,
    by_estimate: bool = False,
    passes_model: ir.Model | None = None,
    provider_options: Mapping[str, Any] | None = None,
) -> BuiltGraph:
    """Place, partition and compile ``graph`` on ``providers`` (priority order, fallback
    last) and return its plan. ``extra_inputs`` are outer-scope values a subgraph reads;
    the plan takes them after the graph's own inputs. ``spaces`` counts the transfers
    (one is made from the providers when not given).

    ``costs`` puts estimates in the report; with ``by_estimate`` (and not ``strict``) the
    placement is the fastest the estimates find, else each node goes to the first provider
    that supports it. ``passes_model`` (the model whose graph this is, at optimisation
    level "all") runs each provider's own passes on the nodes placed on it. ``provider_options``
    (the session's options) gives each partition the keys of its provider (``Partition.options``)."""
    providers = list(providers)
    if spaces is None:
        spaces = MemorySpaces([m for m in map(memory_of, providers) if m is not None])
    if precompiled is not None:
        outcome = _Placed(list(precompiled), [], PlacementEstimate("priority"), None, {})
    else:
        outcome = _compile_all(
            graph, providers, opset_imports, registry, strict, pinned, devices or {}, restored or {},
            costs, by_estimate, passes_model, provider_options,
        )
    compiled, fallbacks = outcome.compiled, outcome.fallbacks
    by_name = {p.name: p for p in providers}
    declared_outputs = frozenset(graph.outputs)
    inputs = list(graph.inputs) + [v for v in extra_inputs if v not in graph.inputs]
    plan_inputs = set(inputs)

    # Values cross memory spaces through transfer steps, staged before the partition that
    # reads them. A constant reaches a device partition once, here; a plan input may be
    # fed on the host or bound on a device, so its step moves it only when needed.
    producer_of: dict[ir.Value, str] = {}
    for part in compiled:
        for value in part.partition.outputs:
            producer_of[value] = part.provider
    transfers: list[Transfer] = []
    steps: list[Step] = []
    infos: list[StepInfo] = []
    stages: list[Stage] = []
    device_constants: dict[ir.Value, Any] = {}
    moved_to: dict[tuple[ir.Value, str], ir.Value] = {}
    input_homes: dict[ir.Value, set[str]] = {}
    for part in compiled:
        provider = by_name.get(part.provider)
        target = memory_of(provider) if provider is not None else None
        space = target.memory if target is not None else HOST
        remap: dict[ir.Value, ir.Value] = {}
        moves: list[Step] = []
        for value in part.partition.inputs:
            if value in plan_inputs:
                input_homes.setdefault(value, set()).add(space)
                if not spaces:
                    continue
            elif value not in producer_of:  # an initializer or an outer-scope constant
                if target is None or value.const_value is None:
                    continue
                moved = moved_to.get((value, space))
                if moved is None:
                    moved = ir.Value(name=f"{value.name}@{part.provider}")
                    device_constants[moved] = _constant_on(target, tensor_array(value.const_value))
                    moved_to[(value, space)] = moved
                remap[value] = moved
                continue
            else:
                source = by_name.get(producer_of[value])
                source_memory = memory_of(source) if source is not None else None
                if (source_memory.memory if source_memory is not None else HOST) == space:
                    continue
            moved = moved_to.get((value, space))
            if moved is None:
                moved = ir.Value(name=f"{value.name}@{part.provider}")
                moved_to[(value, space)] = moved
                moves.append(
                    Step(spaces.mover(target), [value], [moved], name=f"transfer:{value.name}", op_type="Transfer")
                )
                infos.append(StepInfo(f"transfer:{value.name}", "Transfer", part.provider))
                transfers.append(_transfer(value, producer_of.get(value, "input"), part.provider, by_name, costs))
            remap[value] = moved
        if moves:
            steps.extend(moves)
            stages.append(Stage(part.provider, moves, None, target))
        part_steps = []
        for step in part.steps:
            step = guard_step(step, part.provider, declared_outputs)
            if remap:
                step = dataclasses.replace(step, inputs=[remap.get(v, v) if v is not None else None for v in step.inputs])
            part_steps.append(step)
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
        steps.extend(part_steps)
        stages.append(Stage(part.provider, part_steps, part, target))

    outputs = list(graph.outputs)
    read = {v for s in steps for v in s.inputs if v is not None} | set(outputs)
    constants: dict[ir.Value, Any] = dict(device_constants)
    for value in graph.initializers.values():
        if value in read and value not in inputs and value.const_value is not None:
            constants[value] = tensor_array(value.const_value)

    with span("plan", steps=len(steps), profiled=profile):
        plan = Plan(inputs, outputs, steps, constants, infos, profile=profile)
    counts: dict[str, int] = {}
    partitions = []
    estimates: list[float | None] = outcome.partition_estimates or [None] * len(compiled)
    for part, estimated in zip(compiled, estimates):
        counts[part.provider] = counts.get(part.provider, 0) + len(part.partition.nodes)
        partitions.append(
            PartitionInfo(
                part.partition.name,
                part.provider,
                len(part.partition.nodes),
                tuple(node_label(n) for n in part.partition.nodes),
                part.restored,
                estimated,
            )
        )
    for index, fb in enumerate(fallbacks):
        if fb.placed_on == "?":
            placed = next((p.provider for p in compiled if any(node_label(n) == fb.node for n in p.partition.nodes)), "?")
            fallbacks[index] = dataclasses.replace(fb, placed_on=placed)
    estimate = outcome.estimate
    if costs is not None and estimate.total_s is None and outcome.partition_estimates is not None:
        staged = sum(t.estimated_s or 0.0 for t in transfers)
        estimate = dataclasses.replace(estimate, total_s=sum(e or 0.0 for e in outcome.partition_estimates) + staged)
    report = PlacementReport([p.name for p in providers], counts, partitions, fallbacks, transfers, estimate)
    for fb in fallbacks:
        instant("fallback", **vars(fb))  # node, op_type, declined_by, reason, placed_on (vars: no deep copy)
    by_memory = {m.memory: m for m in spaces.memories}
    homes = {}
    for value, places in input_homes.items():
        (place, *others) = places
        if not others and place in by_memory:
            homes[value] = by_memory[place]
    return BuiltGraph(plan, report, compiled, stages, spaces, homes, outcome.pass_stats)


def _transfer(
    value: ir.Value, source: str, target: str, by_name: dict[str, ExecutionProvider], costs: "CostModel | None"
) -> Transfer:
    """The report's entry of a transfer step, with its estimate when there are costs."""
    from .costs import value_bytes

    nbytes = value_bytes(value)
    if costs is None:
        return Transfer(value.name or "", source, target, None, nbytes)
    source_memory = costs.memory(source) if source in by_name else HOST_MEMORY
    return Transfer(value.name or "", source, target, costs.transfer_cost(source_memory, costs.memory(target), nbytes), nbytes)
