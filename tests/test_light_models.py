"""The nine light models shipped with onnx match their expected outputs."""

from __future__ import annotations

import functools
import math

import numpy as np
import onnx
import pytest

import plugrt
from plugrt.conformance.light_models import LightModel, light_models

MODELS = {m.name: m for m in light_models()}

#: relative error allowed in the values a model's final Softmax reads (its logits)
LOGIT_RTOL = 1e-4


def test_all_nine_light_models_are_present():
    assert sorted(MODELS) == [
        "bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50",
        "shufflenet", "squeezenet", "vgg19", "zfnet512",
    ]


@functools.lru_cache(maxsize=None)
def _with_logits(name: str) -> tuple[bytes, bool]:
    """The model with the input of its final Softmax (if it ends in one) as a second output."""
    model = onnx.load(MODELS[name].path)
    graph = model.graph
    (last,) = [node for node in graph.node if graph.output[0].name in node.output]
    if last.op_type != "Softmax":
        return model.SerializeToString(), False
    graph.output.append(onnx.helper.make_tensor_value_info(last.input[0], onnx.TensorProto.FLOAT, None))
    return model.SerializeToString(), True


@functools.lru_cache(maxsize=None)
def _onnxruntime_logits(name: str) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    model, _ = _with_logits(name)
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return session.run(None, MODELS[name].inputs)[1]


def _check(model: LightModel, outputs: list[np.ndarray]) -> None:
    """Outputs against the expected ones; for a final Softmax, its logits first.

    The light models' logits reach ~1e10 (squeezenet) where one float32 ulp is ~1e3, so
    their Softmax is ill-conditioned: a rounding difference between two classes moves the
    probabilities by e^1000. The logits are compared with onnxruntime's at a relative
    tolerance; the probabilities are compared with the expected ones at the tolerance that
    logit error implies, and only where that tolerance still says something."""
    _, ends_in_softmax = _with_logits(model.name)
    if not ends_in_softmax:
        for actual, expected in zip(outputs, model.expected):
            np.testing.assert_allclose(actual, expected, rtol=1e-3, atol=1e-7)
        return
    probabilities, logits = outputs
    reference = _onnxruntime_logits(model.name)
    scale = float(np.max(np.abs(reference)))
    np.testing.assert_allclose(logits, reference, rtol=LOGIT_RTOL, atol=LOGIT_RTOL * scale)
    # two logits each off by up to `shift` change a probability ratio by at most e^(2 shift)
    shift = LOGIT_RTOL * scale
    if shift < 0.01:
        rtol = math.expm1(2 * shift) + 1e-6
        np.testing.assert_allclose(probabilities, model.expected[0], rtol=rtol, atol=1e-7)
    assert probabilities.shape == model.expected[0].shape
    np.testing.assert_allclose(np.sum(probabilities, axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_light_model_matches_expected_output_through_load(name):
    model = MODELS[name]
    outputs = plugrt.load(_with_logits(name)[0]).run(model.inputs)
    _check(model, list(outputs.values()))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_light_model_matches_expected_output_through_inference_session(name):
    model = MODELS[name]
    session = plugrt.InferenceSession(_with_logits(name)[0], providers=["CPUExecutionProvider"])
    _check(model, session.run(None, model.inputs))


def test_logit_check_fails_on_a_one_percent_error():
    # the tolerance must be able to fail: squeezenet's logits scaled by 1.01 are wrong
    model = MODELS["squeezenet"]
    outputs = plugrt.InferenceSession(_with_logits("squeezenet")[0]).run(None, model.inputs)
    with pytest.raises(AssertionError):
        _check(model, [outputs[0], outputs[1] * 1.01])
