"""Loss kernels (NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss), checked against
onnx.reference and independently written numpy."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import plugrt

RNG = np.random.default_rng(0)


def _loss_model(op, inputs, attrs, opset, n_outputs=1):
    names = ["scores", "target", "weight"][: len(inputs)]
    outputs = ["loss", "log_prob"][:n_outputs]
    node = helper.make_node(op, names, outputs, **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for n, v in zip(names, inputs)],
        [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return model, dict(zip(names, inputs))


def _run(model: onnx.ModelProto, feeds):
    return plugrt.InferenceSession(model.SerializeToString()).run(None, feeds)


def _inputs(shape, dtype, ignore_index=None, with_weight=False):
    scores = RNG.standard_normal(shape).astype(dtype)
    target = RNG.integers(0, shape[1], (shape[0],) + shape[2:]).astype(np.int64)
    if ignore_index is not None:
        target.reshape(-1)[::3] = ignore_index
    inputs = [scores, target]
    if with_weight:
        inputs.append(RNG.random(shape[1]).astype(dtype))
    return inputs


@pytest.mark.parametrize(("op", "opset"), [("NegativeLogLikelihoodLoss", 13), ("NegativeLogLikelihoodLoss", 22), ("SoftmaxCrossEntropyLoss", 13)])
@pytest.mark.parametrize("shape", [(6, 5), (3, 5, 7), (2, 4, 3, 2, 2)])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize(("ignore_index", "with_weight"), [(None, False), (2, False), (-5, True), (None, True)])
def test_loss_matches_reference(op, opset, shape, reduction, ignore_index, with_weight):
    inputs = _inputs(shape, np.float32, ignore_index, with_weight)
    attrs = {"reduction": reduction}
    if ignore_index is not None:
        attrs["ignore_index"] = ignore_index
    model, feeds = _loss_model(op, inputs, attrs, opset)
    (got,) = _run(model, feeds)
    (expected,) = ReferenceEvaluator(model).run(None, feeds)
    assert got.dtype == np.float32
    assert got.shape == np.asarray(expected).shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_nll_mean_divides_by_the_weight_of_targets_not_ignored():
    log_prob = np.log(np.array([[0.2, 0.8], [0.6, 0.4], [0.5, 0.5]], dtype=np.float64))
    target = np.array([1, 0, -1], dtype=np.int64)
    weight = np.array([2.0, 3.0])
    model, feeds = _loss_model("NegativeLogLikelihoodLoss", [log_prob, target, weight], {"ignore_index": -1}, 22)
    (got,) = _run(model, feeds)
    expected = -(3.0 * np.log(0.8) + 2.0 * np.log(0.6)) / (3.0 + 2.0)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_softmax_cross_entropy_returns_log_softmax_as_second_output():
    scores, target = _inputs((4, 6, 3), np.float64)
    model, feeds = _loss_model("SoftmaxCrossEntropyLoss", [scores, target], {"reduction": "sum"}, 13, n_outputs=2)
    loss, log_prob = _run(model, feeds)
    shifted = scores - scores.max(axis=1, keepdims=True)
    expected_log_prob = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(log_prob, expected_log_prob, rtol=1e-12)
    picked = np.take_along_axis(expected_log_prob, target[:, None], axis=1)
    np.testing.assert_allclose(loss, -picked.sum(), rtol=1e-12)


def test_softmax_cross_entropy_is_stable_for_large_scores():
    scores = np.array([[1000.0, 0.0], [-1000.0, 0.0]], dtype=np.float32)
    target = np.array([0, 0], dtype=np.int64)
    model, feeds = _loss_model("SoftmaxCrossEntropyLoss", [scores, target], {"reduction": "none"}, 13)
    (got,) = _run(model, feeds)
    np.testing.assert_allclose(got, [0.0, 1000.0], rtol=1e-6)
