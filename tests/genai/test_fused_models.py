"""BERT and GPT-2 exported by torch.onnx.export and fused by onnxruntime's transformer optimizer
(scripts/make_decoder_models.py --fused): plugrt's contrib kernels against onnxruntime on whole models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import plugrt

ort = pytest.importorskip("onnxruntime")

ASSETS = Path(__file__).parent / "assets" / "fused"
FUSED_OPS = {
    "bert": {"EmbedLayerNormalization", "Attention", "SkipLayerNormalization", "BiasGelu"},
    "gpt2": {"SkipLayerNormalization", "FastGelu"},
}


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    # the second sequence is right-padded: the mask reaches Attention as a mask index
    values = {
        "input_ids": rng.integers(0, 64, (2, 7)),
        "attention_mask": np.array([[1] * 7, [1] * 4 + [0] * 3]),
        "token_type_ids": np.array([[0] * 3 + [1] * 4, [0] * 7]),
    }
    return {i.name: values[i.name].astype(np.int64) for i in model.graph.input}


@pytest.mark.parametrize("name", sorted(FUSED_OPS))
def test_fused_model_uses_the_contrib_ops(name):
    model = onnx.load(str(ASSETS / f"{name}.onnx"))
    assert FUSED_OPS[name] <= {n.op_type for n in model.graph.node if n.domain == "com.microsoft"}


@pytest.mark.parametrize("name", sorted(FUSED_OPS))
def test_fused_model_matches_onnxruntime(name):
    path = ASSETS / f"{name}.onnx"
    feeds = _feeds(onnx.load(str(path)))
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = plugrt.InferenceSession(str(path)).run(None, feeds)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)
