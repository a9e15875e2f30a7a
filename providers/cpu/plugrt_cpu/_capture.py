"""Capture on the CPU provider: each step bound once to preallocated output buffers.

A captured step calls its kernel's ``into(out, *inputs)`` variant (numpy ``out=``), so
a replay allocates no arrays; a step whose outputs are views of persistent buffers
needs no replay at all; any other step runs eagerly and copies into its buffer.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from plugrt.provider import CaptureContext, CapturedPartition, CompiledPartition, Step, eager_replay, outputs_of

__all__ = ["capture_partition"]


def _identical(a: Any, b: Any) -> bool:
    return (
        isinstance(a, np.ndarray)
        and isinstance(b, np.ndarray)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.tobytes() == b.tobytes()
    )


def capture_partition(compiled: CompiledPartition, ctx: CaptureContext, metadata: list) -> CapturedPartition:
    """Capture every step of a CPU partition; ``metadata[i]`` is (spec, attributes) or None."""
    from .kernels._compiled import pinned, snapshot  # the kernels are loaded by now

    runs: list[Callable[[], None]] = []
    run_nodes: list[str] = []
    nodes: list[tuple[str, bool, str]] = []
    # The compiled loops still being built when the capture starts stay out of it and of
    # its replays: a step that switched to them would allocate on its first compiled call.
    view = snapshot()
    with pinned(view):
        for step, meta in zip(compiled.steps, metadata):
            run, reason = _capture_step(step, meta, ctx)
            if run is not None:
                runs.append(run if view is None else functools.partial(_run_pinned, view, run))
                run_nodes.append(step.name)
            nodes.append((step.name, not reason, reason))
            ctx.step_done(step)
    return CapturedPartition(runs, nodes, run_nodes)


def _run_pinned(view: Any, run: Callable[[], None]) -> None:
    """``run`` with the compiled loops of ``view`` (a ``kernels._compiled.Snapshot``)."""
    from .kernels._compiled import pinned

    with pinned(view):
        run()


def _capture_step(step: Step, meta, ctx: CaptureContext) -> tuple[Callable[[], None] | None, str]:
    """The step's replay callable (None: nothing to replay) and why it is eager ("" if not)."""
    inputs = [ctx.array(v) for v in step.inputs]
    recorded = outputs_of(step, step.fn(*inputs))
    spec, attributes = meta if meta is not None else (None, {})
    if spec is not None and spec.data_dependent:
        return eager_replay(step, inputs, recorded, ctx), "its output depends on the input values (shape or randomness)"
    if all(isinstance(r, np.ndarray) and ctx.is_persistent(r) for r in recorded):
        for value, array in zip(step.outputs, recorded):
            ctx.set(value, array)  # a view of a persistent buffer: nothing to replay
        return None, ""
    into = into_of(step)
    if into is None or not all(isinstance(r, (np.ndarray, np.generic)) for r in recorded):
        return eager_replay(step, inputs, recorded, ctx), "its kernel has no out= variant"
    buffers = (
        _in_place(step, spec, inputs, recorded, ctx)
        or _carried_over(step, into, inputs, recorded, ctx)
        or [ctx.buffer_like(r) for r in recorded]
    )
    out = tuple(buffers) if step.multi_output else buffers[0]
    replay = functools.partial(into, out, *inputs)
    replay()
    if not all(_identical(b, np.asarray(r)) for b, r in zip(buffers, recorded)):
        return eager_replay(step, inputs, recorded, ctx), "its out= variant differs from the eager result"
    for value, buffer in zip(step.outputs, buffers):
        ctx.set(value, buffer)
    return replay, ""


def _in_place(step: Step, spec, inputs: list, recorded: list, ctx: CaptureContext) -> list | None:
    """[first input's buffer] when an elementwise step may write over its first input
    (it dies here, nothing else lives in its buffer, same shape and dtype): one buffer
    less to stream through the cache. Only for kernels whose registration says so."""
    if spec is None or not spec.inplace or step.multi_output or not inputs:
        return None
    first, result = inputs[0], np.asarray(recorded[0])
    if not isinstance(first, np.ndarray) or first.shape != result.shape or first.dtype != result.dtype:
        return None
    if any(other is not None and np.shares_memory(first, other) for other in inputs[1:]):
        return None
    return [first] if ctx.can_overwrite(step.inputs[0], first) else None


def _carried_over(step: Step, into, inputs: list, recorded: list, ctx: CaptureContext) -> list | None:
    """The buffers of a step whose ``into`` declares ``writes_over_inputs`` ({output index:
    input index}) when one binding carries such an input in and the output out (a KV cache
    updated in place): that input's own buffer for the output, new buffers for the rest."""
    pairs = getattr(into, "writes_over_inputs", None)
    carried_over = getattr(ctx, "carried_over", None)
    if not pairs or carried_over is None:
        return None
    shared: dict[int, np.ndarray] = {}
    for output, input in pairs.items():
        if output >= len(recorded) or input >= len(inputs):
            continue
        source, result = inputs[input], recorded[output]
        if (
            isinstance(source, np.ndarray)
            and isinstance(result, np.ndarray)
            and source.shape == result.shape
            and source.dtype == result.dtype
            and carried_over(step.outputs[output], step.inputs[input])
        ):
            shared[output] = source
    if not shared:
        return None
    return [shared[i] if i in shared else ctx.buffer_like(r) for i, r in enumerate(recorded)]


def into_of(step: Step) -> Callable[..., Any] | None:
    """The step kernel's ``into(out, *inputs)`` variant, attributes bound; None if it has none."""
    fn = step.fn
    into = getattr(fn, "into", None)
    if into is not None:
        return into
    base = fn.func if isinstance(fn, functools.partial) else fn
    if isinstance(base, np.ufunc):
        keywords = fn.keywords if isinstance(fn, functools.partial) else {}
        return lambda out, *args: base(*args, out=out, **keywords)
    into = getattr(base, "into", None)
    if into is not None and isinstance(fn, functools.partial):
        return functools.partial(into, **fn.keywords)
    return into
