"""The kernel math written over ``xp``, bound to numpy, against onnx.reference."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from plugrt_cuda import _xp

RNG = np.random.default_rng(7)


def _reference(op_type: str, inputs: list, opset: int = 19, **attributes):
    """The single output of ``op_type`` on ``inputs`` by onnx.reference (an empty name skips an input)."""
    names = [f"i{k}" if x is not None else "" for k, x in enumerate(inputs)]
    node = helper.make_node(op_type, names, ["y"], **attributes)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape) for n, x in zip(names, inputs) if n],
        [helper.make_tensor_value_info("y", onnx.TensorProto.UNDEFINED, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    feeds = {n: x for n, x in zip(names, inputs) if n}
    return ReferenceEvaluator(model).run(None, feeds)[0]


def _onnxruntime(op_type: str, x: np.ndarray, opset: int, **attributes):
    """The output of ``op_type`` on one input by onnxruntime (where onnx.reference differs from it)."""
    import onnxruntime

    node = helper.make_node(op_type, ["x"], ["y"], **attributes)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _random(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


CONV_CASES = [
    dict(),
    dict(strides=[2, 2], pads=[1, 1, 1, 1]),
    dict(dilations=[2, 2], pads=[2, 1, 0, 1]),
    dict(auto_pad="SAME_UPPER", strides=[2, 2]),
    dict(auto_pad="SAME_LOWER"),
    dict(auto_pad="VALID", strides=[1, 2]),
]


@pytest.mark.parametrize("attributes", CONV_CASES, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "plain")
def test_conv_matches_the_reference(attributes):
    x, w, b = _random(2, 4, 9, 8), _random(6, 4, 3, 3), _random(6)
    np.testing.assert_allclose(_xp.conv(np, x, w, b, **attributes), _reference("Conv", [x, w, b], **attributes), rtol=1e-4, atol=1e-4)


def test_grouped_conv_matches_the_reference():
    x, w = _random(1, 6, 7, 7), _random(9, 2, 3, 3)
    np.testing.assert_allclose(_xp.conv(np, x, w, group=3, pads=[1, 1, 1, 1]), _reference("Conv", [x, w], group=3, pads=[1, 1, 1, 1]), rtol=1e-4, atol=1e-4)


def test_depthwise_conv_matches_the_reference():
    x, w, b = _random(2, 5, 8, 8), _random(5, 1, 3, 3), _random(5)
    expected = _reference("Conv", [x, w, b], group=5, strides=[2, 2], pads=[1, 1, 1, 1])
    np.testing.assert_allclose(_xp.conv(np, x, w, b, group=5, strides=[2, 2], pads=[1, 1, 1, 1]), expected, rtol=1e-4, atol=1e-4)


def test_conv_1d_matches_the_reference():
    x, w = _random(2, 3, 11), _random(4, 3, 5)
    np.testing.assert_allclose(_xp.conv(np, x, w, strides=[2], pads=[2, 1]), _reference("Conv", [x, w], strides=[2], pads=[2, 1]), rtol=1e-4, atol=1e-4)


def test_conv_in_float16_stays_float16_and_close_to_float32():
    x, w = _random(1, 4, 6, 6), _random(3, 4, 3, 3)
    y = _xp.conv(np, x.astype(np.float16), w.astype(np.float16))
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.astype(np.float32), _reference("Conv", [x, w]), rtol=2e-2, atol=2e-2)


POOL_CASES = [
    dict(kernel_shape=[3, 3], strides=[2, 2]),
    dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
    dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
    dict(kernel_shape=[2, 3], pads=[1, 0, 1, 2], strides=[2, 1], ceil_mode=1),
    dict(kernel_shape=[3, 3], auto_pad="SAME_UPPER", strides=[2, 2]),
]


@pytest.mark.parametrize("attributes", POOL_CASES, ids=str)
def test_maxpool_matches_the_reference(attributes):
    x = _random(2, 3, 9, 10)
    np.testing.assert_array_equal(_xp.pool(np, x, "max", **attributes), _reference("MaxPool", [x], **attributes))


def test_dilated_maxpool_matches_the_reference():
    x = _random(1, 2, 9, 9)
    attributes = dict(kernel_shape=[2, 2], dilations=[2, 2], strides=[1, 1])
    np.testing.assert_array_equal(_xp.pool(np, x, "max", **attributes), _reference("MaxPool", [x], **attributes))


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("attributes", POOL_CASES, ids=str)
def test_average_pool_matches_the_reference(attributes, count_include_pad):
    x = _random(2, 3, 9, 10)
    expected = _reference("AveragePool", [x], count_include_pad=count_include_pad, **attributes)
    y = _xp.pool(np, x, "average", count_include_pad=count_include_pad, **attributes)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


def test_global_average_pool_matches_the_reference():
    x = _random(2, 3, 5, 4)
    np.testing.assert_allclose(_xp.global_pool(np, x, "average"), _reference("GlobalAveragePool", [x]), rtol=1e-5, atol=1e-6)


def test_batch_normalization_matches_the_reference():
    x, s, b, m = _random(2, 3, 4, 4), _random(3), _random(3), _random(3)
    v = np.abs(_random(3)) + 0.1
    expected = _reference("BatchNormalization", [x, s, b, m, v], epsilon=1e-3)
    np.testing.assert_allclose(_xp.batch_normalization(np, x, s, b, m, v, epsilon=1e-3), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [3, 5])
def test_lrn_matches_onnxruntime(size):
    x = _random(2, 7, 3, 3)
    expected = _onnxruntime("LRN", x, 13, size=size, alpha=1e-2, beta=0.75, bias=2.0)
    np.testing.assert_allclose(_xp.lrn(np, x, size=size, alpha=1e-2, beta=0.75, bias=2.0), expected, rtol=1e-5, atol=1e-6)


def test_lrn_with_an_even_size_follows_the_spec_window():
    x = _random(1, 6, 2, 2)
    size, c = 4, x.shape[1]
    # the spec: channels max(0, c - floor((size-1)/2)) .. min(C-1, c + ceil((size-1)/2))
    square_sum = np.stack(
        [(x[:, max(0, k - 1) : min(c - 1, k + 2) + 1] ** 2).sum(axis=1) for k in range(c)], axis=1
    )
    expected = x / (2.0 + 1e-2 / size * square_sum) ** 0.75
    np.testing.assert_allclose(_xp.lrn(np, x, size=size, alpha=1e-2, beta=0.75, bias=2.0), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax_matches_the_reference(axis):
    x = _random(2, 3, 5)
    np.testing.assert_allclose(_xp.softmax(np, x, axis=axis), _reference("Softmax", [x], axis=axis), rtol=1e-5, atol=1e-7)


def test_softmax_before_opset_13_flattens_from_the_axis():
    x = _random(2, 3, 4)
    expected = _onnxruntime("Softmax", x, 11, axis=1)
    np.testing.assert_allclose(_xp.softmax(np, x, axis=1, coerce_2d=True), expected, rtol=1e-5, atol=1e-7)


def test_log_softmax_matches_the_reference():
    x = _random(3, 6)
    np.testing.assert_allclose(_xp.log_softmax(np, x, axis=-1), _reference("LogSoftmax", [x], axis=-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis", [-1, 1])
def test_layer_normalization_matches_the_reference(axis):
    x = _random(2, 3, 8)
    scale, bias = _random(*x.shape[axis:]), _random(*x.shape[axis:])
    y, mean, inv_std = _xp.layer_normalization(np, x, scale, bias, axis=axis, epsilon=1e-5)
    np.testing.assert_allclose(y, _reference("LayerNormalization", [x, scale, bias], axis=axis, epsilon=1e-5), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mean.reshape(-1), x.reshape(x.shape[0] if axis == 1 else 6, -1).mean(axis=1), rtol=1e-5, atol=1e-6)


def test_erf_is_within_2e_7_of_math_erf():
    x = np.linspace(-6, 6, 20001)
    expected = np.array([math.erf(v) for v in x])
    assert np.max(np.abs(_xp.erf(np, x) - expected)) < 2e-7


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_matches_the_reference(approximate):
    x = _random(4, 16) * 3
    expected = _reference("Gelu", [x], opset=20, approximate=approximate)
    np.testing.assert_allclose(_xp.gelu(np, x, approximate=approximate), expected, rtol=1e-5, atol=1e-6)


RESIZE_CASES = [
    dict(mode="nearest"),
    dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
    dict(mode="nearest", coordinate_transformation_mode="align_corners", nearest_mode="round_prefer_ceil"),
    dict(mode="linear"),
    dict(mode="linear", coordinate_transformation_mode="align_corners"),
    dict(mode="linear", coordinate_transformation_mode="asymmetric"),
    dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
]


@pytest.mark.parametrize("scale", [2.0, 0.5, 1.5])
@pytest.mark.parametrize("attributes", RESIZE_CASES, ids=str)
def test_resize_matches_the_reference(attributes, scale):
    x = _random(1, 2, 4, 6)
    scales = np.array([1, 1, scale, scale], np.float32)
    expected = _reference("Resize", [x, None, scales], **attributes)
    sizes = [int(math.floor(d * s)) for d, s in zip(x.shape, scales)]
    y = _xp.resize(np, x, sizes, [float(s) for s in scales], **attributes)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transA,transB", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm_matches_the_reference(transA, transB):
    a = _random(5, 4) if not transA else _random(4, 5)
    b = _random(4, 3) if not transB else _random(3, 4)
    c = _random(3)
    expected = _reference("Gemm", [a, b, c], alpha=0.5, beta=2.0, transA=transA, transB=transB)
    y = _xp.gemm(np, a, b, c, alpha=0.5, beta=2.0, transA=transA, transB=transB)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
