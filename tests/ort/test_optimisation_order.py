"""Optimisation never depends on where the host provider sits in the provider list."""

from __future__ import annotations

import numpy as np
import onnx.parser
import pytest

import plugrt

# ConstantOfShape is something only the CPU provider can evaluate: folding it needs the
# host provider even when an accelerator is listed last
MODEL = onnx.parser.parse_model(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1, 2] X) => (float[1, 2] Y) {
        shape = Constant <value = int64[2] {1, 2}> ()
        two = ConstantOfShape <value = float[1] {2.0}> (shape)
        Y = Mul(X, two)
    }
    """
).SerializeToString()


@pytest.mark.parametrize("providers", [["CPUExecutionProvider", "template"], ["template", "CPUExecutionProvider"]])
def test_constants_fold_whatever_the_provider_order(providers):
    pytest.importorskip("plugrt_provider_template")
    reference = plugrt.InferenceSession(MODEL, providers=["CPUExecutionProvider"]).session
    session = plugrt.InferenceSession(MODEL, providers=providers).session
    assert session.optimization_stats["folded"] == reference.optimization_stats["folded"] >= 2
    assert [n.op_type for n in session.model.graph] == ["Mul"]
    x = np.array([[1.5, -3.0]], np.float32)
    np.testing.assert_array_equal(session.run({"X": x})["Y"], x * 2)
