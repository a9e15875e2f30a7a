"""Softmax(scores + mask) over the last axis, with the NaN guard exporters put after it
(``Where(IsNaN(p), 0, p)``), as one AddSoftmax step: onnxruntime's values on the same
graph (rows every key of which is masked included), each of the kernel's ways (one
compiled pass a row, on one thread or two; the three passes for narrow rows; numpy
without the compiled loops), capture/replay without allocating, and no fusion where the
graph differs."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from cpu.test_fusions import _assert_replays_without_allocating, _step_ops


def _model(
    scores: tuple[int, ...], mask: tuple[int, ...], *, guard: bool = True, boolean: bool = True, dtype: int = TensorProto.FLOAT,
    axis: int = -1, mask_first: bool = False, extra_output: str = "",
) -> bytes:
    """y = Softmax(s + m) (then the guard), m = Where(keep, 0, -inf) from a boolean input
    (``boolean``) or a float input itself."""
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    nodes = []
    inputs = [helper.make_tensor_value_info("s", dtype, list(scores))]
    initializers = [numpy_helper.from_array(np.array(0, np_type), "zero")]
    if boolean:
        inputs.append(helper.make_tensor_value_info("keep", TensorProto.BOOL, list(mask)))
        initializers.append(numpy_helper.from_array(np.array(-np.inf, np_type), "minus_inf"))
        nodes.append(helper.make_node("Where", ["keep", "zero", "minus_inf"], ["m"]))
    else:
        inputs.append(helper.make_tensor_value_info("m", dtype, list(mask)))
    nodes.append(helper.make_node("Add", ["m", "s"] if mask_first else ["s", "m"], ["sum"]))
    nodes.append(helper.make_node("Softmax", ["sum"], ["p" if guard else "y"], axis=axis))
    if guard:
        nodes += [helper.make_node("IsNaN", ["p"], ["nan"]), helper.make_node("Where", ["nan", "zero", "p"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", dtype, None)]
    if extra_output:
        outputs.append(helper.make_tensor_value_info(extra_output, dtype, None))
    graph = helper.make_graph(nodes, "masked_softmax", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _feeds(scores, mask, *, boolean=True, dtype=np.float32, masked_row=True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {"s": (rng.standard_normal(scores) * 3).astype(dtype)}
    if boolean:
        keep = rng.random(mask) > 0.3
        if masked_row and len(mask) >= 2 and mask[-2] > 1:
            keep[..., 1, :] = False  # a query every key of which is masked: NaN, zeroed by the guard
        feeds["keep"] = keep
    else:
        feeds["m"] = rng.standard_normal(mask).astype(dtype)
    return feeds


def _onnxruntime(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)


SHAPES = {
    "gpt2-causal-narrow": ((1, 4, 64, 64), (1, 1, 64, 64)),  # the three passes on one thread
    "bert-padding-wide": ((1, 4, 128, 128), (1, 1, 1, 128)),  # one pass a row, one thread
    "two-threads": ((2, 12, 48, 96), (2, 1, 48, 96)),  # one pass a row on the pool
    "swin-windows": ((16, 3, 49, 49), (3, 49, 49)),
}


@pytest.mark.parametrize("shapes", list(SHAPES.values()), ids=list(SHAPES))
def test_masked_softmax_runs_as_one_step_and_matches_onnxruntime(shapes):
    model, feeds = _model(*shapes), _feeds(*shapes)
    ops, (actual,) = _step_ops(model, feeds)
    assert ops == ["Where", "AddSoftmax"]
    (expected,) = _onnxruntime(model, feeds)
    assert np.isnan(expected).sum() == 0 and (expected == 0).any()
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shapes", list(SHAPES.values()), ids=list(SHAPES))
def test_without_the_guard_a_fully_masked_row_stays_nan(shapes):
    model, feeds = _model(*shapes, guard=False), _feeds(*shapes)
    ops, (actual,) = _step_ops(model, feeds)
    assert ops == ["Where", "AddSoftmax"]
    (expected,) = _onnxruntime(model, feeds)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("variant", [dict(mask_first=True), dict(boolean=False)], ids=["mask-first", "float-mask-input"])
def test_the_variants_are_recognised(variant):
    shapes = SHAPES["bert-padding-wide"]
    model = _model(*shapes, **variant)
    feeds = _feeds(*shapes, boolean=variant.get("boolean", True))
    ops, (actual,) = _step_ops(model, feeds)
    assert "AddSoftmax" in ops and "Softmax" not in ops
    np.testing.assert_allclose(actual, _onnxruntime(model, feeds)[0], rtol=1e-5, atol=1e-7)


def test_float64_keeps_its_precision():
    shapes = SHAPES["gpt2-causal-narrow"]
    model, feeds = _model(*shapes, dtype=TensorProto.DOUBLE), _feeds(*shapes, dtype=np.float64)
    ops, (actual,) = _step_ops(model, feeds)
    assert ops == ["Where", "AddSoftmax"] and actual.dtype == np.float64
    np.testing.assert_allclose(actual, _onnxruntime(model, feeds)[0], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("shapes", [SHAPES["gpt2-causal-narrow"], SHAPES["two-threads"]], ids=["narrow", "pool"])
def test_add_softmax_is_captured_and_replays_without_allocating(shapes):
    _assert_replays_without_allocating(_model(*shapes), _feeds(*shapes), ["Where", "AddSoftmax"])


def test_without_the_compiled_loops_numpy_gives_the_same_values(monkeypatch):
    from plugrt_cpu.kernels import softmax

    shapes = SHAPES["two-threads"]
    feeds = _feeds(*shapes)
    mask = np.where(feeds["keep"], np.float32(0), np.float32(-np.inf))
    compiled = softmax.add_softmax(feeds["s"], mask, True)
    monkeypatch.setattr(softmax, "compiled_loops", lambda: None)
    plain = softmax.add_softmax(feeds["s"], mask, True)
    (expected,) = _onnxruntime(_model(*shapes), feeds)
    np.testing.assert_allclose(plain, expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(compiled, plain, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "variant", [dict(axis=2), dict(extra_output="sum"), dict(extra_output="p")], ids=["not-the-last-axis", "sum-read-elsewhere", "probabilities-read-elsewhere"]
)
def test_other_graphs_keep_the_pattern_apart_or_the_guard(variant):
    """A softmax over another axis, or a sum another reader sees, is not fused; a softmax
    whose probabilities are read elsewhere too is fused without its guard."""
    shapes = SHAPES["gpt2-causal-narrow"]
    model, feeds = _model(*shapes, **variant), _feeds(*shapes)
    ops, outputs = _step_ops(model, feeds)
    if variant.get("extra_output") == "p":
        assert "AddSoftmax" in ops and "IsNaN" in ops
    else:
        assert "AddSoftmax" not in ops
    for actual, expected in zip(outputs, _onnxruntime(model, feeds)):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-7)
