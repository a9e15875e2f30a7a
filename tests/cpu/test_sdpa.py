"""Scaled dot-product attention as one step (``plugrt.cpu::ScaledDotProductAttention``):
the graphs transformers' SDPA export and torchvision's ViT write (q and k^T each scaled
by a root of the scale, or the scores by the scale; a padding or causal mask through
AddSoftmax with the NaN guard, or a plain Softmax; the Transpose of the heads back),
against onnxruntime on the same graph and against level "none"; the compiled job and
numpy's way; float64; heads shared by several queries' heads; capture/replay without
allocating; and the graphs that must keep their steps."""

from __future__ import annotations

import math

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from cpu.test_fusions import _assert_replays_without_allocating, _step_ops


def _model(
    batch: int, heads: int, queries: int, keys: int, depth: int, *, mask: str | None = "padding", guard: bool = True,
    scaling: str = "roots", transpose_out: bool = True, kv_heads: int | None = None, dtype: int = TensorProto.FLOAT,
    scores_out: bool = False,
) -> bytes:
    """q (batch, queries, heads * depth), k and v (batch, keys, kv_heads * depth) split into
    heads the way exporters do (Reshape, Transpose; k to (batch, heads, depth, keys)), then
    ``softmax(q k^T * scale + mask) v`` and, with ``transpose_out``, the heads put back
    side by side. ``scaling``: "roots" (q and k^T each by scale ** 0.5, SDPA's export),
    "scores" (a Div of the scores), "none". ``mask``: None, "padding" (batch, 1, 1, keys)
    or "causal" (1, 1, queries, keys), from a boolean input through Where."""
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    kv_heads = kv_heads or heads
    scale = 1.0 / math.sqrt(depth)
    inputs = [
        helper.make_tensor_value_info("q", dtype, [batch, queries, heads * depth]),
        helper.make_tensor_value_info("k", dtype, [batch, keys, kv_heads * depth]),
        helper.make_tensor_value_info("v", dtype, [batch, keys, kv_heads * depth]),
    ]
    initializers = [
        numpy_helper.from_array(np.array([batch, queries, heads, depth], np.int64), "q_shape"),
        numpy_helper.from_array(np.array([batch, keys, kv_heads, depth], np.int64), "kv_shape"),
        numpy_helper.from_array(np.array(math.sqrt(scale), np_type), "root"),
        numpy_helper.from_array(np.array(math.sqrt(depth), np_type), "divisor"),
        numpy_helper.from_array(np.array(0, np_type), "zero"),
        numpy_helper.from_array(np.array(-np.inf, np_type), "minus_inf"),
        numpy_helper.from_array(np.array([batch, queries, heads * depth], np.int64), "out_shape"),
    ]
    nodes = [
        helper.make_node("Reshape", ["q", "q_shape"], ["q4"]),
        helper.make_node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["k", "kv_shape"], ["k4"]),
        helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
        helper.make_node("Reshape", ["v", "kv_shape"], ["v4"]),
        helper.make_node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]),
    ]
    left, right = "qh", "kt"
    if scaling == "roots":
        nodes += [helper.make_node("Mul", ["qh", "root"], ["qs"]), helper.make_node("Mul", ["kt", "root"], ["ks"])]
        left, right = "qs", "ks"
    nodes.append(helper.make_node("MatMul", [left, right], ["raw"]))
    scores = "raw"
    if scaling == "scores":
        nodes.append(helper.make_node("Div", ["raw", "divisor"], ["scaled"]))
        scores = "scaled"
    if mask is not None:
        shape = [batch, 1, 1, keys] if mask == "padding" else [1, 1, queries, keys]
        inputs.append(helper.make_tensor_value_info("keep", TensorProto.BOOL, shape))
        nodes += [helper.make_node("Where", ["keep", "zero", "minus_inf"], ["m"]), helper.make_node("Add", [scores, "m"], ["sum"])]
        scores = "sum"
    nodes.append(helper.make_node("Softmax", [scores], ["p"], axis=-1))
    probabilities = "p"
    if guard and mask is not None:
        nodes += [helper.make_node("IsNaN", ["p"], ["nan"]), helper.make_node("Where", ["nan", "zero", "p"], ["pg"])]
        probabilities = "pg"
    nodes.append(helper.make_node("MatMul", [probabilities, "vh"], ["o" if not transpose_out else "oh"]))
    if transpose_out:
        nodes += [
            helper.make_node("Transpose", ["oh"], ["ot"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", ["ot", "out_shape"], ["o"]),
        ]
    outputs = [helper.make_tensor_value_info("o", dtype, None)]
    if scores_out:
        outputs.append(helper.make_tensor_value_info("raw", dtype, None))
    model = helper.make_model(
        helper.make_graph(nodes, "attention", inputs, outputs, initializers), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    return model.SerializeToString()


def _feeds(batch, heads, queries, keys, depth, *, mask="padding", kv_heads=None, dtype=np.float32, masked_row=False):
    rng = np.random.default_rng(0)
    kv = (kv_heads or heads) * depth
    feeds = {
        "q": rng.standard_normal((batch, queries, heads * depth)).astype(dtype),
        "k": rng.standard_normal((batch, keys, kv)).astype(dtype),
        "v": rng.standard_normal((batch, keys, kv)).astype(dtype),
    }
    if mask == "padding":
        keep = np.ones((batch, 1, 1, keys), bool)
        keep[-1, ..., keys - 3 :] = False  # the last entry's last keys are padding
        if masked_row:
            keep[0] = False  # every key of the first entry masked: NaN rows, zeroed by the guard
        feeds["keep"] = keep
    elif mask == "causal":
        feeds["keep"] = np.tril(np.ones((queries, keys), bool), keys - queries)[None, None]
    return feeds


def _onnxruntime(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)


def _check(model: bytes, feeds: dict[str, np.ndarray], rtol: float = 1e-5, atol: float = 2e-6) -> list[str]:
    """The plan's step ops; its outputs checked against onnxruntime and level "none"."""
    ops, ours = _step_ops(model, feeds)
    _, plain = _step_ops(model, feeds, optimization="none")
    for actual, unfused, theirs in zip(ours, plain, _onnxruntime(model, feeds)):
        np.testing.assert_array_equal(np.isnan(actual), np.isnan(theirs))
        np.testing.assert_allclose(actual, theirs, rtol=rtol, atol=atol)
        np.testing.assert_allclose(actual, unfused, rtol=rtol, atol=atol)
    return ops


SHAPES = {
    "bert-small": (1, 4, 128, 128, 64),
    "gpt2-prefill": (1, 4, 64, 64, 64),
    "vit-like": (1, 12, 197, 197, 64),
    "batch-of-two": (2, 3, 20, 20, 16),
    "cross-attention": (2, 2, 7, 33, 8),
}


@pytest.fixture(params=["compiled", "numpy"])
def way(request, monkeypatch):
    """Each test twice: the compiled job (skipped without numba) and numpy's way."""
    from plugrt_cpu.kernels import sdpa

    if request.param == "compiled":
        pytest.importorskip("numba")
        if sdpa.compiled_module("_numba_dense") is None or sdpa.compiled_pool() is None:
            pytest.skip("the compiled loops are off here")
    else:
        monkeypatch.setattr(sdpa, "compiled_module", lambda name: None)
    return request.param


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_sdpa_export_runs_as_one_attention_step(way, shape):
    ops = _check(_model(*shape), _feeds(*shape))
    assert "ScaledDotProductAttention" in ops
    assert not {"MatMul", "Softmax", "AddSoftmax", "Mul"} & set(ops)


def test_a_fully_masked_query_gives_zeros_behind_the_guard(way):
    shape = SHAPES["batch-of-two"]
    feeds = _feeds(*shape, masked_row=True)
    ops = _check(_model(*shape), feeds)
    assert "ScaledDotProductAttention" in ops
    (output,) = _step_ops(_model(*shape), feeds)[1]
    assert np.all(output[0] == 0) and np.all(np.isfinite(output))


def test_without_the_guard_a_fully_masked_query_stays_nan(way):
    shape = SHAPES["batch-of-two"]
    feeds = _feeds(*shape, masked_row=True)
    model = _model(*shape, guard=False)
    assert "ScaledDotProductAttention" in _check(model, feeds)
    (output,) = _step_ops(model, feeds)[1]
    assert np.isnan(output[0]).all() and not np.isnan(output[1]).any()


@pytest.mark.parametrize("scaling", ["scores", "none"])
def test_a_scale_of_the_scores_or_none_is_taken(way, scaling):
    shape = SHAPES["gpt2-prefill"]
    assert "ScaledDotProductAttention" in _check(_model(*shape, mask="causal", scaling=scaling), _feeds(*shape, mask="causal"))


def test_vit_attention_without_a_mask_runs_as_one_step(way):
    shape = SHAPES["vit-like"]
    ops = _check(_model(*shape, mask=None), _feeds(*shape, mask=None))
    assert ops.count("ScaledDotProductAttention") == 1 and "Softmax" not in ops


def test_the_heads_are_left_in_place_without_a_transpose_after(way):
    shape = SHAPES["batch-of-two"]
    ops = _check(_model(*shape, transpose_out=False), _feeds(*shape))
    assert "ScaledDotProductAttention" in ops and "Transpose" not in ops[ops.index("ScaledDotProductAttention") :]


def test_heads_shared_by_several_query_heads_are_broadcast(way):
    shape = (2, 4, 9, 9, 8)  # four query heads over one key/value head
    ops = _check(_model(*shape, kv_heads=1, mask="causal"), _feeds(*shape, kv_heads=1, mask="causal"))
    assert "ScaledDotProductAttention" in ops


def test_float64_keeps_its_precision(way):
    shape = SHAPES["batch-of-two"]
    model, feeds = _model(*shape, dtype=TensorProto.DOUBLE), _feeds(*shape, dtype=np.float64)
    ops = _check(model, feeds, rtol=1e-12, atol=1e-12)
    assert "ScaledDotProductAttention" in ops
    assert _step_ops(model, feeds)[1][0].dtype == np.float64


def test_scores_read_elsewhere_keep_the_steps():
    shape = SHAPES["batch-of-two"]
    ops = _check(_model(*shape, scaling="none", scores_out=True), _feeds(*shape))
    assert "ScaledDotProductAttention" not in ops and "MatMul" in ops


@pytest.mark.parametrize("shape", [SHAPES["gpt2-prefill"], SHAPES["batch-of-two"]], ids=["gpt2-prefill", "batch-of-two"])
def test_attention_is_captured_and_replays_without_allocating(shape):
    model, feeds = _model(*shape, mask="causal"), _feeds(*shape, mask="causal")
    ops, _ = _step_ops(model, feeds)
    _assert_replays_without_allocating(model, feeds, ops)
    assert "ScaledDotProductAttention" in ops


def test_float64_whose_scale_float32_cannot_hold_keeps_its_steps():
    shape = (2, 3, 20, 20, 12)  # 1 / sqrt(12): not a float32
    model, feeds = _model(*shape, dtype=TensorProto.DOUBLE, scaling="scores"), _feeds(*shape, dtype=np.float64)
    ops = _check(model, feeds, rtol=1e-12, atol=1e-12)
    assert "ScaledDotProductAttention" not in ops and "Div" in ops


def test_operands_that_do_not_chain_are_a_clear_error():
    from plugrt_cpu.kernels import sdpa

    q, kt, v = np.zeros((1, 2, 4, 8), np.float32), np.zeros((1, 2, 6, 5), np.float32), np.zeros((1, 2, 5, 8), np.float32)
    with pytest.raises(ValueError, match="do not chain"):
        sdpa.attend(q, kt, v, None, 1.0, False, (0, 1, 2, 3))
    kt = np.zeros((1, 2, 8, 5), np.float32)
    with pytest.raises(ValueError, match="does not broadcast"):
        sdpa.attend(q, kt, v, np.zeros((1, 1, 3, 5), np.float32), 1.0, False, (0, 1, 2, 3))
