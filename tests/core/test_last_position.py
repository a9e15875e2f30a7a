"""The ``outputs.last_position`` option: an output read only at its last position is
computed there alone, with the values onnxruntime gives that position of the full output;
outputs made otherwise are left as they are."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import plugrt
from plugrt.errors import InvalidOptionValueError

B, S, K, V = 2, 5, 16, 24


def _model(body: str, **constants: np.ndarray) -> bytes:
    """``body`` over the input x (and y, the logits' shape, where it reads one)."""
    inputs = f"float[B, S, {K}] x" + (f", float[B, S, {V}] y" if " y)" in body else "")
    model = onnx.parser.parse_model(
        f'<ir_version: 8, opset_import: ["" : 17]> g ({inputs}) => (float[B, S, {V}] logits) {{ {body} }}'
    )
    model.graph.initializer.extend(numpy_helper.from_array(np.asarray(a), name) for name, a in constants.items())
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _x() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((B, S, K)).astype(np.float32)


def _weight() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((K, V)).astype(np.float32)


def _full(model: bytes, x: np.ndarray) -> np.ndarray:
    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(["logits"], {"x": x})[0]


def test_soft_capped_logits_are_computed_at_the_last_position_only():
    model = _model(
        "h = MatMul(x, w) s = Div(h, cap) t = Tanh(s) logits = Mul(t, cap)",
        w=_weight(), cap=np.array(3.0, np.float32),
    )
    session = plugrt.load(model, **{"outputs.last_position": ["logits"]})
    got = session.run({"x": _x()})["logits"]
    assert got.shape == (B, 1, V)
    np.testing.assert_allclose(got, _full(model, _x())[:, -1:], rtol=1e-5, atol=1e-6)
    assert session.optimization_stats["last_position_outputs"] == 1


def test_a_4bit_lm_head_multiplies_the_last_position_only():
    blocks = K // 16
    rng = np.random.default_rng(2)
    b = rng.integers(0, 256, (V, blocks, 8), dtype=np.uint8)
    scales = (rng.random(V * blocks, dtype=np.float32) * 0.1).astype(np.float32)
    node = helper.make_node(
        "MatMulNBits", ["x", "b", "scales"], ["logits"], domain="com.microsoft", K=K, N=V, bits=4, block_size=16
    )
    graph = helper.make_graph(
        [node], "lm_head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", K])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "S", V])],
        [numpy_helper.from_array(b, "b"), numpy_helper.from_array(scales, "scales")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    proto.ir_version = 10
    model = proto.SerializeToString()
    got = plugrt.load(model, **{"outputs.last_position": "logits"}).run({"x": _x()})["logits"]
    assert got.shape == (B, 1, V)
    np.testing.assert_allclose(got, _full(model, _x())[:, -1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "body",
    [
        "h = MatMul(x, w) logits = Softmax <axis = 1> (h)",  # mixes the positions
        "h = MatMul(x, w) logits = Add(h, h)",  # the product's output read twice
        "h = MatMul(x, w) logits = Add(h, y)",  # each position plus another input's
    ],
)
def test_outputs_not_made_position_by_position_from_a_product_are_left_whole(body):
    model = _model(body, w=_weight())
    feeds = {"x": _x(), "y": np.random.default_rng(3).standard_normal((B, S, V)).astype(np.float32)}
    feeds = {name: feeds[name] for name in ("x", "y") if name in body}
    session = plugrt.load(model, **{"outputs.last_position": ["logits"]})
    got = session.run(feeds)["logits"]
    assert got.shape == (B, S, V)
    expected = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert session.optimization_stats["last_position_outputs"] == 0


def test_a_name_that_is_no_output_is_refused_naming_the_outputs():
    model = _model("logits = MatMul(x, w)", w=_weight())
    with pytest.raises(InvalidOptionValueError, match="logits"):
        plugrt.load(model, **{"outputs.last_position": ["logit"]})
