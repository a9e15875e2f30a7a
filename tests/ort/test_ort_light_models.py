"""The onnxruntime facade on onnx's light models (IR 3, as real exporters wrote them)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import plugrt
from plugrt.conformance.light_models import light_models

LIGHT = light_models()


@pytest.mark.parametrize("model", LIGHT, ids=[m.name for m in LIGHT])
def test_optimized_model_file_of_a_light_model_is_valid_and_runs_alike(model, tmp_path):
    options = plugrt.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = plugrt.InferenceSession(model.path, options, providers=["CPUExecutionProvider"])
    written = onnx.load(options.optimized_model_filepath)
    onnx.checker.check_model(written)  # an IR 3 file with initializers not among the inputs fails here
    reloaded = plugrt.InferenceSession(options.optimized_model_filepath, providers=["CPUExecutionProvider"])
    expected = session.run(None, model.inputs)
    for got, want in zip(reloaded.run(None, model.inputs), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
