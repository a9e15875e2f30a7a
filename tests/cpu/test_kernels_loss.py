"""Loss kernels (NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss), checked against
onnx.reference and independently written numpy."""

from __future__ import annotations

import numpy as np
import pytest
from onnx.reference import ReferenceEvaluator

from helpers import node_case, run_model

RNG = np.random.default_rng(0)


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
    model, feeds = node_case(op, inputs, opset, ir_version=10, attributes=attrs)
    (got,) = run_model(model, feeds)
    (expected,) = ReferenceEvaluator(model).run(None, feeds)
    assert got.dtype == np.float32
    assert got.shape == np.asarray(expected).shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_nll_mean_divides_by_the_weight_of_targets_not_ignored():
    log_prob = np.log(np.array([[0.2, 0.8], [0.6, 0.4], [0.5, 0.5]], dtype=np.float64))
    target = np.array([1, 0, -1], dtype=np.int64)
    weight = np.array([2.0, 3.0])
    model, feeds = node_case("NegativeLogLikelihoodLoss", [log_prob, target, weight], 22, ir_version=10, attributes={"ignore_index": -1})
    (got,) = run_model(model, feeds)
    expected = -(3.0 * np.log(0.8) + 2.0 * np.log(0.6)) / (3.0 + 2.0)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_softmax_cross_entropy_returns_log_softmax_as_second_output():
    scores, target = _inputs((4, 6, 3), np.float64)
    model, feeds = node_case("SoftmaxCrossEntropyLoss", [scores, target], 13, outputs=2, ir_version=10, attributes={"reduction": "sum"})
    loss, log_prob = run_model(model, feeds)
    shifted = scores - scores.max(axis=1, keepdims=True)
    expected_log_prob = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(log_prob, expected_log_prob, rtol=1e-12)
    picked = np.take_along_axis(expected_log_prob, target[:, None], axis=1)
    np.testing.assert_allclose(loss, -picked.sum(), rtol=1e-12)


def test_softmax_cross_entropy_is_stable_for_large_scores():
    scores = np.array([[1000.0, 0.0], [-1000.0, 0.0]], dtype=np.float32)
    target = np.array([0, 0], dtype=np.int64)
    model, feeds = node_case("SoftmaxCrossEntropyLoss", [scores, target], 13, ir_version=10, attributes={"reduction": "none"})
    (got,) = run_model(model, feeds)
    np.testing.assert_allclose(got, [0.0, 1000.0], rtol=1e-6)
