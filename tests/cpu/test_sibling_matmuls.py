"""Products of one input by several constant weights (an attention's q, k and v
projections, a decoder MLP's gate and up) run as one FusedMatMul by the weights side by
side and a Split of its columns: the outputs match onnxruntime and level "none", at
opsets with Split's sizes as an input and as an attribute, a replay allocates nothing,
and a product that is a graph output keeps its own step."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from cpu.test_fusions import _assert_replays_without_allocating, _step_ops


def _model(widths: tuple[int, ...], *, opset: int = 17, graph_output: bool = False, depth: int = 32) -> bytes:
    """x (2, 10, depth) @ w_i + b_i for each width, then each product through a Relu (a
    reader of the view) and the sum of their first columns' means (one output)."""
    rng = np.random.default_rng(0)
    nodes, initializers, outputs = [], [], []
    for i, width in enumerate(widths):
        initializers += [
            numpy_helper.from_array((rng.standard_normal((depth, width)) * 0.2).astype(np.float32), f"w{i}"),
            numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), f"b{i}"),
        ]
        nodes += [
            helper.make_node("MatMul", ["x", f"w{i}"], [f"m{i}"]),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"p{i}"]),
            helper.make_node("Relu", [f"p{i}"], [f"y{i}"]),
        ]
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    if graph_output:
        outputs.append(helper.make_tensor_value_info("p0", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "siblings", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 10, depth])], outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model.SerializeToString()


def _feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((2, 10, 32)).astype(np.float32)}


def _check(model: bytes) -> list[str]:
    feeds = _feeds()
    ops, ours = _step_ops(model, feeds)
    _, plain = _step_ops(model, feeds, optimization="none")
    theirs = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    for actual, unfused, ort in zip(ours, plain, theirs):
        np.testing.assert_allclose(actual, ort, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(actual, unfused, rtol=1e-5, atol=1e-5)
    return ops


@pytest.mark.parametrize("opset", [12, 17])
def test_three_projections_of_one_input_run_as_one_product(opset):
    ops = _check(_model((24, 40, 8), opset=opset))
    assert ops.count("FusedMatMul") == 1 and ops.count("Split") == 1 and ops.count("Relu") == 3


def test_a_product_that_is_a_graph_output_keeps_its_step():
    ops = _check(_model((24, 40, 8), graph_output=True))
    assert ops.count("FusedMatMul") == 2 and ops.count("Split") == 1


def test_one_product_is_left_alone():
    ops = _check(_model((24,)))
    assert ops.count("FusedMatMul") == 1 and "Split" not in ops


def test_merged_products_replay_without_allocating():
    model = _model((24, 40, 8))
    ops, _ = _step_ops(model, _feeds())
    _assert_replays_without_allocating(model, _feeds(), ops)


def test_siblings_past_the_weight_limit_stay_apart(monkeypatch):
    from plugrt_cpu import fusions_transformer

    monkeypatch.setattr(fusions_transformer, "_MERGED_WEIGHT_LIMIT", 32 * 60)  # under 32 x (24 + 40 + 8)
    ops = _check(_model((24, 40, 8)))
    assert ops.count("FusedMatMul") == 3 and "Split" not in ops
