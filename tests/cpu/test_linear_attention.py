"""ReLU linear attention (EfficientViT's LiteMLA) as one ReluLinearAttention step: the
graph written out as timm's export writes it (Reshape, Transpose, three Slices, Relus,
Casts to the same type, a Pad of ones, two MatMuls, Slices, Add, Div, Transpose,
Reshape), checked against onnxruntime running the same graph unfused and against numpy's
own formula; capture/replay without allocating; no fusion where the graph differs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from cpu.test_fusions import _assert_replays_without_allocating, _step_ops

INT64_MAX = np.iinfo(np.int64).max


def _model(
    n: int = 1, heads: int = 4, d: int = 8, height: int = 5, width: int = 6, *, dtype: int = TensorProto.FLOAT,
    casts: bool = True, eps_first: bool = False, pad_value: float = 1.0, extra_output: str = "",
    v_end: int = INT64_MAX,
) -> bytes:
    """The pattern for x (n, heads * 3d, height, width) -> y (n, heads * d, height, width)."""
    size = height * width
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    const = {
        "shape_in": np.array([n, -1, 3 * d, size], np.int64),
        "shape_out": np.array([n, heads * d, height, width], np.int64),
        "axes": np.array([-1], np.int64), "zero": np.array([0], np.int64), "d": np.array([d], np.int64),
        "d2": np.array([2 * d], np.int64), "v_end": np.array([v_end], np.int64),
        "minus_one": np.array([-1], np.int64), "big": np.array([INT64_MAX], np.int64),
        "pads": np.array([0, 0, 0, 0, 0, 0, 0, 1], np.int64),
        "one": np.array(pad_value, np_type), "eps": np.array(1e-15, np_type),
    }

    def cast(name: str) -> list[onnx.NodeProto]:
        return [helper.make_node("Cast", [name], [name + "_c"], to=dtype)] if casts else []

    c = "_c" if casts else ""
    nodes = [
        helper.make_node("Reshape", ["x", "shape_in"], ["grouped"]),
        helper.make_node("Transpose", ["grouped"], ["t"], perm=[0, 1, 3, 2]),
        helper.make_node("Slice", ["t", "zero", "d", "axes"], ["q_s"]),
        helper.make_node("Slice", ["t", "d", "d2", "axes"], ["k_s"]),
        helper.make_node("Slice", ["t", "d2", "v_end", "axes"], ["v_s"]),
        helper.make_node("Relu", ["q_s"], ["q"]),
        helper.make_node("Relu", ["k_s"], ["k"]),
        helper.make_node("Pad", ["v_s", "pads", "one"], ["v"], mode="constant"),
        *cast("q"), *cast("k"), *cast("v"),
        helper.make_node("Transpose", ["k" + c], ["k_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["k_t", "v" + c], ["kv"]),
        helper.make_node("MatMul", ["q" + c, "kv"], ["out"]),
        helper.make_node("Slice", ["out", "zero", "minus_one", "axes"], ["num"]),
        helper.make_node("Slice", ["out", "minus_one", "big", "axes"], ["last"]),
        helper.make_node("Add", ["eps", "last"] if eps_first else ["last", "eps"], ["den"]),
        helper.make_node("Div", ["num", "den"], ["quotient"]),
        *cast("quotient"),
        helper.make_node("Transpose", ["quotient" + c], ["channels_first"], perm=[0, 1, 3, 2]),
        helper.make_node("Reshape", ["channels_first", "shape_out"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", dtype, [n, heads * d, height, width])]
    if extra_output:
        outputs.append(helper.make_tensor_value_info(extra_output, dtype, None))
    graph = helper.make_graph(
        nodes, "lite_mla", [helper.make_tensor_value_info("x", dtype, [n, heads * 3 * d, height, width])], outputs,
        [numpy_helper.from_array(v, k) for k, v in const.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _input(n: int = 1, heads: int = 4, d: int = 8, height: int = 5, width: int = 6, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, heads * 3 * d, height, width)).astype(dtype)


def _numpy(x: np.ndarray, d: int, eps: float = 1e-15) -> np.ndarray:
    """The formula in timm's order (positions first, v padded with ones), in float64."""
    n, c, h, w = x.shape
    t = x.astype(np.float64).reshape(n, c // (3 * d), 3 * d, h * w).transpose(0, 1, 3, 2)
    q, k, v = np.maximum(t[..., :d], 0), np.maximum(t[..., d : 2 * d], 0), t[..., 2 * d :]
    v = np.concatenate([v, np.ones(v.shape[:-1] + (1,))], axis=-1)
    out = q @ (k.transpose(0, 1, 3, 2) @ v)
    y = out[..., :-1] / (out[..., -1:] + eps)
    return y.transpose(0, 1, 3, 2).reshape(n, c // 3, h, w)


def _onnxruntime(model: bytes, x: np.ndarray) -> list[np.ndarray]:
    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.mark.parametrize(
    "shape",
    [dict(), dict(n=2), dict(heads=8, d=16, height=14, width=14), dict(heads=1, d=4, height=1, width=3)],
    ids=["one-image", "two-images", "efficientvit-b0-stage-3", "one-head"],
)
def test_linear_attention_runs_as_one_step_and_matches_onnxruntime(shape):
    model, x = _model(**shape), _input(**shape)
    ops, (actual,) = _step_ops(model, {"x": x})
    assert ops == ["ReluLinearAttention"]
    (expected,) = _onnxruntime(model, x)
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(actual, _numpy(x, shape.get("d", 8)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", [dict(casts=False), dict(eps_first=True), dict(v_end=24)], ids=["no-casts", "eps-first", "v-end-exact"])
def test_the_exporters_variants_are_recognised(variant):
    model, x = _model(**variant), _input()
    ops, (actual,) = _step_ops(model, {"x": x})
    assert ops == ["ReluLinearAttention"]
    np.testing.assert_allclose(actual, _onnxruntime(model, x)[0], rtol=1e-4, atol=1e-5)


def test_float64_keeps_its_precision():
    model, x = _model(dtype=TensorProto.DOUBLE), _input(dtype=np.float64)
    ops, (actual,) = _step_ops(model, {"x": x})
    assert ops == ["ReluLinearAttention"] and actual.dtype == np.float64
    np.testing.assert_allclose(actual, _numpy(x, 8), rtol=1e-12, atol=1e-12)


def test_linear_attention_is_captured_and_replays_without_allocating():
    _assert_replays_without_allocating(_model(), {"x": _input()}, ["ReluLinearAttention"])


@pytest.mark.parametrize(
    "variant", [dict(extra_output="k"), dict(extra_output="out"), dict(pad_value=0.0)],
    ids=["relu-read-elsewhere", "product-read-elsewhere", "padded-with-zeros"],
)
def test_other_graphs_keep_the_pattern_apart(variant):
    """An intermediate another reader sees, or a pad that is not ones (the denominators
    would be zero), is not this attention: the nodes run as they are, onnxruntime's values."""
    model, x = _model(**variant), _input()
    ops, outputs = _step_ops(model, {"x": x})
    assert "ReluLinearAttention" not in ops
    for actual, expected in zip(outputs, _onnxruntime(model, x)):
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)


def test_an_input_that_does_not_split_into_heads_is_a_clear_error():
    from plugrt_cpu.fusions_linear_attention import relu_linear_attention

    with pytest.raises(ValueError, match="does not split into heads of 3 x 8 channels"):
        relu_linear_attention(np.zeros((1, 20, 2, 2), np.float32), 8, 1e-15)
