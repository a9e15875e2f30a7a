"""A captured GroupQueryAttention step writes the cache in place when one binding carries
it in and out (the recording then runs the step's in-place variant), and copies it
otherwise; checked with the fake cupy of test_capture_logic (no GPU)."""

from __future__ import annotations

import contextlib
import types

import numpy as np
import onnx_ir as ir

from plugrt.provider import CompiledPartition, Partition, Step

from plugrt_cuda import _xp
from plugrt_cuda._capture import capture_partition
from plugrt_cuda._ops import OPS, OpInfo
from test_capture_logic import _FakeCupy

RNG = np.random.default_rng(3)


class _CarryingContext:
    """A capture context whose bindings carry ``carried`` ({output: input}) in and out."""

    def __init__(self, arrays: dict, carried: dict):
        self.arrays, self.carried, self.outputs = dict(arrays), carried, {}

    def array(self, value):
        return None if value is None else self.arrays[value]

    def set(self, value, array):
        self.outputs[value] = array

    def step_done(self, step):
        pass

    def carried_over(self, output, input):
        return self.carried.get(output) is input


def _gqa_step(backend) -> Step:
    attributes = {"num_heads": 4, "kv_num_heads": 2, "do_rotary": 0}
    fn = OPS[("com.microsoft", "GroupQueryAttention")].builder(OpInfo(attributes, [], 1, 7, 3, backend))
    inputs = [ir.Value(name=n) for n in ("q", "past_k", "past_v", "seqlens", "total")]
    q, past_k, past_v, seqlens, total = inputs
    outputs = [ir.Value(name=n) for n in ("out", "present_k", "present_v")]
    return Step(fn, [q, None, None, past_k, past_v, seqlens, total], outputs, multi_output=True,
                name="GroupQueryAttention", op_type="GroupQueryAttention")


def _capture(carry: bool):
    cupy = _FakeCupy()
    backend = types.SimpleNamespace(
        xp=cupy, gemm_engine="auto", warming_for_capture=contextlib.nullcontext, matmul=np.matmul,
        softmax=lambda x, axis, coerce, log: _xp.softmax(np, x, axis=axis),
    )
    step = _gqa_step(backend)
    q, _, _, past_k, past_v, seqlens, total = step.inputs
    arrays = {q: RNG.standard_normal((1, 1, 128)).astype(np.float32),
              past_k: RNG.standard_normal((1, 2, 16, 16)).astype(np.float32),
              past_v: RNG.standard_normal((1, 2, 16, 16)).astype(np.float32),
              seqlens: np.array([6], np.int32), total: np.array([16], np.int32)}
    expected = step.fn(*[None if v is None else arrays[v].copy() for v in step.inputs])  # the copying variant
    before = arrays[past_k].copy()
    carried = {step.outputs[1]: past_k, step.outputs[2]: past_v} if carry else {}
    ctx = _CarryingContext(arrays, carried)
    partition = Partition("p", [], [v for v in step.inputs if v is not None], list(step.outputs), {"": 17})
    result = capture_partition(CompiledPartition(partition, [step], "cuda"), ctx, backend)
    assert result.nodes == [("GroupQueryAttention", True, "")]
    return step, arrays, ctx, expected, before


def test_a_carried_cache_is_written_in_place_with_the_copying_variants_values():
    step, arrays, ctx, expected, before = _capture(carry=True)
    present_k, present_v = ctx.outputs[step.outputs[1]], ctx.outputs[step.outputs[2]]
    assert present_k is arrays[step.inputs[3]] and present_v is arrays[step.inputs[4]]
    assert not np.array_equal(present_k, before)  # the new row and the zeroed tail
    np.testing.assert_allclose(present_k, expected[1])
    np.testing.assert_allclose(present_v, expected[2])
    np.testing.assert_allclose(ctx.outputs[step.outputs[0]], expected[0], rtol=1e-6)


def test_a_cache_no_binding_carries_is_copied_and_the_past_left_as_it_was():
    step, arrays, ctx, expected, before = _capture(carry=False)
    past = arrays[step.inputs[3]]
    present_k = ctx.outputs[step.outputs[1]]
    assert present_k is not past
    np.testing.assert_array_equal(past, before)
    np.testing.assert_allclose(present_k, expected[1])
