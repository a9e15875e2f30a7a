"""The CPU provider: claims every op with a registered kernel and binds kernels to nodes."""

from __future__ import annotations

import functools
import platform
from typing import TYPE_CHECKING, Any, Callable

from plugrt import provider as protocol  # its onnx_ir helpers load on first use, not at discovery
from plugrt.errors import UnsupportedOpError
from plugrt.provider import (
    CacheReport,
    CaptureContext,
    CapturedPartition,
    CompiledPartition,
    Device,
    DeviceKind,
    Partition,
    Step,
    Support,
    SupportContext,
    node_label,
)

from . import _registry
from ._capture import capture_partition, into_of
from ._counters import AllocationCount, PartitionCounters, collecting, counted, track_runner
from ._host_memory import tune_host_allocator

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["CPUProvider"]

_kernels_loaded = False


def _load_kernels() -> None:
    global _kernels_loaded
    if not _kernels_loaded:
        from . import fusions, fusions_linear_attention, fusions_transformer, kernels  # noqa: F401  (registers every kernel, fused ones too)

        _kernels_loaded = True


def attribute_value(attr: ir.Attr) -> Any:
    """An ONNX attribute as the Python value a kernel receives."""
    import onnx_ir as ir

    kind = attr.type
    value = attr.value
    if kind == ir.AttributeType.FLOAT:
        return float(value)
    if kind == ir.AttributeType.INT:
        return int(value)
    if kind == ir.AttributeType.STRING:
        return value.decode("utf-8") if isinstance(value, bytes) else value
    if kind == ir.AttributeType.FLOATS:
        return [float(v) for v in value]
    if kind == ir.AttributeType.INTS:
        return [int(v) for v in value]
    if kind == ir.AttributeType.STRINGS:
        return [v.decode("utf-8") if isinstance(v, bytes) else v for v in value]
    if kind == ir.AttributeType.TENSOR:
        return protocol.tensor_array(value)
    if kind == ir.AttributeType.TENSORS:
        return [protocol.tensor_array(v) for v in value]
    if kind == ir.AttributeType.GRAPHS:
        return list(value)
    return value  # GRAPH, TYPE_PROTO(S), SPARSE_TENSOR(S): as onnx_ir holds them


class SubgraphRunner:
    """A subgraph compiled once: ``run(inputs, outer)`` returns its outputs as a list."""

    __slots__ = ("graph", "input_names", "output_names", "outer_names", "_plan", "runs")

    def __init__(self, graph: ir.Graph, build_subgraph: Any):
        free = protocol.graph_free_values(graph)
        self.graph = graph
        self.input_names = [v.name or "" for v in graph.inputs]
        self.output_names = [v.name or "" for v in graph.outputs]
        self.outer_names = [v.name or "" for v in free]
        self._plan = build_subgraph(graph, free)
        self.runs = 0  # for Session.stats()
        track_runner(self)

    def run(self, inputs: list, outer: dict[str, Any]) -> list:
        self.runs += 1
        return self._plan.run(*inputs, *[outer[name] for name in self.outer_names])


#: Ops the CPU fusions fold into the Conv, MatMul or BatchNormalization before them (an
#: epilogue: no pass of their own over memory), for placement by estimate.
_EPILOGUES = frozenset({"Relu", "Add", "Mul", "BatchNormalization"})
_FUSED_INTO = frozenset({"Conv", "MatMul", "BatchNormalization"})


class CPUProvider:
    """numpy kernels; the fallback for every other provider."""

    name = _registry.PROVIDER_NAME
    priority = 0
    memory = "host"
    device_kinds = (DeviceKind.CPU,)
    # a CPU partition is more steps of the same plan: nothing to enter or leave
    partition_overhead = 0.0

    def devices(self) -> list[Device]:
        return [Device(DeviceKind.CPU, 0, _cpu_name())]

    def supports_op(self, node: ir.Node, ctx: SupportContext) -> Support:
        _load_kernels()
        opset = ctx.opset(node.domain)
        if _registry.lookup(node.domain, node.op_type, opset) is not None:
            return Support.yes()
        domain = node.domain or "ai.onnx"
        known = _registry.versions(node.domain, node.op_type)
        if known:
            return Support.no(
                f"the CPU provider's {domain}::{node.op_type} kernels start at opset "
                f"{known[0]}, above the model's opset {opset}; re-export the model at opset {known[0]} or later"
            )
        return Support.no(f"the CPU provider has no kernel for {domain}::{node.op_type}")

    def fused_cost(self, node: ir.Node, producer: ir.Node, ctx: protocol.CostContext) -> float | None:
        """What ``node`` costs when it runs here right after ``producer`` (the only reader
        of its output): a Relu, bias Add, Mul or BatchNormalization after a Conv, MatMul or
        BatchNormalization is folded into it by the fusions, a call and no pass over memory."""
        if node.op_type in _EPILOGUES and producer.op_type in _FUSED_INTO:
            return 0.0
        return None

    def passes(self, model: ir.Model) -> list:
        """The CPU fusions (onnx_ir passes), run at optimisation level "all" after placement,
        on the nodes placed on this provider.

        Importing ``fusions`` registers the kernels of the ``plugrt.cpu`` nodes they write.
        """
        from . import fusions, fusions_linear_attention, fusions_transformer

        return [
            *fusions.fusion_passes(), *fusions_transformer.transformer_passes(),
            fusions_linear_attention.FuseReluLinearAttentionPass(),
        ]

    def compile(self, partition: Partition) -> CompiledPartition:
        _load_kernels()
        tune_host_allocator()  # once per process: see _host_memory
        with collecting(PartitionCounters()) as counters:
            bound = [self._bind(node, partition.opset_imports, partition.build_subgraph) for node in partition.nodes]
        steps = [step for step, _ in bound]
        # per step: (KernelSpec, attributes), for capture to find out= variants
        return CompiledPartition(partition, steps, self.name, state=_StepMetadata(bound, counters))

    def counters(self, compiled: CompiledPartition) -> dict[str, int]:
        """Kernel-plan cache look-ups, control-flow executions and subgraph runs of
        ``compiled`` so far (``Session.stats()`` sums them)."""
        counters = getattr(compiled.state, "counters", None)
        return counters.snapshot() if isinstance(counters, PartitionCounters) else {}

    #: Plain runs stay eager by default (``graphs="auto"``): measured on the light models,
    #: replaying a capture gains nothing consistent over an eager run here (0.83-1.17x of
    #: its time over two measurements, benchmarks/plain_run_graphs.py): the kernels' own
    #: work dominates a run.
    capture_plain_runs = False

    def count_allocations(self) -> AllocationCount:
        """A context manager counting the arrays a replay on this thread allocates (its
        eager seams' outputs; a captured step writes into its buffer), for
        ``session.capture_stats.sites``."""
        return AllocationCount()

    def capture(self, compiled: CompiledPartition, ctx: CaptureContext) -> CapturedPartition:
        """Bind every step to preallocated outputs (see plugrt_cpu._capture)."""
        metadata = compiled.state if isinstance(compiled.state, list) else [None] * len(compiled.steps)
        return capture_partition(compiled, ctx, metadata)

    def prepare_cache(self, progress: Callable[[int, int, str], None]) -> CacheReport:
        """Compile numba's loops into its on-disk cache now (``plugrt compile-cache``), so
        that later processes load them at once instead of building them in the background."""
        import importlib.util
        import os

        from .kernels import _compiled

        total = len(_compiled.MODULES)
        if importlib.util.find_spec("numba") is None:
            return CacheReport(0, total, note="numba is not installed (pip install 'plugrt[accelerate]'): nothing to compile")
        if os.environ.get("PLUGRT_NUMBA", "1") == "0":
            return CacheReport(0, total, note="PLUGRT_NUMBA=0 turns the compiled loops off")

        def step(done: int, total: int, name: str) -> None:
            progress(done, total, f"{name} ({_compiled.MODULES[name]})" if name else "")

        ready = _compiled.build_all(step)
        note = "" if ready == total else "numba could not compile some loops here (see the warning above)"
        return CacheReport(ready, total, location=_compiled.cache_directory(), note=note)

    def bind(self, node: ir.Node, opset_imports: dict[str, int], build_subgraph: Any = None) -> Step:
        """The step that runs ``node``: its kernel with attributes bound once.
        ``build_subgraph`` (``Partition.build_subgraph``) is needed for control flow."""
        return self._bind(node, opset_imports, build_subgraph)[0]

    def _bind(self, node: ir.Node, opset_imports: dict[str, int], build_subgraph: Any = None) -> tuple[Step, tuple]:
        import onnx_ir as ir

        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        opset = opset_imports.get(domain, 1 if domain else 0)
        spec = _registry.lookup(domain, node.op_type, opset)
        label = node_label(node)
        if spec is None:
            raise UnsupportedOpError(
                domain, node.op_type, opset, node=label, providers_consulted=[self.name],
                reasons={self.name: "no kernel"},
            )
        if spec.compiled:
            from .kernels._compiled import compiled_module

            for module in spec.compiled:
                compiled_module(module)  # queued now: loaded while the rest of the session is built
        inputs: list[ir.Value | None] = list(node.inputs)
        while inputs and inputs[-1] is None:
            inputs.pop()
        control_flow = any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())
        implicit = protocol.implicit_inputs(node) if control_flow else []
        attributes = {name: attribute_value(attr) for name, attr in node.attributes.items()}
        if spec.builder:
            ctx = _registry.KernelContext(
                op_type=node.op_type,
                domain=domain,
                opset=opset,
                attributes=attributes,
                num_inputs=len(inputs),
                num_outputs=len(node.outputs),
                input_dtypes=[_dtype_of(v) for v in inputs],
                constant_inputs=[protocol.constant_array(v) if v is not None else None for v in inputs],
                node=node,
                compile_subgraph=(
                    functools.partial(SubgraphRunner, build_subgraph=build_subgraph) if build_subgraph else None
                ),
                implicit_inputs=tuple(v.name or "" for v in implicit),
            )
            try:
                fn = spec.fn(ctx)
            except NotImplementedError as exc:
                raise UnsupportedOpError(
                    domain, node.op_type, opset, node=label, providers_consulted=[self.name],
                    reasons={self.name: str(exc) or "these attributes are not supported"},
                ) from exc
        else:
            if spec.attribute_names is not None:
                attributes = {k: v for k, v in attributes.items() if k in spec.attribute_names}
            fn = functools.partial(spec.fn, **attributes) if attributes else spec.fn
        if control_flow:
            fn = counted(node.op_type, fn)  # its executions, for Session.stats()
        outputs: list[ir.Value | None] = list(node.outputs)
        while len(outputs) > 1 and outputs[-1] is None:
            outputs.pop()
        step = Step(
            fn,
            [*inputs, *implicit],
            outputs,
            multi_output=spec.multi_output,
            name=label,
            op_type=node.op_type,
            domain=domain,
            nodes=(label,),
        )
        if spec.inplace and not spec.multi_output:
            step.inplace = into_of(step)
            step.inplace_keeps_first = spec.inplace_keeps_first
        return step, (spec, attributes)


class _StepMetadata(list):
    """Per step (KernelSpec, attributes), for capture to find out= variants; and the
    partition's counters."""

    def __init__(self, bound: list[tuple[Step, tuple]], counters: PartitionCounters):
        super().__init__(meta for _, meta in bound)
        self.counters = counters


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _dtype_of(value: ir.Value | None):
    if value is None or value.dtype is None:
        return None
    try:
        return protocol.numpy_dtype(int(value.dtype))
    except ValueError:
        return None


