"""Capture on the CPU provider: each step bound once to preallocated output buffers.

A captured step calls its kernel's ``into(out, *inputs)`` variant (numpy ``out=``), so
a replay allocates no output arrays; a step whose outputs are views of persistent buffers
needs no replay at all; any other step runs eagerly and copies into its buffer.

What a replay still allocates is counted (``CPUProvider.count_allocations``): an eager
step's outputs, and the temporaries of a captured step whose kernel made some (over 1 KiB,
measured with tracemalloc while the capture ran it: e.g. a convolution's packed windows).

Consecutive steps whose bound replay is also a step of a compiled program (its
``program`` attribute: a decoder's 4-bit products, RMS norms, attention over the KV cache
and SwiGLU gate, with numba) replay as one compiled call that runs them in order, their
jobs over the compiled pool's threads (``_numba_parallel.run_program``): a SmolLM2-135M
decode step went from 279 Python-level calls to 10, and 5.2-5.6 to 3.6-3.8 ms. The values
are the step-by-step replay's bit for bit: each step calls the compiled code its replay
calls.
"""

from __future__ import annotations

import functools
import tracemalloc
from typing import Any, Callable

import numpy as np

from plugrt.provider import CaptureContext, CapturedPartition, CompiledPartition, Step, outputs_of
from plugrt.provider import eager_replay as _eager_replay

from ._counters import note_allocations

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
    from .kernels._compiled import call_pinned, pinned, snapshot  # the kernels are loaded by now

    runs: list[Callable[[], None]] = []
    run_nodes: list[str] = []
    nodes: list[tuple[str, bool, str]] = []
    # The compiled loops still being built when the capture starts stay out of it and of
    # its replays: a step that switched to them would allocate on its first compiled call.
    view = snapshot()
    meter = _Meter()
    captured: list[tuple[Step, Callable[[], None]]] = []
    with pinned(view), meter:
        for step, meta in zip(compiled.steps, metadata):
            run, reason = _capture_step(step, meta, ctx, meter)
            if run is not None:
                captured.append((step, run))
            nodes.append((step.name, not reason, reason))
            ctx.step_done(step)
    for first, run in _programs(captured, compiled.provider):
        runs.append(run if view is None else functools.partial(call_pinned, view, run))
        run_nodes.append(first.name)
    return CapturedPartition(runs, nodes, run_nodes)


#: Consecutive replays that are steps of a compiled program (``replay.program``) run as one
#: compiled call from this many on.
_PROGRAM_MIN_STEPS = 2


def _programs(captured: list[tuple[Step, Callable[[], None]]], provider: str) -> list[tuple[Step, Callable[[], None]]]:
    """The replays, each run of consecutive compiled-program steps (``replay.program``:
    a decode step's products, norms and attention) made one replay that runs them in one
    compiled call (``CompiledPool.run_program``): hundreds of Python-level calls a decode
    step fewer. Each such replay is named by its first step."""
    from .kernels._compiled_parallel import compiled_pool

    pool = compiled_pool()
    if pool is None:
        return captured
    merged: list[tuple[Step, Callable[[], None]]] = []
    group: list[tuple[Step, Callable[[], None]]] = []

    def close() -> None:
        if len(group) >= _PROGRAM_MIN_STEPS:
            merged.append((group[0][0], _Program(group, provider, pool)))
        else:
            merged.extend(group)
        group.clear()

    for step, run in captured:
        if getattr(run, "program", None) is None:
            close()
            merged.append((step, run))
        else:
            group.append((step, run))
    close()
    return merged


class _Program:
    """Consecutive captured steps run as one compiled program; a step whose compiled
    function refuses (lengths outside a KV cache, ...) runs its own replay, which raises
    what it raises, as a KernelError naming that step."""

    def __init__(self, group: list[tuple[Step, Callable[[], None]]], provider: str, pool: Any) -> None:
        self.steps = [step for step, _ in group]
        self.replays = [run for _, run in group]  # they keep the programs' contexts alive
        self.table = np.array([run.program for run in self.replays], np.int64)  # type: ignore[attr-defined]
        self.table.flags.writeable = False
        self.answer = np.zeros(2, np.int64)
        self.provider = provider
        self.pool = pool  # the process's compiled pool, kept once made

    def __call__(self) -> None:
        self.pool.run_program(self.table, self.answer, self._refused)

    def _refused(self, index: int) -> None:
        from plugrt.errors import KernelError, PlugrtError

        step = self.steps[index]
        try:
            self.replays[index]()
        except (PlugrtError, MemoryError):
            raise
        except Exception as exc:
            raise KernelError(step.name, step.op_type, self.provider, exc) from exc


def eager_replay(step: Step, inputs: list, recorded: list, ctx: CaptureContext) -> Callable[[], None]:
    """The core's eager replay of ``step``, counting the output arrays it makes on each
    replay (``counting_allocations``): an eager seam allocates them afresh every time."""
    run = _eager_replay(step, inputs, recorded, ctx)
    count = len(recorded)
    nbytes = sum(int(getattr(r, "nbytes", 0)) for r in recorded)

    def counted() -> None:
        run()
        note_allocations(count, nbytes)

    return counted


#: Traced bytes above which a captured step's kernel counts as allocating (below: Python's
#: own objects, the views and argument tuples of one call, ~0.6 KiB at most measured).
_ALLOCATING_STEP = 1024


class _Meter:
    """Measures, during a capture, what each captured step's kernel allocates when the
    capture runs it (numpy reports its arrays to tracemalloc): tracing is started for the
    capture and stopped after it, unless the process traces already, whose trace and peak
    are left alone (nothing is then measured)."""

    def __init__(self) -> None:
        self.active = False

    def __enter__(self) -> "_Meter":
        self.active = not tracemalloc.is_tracing()
        if self.active:
            tracemalloc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            tracemalloc.stop()
            self.active = False

    def run(self, fn: Callable[[], None]) -> int:
        """Run ``fn``; the bytes it allocated at its peak (0 when not measuring)."""
        if not self.active:
            fn()
            return 0
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn()
        return max(0, tracemalloc.get_traced_memory()[1] - before)


def _allocating(run: Callable[[], None], nbytes: int) -> Callable[[], None]:
    """``run``, counting one allocation of ``nbytes`` per replay (its kernel's scratch)."""

    def counted() -> None:
        run()
        note_allocations(1, nbytes)

    return counted


def _capture_step(
    step: Step, meta, ctx: CaptureContext, meter: _Meter | None = None
) -> tuple[Callable[[], None] | None, str]:
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
    # a kernel's ``into.bind(out, *inputs)`` may give the replay as one call, checked once
    # for these buffers (None: it does not apply to them); checked below as ``into`` is
    bind = getattr(into, "bind", None)
    replay = (bind(out, *inputs) if bind is not None else None) or functools.partial(into, out, *inputs)
    replay()
    if not all(_identical(b, np.asarray(r)) for b, r in zip(buffers, recorded)):
        return eager_replay(step, inputs, recorded, ctx), "its out= variant differs from the eager result"
    # a second call, measured, as every replay makes it (a kernel's first call may build
    # what later calls reuse); not for a step writing over an input, which it would change
    overwrites = any(
        isinstance(i, np.ndarray) and np.may_share_memory(b, i) for b in buffers for i in inputs if i is not None
    )
    scratch = meter.run(replay) if meter is not None and meter.active and not overwrites else 0
    for value, buffer in zip(step.outputs, buffers):
        ctx.set(value, buffer)
    if scratch > _ALLOCATING_STEP:  # its kernel makes temporaries on every call: counted per replay
        return _allocating(replay, scratch), ""
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
        bound = functools.partial(into, **fn.keywords)
        bind = getattr(into, "bind", None)
        if bind is not None:  # the attributes go to the one-call variant too
            bound.bind = functools.partial(bind, **fn.keywords)  # type: ignore[attr-defined]
        return bound
    return into
