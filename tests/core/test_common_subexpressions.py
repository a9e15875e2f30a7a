"""A subexpression computed twice runs once (as onnxruntime's basic level does): nodes of
the same op, attributes and inputs merge, identical small constants first (exporters
give each layer its own copy of the attention mask's Where and of its constants). The
outputs still match onnxruntime, a graph output that was a duplicate keeps its name,
random ops stay apart, and level "none" keeps every node."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnxruntime
import pytest

import plugrt

# two "layers", each with its own constants 0 and -inf, masking the same scores
_MASKED = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (bool[2, 5] keep, float[2, 5] a, float[2, 5] b) => (float[2, 5] y) {
        zero1 = Constant <value = float {0.0}> ()
        low1 = Constant <value = float {-1e9}> ()
        m1 = Where (keep, zero1, low1)
        s1 = Add (a, m1)
        zero2 = Constant <value = float {0.0}> ()
        low2 = Constant <value = float {-1e9}> ()
        m2 = Where (keep, zero2, low2)
        s2 = Add (b, m2)
        y = Add (s1, s2)
    }
"""


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "keep": rng.random((2, 5)) > 0.3,
        "a": rng.standard_normal((2, 5)).astype(np.float32),
        "b": rng.standard_normal((2, 5)).astype(np.float32),
    }


def _ops(model: bytes, feeds: dict[str, np.ndarray], optimization: str) -> tuple[list[str], dict[str, np.ndarray]]:
    session = plugrt.load(model, device="cpu", optimization=optimization, profiling=True)
    outputs = session.run(feeds)
    return [event["args"]["op_name"] for event in session.profile() if event["cat"] == "Node"], outputs


@pytest.mark.parametrize("optimization", ["basic", "all"])
def test_a_repeated_where_of_equal_constants_runs_once(optimization):
    model = onnx.parser.parse_model(_MASKED).SerializeToString()
    feeds = _feeds()
    ops, outputs = _ops(model, feeds, optimization)
    assert ops.count("Where") == 1
    (expected,) = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(outputs["y"], expected, rtol=1e-6)


def test_level_none_keeps_both():
    model = onnx.parser.parse_model(_MASKED).SerializeToString()
    ops, _ = _ops(model, _feeds(), "none")
    assert ops.count("Where") == 2


def test_a_duplicate_graph_output_keeps_its_name():
    text = """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3] x) => (float[3] first, float[3] second) {
            first = Relu (x)
            second = Relu (x)
        }
    """
    model = onnx.parser.parse_model(text).SerializeToString()
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    outputs = plugrt.load(model, device="cpu").run({"x": x})
    assert list(outputs) == ["first", "second"]
    np.testing.assert_array_equal(outputs["first"], np.maximum(x, 0))
    np.testing.assert_array_equal(outputs["second"], np.maximum(x, 0))


def test_random_ops_are_not_merged():
    text = """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1] x) => (float[64] y) {
            r1 = RandomUniform <shape = [64], dtype = 1> ()
            r2 = RandomUniform <shape = [64], dtype = 1> ()
            y = Sub (r1, r2)
        }
    """
    model = onnx.parser.parse_model(text).SerializeToString()
    session = plugrt.load(model, device="cpu")
    assert np.any(session.run({"x": np.zeros(1, np.float32)})["y"] != 0)


def test_a_node_whose_attribute_cannot_be_compared_leaves_the_model_to_run():
    # Optional's ``type`` attribute (a TypeProto) is not hashable by onnx_ir's pass
    from onnx import TensorProto, helper

    optional = helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [2]))
    nodes = [
        helper.make_node("Optional", [], ["none"], type=optional),
        helper.make_node("OptionalHasElement", ["none"], ["has"]),
        helper.make_node("Relu", ["x"], ["y"]),
        helper.make_node("Relu", ["x"], ["z"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("has", TensorProto.BOOL, []), *(helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in "yz")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    outputs = plugrt.load(model.SerializeToString(), device="cpu").run({"x": np.array([-1.0, 3.0], np.float32)})
    assert not outputs["has"]
    np.testing.assert_array_equal(outputs["y"], [0.0, 3.0])
    np.testing.assert_array_equal(outputs["z"], [0.0, 3.0])
