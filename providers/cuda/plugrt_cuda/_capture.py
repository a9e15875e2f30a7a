"""Segmented CUDA-graph capture of a compiled partition, with cupy's stream capture.

Consecutive capturable steps form a segment recorded into one ``cupy.cuda.Graph``; a step
that cannot be captured (cupy's cuBLAS under ``PLUGRT_CUDA_GEMM=cublas``, or one whose
recording fails; cuBLASLt on the provider's own handle is recorded) is a seam run eagerly between graphs, copying its result into a persistent buffer,
and the steps around it are still recorded. Every segment allocates from
its own memory pool, kept alive with its graph, so no address baked into a graph is ever
handed to anything else.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from plugrt.provider import CaptureContext, CaptureMiss, CapturedPartition, CompiledPartition, NotCapturable, Step

from ._backend import CupyBackend

__all__ = ["capture_partition", "seam_reason", "allocation_counter", "stream_error", "wrap_pointer", "NoAllocations"]

_GEMM_OPS = frozenset({"MatMul", "Gemm", "Conv", "FusedConv", "FusedMatMul"})
# ops whose output is built on the host and copied up: cupy refuses that copy under capture
# (Shape is not one: it copies its shape up once per input shape, in the warm-up)
_HOST_BUILT: frozenset[str] = frozenset()


def seam_reason(step: Step, backend: CupyBackend) -> str | None:
    """Why ``step`` runs eagerly between graphs, or None when it is captured."""
    if backend.gemm_engine == "cublas" and step.op_type in _GEMM_OPS:
        return "cuBLAS cannot be captured by cupy (PLUGRT_CUDA_GEMM=cublas); unset it to capture the own GEMM"
    if step.op_type in _HOST_BUILT:
        return f"{step.op_type} builds its output on the host; a host-to-device copy cannot be captured"
    return None


def _recorded_fn(step: Step, ctx: CaptureContext) -> Callable[..., Any]:
    """What the recording runs for ``step``: its in-place variant when the step declares
    one (``writes_over_inputs``, {output index: input index}) and one binding carries each
    such input in and output out, no later step reading the input; else the step itself."""
    pairs = getattr(step.fn, "writes_over_inputs", None)
    in_place = getattr(step.fn, "in_place", None)
    carried_over = getattr(ctx, "carried_over", None)
    if not pairs or in_place is None or carried_over is None:
        return step.fn
    for output, input in pairs.items():
        if output >= len(step.outputs) or input >= len(step.inputs) or not carried_over(step.outputs[output], step.inputs[input]):
            return step.fn
    return in_place


def _results(step: Step, result: Any) -> list:
    return list(result[: len(step.outputs)]) if step.multi_output else [result]


def capture_partition(
    compiled: CompiledPartition, ctx: CaptureContext, backend: CupyBackend
) -> CapturedPartition | NotCapturable:
    """Segments and seams of ``compiled``; NotCapturable (the partition then runs eagerly
    between the session's captured segments) when recording a segment fails."""
    try:
        return _capture(compiled, ctx, backend)
    except Exception as exc:  # e.g. a cupy routine that calls cuBLAS or copies from the host
        why = f"CUDA graph capture failed: {type(exc).__name__}: {exc}"
        return NotCapturable([(step.name, why) for step in compiled.steps])


def _capture(compiled: CompiledPartition, ctx: CaptureContext, backend: CupyBackend) -> CapturedPartition:
    cp = backend.xp
    steps = compiled.steps
    # Values made here stay private until every segment is recorded, so a failure leaves
    # ``ctx`` as it was and the session can run the partition eagerly instead.
    made: dict[Any, Any] = {}

    def array(value: Any) -> Any:
        return None if value is None else (made[value] if value in made else ctx.array(value))

    runs: list[Callable[[], None]] = []
    nodes: list[tuple[str, bool, str]] = []

    def seam(step: Step, reason: str) -> None:
        runs.append(_seam(step, array, made, cp))
        nodes.append((step.name, False, reason))

    def record(part: list[Step]) -> None:
        """``part`` as one graph; a step whose recording fails becomes a seam and the
        steps around it are recorded without it."""
        try:
            runs.append(_segment(part, array, made, cp, backend, [_recorded_fn(s, ctx) for s in part]))
        except _RecordingFailed as failure:
            if failure.position is None and len(part) > 1:  # the failing step is unknown: halve
                middle = len(part) // 2
                record(part[:middle])
                record(part[middle:])
                return
            at = failure.position or 0
            if at > 0:
                record(part[:at])
            seam(part[at], f"cannot be recorded in a CUDA graph ({failure.why}); runs eagerly between graphs")
            if at + 1 < len(part):
                record(part[at + 1 :])
            return
        nodes.extend((s.name, True, "") for s in part)

    index = 0
    while index < len(steps):
        reason = seam_reason(steps[index], backend)
        if reason is not None:
            seam(steps[index], reason)
            index += 1
            continue
        end = index
        while end < len(steps) and seam_reason(steps[end], backend) is None:
            end += 1
        record(list(steps[index:end]))
        index = end
    for step in steps:
        for value in step.outputs:
            if value is not None and value in made:
                ctx.set(value, made[value])
        ctx.step_done(step)
    return CapturedPartition(runs, nodes)


class _RecordingFailed(Exception):
    """Recording a segment failed: at step ``position`` of it (None: not known which)."""

    def __init__(self, position: int | None, error: BaseException):
        super().__init__(position, error)
        self.position = position
        self.why = f"{type(error).__name__}: {error}"


def _segment(
    steps: list[Step], array: Callable[[Any], Any], made: dict, cp: Any, backend: CupyBackend,
    fns: list[Callable[..., Any]],
) -> Callable[[], None]:
    # Warm up outside capture, running each step as it will be recorded (the own GEMM, not
    # cuBLAS): every kernel compiles (NVRTC) and every module loads before the recording.
    warm: dict[Any, Any] = {}
    with backend.warming_for_capture():
        for step, fn in zip(steps, fns):
            results = fn(*[warm[v] if v in warm else array(v) for v in step.inputs])
            warm.update(zip(step.outputs, _results(step, results)))
    del warm
    cp.cuda.get_current_stream().synchronize()
    synchronize = getattr(backend, "synchronize", None)
    if synchronize is not None:  # the warm-up ran on the provider's stream
        synchronize()

    pool = cp.cuda.MemoryPool()
    stream = cp.cuda.Stream(non_blocking=True)
    # cuBLASLt's workspace for this stream, made before recording: a recorded GEMM never
    # allocates, and no other stream's GEMMs share it
    prepare = getattr(backend, "prepare_capture", None)
    if prepare is not None and any(step.op_type in _GEMM_OPS for step in steps):
        prepare(stream)
    keep: list[Any] = []  # every array the graph reads or writes stays referenced with it
    recorded: dict[Any, Any] = {}  # joins ``made`` only once the whole segment is recorded

    def value_of(value: Any) -> Any:
        return recorded[value] if value in recorded else array(value)

    failure: _RecordingFailed | None = None
    with cp.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture()
        position = 0  # the step being recorded
        try:
            for step, fn in zip(steps, fns):
                inputs = [value_of(v) for v in step.inputs]
                outputs = _results(step, fn(*inputs))
                keep.extend(inputs)
                keep.extend(outputs)
                recorded.update((v, a) for v, a in zip(step.outputs, outputs) if v is not None)
                position += 1
        except Exception as exc:  # e.g. a cupy routine that calls cuBLAS or copies from the host
            failure = _RecordingFailed(position, exc)
        try:
            graph = stream.end_capture()
        except Exception as exc:  # the capture was invalidated by something no step raised
            if failure is None:
                failure = _RecordingFailed(None, exc)
    if failure is not None:
        raise failure
    made.update(recorded)
    graph.launch(stream)  # the outputs hold real values for the eager steps that follow
    stream.synchronize()

    def replay() -> None:
        graph.launch(cp.cuda.get_current_stream())

    replay.keep = (graph, pool, stream, keep)  # type: ignore[attr-defined]
    release = getattr(backend, "release_workspace", None)
    if release is not None:
        weakref.finalize(replay, release, stream)  # the workspace goes with the graph
    return replay


def _seam(step: Step, array: Callable[[Any], Any], made: dict, cp: Any) -> Callable[[], None]:
    inputs = [array(v) for v in step.inputs]
    buffers = [cp.array(r, copy=True) if r is not None else None for r in _results(step, step.fn(*inputs))]
    made.update((v, b) for v, b in zip(step.outputs, buffers) if v is not None)
    fn = step.fn

    def run() -> None:
        for buffer, new in zip(buffers, _results(step, fn(*inputs))):
            if buffer is None:
                continue
            if new.shape != buffer.shape or new.dtype != buffer.dtype:
                raise CaptureMiss(f"{step.name}: output became {new.dtype}{list(new.shape)}")
            cp.copyto(buffer, new)

    return run


# -- what a replay did: allocations from cupy's pools, errors on the stream -------------------

class NoAllocations:
    """The count of a backend without memory pools (numpy in tests): nothing to read."""

    count = 0
    bytes = 0

    def __enter__(self) -> "NoAllocations":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_COUNTERS: dict[int, type] = {}  # id(cupy module) -> its MemoryHook subclass


def allocation_counter(cp: Any) -> Any:
    """A fresh cupy ``MemoryHook`` that counts, while entered on this thread, every block
    taken from a cupy memory pool (``count``, ``bytes``): a graph replay takes none (its
    memory was fixed when it was recorded), an eager seam takes its outputs."""
    hook_type = _COUNTERS.get(id(cp))
    if hook_type is None:

        class ReplayAllocations(cp.cuda.MemoryHook):  # type: ignore[name-defined,misc]
            name = "plugrt_replay_allocations"

            def __init__(self) -> None:
                self.count = 0
                self.bytes = 0

            def malloc_preprocess(self, device_id: int, size: int, mem_size: int) -> None:
                self.count += 1
                self.bytes += int(mem_size)

        hook_type = _COUNTERS[id(cp)] = ReplayAllocations
    return hook_type()


#: cudaErrorNotReady: the stream's work is still running, which is no error
_NOT_READY = 600


def stream_error(cp: Any) -> str:
    """Why the current stream is in error after a replay ("" when it is not): the status of
    ``cudaStreamQuery`` on it, which reports an error any launch on it recorded (a graph
    launch included) without waiting for it to finish, and ``cudaGetLastError`` where cupy
    exposes it."""
    runtime = cp.cuda.runtime
    stream = cp.cuda.get_current_stream()
    try:
        status = runtime.streamQuery(stream.ptr)
    except runtime.CUDARuntimeError as exc:  # cupy raises for a status other than success
        status = getattr(exc, "status", None)
        if status != _NOT_READY:
            return f"cudaStreamQuery: {exc}"
        status = 0
    if status not in (0, None, _NOT_READY):
        return f"cudaStreamQuery returned error {status}"
    last_error = getattr(runtime, "getLastError", None)
    if callable(last_error):
        code = last_error()
        if code:
            return f"cudaGetLastError returned error {code}"
    return ""


def wrap_pointer(cp: Any, pointer: int, shape: tuple[int, ...], dtype: Any, device_index: int) -> Any:
    """A cupy array over device memory the caller owns at ``pointer`` (no copy): cupy's
    ``UnownedMemory`` keeps no reference, so the caller keeps the memory alive while the
    array is bound."""
    import numpy as np

    dtype = np.dtype(dtype)
    count = 1
    for dim in shape:
        count *= int(dim)
    memory = cp.cuda.UnownedMemory(int(pointer), count * dtype.itemsize, None, device_index)
    return cp.ndarray(tuple(shape), dtype, cp.cuda.MemoryPointer(memory, 0))
