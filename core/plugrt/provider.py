"""The execution-provider protocol: what a provider plugin implements.

STOP AND THINK before changing anything in this module. Hardware vendors build their
providers against these definitions; a change here breaks every provider shipped as a
separate package. Add optional capabilities rather than changing required members, and
bump ``PROTOCOL_VERSION`` when a required member changes.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import onnx_ir as ir

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
    "CAPABILITIES",
    "CaptureMiss",
    "CaptureContext",
    "CapturedPartition",
    "NotCapturable",
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
class Partition:
    """Consecutive nodes placed on one provider, with the values crossing its boundary."""

    name: str
    nodes: list["ir.Node"]
    inputs: list["ir.Value"]  # values read from outside the partition (graph inputs, initializers, other partitions)
    outputs: list["ir.Value"]  # values read after the partition or model outputs
    opset_imports: dict[str, int]
    device: Device | None = None


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
    nodes: tuple[str, ...] = ()  # names of the graph nodes this step computes (several when fused)
    # Optional ``inplace(out, *inputs)``, correct when ``out`` is the first input (an
    # elementwise op whose output has that input's dtype). The plan calls it when the
    # first input dies at this step and nothing else refers to its array.
    inplace: Callable[..., Any] | None = None


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


class CaptureContext:
    """The persistent arrays of a capture: every value's buffer lives here.

    A provider's ``capture`` reads its inputs with :meth:`array`, takes output buffers
    from :meth:`buffer_like` (a pool: a buffer whose values are all dead is handed out
    again, so a capture needs about as much memory as a run), registers each output with
    :meth:`set` and calls :meth:`step_done` after each step. Replay callables must write
    into those buffers and never rebind them.
    """

    def __init__(self, arrays: dict["ir.Value", Any], last_use: dict["ir.Value", int] | None = None):
        self._arrays = dict(arrays)
        self._last_use = last_use or {}  # value -> index of the last step reading it
        self._step = 0
        self._pool: dict[int, list[Any]] = {}  # nbytes -> free root buffers
        self._roots: dict[int, Any] = {}  # id(root) -> root, for pooled buffers
        self._live: dict[int, int] = {}  # id(root) -> number of live values in it

    def array(self, value: "ir.Value | None") -> Any:
        return None if value is None else self._arrays[value]

    def buffer_like(self, array: Any) -> Any:
        """A buffer of ``array``'s shape, dtype and memory order, reused when one is free."""
        import numpy as np

        array = np.asarray(array)
        if not array.flags.c_contiguous:  # keep its memory order (a kernel may rely on it)
            return np.empty_like(array)
        nbytes = max(array.nbytes, 1)
        root = self._take_free(nbytes)
        if root is None:
            root = np.empty(nbytes, np.uint8)
        self._roots[id(root)] = root
        return root[: array.nbytes].view(array.dtype).reshape(array.shape)

    def _take_free(self, nbytes: int) -> Any:
        """The smallest free buffer of at least ``nbytes`` (and at most twice that)."""
        sizes = [size for size, free in self._pool.items() if free and nbytes <= size <= 2 * nbytes]
        if not sizes:
            return None
        return self._pool[min(sizes)].pop()

    def _root_of(self, array: Any) -> Any:
        while getattr(array, "base", None) is not None:
            array = array.base
        return array if id(array) in self._roots else None

    def set(self, value: "ir.Value | None", array: Any) -> None:
        if value is None:
            return
        self._arrays[value] = array
        root = self._root_of(array)
        if root is not None:
            self._live[id(root)] = self._live.get(id(root), 0) + 1

    def can_overwrite(self, value: "ir.Value | None", array: Any) -> bool:
        """True when the current step reads ``value`` for the last time and ``array`` (its
        buffer) holds no other live value: the step may write its output over it."""
        if value is None or self._last_use.get(value, -1) != self._step:
            return False
        root = self._root_of(array)
        return root is not None and self._live.get(id(root)) == 1 and bool(array.flags.c_contiguous)

    def step_done(self, step: "Step") -> None:
        """Release the buffers of values this step read (or made) for the last time."""
        index = self._step
        self._step += 1
        for value in {v for v in list(step.inputs) + list(step.outputs) if v is not None}:
            if self._last_use.get(value, index) <= index and value in self._arrays:
                root = self._root_of(self._arrays[value])
                if root is None:
                    continue
                self._live[id(root)] -= 1
                if self._live[id(root)] == 0:
                    self._pool.setdefault(root.nbytes, []).append(root)

    def is_persistent(self, array: Any) -> bool:
        """True when ``array`` is (a view of) a buffer this capture owns or was given."""
        import numpy as np

        if not isinstance(array, np.ndarray):
            return False
        return any(isinstance(b, np.ndarray) and np.shares_memory(array, b) for b in self._arrays.values())


@dataclasses.dataclass
class CapturedPartition:
    """A provider's capture of one compiled partition.

    ``runs`` are zero-argument callables run in order on every replay; ``nodes`` says,
    per step, whether it was captured and, if not, why (it then runs eagerly inside a
    run, copying into its persistent buffer, and raises CaptureMiss if that no longer fits).
    """

    runs: list[Callable[[], None]]
    nodes: list[tuple[str, bool, str]]  # (node label, captured, reason when not)


@dataclasses.dataclass
class NotCapturable:
    """Capture declined, with each node that declined and why."""

    report: list[tuple[str, str]]  # (node label, reason)
    captured: bool = False


@runtime_checkable
class ExecutionProvider(Protocol):
    """What every provider implements. Optional capabilities are listed in CAPABILITIES
    and discovered with ``hasattr``."""

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


#: Optional members a provider may implement, with what each is for.
CAPABILITIES: dict[str, str] = {
    "unavailable_reason": "str: why devices() is empty",
    "allocate": "allocate(shape, dtype, device) -> device array (device memory)",
    "to_device": "to_device(array, device) -> device array",
    "to_host": "to_host(array) -> numpy.ndarray",
    "capture": "capture(compiled, ctx: CaptureContext) -> CapturedPartition | NotCapturable",
    "save_context": "save_context(compiled) -> bytes (EPContext export)",
    "load_context": "load_context(blob, meta) -> CompiledPartition (EPContext restore)",
    "context_source_keys": "tuple[str, ...]: EPContext 'source' values this provider restores",
    "passes": "passes(model) -> onnx_ir passes run before placement at optimization='all'; they must "
    "leave alone nodes whose meta['plugrt.claimed_by'] names a higher-priority provider",
    "memory": "str: 'host' (default) when the provider's arrays are numpy arrays in host memory; "
    "anything else makes the session insert transfers (to_host/to_device)",
    "default_device": "the device to_device targets when a value moves onto this provider",
    "sdk_version": "str: written as ep_sdk_version in exported EPContext nodes",
    "supports_function": "supports_function(domain, name, ctx) -> Support: keep a model-local function un-inlined",
}
