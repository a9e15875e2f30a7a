"""Capture and replay: record a shape-specialised plan once, replay it without checks.

Each compiled partition is captured by its provider's ``capture`` hook (the CPU
provider binds every kernel to preallocated outputs); a provider without one, and any
step a provider declines, runs eagerly between captured segments and copies its result
into a persistent buffer. A replay whose eager step changes shape falls back to an
eager run: a capture never gives a wrong answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import tracemalloc
from typing import Any, Callable, Sequence

import numpy as np

from .bindings import DeviceBinding, deliver_outputs
from .build import BuiltGraph
from .errors import (
    CaptureThreadError,
    InvalidInputError,
    KernelError,
    MissingInputError,
    NoCaptureError,
    PlugrtError,
    ReplayStreamError,
    StaleCaptureError,
)
from .provider import (
    CaptureCapability,
    CaptureMiss,
    CapturedPartition,
    CompiledPartition,
    ExecutionProvider,
    MemoryCapability,
    NotCapturable,
    Step,
    eager_replay,
    outputs_of,
)
from .signature import InputSignature
from .tracing import Recorder, traced_capture, traced_replay
from .transfers import MemorySpaces, owner_of

__all__ = [
    "DEFAULT_SLOT",
    "CaptureReport",
    "Captured",
    "CapturedPlan",
    "CaptureBuffers",
    "CaptureSlots",
    "CaptureStats",
    "SiteStats",
    "ReplayResult",
    "eager_replay",
    "outputs_of",
]

#: The slot ``try_capture`` and ``replay`` use when none is named.
DEFAULT_SLOT = "default"


@dataclasses.dataclass
class CaptureReport:
    """Captured segments (node names) and the seams run eagerly between them, with why."""

    segments: list[list[str]]
    seams: list[tuple[str, str]]
    staged: list[str] = dataclasses.field(default_factory=list)  # transfers copied between segments

    def summary(self) -> str:
        lines = [
            f"capture: {len(self.segments)} segment(s), {len(self.seams)} seam(s), "
            f"{len(self.staged)} staged transfer(s)"
        ]
        for index, segment in enumerate(self.segments):
            lines.append(f"  segment {index}: {len(segment)} node(s)")
        for node, reason in self.seams:
            lines.append(f"  seam {node}: {reason}")
        return "\n".join(lines)


@dataclasses.dataclass
class Captured:
    """``try_capture`` succeeded (perhaps in segments; see ``report``)."""

    report: CaptureReport
    captured: bool = True


def _root(array: Any) -> Any:
    while getattr(array, "base", None) is not None:
        array = array.base
    return array


class CaptureBuffers:
    """The session's :class:`~plugrt.provider.CaptureContext`: every value's persistent
    array, with a buffer pool per memory space (host buffers by size, device buffers by
    shape and dtype, allocated by the provider that owns the memory)."""

    def __init__(
        self,
        arrays: dict[Any, Any],
        last_use: dict[Any, int] | None = None,
        memories: Sequence[MemoryCapability] = (),
        carried: dict[Any, Any] | None = None,
    ):
        self._arrays = dict(arrays)
        self._last_use = last_use or {}  # value -> index of the last step reading it
        self._carried = carried or {}  # output value -> input value one binding carries both of
        self._memories = list(memories)
        self._step = 0
        self._pool: dict[Any, list[Any]] = {}  # host: nbytes, device: (memory, shape, dtype) -> free roots
        self._roots: dict[int, Any] = {}  # id(root) -> root, for pooled buffers
        self._live: dict[int, int] = {}  # id(root) -> number of live values in it
        self.allocated_bytes = 0

    def array(self, value: Any) -> Any:
        return None if value is None else self._arrays[value]

    def owner(self, array: Any) -> MemoryCapability | None:
        """The provider whose memory holds ``array`` (None: host memory)."""
        return owner_of(array, self._memories)

    def buffer_like(self, array: Any) -> Any:
        """A buffer of ``array``'s shape, dtype and memory order, reused when one is free."""
        memory = self.owner(array)
        if memory is not None:
            key = (memory.memory, tuple(array.shape), np.dtype(array.dtype))
            free = self._pool.get(key)
            root = free.pop() if free else None
            if root is None:
                root = memory.allocate(key[1], key[2], memory.default_device)
                self.allocated_bytes += int(np.prod(key[1], dtype=np.int64)) * key[2].itemsize
            self._roots[id(root)] = (root, key)
            return root
        array = np.asarray(array)
        if not array.flags.c_contiguous:  # keep its memory order (a kernel may rely on it)
            self.allocated_bytes += array.nbytes
            return np.empty_like(array)
        nbytes = max(array.nbytes, 1)
        sizes = [size for size, free in self._pool.items() if free and isinstance(size, int) and nbytes <= size <= 2 * nbytes]
        if sizes:
            root = self._pool[min(sizes)].pop()
        else:
            root = np.empty(nbytes, np.uint8)
            self.allocated_bytes += nbytes
        self._roots[id(root)] = (root, root.nbytes)
        return root[: array.nbytes].view(array.dtype).reshape(array.shape)

    def _root_of(self, array: Any) -> Any:
        root = _root(array)
        return root if id(root) in self._roots else None

    def set(self, value: Any, array: Any) -> None:
        if value is None:
            return
        self._arrays[value] = array
        root = self._root_of(array)
        if root is not None:
            self._live[id(root)] = self._live.get(id(root), 0) + 1

    def can_overwrite(self, value: Any, array: Any) -> bool:
        if value is None or self._last_use.get(value, -1) != self._step:
            return False
        root = self._root_of(array)
        flags = getattr(array, "flags", None)
        contiguous = bool(flags.c_contiguous) if flags is not None else True
        return root is not None and self._live.get(id(root)) == 1 and contiguous

    def carried_over(self, output: Any, input: Any) -> bool:
        """True when one binding is both ``input``'s buffer and ``output``'s destination
        (state such as a KV cache) and no later step reads ``input``: the current step
        may write ``output`` into the input's buffer, where the run would store it anyway."""
        if output is None or input is None or self._carried.get(output) is not input:
            return False
        return self._last_use.get(input, -1) <= self._step

    def step_done(self, step: Step) -> None:
        index = self._step
        self._step += 1
        for value in {v for v in list(step.inputs) + list(step.outputs) if v is not None}:
            if self._last_use.get(value, index) <= index and value in self._arrays:
                root = self._root_of(self._arrays[value])
                if root is None:
                    continue
                self._live[id(root)] -= 1
                if self._live[id(root)] == 0:
                    held, key = self._roots[id(root)]
                    self._pool.setdefault(key, []).append(held)

    def is_persistent(self, array: Any) -> bool:
        if isinstance(array, np.ndarray):
            return any(isinstance(b, np.ndarray) and np.shares_memory(array, b) for b in self._arrays.values())
        if self.owner(array) is None:
            return False
        root = _root(array)
        return any(_root(b) is root for b in self._arrays.values() if b is not None)


def _eager_partition(steps: Sequence[Step], ctx: CaptureBuffers, reason: str) -> CapturedPartition:
    runs, nodes = [], []
    for step in steps:
        inputs = [ctx.array(v) for v in step.inputs]
        recorded = outputs_of(step, step.fn(*inputs))
        runs.append(eager_replay(step, inputs, recorded, ctx))
        nodes.append((step.name, False, reason))
        ctx.step_done(step)
    return CapturedPartition(runs, nodes, [step.name for step in steps])


def _staged_transfers(steps: Sequence[Step], ctx: CaptureBuffers, spaces: MemorySpaces) -> list[tuple[Step, Callable[[], None]]]:
    """Transfers between memory spaces, outside any captured segment (GPU graph APIs
    cannot capture host<->device copies): a copy between two persistent buffers."""
    runs: list[tuple[Step, Callable[[], None]]] = []
    for step in steps:
        source = ctx.array(step.inputs[0])
        moved = step.fn(source)
        if moved is source or not hasattr(moved, "shape") or isinstance(moved, np.generic):
            ctx.set(step.outputs[0], moved)  # already where it is read: nothing to move
        else:
            buffer = ctx.buffer_like(moved)
            spaces.copy_into(source, buffer)
            ctx.set(step.outputs[0], buffer)
            runs.append((step, functools.partial(spaces.copy_into, source, buffer)))
        ctx.step_done(step)
    return runs


def _allocated_bytes(spaces: MemorySpaces) -> int:
    """Bytes allocated so far by the memory providers that count them, plus host memory
    when tracemalloc is tracing (numpy reports its buffers to it)."""
    total = tracemalloc.get_traced_memory()[1] if tracemalloc.is_tracing() else 0
    for memory in spaces.memories:
        counted = getattr(memory, "allocated_bytes", None)
        if counted is not None:
            total += int(counted())
    return total


def _run_steps(
    result: CapturedPartition, steps: Sequence[Step], compiled: CompiledPartition
) -> list[tuple[str, str, str]]:
    """(node label, op type, provider) for each of a partition capture's runs; the
    partition itself where the provider did not say which step a run replays."""
    if len(result.run_nodes) == len(result.runs):
        op_types = {step.name: step.op_type for step in steps}
        return [(name, op_types.get(name, "?"), compiled.provider) for name in result.run_nodes]
    return [(compiled.partition.name, "partition", compiled.provider)] * len(result.runs)


class CapturedPlan:
    """What ``Session.try_capture`` recorded for one slot; replayed by ``Session.replay``."""

    def __init__(
        self,
        built: BuiltGraph,
        signature: InputSignature,
        output_names: Sequence[str],
        providers: Sequence[ExecutionProvider],
        feeds: dict[str, Any],
        bindings: Sequence[DeviceBinding],
    ):
        self.bindings = list(bindings)
        self._generations = [b.generation for b in self.bindings]
        self.bound_inputs = {b.input: b for b in self.bindings if b.input}
        self.replays = 0
        self.misses = 0
        self._spaces = spaces = built.spaces
        plan = built.plan
        self._input_buffers: dict[str, Any] = {}
        arrays: dict[Any, Any] = dict(plan.constants)
        for spec, value in zip(signature.specs, plan.inputs):
            if spec.name in self.bound_inputs:
                arrays[value] = self.bound_inputs[spec.name].view()
            elif spec.name in feeds:
                feed = feeds[spec.name]
                owner = spaces.owner(feed) if spec.is_tensor else None
                if owner is not None:
                    buffer = owner.allocate(tuple(feed.shape), feed.dtype, owner.default_device)
                    spaces.copy_into(feed, buffer)
                elif spec.is_tensor:
                    buffer = np.array(feed, copy=True).view(np.ndarray)
                else:
                    buffer = feed
                arrays[value] = buffer
                self._input_buffers[spec.name] = buffer
            elif spec.default is not None:
                arrays[value] = spec.default
            elif spec.info.kind == "optional":
                arrays[value] = None
            else:
                raise MissingInputError(spec.name, [s.name for s in signature.specs])
        signature.check([arrays[v] for s, v in zip(signature.specs, plan.inputs) if s.is_tensor], tensors_only=True)

        # The last step reading each value, so its buffer can serve a later value;
        # the plan's outputs are read after the last step.
        last_use: dict[Any, int] = {}
        index = 0
        for stage in built.stages:
            for step in stage.steps:
                for read in step.inputs:
                    if read is not None:
                        last_use[read] = index
                index += 1
        for value in plan.outputs:
            last_use[value] = index
        input_values = {spec.name: value for spec, value in zip(signature.specs, plan.inputs)}
        output_values = dict(zip(output_names, plan.outputs))
        carried = {
            output_values[b.output]: input_values[b.input]
            for b in self.bindings
            if b.input in input_values and b.output in output_values
        }
        ctx = CaptureBuffers(arrays, last_use, spaces.memories, carried)
        by_name = {p.name: p for p in providers}
        runs: list[Callable[[], None]] = []
        run_steps: list[tuple[str, str, str]] = []  # per run: the node label, op type and provider an error names
        nodes: list[tuple[str, bool | None, str]] = []
        staged: list[str] = []
        for stage in built.stages:
            if stage.compiled is None:
                for step, run in _staged_transfers(stage.steps, ctx, spaces):
                    runs.append(run)
                    run_steps.append((step.name, step.op_type, stage.provider))
                staged.extend(step.name for step in stage.steps)
                nodes.append(("", None, ""))  # a staged copy ends the captured segment before it
                continue
            compiled = dataclasses.replace(stage.compiled, steps=stage.steps)
            provider = by_name.get(compiled.provider)
            try:
                result = provider.capture(compiled, ctx) if isinstance(provider, CaptureCapability) else None
                if result is None or isinstance(result, NotCapturable):
                    why = (
                        f"provider {compiled.provider!r} does not offer capture"
                        if result is None
                        else "; ".join(f"{n}: {r}" for n, r in result.report) or "declined"
                    )
                    result = _eager_partition(stage.steps, ctx, why)
            except PlugrtError:
                raise
            except Exception as exc:
                raise KernelError(compiled.partition.name, "capture", compiled.provider, exc) from exc
            runs.extend(result.runs)
            nodes.extend(result.nodes)
            run_steps.extend(_run_steps(result, stage.steps, compiled))
        self._runs = runs
        self._run_steps = run_steps
        self._outputs = [ctx.array(v) for v in plan.outputs]
        self.output_names = list(output_names)
        segments: list[list[str]] = []
        seams: list[tuple[str, str]] = []
        previous_captured = False
        for name, captured, reason in nodes:
            if captured:
                if not previous_captured:
                    segments.append([])
                segments[-1].append(name)
            elif captured is False:
                seams.append((name, reason))
            previous_captured = bool(captured)
        self.report = CaptureReport(segments, seams, staged)
        # the optional hooks of the providers this plan runs on: allocations counted
        # during each replay, and the device stream checked for an error after it
        used = {stage.provider for stage in built.stages} | {getattr(m, "name", "") for m in spaces.memories}
        hooked = [p for p in providers if p.name in used]
        self._counters = [c for c in (getattr(p, "count_allocations", None) for p in hooked) if callable(c)]
        self._stream_checks = [c for c in (getattr(p, "stream_error", None) for p in hooked) if callable(c)]
        self.thread = threading.current_thread()  # replays elsewhere would share the output buffers
        self.shared = False  # replayed on another thread too: every replay copies its outputs unless told not to
        bound = {b.output for b in self.bindings if b.output}
        self.has_host_outputs = any(name not in bound for name in self.output_names)

    def check(self, bindings: Sequence[DeviceBinding] | None) -> None:
        if bindings is not None and [id(b) for b in bindings] != [id(b) for b in self.bindings]:
            raise StaleCaptureError("replay was given other bindings than the capture")
        for binding, generation in zip(self.bindings, self._generations):
            if binding.freed:
                raise StaleCaptureError(f"binding {binding.name!r} was freed", name=binding.name)
            if binding.generation != generation:
                raise StaleCaptureError(
                    f"binding {binding.name!r} changed shape to {binding.shape}", name=binding.name
                )

    def load_feeds(self, feeds: dict[str, Any]) -> None:
        for name, value in feeds.items():
            buffer = self._input_buffers.get(name)
            if buffer is None:
                if name in self.bound_inputs:
                    raise InvalidInputError(f"input {name!r} is bound; write to its binding instead", input_name=name)
                raise InvalidInputError(f"input {name!r} was not fed when the capture was made", input_name=name)
            if not hasattr(buffer, "shape"):
                raise StaleCaptureError(f"input {name!r} is not a tensor and cannot be refilled", name=name)
            if self._spaces.owner(value) is None:
                value = np.asarray(value)
            if tuple(value.shape) != tuple(buffer.shape) or value.dtype != buffer.dtype:
                raise StaleCaptureError(
                    f"input {name!r} is {value.dtype}{list(value.shape)}, captured as "
                    f"{buffer.dtype}{list(buffer.shape)}",
                    name=name,
                )
            self._spaces.copy_into(value, buffer)

    def replay(self) -> list | None:
        """Run the captured steps; None when an eager seam missed (caller runs eagerly).
        A kernel that raises is a KernelError naming its node, as in an eager run."""
        index = 0
        try:
            # one try around the loop, and the index it keeps, name the failed step:
            # no per-step cost on the hot path
            for index, run in enumerate(self._runs):  # noqa: B007 (the except clause reads index)
                run()
        except CaptureMiss as miss:
            self.misses += 1
            self.last_miss = str(miss)
            return None
        except (PlugrtError, MemoryError):
            raise
        except Exception as exc:
            name, op_type, provider = self._run_steps[index]
            raise KernelError(name, op_type, provider, exc) from exc
        self.replays += 1
        return self._outputs

    def measured_replay(self, site: "SiteStats", name: str) -> list | None:
        """``replay()``, counting in ``site`` the replay and the allocations the providers'
        ``count_allocations`` saw during it; ReplayStreamError when a provider's
        ``stream_error`` reports that the device stream recorded an error."""
        counters = self._counters
        if not counters:
            values = self.replay()
        elif len(counters) == 1:
            with counters[0]() as counted:
                values = self.replay()
            site.note_allocations(counted.count, counted.bytes)
        else:
            with contextlib.ExitStack() as stack:
                counts = [stack.enter_context(c()) for c in counters]
                values = self.replay()
            site.note_allocations(sum(c.count for c in counts), sum(c.bytes for c in counts))
        for check in self._stream_checks:
            why = check()
            if why:
                site.stream_errors += 1
                raise ReplayStreamError(name, why)
        if values is not None:
            site.replays += 1
        return values

    def current_feeds(self) -> dict[str, Any]:
        """The inputs as the capture's buffers hold them now (for an eager fallback)."""
        return dict(self._input_buffers)


@dataclasses.dataclass
class SiteStats:
    """What the replays of one capture site (a slot, or a plain-run graph's signature)
    did: replays, the allocations the providers counted during them (``count_allocations``:
    cupy's pool on CUDA, the arrays eager seams make on the CPU), those of the latest
    replay, and replays after which the device stream reported an error. A replay should
    allocate nothing."""

    replays: int = 0
    allocations: int = 0
    bytes_allocated: int = 0
    last_allocations: int = 0
    stream_errors: int = 0

    def note_allocations(self, count: int, nbytes: int) -> None:
        self.allocations += count
        self.bytes_allocated += nbytes
        self.last_allocations = count


@dataclasses.dataclass
class CaptureStats:
    """What a session's replays did: replays, eager fallbacks by reason, and the bytes
    allocated during replays (by memory providers that count them, and on the host when
    tracemalloc is tracing). A replay should allocate nothing. ``sites`` holds each
    capture site's counters by name: slots by their name, plain-run graphs as
    ``run(x: float32[1, 3])``."""

    replays: int = 0
    eager_fallbacks: int = 0
    fallback_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes_allocated_during_replay: int = 0
    sites: dict[str, SiteStats] = dataclasses.field(default_factory=dict)

    def site(self, name: str) -> SiteStats:
        """The counters of capture site ``name`` (made on first use)."""
        found = self.sites.get(name)
        if found is None:
            found = self.sites.setdefault(name, SiteStats())
        return found


class ReplayResult(dict):
    """``replay``'s outputs by name, saying whether the capture was replayed (``replayed``)
    or the run went the plain way, and why (``reason``). Host outputs are copies when the
    replay ran on a thread other than the capturing one, or the slot has ever been
    replayed on one, or ``copy_outputs=True`` was asked; otherwise (or with
    ``copy_outputs=False``) they are the capture's buffers, which the next replay of the
    slot overwrites."""

    replayed: bool = True
    reason: str = ""
    slot: str = DEFAULT_SLOT


class CaptureSlots:
    """A session's captures by slot name, and the lock that serialises them: a capture's
    buffers are shared, so two threads replaying one capture take turns, and once a
    slot is replayed off the thread that captured it, its replays return copies of the
    outputs (made under the lock) unless the caller asks for the buffers."""

    def __init__(self, trace: Recorder | None = None) -> None:
        self.slots: dict[str, CapturedPlan] = {}
        self.lock = threading.RLock()
        self.stats = CaptureStats()
        if trace is not None:  # profiling: capture and replay record events (no cost otherwise)
            self.record_into(trace)

    def record_into(self, trace: Recorder) -> None:
        """Record a span per capture and per replay into ``trace`` from now on."""
        self.capture = traced_capture(trace, type(self).capture.__get__(self))  # type: ignore[method-assign]
        self.replay = traced_replay(trace, type(self).replay.__get__(self))  # type: ignore[method-assign]

    def capture(self, slot: str, record: Callable[[], CapturedPlan]) -> "Captured | NotCapturable":
        """Record a capture into ``slot`` (replacing only that slot's)."""
        with self.lock:
            self.slots.pop(slot, None)
            captured = record()
            if not captured.report.segments:
                return NotCapturable(captured.report.seams)
            self.slots[slot] = captured
            return Captured(captured.report)

    def reset(self, slot: str | None) -> None:
        """Drop the capture in ``slot``, or every capture when None."""
        with self.lock:
            if slot is None:
                self.slots.clear()
            else:
                self.slots.pop(slot, None)

    def report(self, slot: str) -> CaptureReport | None:
        captured = self.slots.get(slot)
        return captured.report if captured is not None else None

    def get(self, slot: str) -> CapturedPlan:
        captured = self.slots.get(slot)
        if captured is None:
            raise NoCaptureError() if slot == DEFAULT_SLOT else StaleCaptureError(
                f"no capture in slot {slot!r} (slots: {sorted(self.slots) or 'none'})", name=slot
            )
        return captured

    def replay(
        self,
        slot: str,
        feeds: dict[str, Any],
        bindings: Sequence[DeviceBinding] | None,
        run_eagerly: Callable[[dict[str, Any], Sequence[DeviceBinding]], dict[str, Any]],
        copy_outputs: bool | None = None,
    ) -> ReplayResult:
        with self.lock:
            captured = self.get(slot)
            here = threading.current_thread()
            if here is not captured.thread:
                captured.shared = True
                if copy_outputs is False and captured.has_host_outputs:
                    raise CaptureThreadError(slot, captured.thread.name, here.name)
            if copy_outputs is None:
                copy_outputs = captured.shared
            captured.check(bindings)
            if feeds:
                captured.load_feeds(feeds)
            spaces = captured._spaces
            before = _allocated_bytes(spaces)
            values = captured.measured_replay(self.stats.site(slot), f"capture slot {slot!r}")
            self.stats.bytes_allocated_during_replay += max(0, _allocated_bytes(spaces) - before)
            if values is None:  # an eager seam changed shape: this run goes the plain way
                reason = f"an eager step no longer fits the capture ({captured.last_miss})"
                self.stats.eager_fallbacks += 1
                self.stats.fallback_reasons[reason] = self.stats.fallback_reasons.get(reason, 0) + 1
                result = ReplayResult(run_eagerly(captured.current_feeds(), captured.bindings))
                result.replayed, result.reason = False, reason
            else:  # the capture's inputs are its own copies: outputs need no un-aliasing from them
                self.stats.replays += 1
                result = ReplayResult(
                    deliver_outputs(
                        captured.output_names, values, captured.bindings, (), spaces, persistent=copy_outputs
                    )
                )
            result.slot = slot
            return result
