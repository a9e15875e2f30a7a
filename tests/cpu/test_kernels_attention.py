"""Attention kernels (Attention, RotaryEmbedding, SwiGLU, LinearAttention, FlexAttention),
checked against onnx.reference and independently written numpy."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

import plugrt
from helpers import node_model, reference_node, run_node
from plugrt_cpu import kernels  # noqa: F401  (registers the kernels)
from plugrt_cpu._registry import KernelContext, lookup


def _random(*shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _assert_all_close(got, expected, tol=1e-5):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(g, e, rtol=tol, atol=tol)


_ATTENTION_OUTPUTS = ["y", "present_key", "present_value", "qk"]


def _qkv_4d(batch=2, q_heads=6, kv_heads=2, q_len=5, kv_len=7, head=8, v_head=4, seed=0):
    return {
        "q": _random(batch, q_heads, q_len, head, seed=seed),
        "k": _random(batch, kv_heads, kv_len, head, seed=seed + 1),
        "v": _random(batch, kv_heads, kv_len, v_head, seed=seed + 2),
    }


@pytest.mark.parametrize("kv_heads", [6, 2, 1])
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_grouped_attention_with_past_matches_onnx_reference(kv_heads, mode):
    inputs = _qkv_4d(kv_heads=kv_heads)
    inputs["attn_mask"] = _random(5, 10, seed=9)
    inputs["past_key"] = _random(2, kv_heads, 3, 8, seed=10)
    inputs["past_value"] = _random(2, kv_heads, 3, 4, seed=11)
    attributes = {"is_causal": 1, "qk_matmul_output_mode": mode, "scale": 0.3}
    _assert_all_close(
        run_node("Attention", inputs, 23, outputs=_ATTENTION_OUTPUTS, **attributes),
        reference_node("Attention", inputs, 23, outputs=_ATTENTION_OUTPUTS, **attributes),
    )


def test_softcap_mode_one_reports_capped_scores_before_the_mask():
    inputs = _qkv_4d(kv_heads=2, seed=20)
    inputs["attn_mask"] = np.random.default_rng(1).random((5, 7)) > 0.3
    attributes = {"softcap": 1.5, "qk_matmul_output_mode": 1}
    _assert_all_close(
        run_node("Attention", inputs, 23, outputs=_ATTENTION_OUTPUTS, **attributes),
        reference_node("Attention", inputs, 23, outputs=_ATTENTION_OUTPUTS, **attributes),
    )


def test_mode_zero_reports_the_raw_scaled_product_even_with_softcap():
    # The spec: mode 0 is the QK matmul output; mode 1 is the one after softcap.
    inputs = _qkv_4d(q_heads=2, kv_heads=2, seed=30)
    y, _, _, qk = run_node("Attention", inputs, 23, outputs=_ATTENTION_OUTPUTS, softcap=0.5, qk_matmul_output_mode=0)
    expected = inputs["q"] @ np.swapaxes(inputs["k"], -1, -2) / np.sqrt(8)
    np.testing.assert_allclose(qk, expected, rtol=1e-5, atol=1e-5)
    assert np.abs(qk).max() > 0.5  # not capped


def _numpy_attention(q, k, v, allowed):
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    scores = np.where(allowed, scores, -np.inf)
    exp = np.exp(scores - scores.max(-1, keepdims=True))
    return (exp / exp.sum(-1, keepdims=True)) @ v


def test_3d_inputs_split_and_merge_heads():
    q, k, v = _random(2, 4, 12, seed=40), _random(2, 6, 4, seed=41), _random(2, 6, 10, seed=42)
    (y,) = run_node("Attention", {"q": q, "k": k, "v": v}, 23, outputs=["y"], q_num_heads=3, kv_num_heads=1)
    heads = lambda x, h: x.reshape(x.shape[0], x.shape[1], h, -1).transpose(0, 2, 1, 3)  # noqa: E731
    expected = _numpy_attention(heads(q, 3), heads(k, 1), heads(v, 1), np.ones((4, 6), bool))
    np.testing.assert_allclose(y, expected.transpose(0, 2, 1, 3).reshape(2, 4, 30), rtol=1e-5, atol=1e-6)


def test_causal_mask_is_bottom_right_aligned_after_past():
    inputs = _qkv_4d(q_heads=2, kv_heads=2, q_len=3, kv_len=3, seed=50)
    past_k, past_v = _random(2, 2, 4, 8, seed=51), _random(2, 2, 4, 4, seed=52)
    y = run_node("Attention", dict(inputs, attn_mask=None, past_key=past_k, past_value=past_v), 23, outputs=["y"], is_causal=1)[0]
    k = np.concatenate([past_k, inputs["k"]], axis=2)
    v = np.concatenate([past_v, inputs["v"]], axis=2)
    allowed = np.arange(7)[None, :] <= np.arange(3)[:, None] + 4
    np.testing.assert_allclose(y, _numpy_attention(inputs["q"], k, v, allowed), rtol=1e-5, atol=1e-6)


def test_nonpad_kv_seqlen_masks_padding_and_shifts_the_causal_frontier():
    inputs = _qkv_4d(batch=3, q_heads=4, kv_heads=2, q_len=2, kv_len=8, seed=60)
    inputs["attn_mask"] = None
    inputs["past_key"] = inputs["past_value"] = None
    inputs["nonpad_kv_seqlen"] = np.array([8, 5, 3], dtype=np.int64)
    attributes = {"is_causal": 1}
    _assert_all_close(
        run_node("Attention", inputs, 24, outputs=["y"], **attributes), reference_node("Attention", inputs, 24, outputs=["y"], **attributes)
    )


@pytest.mark.parametrize(("left", "right", "causal"), [(2, 0, 0), (1, 2, 0), (3, -1, 1), (-1, 1, 0)])
def test_sliding_window_matches_onnx_reference(left, right, causal):
    inputs = _qkv_4d(q_heads=2, kv_heads=1, q_len=6, kv_len=6, seed=70)
    inputs["attn_mask"] = np.random.default_rng(2).random((2, 1, 6, 6)) > 0.2
    attributes = {"left_window_size": left, "right_window_size": right, "is_causal": causal}
    _assert_all_close(
        run_node("Attention", inputs, 25, outputs=["y"], **attributes), reference_node("Attention", inputs, 25, outputs=["y"], **attributes)
    )


def test_fully_masked_rows_give_zeros_not_nan():
    inputs = _qkv_4d(q_heads=2, kv_heads=2, q_len=3, kv_len=4, seed=80)
    mask = np.ones((3, 4), dtype=bool)
    mask[1] = False
    inputs["attn_mask"] = mask
    y, _, _, probs = run_node("Attention", inputs, 23, outputs=_ATTENTION_OUTPUTS, qk_matmul_output_mode=3)
    assert not np.isnan(y).any()
    np.testing.assert_array_equal(y[:, :, 1], 0)
    np.testing.assert_array_equal(probs[:, :, 1], 0)
    np.testing.assert_allclose(probs[:, :, [0, 2]].sum(-1), 1, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_attention_keeps_the_input_dtype(dtype):
    inputs = {name: value.astype(dtype) for name, value in _qkv_4d(seed=90).items()}
    (y,) = run_node("Attention", inputs, 23, outputs=["y"], is_causal=1)
    (expected,) = reference_node("Attention", inputs, 23, outputs=["y"], is_causal=1)
    assert y.dtype == dtype
    np.testing.assert_allclose(y, expected, rtol=1e-3, atol=1e-3)


def test_4d_inputs_reject_head_count_attributes_from_opset_25():
    with pytest.raises(Exception, match="q_num_heads"):
        run_node("Attention", _qkv_4d(seed=95), 25, outputs=["y"], q_num_heads=6, kv_num_heads=2)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rotary_dim", [0, 4])
def test_rotary_embedding_with_position_ids_matches_onnx_reference(interleaved, rotary_dim):
    half = (rotary_dim or 8) // 2
    inputs = {
        "x": _random(2, 3, 5, 8, seed=100),
        "cos": _random(12, half, seed=101),
        "sin": _random(12, half, seed=102),
        "position_ids": np.random.default_rng(3).integers(0, 12, (2, 5)),
    }
    attributes = {"interleaved": interleaved, "rotary_embedding_dim": rotary_dim}
    _assert_all_close(
        run_node("RotaryEmbedding", inputs, 23, outputs=["y"], **attributes),
        reference_node("RotaryEmbedding", inputs, 23, outputs=["y"], **attributes),
    )


def test_rotary_embedding_on_3d_input_without_position_ids_rotates_halves():
    x, cos, sin = _random(2, 5, 12, seed=110), _random(2, 5, 3, seed=111), _random(2, 5, 3, seed=112)
    (y,) = run_node("RotaryEmbedding", {"x": x, "cos": cos, "sin": sin}, 23, outputs=["y"], num_heads=2)
    heads = x.reshape(2, 5, 2, 6)
    c, s = cos[:, :, None], sin[:, :, None]
    first, second = heads[..., :3], heads[..., 3:]
    expected = np.concatenate([c * first - s * second, s * first + c * second], axis=-1)
    np.testing.assert_allclose(y, expected.reshape(2, 5, 12), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_swiglu_is_swish_gate_times_value(dtype):
    a, b = _random(4, 16, seed=120, dtype=dtype), _random(4, 16, seed=121, dtype=dtype)
    (y,) = run_node("SwiGLU", {"a": a, "b": b}, 28, outputs=["y"], alpha=1.7)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    expected = a64 / (1 + np.exp(-1.7 * a64)) * b64
    assert y.dtype == dtype
    np.testing.assert_allclose(y.astype(np.float64), expected, rtol=1e-3 if dtype == np.float16 else 1e-6, atol=1e-3)


@pytest.mark.parametrize("rule", ["linear", "gated", "delta", "gated_delta"])
@pytest.mark.parametrize("per_dim_decay", [False, True])
def test_linear_attention_matches_onnx_reference(rule, per_dim_decay):
    batch, steps, q_heads, kv_heads, dk, dv = 2, 6, 4, 2, 3, 5
    rng = np.random.default_rng(130)
    inputs = {
        "query": _random(batch, steps, q_heads * dk, seed=131),
        "key": _random(batch, steps, kv_heads * dk, seed=132) / 2,
        "value": _random(batch, steps, kv_heads * dv, seed=133),
        "past_state": _random(batch, kv_heads, dk, dv, seed=134),
        "decay": None,
        "beta": None,
    }
    if rule in ("gated", "gated_delta"):
        width = kv_heads * dk if per_dim_decay else kv_heads
        inputs["decay"] = -rng.random((batch, steps, width)).astype(np.float32)
    if rule in ("delta", "gated_delta"):
        inputs["beta"] = rng.random((batch, steps, kv_heads)).astype(np.float32)
    attributes = {"q_num_heads": q_heads, "kv_num_heads": kv_heads, "update_rule": rule}
    _assert_all_close(
        run_node("LinearAttention", inputs, 27, outputs=["y", "state"], **attributes),
        reference_node("LinearAttention", inputs, 27, outputs=["y", "state"], **attributes),
    )


def test_linear_attention_rule_without_its_decay_is_rejected():
    inputs = {"query": _random(1, 2, 4), "key": _random(1, 2, 4), "value": _random(1, 2, 4)}
    with pytest.raises(Exception, match="decay"):
        run_node("LinearAttention", inputs, 27, outputs=["y"], q_num_heads=1, kv_num_heads=1, update_rule="gated")


def test_flex_attention_without_modifiers_matches_onnx_reference():
    inputs = _qkv_4d(seed=140)
    model = node_model("FlexAttention", inputs, 26, outputs=["y"], domain="ai.onnx.preview", scale=0.25)
    (y,) = plugrt.InferenceSession(model.SerializeToString()).run(None, inputs)
    (expected,) = ReferenceEvaluator(model).run(None, inputs)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


def test_flex_attention_passes_outer_scope_values_to_its_score_modifier():
    inputs = _qkv_4d(q_heads=2, kv_heads=2, seed=150)
    bias = _random(5, 7, seed=151)
    compiled = []

    def compile_subgraph(graph):
        compiled.append(graph)
        return SimpleNamespace(run=lambda values, outer: [values[0] + outer["bias"]])

    ctx = KernelContext(
        "FlexAttention", "ai.onnx.preview", 1, {"score_mod": object()}, 3, 1,
        [np.dtype(np.float32)] * 3, [None] * 3, compile_subgraph=compile_subgraph, implicit_inputs=("bias",),
    )
    run = lookup("ai.onnx.preview", "FlexAttention", 1).fn(ctx)
    y = run(inputs["q"], inputs["k"], inputs["v"], bias)
    scores = inputs["q"] @ np.swapaxes(inputs["k"], -1, -2) / np.sqrt(8) + bias
    exp = np.exp(scores - scores.max(-1, keepdims=True))
    assert len(compiled) == 1
    np.testing.assert_allclose(y, exp / exp.sum(-1, keepdims=True) @ inputs["v"], rtol=1e-5, atol=1e-6)


def test_flex_attention_score_modifier_reads_an_outer_scope_value_in_a_session():
    inputs = _qkv_4d(q_heads=2, kv_heads=1, seed=160)
    bias = _random(5, 7, seed=161)
    score_mod = helper.make_graph(
        [helper.make_node("Add", ["scores", "bias"], ["modified"])],
        "score_mod",
        [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("modified", onnx.TensorProto.FLOAT, None)],
    )
    model = node_model("FlexAttention", dict(inputs, bias=None), 26, outputs=["y"], domain="ai.onnx.preview", score_mod=score_mod)
    model.graph.input.append(helper.make_tensor_value_info("bias", onnx.TensorProto.FLOAT, bias.shape))
    (y,) = plugrt.InferenceSession(model.SerializeToString()).run(None, dict(inputs, bias=bias))
    k = np.repeat(inputs["k"], 2, axis=1)
    v = np.repeat(inputs["v"], 2, axis=1)
    scores = inputs["q"] @ np.swapaxes(k, -1, -2) / np.sqrt(8) + bias
    exp = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(y, exp / exp.sum(-1, keepdims=True) @ v, rtol=1e-5, atol=1e-6)
