"""Segmented CUDA-graph capture of a compiled partition, with cupy's stream capture.

Consecutive capturable steps form a segment recorded into one ``cupy.cuda.Graph``; a step
that cannot be captured (cuBLAS under ``PLUGRT_CUDA_GEMM=cublas``) is a seam run eagerly
between graphs, copying its result into a persistent buffer. Every segment allocates from
its own memory pool, kept alive with its graph, so no address baked into a graph is ever
handed to anything else.
"""

from __future__ import annotations

from typing import Any, Callable

from plugrt.provider import CaptureContext, CaptureMiss, CapturedPartition, CompiledPartition, Step

from ._backend import CupyBackend

__all__ = ["capture_partition", "seam_reason"]

_GEMM_OPS = frozenset({"MatMul", "Gemm", "Conv", "FusedConv", "FusedMatMul"})


def seam_reason(step: Step, backend: CupyBackend) -> str | None:
    """Why ``step`` runs eagerly between graphs, or None when it is captured."""
    if backend.gemm_engine == "cublas" and step.op_type in _GEMM_OPS:
        return "cuBLAS cannot be captured by cupy (PLUGRT_CUDA_GEMM=cublas); unset it to capture the own GEMM"
    return None


def _results(step: Step, result: Any) -> list:
    return list(result[: len(step.outputs)]) if step.multi_output else [result]


def capture_partition(compiled: CompiledPartition, ctx: CaptureContext, backend: CupyBackend) -> CapturedPartition:
    cp = backend.xp
    steps = compiled.steps
    runs: list[Callable[[], None]] = []
    nodes: list[tuple[str, bool, str]] = []
    index = 0
    while index < len(steps):
        reason = seam_reason(steps[index], backend)
        if reason is not None:
            runs.append(_seam(steps[index], ctx, backend))
            nodes.append((steps[index].name, False, reason))
            index += 1
            continue
        end = index
        while end < len(steps) and seam_reason(steps[end], backend) is None:
            end += 1
        runs.append(_segment(steps[index:end], ctx, cp))
        nodes.extend((s.name, True, "") for s in steps[index:end])
        index = end
    return CapturedPartition(runs, nodes)


def _segment(steps: list[Step], ctx: CaptureContext, cp: Any) -> Callable[[], None]:
    # Warm up outside capture: every kernel compiles (NVRTC) and every module loads now.
    warm: dict[Any, Any] = {}
    for step in steps:
        results = step.fn(*[warm[v] if v in warm else ctx.array(v) for v in step.inputs])
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
                inputs = [ctx.array(v) for v in step.inputs]
                outputs = _results(step, step.fn(*inputs))
                keep.extend(inputs)
                keep.extend(outputs)
                for value, array in zip(step.outputs, outputs):
                    ctx.set(value, array)
                ctx.step_done(step)
        finally:
            graph = stream.end_capture()
    graph.launch(stream)  # the outputs hold real values for the eager steps that follow
    stream.synchronize()

    def replay() -> None:
        graph.launch(cp.cuda.get_current_stream())

    replay.keep = (graph, pool, stream, keep)  # type: ignore[attr-defined]
    return replay


def _seam(step: Step, ctx: CaptureContext, backend: CupyBackend) -> Callable[[], None]:
    cp = backend.xp
    inputs = [ctx.array(v) for v in step.inputs]
    buffers = [cp.array(r, copy=True) if r is not None else None for r in _results(step, step.fn(*inputs))]
    for value, buffer in zip(step.outputs, buffers):
        ctx.set(value, buffer)
    ctx.step_done(step)
    fn = step.fn

    def run() -> None:
        for buffer, new in zip(buffers, _results(step, fn(*inputs))):
            if buffer is None:
                continue
            if new.shape != buffer.shape or new.dtype != buffer.dtype:
                raise CaptureMiss(f"{step.name}: output became {new.dtype}{list(new.shape)}")
            cp.copyto(buffer, new)

    return run
