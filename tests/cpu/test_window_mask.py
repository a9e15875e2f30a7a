"""A shifted-window attention's mask (Swin's): the scores plus the relative-position bias,
reshaped to (batch, windows, heads, rows, keys), plus the windows' mask, reshaped back,
then the Softmax. Folded into one Add of a constant, which the masked-softmax and
attention fusions then take: the same values as onnxruntime and level "none", one
attention step, and the pattern left alone where an intermediate is read elsewhere."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from cpu.test_fusions import _step_ops


def _model(batch: int, windows: int, heads: int = 3, rows: int = 16, depth: int = 8, *, extra_output: str = "") -> bytes:
    rng = np.random.default_rng(0)
    groups = batch * windows
    mask = np.where(rng.random((1, windows, 1, rows, rows)) > 0.2, 0.0, -100.0).astype(np.float32)
    initializers = [
        numpy_helper.from_array((rng.standard_normal((1, heads, rows, rows)) * 0.5).astype(np.float32), "bias"),
        numpy_helper.from_array(mask, "mask"),
        numpy_helper.from_array(np.array([batch, windows, heads, rows, rows], np.int64), "split"),
        numpy_helper.from_array(np.array([groups, heads, rows, rows], np.int64), "merge"),
        numpy_helper.from_array(np.array(depth ** -0.5, np.float32), "scale"),
    ]
    nodes = [
        helper.make_node("Mul", ["q", "scale"], ["qs"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["qs", "kt"], ["s"]),
        helper.make_node("Add", ["s", "bias"], ["biased"]),
        helper.make_node("Reshape", ["biased", "split"], ["by_window"]),
        helper.make_node("Add", ["by_window", "mask"], ["masked"]),
        helper.make_node("Reshape", ["masked", "merge"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o"]),
    ]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [groups, heads, rows, depth]) for n in "qkv"]
    outputs = [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)]
    if extra_output:
        outputs.append(helper.make_tensor_value_info(extra_output, TensorProto.FLOAT, None))
    model = helper.make_model(helper.make_graph(nodes, "windows", inputs, outputs, initializers), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _feeds(batch: int, windows: int, heads: int = 3, rows: int = 16, depth: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {n: rng.standard_normal((batch * windows, heads, rows, depth)).astype(np.float32) for n in "qkv"}


def _check(model: bytes, feeds: dict[str, np.ndarray]) -> list[str]:
    ops, ours = _step_ops(model, feeds)
    _, plain = _step_ops(model, feeds, optimization="none")
    for actual, unfused, theirs in zip(ours, plain, onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)):
        np.testing.assert_allclose(actual, theirs, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(actual, unfused, rtol=1e-5, atol=1e-5)
    return ops


@pytest.mark.parametrize("batch, windows", [(1, 4), (2, 4)])
def test_a_shifted_window_mask_folds_into_one_attention_step(batch, windows):
    ops = _check(_model(batch, windows), _feeds(batch, windows))
    assert ops == ["Transpose", "ScaledDotProductAttention"]  # k^T: a view of the input


def test_a_window_view_read_elsewhere_keeps_the_steps():
    ops = _check(_model(1, 4, extra_output="by_window"), _feeds(1, 4))
    assert "Reshape" in ops and "ScaledDotProductAttention" not in ops
