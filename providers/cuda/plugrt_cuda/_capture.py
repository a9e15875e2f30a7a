"""Segmented CUDA-graph capture of a compiled partition, with cupy's stream capture.

Consecutive capturable steps form a segment recorded into one ``cupy.cuda.Graph``; a step
that cannot be captured (cuBLAS under ``PLUGRT_CUDA_GEMM=cublas``) is a seam run eagerly
between graphs, copying its result into a persistent buffer. Every segment allocates from
its own memory pool, kept alive with its graph, so no address baked into a graph is ever
handed to anything else.
"""

from __future__ import annotations

from typing import Any, Callable

from plugrt.provider import CaptureContext, CaptureMiss, CapturedPartition, CompiledPartition, NotCapturable, Step

from ._backend import CupyBackend

__all__ = ["capture_partition", "seam_reason"]

_GEMM_OPS = frozenset({"MatMul", "Gemm", "Conv", "FusedConv", "FusedMatMul"})
# ops whose output is built on the host and copied up: cupy refuses that copy under capture
_HOST_BUILT = frozenset({"Shape"})


def seam_reason(step: Step, backend: CupyBackend) -> str | None:
    """Why ``step`` runs eagerly between graphs, or None when it is captured."""
    if backend.gemm_engine == "cublas" and step.op_type in _GEMM_OPS:
        return "cuBLAS cannot be captured by cupy (PLUGRT_CUDA_GEMM=cublas); unset it to capture the own GEMM"
    if step.op_type in _HOST_BUILT:
        return f"{step.op_type} builds its output on the host; a host-to-device copy cannot be captured"
    return None


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
    index = 0
    while index < len(steps):
        reason = seam_reason(steps[index], backend)
        if reason is not None:
            runs.append(_seam(steps[index], array, made, cp))
            nodes.append((steps[index].name, False, reason))
            index += 1
            continue
        end = index
        while end < len(steps) and seam_reason(steps[end], backend) is None:
            end += 1
        runs.append(_segment(steps[index:end], array, made, cp))
        nodes.extend((s.name, True, "") for s in steps[index:end])
        index = end
    for step in steps:
        for value in step.outputs:
            if value is not None and value in made:
                ctx.set(value, made[value])
        ctx.step_done(step)
    return CapturedPartition(runs, nodes)


def _segment(steps: list[Step], array: Callable[[Any], Any], made: dict, cp: Any) -> Callable[[], None]:
    # Warm up outside capture: every kernel compiles (NVRTC) and every module loads now.
    warm: dict[Any, Any] = {}
    for step in steps:
        results = step.fn(*[warm[v] if v in warm else array(v) for v in step.inputs])
        warm.update(zip(step.outputs, _results(step, results)))
    del warm
    cp.cuda.get_current_stream().synchronize()

    pool = cp.cuda.MemoryPool()
    stream = cp.cuda.Stream(non_blocking=True)
    keep: list[Any] = []  # every array the graph reads or writes stays referenced with it
    with cp.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture()
        try:
            for step in steps:
                inputs = [array(v) for v in step.inputs]
                outputs = _results(step, step.fn(*inputs))
                keep.extend(inputs)
                keep.extend(outputs)
                made.update((v, a) for v, a in zip(step.outputs, outputs) if v is not None)
        finally:
            graph = stream.end_capture()
    graph.launch(stream)  # the outputs hold real values for the eager steps that follow
    stream.synchronize()

    def replay() -> None:
        graph.launch(cp.cuda.get_current_stream())

    replay.keep = (graph, pool, stream, keep)  # type: ignore[attr-defined]
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
