"""Capture decisions that need no GPU: which steps are seams, and that a failed recording
leaves the capture context untouched and declines (the session then runs it eagerly)."""

from __future__ import annotations

import contextlib
import types

import numpy as np
import onnx_ir as ir

from plugrt.provider import CompiledPartition, NotCapturable, Partition, Step

from plugrt_cuda._capture import capture_partition, seam_reason


def _step(op_type: str, fn=np.negative) -> Step:
    x, y = ir.Value(name=f"{op_type}_in"), ir.Value(name=f"{op_type}_out")
    return Step(fn, [x], [y], name=op_type, op_type=op_type)


def _backend(engine: str = "auto", refuse_capture: bool = False):
    """A stand-in backend whose stream refuses to begin a capture (when asked); the full
    fake cupy below is for what happens during a recording."""
    class Stream:
        def __init__(self, non_blocking: bool = False):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def begin_capture(self):
            if refuse_capture:
                raise RuntimeError("operation not permitted when stream is capturing")

        def synchronize(self):
            pass

    cuda = types.SimpleNamespace(
        Stream=Stream,
        MemoryPool=lambda: types.SimpleNamespace(malloc=None),
        using_allocator=lambda allocator: contextlib.nullcontext(),
        get_current_stream=lambda: Stream(),
    )
    return types.SimpleNamespace(
        xp=types.SimpleNamespace(cuda=cuda), gemm_engine=engine, warming_for_capture=contextlib.nullcontext
    )


def test_gemms_are_seams_only_when_cublas_is_chosen():
    assert seam_reason(_step("MatMul"), _backend("cublas")) is not None
    assert seam_reason(_step("MatMul"), _backend("auto")) is None
    assert seam_reason(_step("MatMul"), _backend("own")) is None


def test_shape_is_captured_because_its_array_is_made_in_the_warm_up():
    assert seam_reason(_step("Shape"), _backend()) is None


class _Context:
    """A capture context that records what the provider registers."""

    def __init__(self, arrays):
        self.arrays, self.set_calls, self.done = dict(arrays), [], []

    def array(self, value):
        return None if value is None else self.arrays[value]

    def set(self, value, array):
        self.set_calls.append(value)

    def step_done(self, step):
        self.done.append(step.name)


def test_a_recording_that_fails_declines_and_leaves_the_context_untouched():
    step = _step("Relu", lambda x: np.maximum(x, 0))
    partition = Partition("p", [], [step.inputs[0]], [step.outputs[0]], {"": 17})
    compiled = CompiledPartition(partition, [step], "cuda")
    ctx = _Context({step.inputs[0]: np.array([-1.0, 2.0], np.float32)})
    result = capture_partition(compiled, ctx, _backend(refuse_capture=True))
    assert isinstance(result, NotCapturable)
    assert result.report == [("Relu", "CUDA graph capture failed: RuntimeError: operation not permitted when stream is capturing")]
    assert ctx.set_calls == [] and ctx.done == []


# -- a fake cupy that records what happens while a stream captures -------------------------


class _FakeCuda:
    """cupy.cuda as the capture uses it: streams that capture, graphs that count launches,
    and a log of every event in order (kernel loads, capture begin/end, launches)."""

    def __init__(self, log: list):
        self.log = log
        self.default = _FakeStream(self)
        self.stack = [self.default]

    def Stream(self, non_blocking: bool = False):
        return _FakeStream(self)

    def get_current_stream(self):
        return self.stack[-1]

    def MemoryPool(self):
        return types.SimpleNamespace(malloc=None)

    def using_allocator(self, allocator):
        return contextlib.nullcontext()


class _FakeStream:
    def __init__(self, cuda: _FakeCuda):
        self.cuda, self.capturing, self.invalidated = cuda, False, False

    def __enter__(self):
        self.cuda.stack.append(self)
        return self

    def __exit__(self, *exc):
        self.cuda.stack.pop()
        return False

    def is_capturing(self) -> bool:
        return self.capturing

    def begin_capture(self):
        self.capturing, self.invalidated = True, False
        self.cuda.log.append("begin capture")

    def end_capture(self):
        self.capturing = False
        self.cuda.log.append("end capture")
        if self.invalidated:
            raise RuntimeError("cudaErrorStreamCaptureInvalidated")
        return types.SimpleNamespace(launch=lambda stream: self.cuda.log.append("launch"))

    def synchronize(self):
        pass


class _FakeCupy:
    """numpy, plus the fake cuda namespace and RawModule (loading a module is logged; its
    gemm kernel computes the plain 2-D product the kernel's arguments describe)."""

    def __init__(self):
        self.log: list = []
        self.cuda = _FakeCuda(self.log)

    def __getattr__(self, name):
        return getattr(np, name)

    def RawModule(self, code: str, options: tuple):
        self.log.append("load module")

        def gemm(grid, block, args):
            a, b, out, _, m, n, k = args[:7]
            out[...] = (np.asarray(a).reshape(int(m), int(k)) @ np.asarray(b).reshape(int(k), int(n))).reshape(out.shape)

        return types.SimpleNamespace(get_function=lambda name: gemm)


def _capture_steps(steps: list[Step], backend, inputs: dict):
    partition = Partition("p", [], list(inputs), [steps[-1].outputs[0]], {"": 17})
    ctx = _Context(inputs)
    return capture_partition(CompiledPartition(partition, steps, "cuda"), ctx, backend), ctx


def _chain(*ops: tuple[str, object]) -> list[Step]:
    """Steps each reading the previous one's output."""
    steps, previous = [], ir.Value(name="x")
    for name, fn in ops:
        out = ir.Value(name=f"{name}_out")
        steps.append(Step(fn, [previous], [out], name=name, op_type=name))
        previous = out
    return steps


def test_the_own_gemm_is_compiled_and_loaded_before_the_capture_begins():
    from plugrt_cuda._backend import CupyBackend

    cupy = _FakeCupy()
    backend = CupyBackend(cupy)  # engine "auto": cuBLAS when eager, the own GEMM when capturing
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    (step,) = _chain(("MatMul", lambda x: backend.matmul(x, w)))
    x = np.ones((4, 3), np.float32)
    result, ctx = _capture_steps([step], backend, {step.inputs[0]: x})
    assert result.nodes == [("MatMul", True, "")]
    assert cupy.log.index("load module") < cupy.log.index("begin capture")
    assert cupy.log.count("load module") == 1  # loaded once, not again while recording


def test_a_step_whose_recording_fails_is_a_seam_and_its_neighbours_are_captured():
    cupy = _FakeCupy()
    backend = types.SimpleNamespace(xp=cupy, gemm_engine="auto", warming_for_capture=contextlib.nullcontext)

    def host_copy(x):  # e.g. a cupy routine that copies from the host: refused while capturing
        if cupy.cuda.get_current_stream().is_capturing():
            raise RuntimeError("operation not permitted when stream is capturing")
        return x * 2

    steps = _chain(("Relu", lambda x: np.maximum(x, 0)), ("Copy", host_copy), ("Neg", np.negative), ("Abs", np.abs))
    x = np.array([-1.0, 2.0], np.float32)
    result, ctx = _capture_steps(steps, backend, {steps[0].inputs[0]: x})
    captured = {name: (ok, why) for name, ok, why in result.nodes}
    assert captured["Relu"] == (True, "") and captured["Neg"] == (True, "") and captured["Abs"] == (True, "")
    assert captured["Copy"][0] is False and "cannot be recorded in a CUDA graph" in captured["Copy"][1]
    assert "operation not permitted" in captured["Copy"][1]
    assert len(result.runs) == 3  # graph, seam, graph
    assert ctx.done == ["Relu", "Copy", "Neg", "Abs"]


def test_a_capture_invalidated_without_an_error_finds_the_step_by_halving():
    cupy = _FakeCupy()
    backend = types.SimpleNamespace(xp=cupy, gemm_engine="auto", warming_for_capture=contextlib.nullcontext)

    def poison(x):  # breaks the capture silently; only end_capture says so
        stream = cupy.cuda.get_current_stream()
        if stream.is_capturing():
            stream.invalidated = True
        return x + 1

    steps = _chain(("A", np.negative), ("B", np.abs), ("Poison", poison), ("C", np.negative), ("D", np.abs))
    result, _ = _capture_steps(steps, backend, {steps[0].inputs[0]: np.array([1.0], np.float32)})
    assert [(name, ok) for name, ok, _ in result.nodes] == [
        ("A", True), ("B", True), ("Poison", False), ("C", True), ("D", True)
    ]
    assert "cudaErrorStreamCaptureInvalidated" in dict((n, w) for n, _, w in result.nodes)["Poison"]
