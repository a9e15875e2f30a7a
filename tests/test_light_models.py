"""The nine light models shipped with onnx match their expected outputs."""

from __future__ import annotations

import numpy as np
import pytest

import plugrt
from plugrt.conformance.light_models import light_models

MODELS = {m.name: m for m in light_models()}


def test_all_nine_light_models_are_present():
    assert sorted(MODELS) == [
        "bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50",
        "shufflenet", "squeezenet", "vgg19", "zfnet512",
    ]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_light_model_matches_expected_output_through_load(name):
    model = MODELS[name]
    outputs = plugrt.load(model.path).run(model.inputs)
    for actual, expected in zip(outputs.values(), model.expected):
        np.testing.assert_allclose(actual, expected, rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_light_model_matches_expected_output_through_inference_session(name):
    model = MODELS[name]
    with open(model.path, "rb") as f:
        session = plugrt.InferenceSession(f.read(), providers=["CPUExecutionProvider"])
    outputs = session.run(None, model.inputs)
    for actual, expected in zip(outputs, model.expected):
        np.testing.assert_allclose(actual, expected, rtol=1e-3, atol=1e-7)
