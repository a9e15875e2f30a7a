"""The execution-provider protocol: what a provider plugin implements.

STOP AND THINK before changing anything in this module. Hardware vendors build their
providers against these definitions; a change here breaks every provider shipped as a
separate package. Add optional capabilities rather than changing required members, and
bump ``PROTOCOL_VERSION`` when a required member changes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    import onnx_ir as ir

    from ._dtypes import numpy_dtype, onnx_type
    from .ir_utils import constant_array, graph_free_values, implicit_inputs, is_constant, subgraphs, tensor_array
    from .weights import shared_transform

#: Helpers a provider may use, re-exported from the modules that hold them; imported on
#: first use (PEP 562), so that discovering providers needs no onnx_ir.
_HELPERS = {
    "numpy_dtype": "._dtypes",
    "onnx_type": "._dtypes",
    "constant_array": ".ir_utils",
    "graph_free_values": ".ir_utils",
    "implicit_inputs": ".ir_utils",
    "is_constant": ".ir_utils",
    "subgraphs": ".ir_utils",
    "tensor_array": ".ir_utils",
    "shared_transform": ".weights",
}


def __getattr__(name: str) -> Any:
    module = _HELPERS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __package__), name)
    globals()[name] = value
    return value

__all__ = [
    "PROTOCOL_VERSION",
    "DeviceKind",
    "Device",
    "Support",
    "SupportContext",
    "Partition",
    "Step",
    "CompiledPartition",
    "ExecutionProvider",
    "CaptureMiss",
    "CaptureContext",
    "CapturedPartition",
    "NotCapturable",
    "SubgraphPlan",
    "eager_replay",
    "outputs_of",
    # optional capabilities
    "MemoryCapability",
    "CaptureCapability",
    "ContextCapability",
    "ContextCompatibilityCapability",
    "PassesCapability",
    "FunctionCapability",
    "AvailabilityCapability",
    "CountersCapability",
    "CostCapability",
    "CostContext",
    "CompiledCacheCapability",
    "CacheReport",
    "CAPABILITIES",
    "CAPABILITY_PROTOCOLS",
    "SUPPORTED_PROTOCOL_VERSIONS",
    "HOST_MEMORY",
    "protocol_version",
    "memory_of",
    # helpers for providers
    "node_label",
    "op_version_in_effect",
    "numpy_dtype",
    "onnx_type",
    "constant_array",
    "tensor_array",
    "is_constant",
    "implicit_inputs",
    "graph_free_values",
    "subgraphs",
    "shared_transform",
]

PROTOCOL_VERSION = 1


class DeviceKind(str, enum.Enum):
    CPU = "cpu"
    GPU = "gpu"
    NPU = "npu"
    OTHER = "other"


@dataclasses.dataclass(frozen=True)
class Device:
    """One device a provider can run on."""

    kind: DeviceKind
    index: int = 0
    name: str = ""

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.index}" + (f" ({self.name})" if self.name else "")


@dataclasses.dataclass(frozen=True)
class Support:
    """A provider's answer to "can you run this node?"; a "no" always says why."""

    supported: bool
    reason: str = ""

    def __post_init__(self) -> None:
        if not self.supported and not self.reason:
            raise ValueError("Support.no() needs a reason the user can act on")

    def __bool__(self) -> bool:
        return self.supported

    @classmethod
    def yes(cls) -> "Support":
        return _YES

    @classmethod
    def no(cls, reason: str) -> "Support":
        return cls(False, reason)


_YES = Support(True)


@dataclasses.dataclass
class SupportContext:
    """What a provider may consult when deciding whether it supports a node."""

    opset_imports: dict[str, int]  # domain -> version ("" is ai.onnx)
    graph: "ir.Graph | None" = None

    def opset(self, domain: str) -> int:
        key = "" if domain in ("", "ai.onnx") else domain
        return self.opset_imports.get(key, 1 if key else 0)


@dataclasses.dataclass
class CostContext(SupportContext):
    """What a provider may consult when estimating a node's cost: the support context,
    and the core's work counts and nominal estimate of the node (see ``plugrt.costs``)."""

    def nominal(self, node: "ir.Node") -> float:
        """The core's estimate, in seconds, of ``node`` on the nominal host (the same on
        every machine): a kernel call plus the larger of arithmetic and memory traffic."""
        from ._nominal import nominal_cost

        return nominal_cost(node)

    def flops(self, node: "ir.Node") -> float:
        """Arithmetic of ``node`` from its inferred shapes (multiply-adds count two)."""
        from ._nominal import node_flops

        return node_flops(node)

    def bytes(self, node: "ir.Node") -> float:
        """Bytes ``node`` reads and writes, from its inferred shapes and types."""
        from ._nominal import node_bytes

        return node_bytes(node)


@dataclasses.dataclass
class Partition:
    """Consecutive nodes placed on one provider, with the values crossing its boundary."""

    name: str
    nodes: list["ir.Node"]
    inputs: list["ir.Value"]  # values read from outside the partition (graph inputs, initializers, other partitions)
    outputs: list["ir.Value"]  # values read after the partition or model outputs
    opset_imports: dict[str, int]
    device: Device | None = None
    # ``build_subgraph(graph, outer_values)`` plans a subgraph (an If branch, a Loop body)
    # on this partition's provider alone; the result's ``run(*inputs, *outer)`` returns
    # the subgraph's outputs. Set by the session before ``compile``.
    build_subgraph: "Callable[[ir.Graph, Sequence[ir.Value]], SubgraphPlan] | None" = None
    # The session's options for this partition's provider: the validated values of the
    # option keys that start with its name and a dot (``cuda.tf32``). Set before ``compile``.
    options: "Mapping[str, Any]" = dataclasses.field(default_factory=dict)


class SubgraphPlan(Protocol):
    """What ``Partition.build_subgraph`` returns: a planned subgraph."""

    def run(self, *args: Any) -> list: ...


@dataclasses.dataclass
class Step:
    """One callable in a compiled partition, as the executor will call it.

    ``fn(*inputs)`` receives the arrays of ``inputs`` (``None`` for an omitted optional
    input) and returns one array when ``multi_output`` is false, else a sequence whose
    first ``len(outputs)`` items are the outputs (``None`` entries in ``outputs`` are
    outputs the graph does not use).
    """

    fn: Callable[..., Any]
    inputs: list["ir.Value | None"]
    outputs: list["ir.Value | None"]
    multi_output: bool = False
    name: str = ""
    op_type: str = ""
    domain: str = ""
    # labels of the graph nodes this step computes (several when fused): node_label(node),
    # the node's name, or its op type and outputs when it has none
    nodes: tuple[str, ...] = ()
    # Optional ``inplace(out, *inputs)``, correct when ``out`` is the first input (an
    # elementwise op whose output has that input's dtype). The plan calls it when the
    # first input dies at this step and nothing else refers to its array.
    inplace: Callable[..., Any] | None = None
    # The output has the first input's shape and dtype whatever the other inputs' shapes
    # (a gate that scales each channel, from weights of other shapes): the plan then checks
    # the first input alone before calling ``inplace``, not that the others broadcast onto it.
    inplace_keeps_first: bool = False


@dataclasses.dataclass
class CompiledPartition:
    """A partition after ``compile``: the steps the executor runs, in order."""

    partition: Partition
    steps: list[Step]
    provider: str = ""
    restored: bool = False  # True when loaded from an EPContext instead of compiled
    state: Any = None  # provider-private data, e.g. for save_context


class CaptureMiss(Exception):
    """Raised by a replay callable when what it captured no longer holds (e.g. an
    eagerly run step produced a different shape); the session then runs eagerly."""


@runtime_checkable
class CaptureContext(Protocol):
    """The persistent arrays of a capture, as a provider's ``capture`` sees them.

    A provider's ``capture`` reads its inputs with :meth:`array`, takes output buffers
    from :meth:`buffer_like` (pooled per memory space: a buffer whose values are all dead
    is handed out again, so a capture needs about as much memory as a run), registers each
    output with :meth:`set` and calls :meth:`step_done` after each step. Replay callables
    must write into those buffers and never rebind them. The session's implementation
    lives in ``plugrt.capture``.
    """

    def array(self, value: "ir.Value | None") -> Any:
        """The persistent array of ``value`` (None for an omitted optional input)."""
        ...

    def buffer_like(self, array: Any) -> Any:
        """A persistent buffer of ``array``'s shape and dtype, in ``array``'s memory space."""
        ...

    def set(self, value: "ir.Value | None", array: Any) -> None:
        """Register ``array`` as the persistent buffer of ``value``."""
        ...

    def can_overwrite(self, value: "ir.Value | None", array: Any) -> bool:
        """True when the current step reads ``value`` for the last time and ``array`` holds
        no other live value: the step may write its output over it."""
        ...

    def step_done(self, step: "Step") -> None:
        """Release the buffers of values this step read (or made) for the last time."""
        ...

    def is_persistent(self, array: Any) -> bool:
        """True when ``array`` is (a view of) a buffer this capture owns or was given."""
        ...

    def owner(self, array: Any) -> "MemoryCapability | None":
        """The provider whose device memory holds ``array``; None for host memory."""
        ...


def outputs_of(step: Step, result: Any) -> list:
    """A step's result as a list with one entry per step output."""
    if step.multi_output:
        return list(result[: len(step.outputs)])
    return [result]


def _persistent_copy(value: Any, ctx: CaptureContext) -> Any:
    import numpy as np

    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, np.generic):
        return np.array(value)
    if isinstance(value, list):
        return list(value)
    owner = ctx.owner(value)
    if owner is not None:  # a device array: a buffer of its memory, filled by its provider
        buffer = ctx.buffer_like(value)
        owner.copy_into(value, buffer)
        return buffer
    return value


def eager_replay(step: Step, inputs: list, recorded: list, ctx: CaptureContext) -> Callable[[], None]:
    """Register copies of ``recorded`` as the step's buffers; the returned callable runs
    the step eagerly and copies its result into them (CaptureMiss when it no longer fits)."""
    import numpy as np

    buffers = [_persistent_copy(r, ctx) for r in recorded]
    owners = [ctx.owner(b) for b in buffers]
    for value, buffer in zip(step.outputs, buffers):
        ctx.set(value, buffer)
    fn = step.fn

    def run() -> None:
        results = outputs_of(step, fn(*inputs))
        for buffer, owner, new in zip(buffers, owners, results):
            if owner is not None:
                if not owner.owns(new) or tuple(new.shape) != tuple(buffer.shape) or new.dtype != buffer.dtype:
                    raise CaptureMiss(f"{step.name}: output became {new.dtype}{list(new.shape)}")
                owner.copy_into(new, buffer)
            elif isinstance(buffer, np.ndarray):
                new = np.asarray(new)
                if new.shape != buffer.shape or new.dtype != buffer.dtype:
                    raise CaptureMiss(f"{step.name}: output became {new.dtype}{list(new.shape)}")
                np.copyto(buffer, new)
            elif isinstance(buffer, list) and isinstance(new, list):
                buffer[:] = new
            elif buffer is not new and not (buffer is None and new is None):
                raise CaptureMiss(f"{step.name}: output changed kind")

    return run


@dataclasses.dataclass
class CapturedPartition:
    """A provider's capture of one compiled partition.

    ``runs`` are zero-argument callables run in order on every replay; ``nodes`` says,
    per step, whether it was captured and, if not, why (it then runs eagerly inside a
    run, copying into its persistent buffer, and raises CaptureMiss if that no longer fits).
    ``run_nodes``, when given, is the label (``Step.name``) of the step each of ``runs``
    replays, so that an error during a replay names its node as an eager run's does;
    without it the error names the partition.
    """

    runs: list[Callable[[], None]]
    nodes: list[tuple[str, bool, str]]  # (node label, captured, reason when not)
    run_nodes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class NotCapturable:
    """Capture declined, with each node that declined and why."""

    report: list[tuple[str, str]]  # (node label, reason)
    captured: bool = False


@runtime_checkable
class ExecutionProvider(Protocol):
    """What every provider implements. Optional capabilities are the ``*Capability``
    protocols below, checked with ``isinstance``; ``protocol_version`` (default 1) must be
    in :data:`SUPPORTED_PROTOCOL_VERSIONS`."""

    name: str
    priority: int  # auto mode prefers higher; the CPU provider is 0; < 0: only when asked by name

    def devices(self) -> list[Device]:
        """The devices this provider can use now; [] when none (then ``unavailable_reason``
        may say why)."""
        ...

    def supports_op(self, node: "ir.Node", ctx: SupportContext) -> Support:
        """Whether this provider can run ``node``; a "no" carries a reason a user can act on."""
        ...

    def compile(self, partition: Partition) -> CompiledPartition:
        """Turn a partition into steps the executor can call; may fuse nodes."""
        ...


# -- optional capabilities -------------------------------------------------------------
#
# Each capability is one runtime-checkable Protocol. The core checks a provider with
# ``isinstance(provider, Capability)`` and calls only the members listed here; a provider
# that implements part of a capability does not have it.


@runtime_checkable
class MemoryCapability(Protocol):
    """Arrays in the provider's own memory space (device memory), with its allocator and
    the copies in and out of it.

    The core never touches a device array's data: it reads ``.shape`` and ``.dtype``,
    slices it with a tuple of ``slice`` objects (a view, for a binding's logical region)
    and passes it to this provider's members and kernels. Everything else goes through
    these members:

    - ``memory``: the name of the memory space (not ``"host"``, which means numpy arrays
      in host memory and needs no capability).
    - ``default_device``: the :class:`Device` that values moved onto this provider land on.
    - ``allocate(shape, dtype, device)``: a new array (contents undefined); bindings and
      capture buffers come from here.
    - ``to_device(array, device)``: a new device array holding a host ``numpy.ndarray``.
    - ``to_host(array)``: a new host ``numpy.ndarray`` holding a device array.
    - ``copy_into(source, target)``: copy ``source`` into the existing array ``target``
      (same shape and dtype); each is a host ``numpy.ndarray`` or an array of this memory
      space, at least one of them the latter (upload into a buffer, download into a host
      buffer, device-to-device copy). Capture replays and bindings copy only through this,
      so that replay allocates nothing.
    - ``owns(array)``: True when ``array`` lives in this provider's memory space.

    Optional: ``allocated_bytes()`` (int, bytes the provider has allocated so far) lets the
    session count what a replay allocates; ``from_pointer(pointer, shape, dtype, device)``
    wraps memory the caller owns at an address as an array of this space, without a copy
    (onnxruntime's ``IOBinding.bind_input`` with a ``buffer_ptr``).
    """

    memory: str
    default_device: Device

    def allocate(self, shape: tuple[int, ...], dtype: Any, device: Device | None) -> Any: ...

    def to_device(self, array: Any, device: Device | None) -> Any: ...

    def to_host(self, array: Any) -> Any: ...

    def copy_into(self, source: Any, target: Any) -> None: ...

    def owns(self, array: Any) -> bool: ...


@runtime_checkable
class CaptureCapability(Protocol):
    """Capture of a compiled partition for replay.

    ``capture(compiled, ctx)`` runs the partition once on ``ctx``'s arrays and returns a
    :class:`CapturedPartition` (replay callables writing into buffers from
    ``ctx.buffer_like``) or :class:`NotCapturable` with each node's reason. Transfers
    between memory spaces are never inside a provider's capture: the session stages them
    between captured segments. Without this capability a partition runs eagerly between
    captured segments.

    Optional members that go with it:

    - ``capture_plain_runs``: True when replays beat eager runs here, so that plain
      ``Session.run`` calls replay a capture per input signature (``graphs="auto"``).
    - ``replay_tolerance``: ``(rtol, atol)`` a plain-run graph's first replay may differ
      from the eager run by (default: none).
    - ``count_allocations()``: a context manager whose object has ``count`` and ``bytes``
      after it exits: what a replay on this thread allocated while it was entered.
    - ``stream_error()``: after a replay, why the device reports an error ("" when none).
    """

    def capture(self, compiled: CompiledPartition, ctx: CaptureContext) -> "CapturedPartition | NotCapturable": ...


@runtime_checkable
class ContextCapability(Protocol):
    """EPContext export and restore (a compiled partition saved as a blob).

    - ``context_source_keys``: the EPContext ``source`` values this provider restores;
      the first is written on export.
    - ``save_context(compiled)``: the blob (bytes) of a compiled partition.
    - ``load_context(blob, meta)``: a :class:`CompiledPartition` from a blob; ``meta``
      holds the node's attributes (``partition``, ``partition_name``, ``source``,
      ``main_context``, ``embed_mode``, ``ep_sdk_version``, ``notes``).
    """

    context_source_keys: tuple[str, ...]

    def save_context(self, compiled: CompiledPartition) -> bytes: ...

    def load_context(self, blob: bytes, meta: dict[str, Any]) -> CompiledPartition: ...


@runtime_checkable
class ContextCompatibilityCapability(Protocol):
    """A check, before restore, that a saved context fits this provider and machine.

    ``check_context(meta)`` (``meta`` as for ``load_context``, e.g. its
    ``ep_sdk_version``) returns :meth:`Support.yes` or :meth:`Support.no` with a reason
    (e.g. "saved by SDK 2.1, this is 3.0: re-export the model"). ``sdk_version`` is
    written as ``ep_sdk_version`` on export.
    """

    sdk_version: str

    def check_context(self, meta: dict[str, Any]) -> Support: ...


@runtime_checkable
class PassesCapability(Protocol):
    """Graph passes (the provider's own fusions) run on the nodes placed on it, after
    placement and before ``compile`` (optimisation level "all").

    ``passes(model)`` returns onnx_ir passes. Every node then carries
    ``meta["plugrt.claimed_by"]``, the provider it was placed on; the passes must rewrite
    only nodes that name this provider and mark what they write with it, so that no other
    provider is ever asked about a node they invented. Rewrites that do not depend on a
    provider belong in the core's rewrites (``plugrt.rewrites``), run before placement.
    """

    def passes(self, model: "ir.Model") -> list: ...


@runtime_checkable
class FunctionCapability(Protocol):
    """Model-local functions run as one op instead of being inlined.

    ``supports_function(domain, name, ctx)`` returns :class:`Support`; a "yes" keeps calls
    of that function as nodes, which ``supports_op`` must then claim.
    """

    def supports_function(self, domain: str, name: str, ctx: SupportContext) -> Support: ...


@runtime_checkable
class AvailabilityCapability(Protocol):
    """``unavailable_reason``: why ``devices()`` is empty (shown by ``plugrt providers``).

    A provider may also declare ``device_kinds``, the kinds of device it can ever offer
    (a tuple of :class:`DeviceKind`), known without probing: an intent for another kind
    (``device="cpu"``, ``"npu:0"``) then never calls its ``devices()``, which may import a
    driver library or touch hardware. Without it the provider is probed as usual."""

    unavailable_reason: str


@runtime_checkable
class CountersCapability(Protocol):
    """Counters of a compiled partition, which ``Session.stats()`` sums.

    ``counters(compiled)`` returns what the partition's kernels did since it was compiled,
    as ``{name: int}``: ``"kernel_cache.hits"`` and ``"kernel_cache.misses"`` (look-ups
    of plans kept per input shape), ``"control_flow.<op_type>"`` (executions of If, Loop,
    Scan, ...) and ``"subgraph_runs"``; subgraphs' counters included. Other names are
    shown per provider. Counting must cost the per-node path no more than an increment.
    """

    def counters(self, compiled: CompiledPartition) -> "Mapping[str, int]": ...


@runtime_checkable
class CostCapability(Protocol):
    """What a node costs on this provider, for placement by estimate (``device="auto"``,
    ``"max_performance"``, ``"prefer_gpu"``, ``"prefer_npu"``).

    ``estimate_cost(node, ctx)`` returns the seconds ``node`` takes on this provider, or
    None to state nothing for it (a function of shapes and dtypes: ``node.inputs`` carry
    the inferred ones; ``ctx`` is a :class:`CostContext` with the core's nominal estimate,
    arithmetic and bytes of the node). Two optional attributes go with it, or alone:

    - ``relative_costs``: ``{op_type: factor}``, the op's seconds as a multiple of the
      core's nominal estimate (``"*"``: every other op); used where ``estimate_cost`` is
      absent or returns None.
    - ``partition_overhead``: seconds each partition placed on this provider costs
      (launch, synchronisation, what its boundary prevents); default
      ``plugrt.costs.DEFAULT_PARTITION_OVERHEAD``.
    - ``fused_cost(node, producer, ctx)``: seconds ``node`` costs when it and ``producer``
      (the node making its first input, which only it reads) both run here, e.g. an
      activation a fusion folds into a convolution; None where no fusion applies. The
      saving counts only when placement puts both on this provider.

    A node the provider states nothing for costs what the session's fallback provider
    (the CPU provider) costs: an accelerator wins a node only by what it states, and only
    where the gain pays for the partition and its transfers (measured by the core).
    """

    def estimate_cost(self, node: "ir.Node", ctx: CostContext) -> float | None: ...


@dataclasses.dataclass
class CacheReport:
    """What ``prepare_cache`` left in a provider's on-disk cache of compiled code."""

    ready: int  # units of compiled code in the cache now
    total: int  # units the provider has
    location: str = ""  # where the cache is, for an image or a CI cache to keep
    note: str = ""  # why fewer than ``total`` are ready (numba not installed, turned off), for the user


@runtime_checkable
class CompiledCacheCapability(Protocol):
    """Code the provider compiles on first use and keeps in an on-disk cache (the CPU
    provider's numba loops), built ahead by ``plugrt compile-cache`` for images and CI.

    ``prepare_cache(progress)`` compiles all of it into the cache now, in this process,
    calling ``progress(done, total, unit)`` before each unit (``done`` finished so far,
    ``unit`` a name a user can read) and once at the end with ``unit`` empty; later
    processes then start with every unit ready. Returns a :class:`CacheReport`.
    """

    def prepare_cache(self, progress: Callable[[int, int, str], None]) -> CacheReport: ...


#: The protocol versions this core can load. A provider declares ``protocol_version``
#: (an int; a provider without one is taken as version 1); any other version is listed by
#: ``plugrt providers`` with the reason and never loaded.
SUPPORTED_PROTOCOL_VERSIONS: frozenset[int] = frozenset({1})

#: The capability protocols, by the name ``plugrt providers`` and the docs use.
CAPABILITY_PROTOCOLS: dict[str, type] = {
    "memory": MemoryCapability,
    "capture": CaptureCapability,
    "context": ContextCapability,
    "context_compatibility": ContextCompatibilityCapability,
    "passes": PassesCapability,
    "functions": FunctionCapability,
    "availability": AvailabilityCapability,
    "counters": CountersCapability,
    "costs": CostCapability,
    "compiled_cache": CompiledCacheCapability,
}

#: Every optional member a provider may implement, with what it is for (the Protocols
#: above are the definitions; this is their one-line summary).
CAPABILITIES: dict[str, str] = {
    "protocol_version": "int: the protocol version the provider was written against (default 1)",
    "unavailable_reason": "str: why devices() is empty (AvailabilityCapability)",
    "device_kinds": "tuple[DeviceKind, ...]: every kind of device the provider can ever offer, known without "
    "probing; a device intent of another kind ('cpu', 'gpu:1') then never probes it (AvailabilityCapability)",
    "memory": "str: the memory space's name; with allocate, to_device, to_host, copy_into, owns and "
    "default_device it makes MemoryCapability (device memory)",
    "capture": "capture(compiled, ctx: CaptureContext) -> CapturedPartition | NotCapturable (CaptureCapability)",
    "capture_plain_runs": "bool: plain runs replay a capture per input signature (graphs='auto'): say True "
    "only where replays were measured faster than eager runs (CaptureCapability)",
    "replay_tolerance": "(rtol, atol): how far a plain-run graph's checked replay may be from the eager run "
    "(default: equal) (CaptureCapability)",
    "count_allocations": "count_allocations() -> context manager with .count and .bytes: what a replay on this "
    "thread allocated, for session.capture_stats.sites (CaptureCapability)",
    "stream_error": "stream_error() -> str: after a replay, why the device reports an error ('' when none); the "
    "replay raises ReplayStreamError (CaptureCapability)",
    "from_pointer": "from_pointer(pointer, shape, dtype, device) -> array over caller-owned memory at that "
    "address, no copy, for IOBinding.bind_input/bind_output by address (MemoryCapability)",
    "save_context": "save_context(compiled) -> bytes (ContextCapability)",
    "load_context": "load_context(blob, meta) -> CompiledPartition (ContextCapability)",
    "context_source_keys": "tuple[str, ...]: EPContext 'source' values this provider restores (ContextCapability)",
    "check_context": "check_context(meta) -> Support: a saved context fits (ContextCompatibilityCapability)",
    "sdk_version": "str: written as ep_sdk_version in exported EPContext nodes",
    "passes": "passes(model) -> onnx_ir passes run on the nodes placed on the provider, after placement, at "
    "optimization='all' (PassesCapability)",
    "rewrite_model": "rewrite_model(model, options) -> bool: rewrite the whole onnx_ir model before placement for "
    "the session's options of this provider (cuda.float16_decoding); True when it changed anything",
    "supports_function": "supports_function(domain, name, ctx) -> Support (FunctionCapability)",
    "counters": "counters(compiled) -> {name: int}: kernel-cache, control-flow counters for Session.stats() "
    "(CountersCapability)",
    "estimate_cost": "estimate_cost(node, ctx: CostContext) -> float | None: seconds the node takes here, for "
    "placement by estimate (CostCapability)",
    "relative_costs": "{op_type: factor}: seconds as a multiple of the core's nominal estimate ('*': other ops) "
    "(CostCapability)",
    "partition_overhead": "float: seconds each partition on this provider costs (default "
    "plugrt.costs.DEFAULT_PARTITION_OVERHEAD) (CostCapability)",
    "fused_cost": "fused_cost(node, producer, ctx) -> float | None: seconds the node costs after producer when "
    "both run here (a fusion's epilogue) (CostCapability)",
    "prepare_cache": "prepare_cache(progress) -> CacheReport: compile every unit of compiled code into the "
    "on-disk cache now, for plugrt compile-cache (CompiledCacheCapability)",
}


def protocol_version(provider: Any) -> Any:
    """The protocol version a provider declares (1 when it declares none)."""
    return getattr(provider, "protocol_version", 1)


#: What a provider declaring its own ``memory`` must have (MemoryCapability's members).
MEMORY_MEMBERS = ("default_device", "allocate", "to_device", "to_host", "copy_into", "owns")


def missing_memory_members(provider: Any) -> list[str]:
    """MemoryCapability's members a provider lacks although it declares a ``memory`` of
    its own (not ``"host"``); [] for a host provider or a complete one. Looked up without
    running properties (a ``default_device`` property may probe the device)."""
    memory = getattr(provider, "memory", None)
    if not isinstance(memory, str) or memory == HOST_MEMORY:
        return []
    absent = object()
    return [name for name in MEMORY_MEMBERS if inspect.getattr_static(provider, name, absent) is absent]


def memory_of(provider: Any) -> MemoryCapability | None:
    """The provider as a MemoryCapability when its arrays live outside host memory."""
    if isinstance(provider, MemoryCapability) and provider.memory != HOST_MEMORY:
        return provider
    return None


#: The memory space of numpy arrays in host memory.
HOST_MEMORY = "host"


# -- helpers a provider may use (so that it needs no other plugrt module) ----------------


@functools.lru_cache(maxsize=None)
def op_version_in_effect(op_type: str, opset: int, domain: str = "") -> int:
    """The version (``since_version``) of ``op_type`` a model importing ``domain`` at
    ``opset`` uses: the highest at or below ``opset``; 0 when the op did not exist yet.
    Compare it with the versions a kernel was checked against, as ``supports_op`` does."""
    import onnx

    try:
        return int(onnx.defs.get_schema(op_type, opset, domain).since_version)
    except onnx.defs.SchemaError:
        return 0


def node_label(node: "ir.Node") -> str:
    """The name placement reports and errors use for ``node``."""
    return node.name or f"{node.op_type}<{', '.join(v.name or '' for v in node.outputs if v is not None)}>"
