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
    return types.SimpleNamespace(xp=types.SimpleNamespace(cuda=cuda), gemm_engine=engine)


def test_gemms_are_seams_only_when_cublas_is_chosen():
    assert seam_reason(_step("MatMul"), _backend("cublas")) is not None
    assert seam_reason(_step("MatMul"), _backend("auto")) is None
    assert seam_reason(_step("MatMul"), _backend("own")) is None


def test_shape_is_a_seam_because_its_output_is_made_on_the_host():
    assert "host" in seam_reason(_step("Shape"), _backend())


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
