"""Cast and quantisation kernels, checked against onnx.reference and independently written numpy."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from helpers import node_case, run_model

RNG = np.random.default_rng(0)


def _assert_same(got: np.ndarray, expected: np.ndarray) -> None:
    """Bit-for-bit equality (NaN matching NaN) and the same dtype."""
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    if expected.dtype == object:
        assert got.tolist() == expected.tolist()
        return
    a, b = got.astype(np.float64), expected.astype(np.float64)
    assert np.all((a == b) | (np.isnan(a) & np.isnan(b)))


def _assert_matches_reference(model, feeds, exact=True):
    expected = ReferenceEvaluator(model).run(None, feeds)
    got = run_model(model, feeds)
    for g, e in zip(got, expected):
        if exact:
            _assert_same(g, e)
        else:
            assert np.asarray(g).dtype == np.asarray(e).dtype
            np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- Cast

_EDGE_VALUES = np.array(
    [0.0, -0.0, 0.3, -1.7, 2.5, 3.5, -2.5, 7.9, 100.4, -300.2, 1e5, 70000, np.nan, np.inf, -np.inf, 1e-7, 448, 500, 60000],
    dtype=np.float32,
)
_CAST_TARGETS = [
    TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE, TensorProto.INT8, TensorProto.UINT8,
    TensorProto.INT32, TensorProto.INT64, TensorProto.BOOL, TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ,
    TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ, TensorProto.INT4, TensorProto.UINT4, TensorProto.FLOAT4E2M1,
    TensorProto.INT2, TensorProto.UINT2,
]


@pytest.mark.parametrize("to", _CAST_TARGETS, ids=helper.tensor_dtype_to_string)
@pytest.mark.parametrize("saturate", [0, 1])
def test_cast_from_float_matches_reference_on_edge_values(to, saturate):
    model, feeds = node_case("Cast", [_EDGE_VALUES], 25, ir_version=10, attributes={"to": to, "saturate": saturate})
    with np.errstate(all="ignore"):
        _assert_matches_reference(model, feeds)


@pytest.mark.parametrize("source", [ml_dtypes.float8_e4m3fn, ml_dtypes.int4, ml_dtypes.bfloat16, np.float16])
def test_cast_to_float_is_exact_from_small_types(source):
    with np.errstate(all="ignore"):
        x = _EDGE_VALUES.astype(source)
    model, feeds = node_case("Cast", [x], 25, ir_version=10, attributes={"to": TensorProto.FLOAT})
    (got,) = run_model(model, feeds)
    _assert_same(got, x.astype(np.float32))


@pytest.mark.parametrize("round_mode", ["up", "down", "nearest"])
@pytest.mark.parametrize("saturate", [0, 1])
def test_cast_to_float8e8m0_rounds_as_requested(round_mode, saturate):
    x = np.array([0.0, 0.124, 0.25, 0.3, 0.75, 1.1, 2.0, 3.0, 1e38, 3.4e38, np.inf, np.nan, -5.0], dtype=np.float32)
    model, feeds = node_case("Cast", [x], 25, ir_version=10, attributes={"to": TensorProto.FLOAT8E8M0, "saturate": saturate, "round_mode": round_mode})
    _assert_matches_reference(model, feeds)


def test_cast_parses_strings_in_plain_scientific_and_special_forms():
    x = np.array(["1.5", "-2", "+INF", "inf", "-INF", "NaN", "nan", "1e-5", "1E8"], dtype=object)
    model, feeds = node_case("Cast", [x], 21, ir_version=10, attributes={"to": TensorProto.FLOAT})
    (got,) = run_model(model, feeds)
    expected = np.array([1.5, -2, np.inf, np.inf, -np.inf, np.nan, np.nan, 1e-5, 1e8], dtype=np.float32)
    _assert_same(got, expected)


def test_cast_string_to_integer_truncates_a_decimal():
    x = np.array(["100", "-7", "100.5"], dtype=object)
    model, feeds = node_case("Cast", [x], 21, ir_version=10, attributes={"to": TensorProto.INT64})
    (got,) = run_model(model, feeds)
    _assert_same(got, np.array([100, -7, 100], dtype=np.int64))


def test_cast_number_to_string_uses_numpy_formatting():
    x = np.array([1.5, -0.25, 3.0, np.inf], dtype=np.float32)
    model, feeds = node_case("Cast", [x], 21, ir_version=10, attributes={"to": TensorProto.STRING})
    (got,) = run_model(model, feeds)
    _assert_same(got, np.array(["1.5", "-0.25", "3.0", "inf"], dtype=object))


def test_cast_like_takes_the_type_of_its_second_input():
    x = np.array([1.7, -2.5, 300.0], dtype=np.float32)
    like = np.zeros(0, dtype=np.int8)
    model, feeds = node_case("CastLike", [x, like], 21, ir_version=10)
    (got,) = run_model(model, feeds)
    _assert_same(got, x.astype(np.int8))


def test_bitcast_reinterprets_bits():
    x = np.array([1.0, -2.5], dtype=np.float32)
    model, feeds = node_case("BitCast", [x], 26, ir_version=10, attributes={"to": TensorProto.UINT32})
    (got,) = run_model(model, feeds)
    _assert_same(got, np.array([0x3F800000, 0xC0200000], dtype=np.uint32))


def test_bitcast_between_types_of_different_width_is_refused():
    x = np.array([1.0], dtype=np.float32)
    model, feeds = node_case("BitCast", [x], 26, ir_version=10, attributes={"to": TensorProto.INT16})
    with pytest.raises(Exception, match="same width|bit"):
        run_model(model, feeds)


# ----------------------------------------------------------------------------- QuantizeLinear / DequantizeLinear

_X = (RNG.standard_normal((2, 6, 5, 4)) * 3).astype(np.float32)


@pytest.mark.parametrize("opset", [13, 19, 21, 25])
@pytest.mark.parametrize("axis", [1, -1, 0])
def test_per_axis_quantize_dequantize_round_trip_matches_reference(opset, axis):
    n = _X.shape[axis]
    scale = (RNG.random(n) * 0.1 + 0.01).astype(np.float32)
    zero_point = RNG.integers(0, 20, n).astype(np.uint8)
    model, feeds = node_case("QuantizeLinear", [_X, scale, zero_point], opset, ir_version=10, attributes={"axis": axis})
    _assert_matches_reference(model, feeds)
    (quantized,) = run_model(model, feeds)
    model, feeds = node_case("DequantizeLinear", [quantized, scale, zero_point], max(opset, 19), ir_version=10, attributes={"axis": axis})
    _assert_matches_reference(model, feeds)


@pytest.mark.parametrize("zero_point_type", [np.int8, np.uint16, ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.int2])
@pytest.mark.parametrize(("axis", "block_size"), [(1, 2), (1, 4), (3, 3), (-1, 4)])
def test_blocked_quantization_matches_reference(zero_point_type, axis, block_size):
    shape = list(_X.shape)
    shape[axis] = -(-shape[axis] // block_size)
    scale = (RNG.random(shape) * 0.5 + 0.1).astype(np.float32)
    zero_point = RNG.integers(0, 2, shape).astype(zero_point_type)
    attrs = {"axis": axis, "block_size": block_size}
    model, feeds = node_case("QuantizeLinear", [_X, scale, zero_point], 25, ir_version=10, attributes=attrs)
    _assert_matches_reference(model, feeds)
    (quantized,) = run_model(model, feeds)
    model, feeds = node_case("DequantizeLinear", [quantized, scale, zero_point], 25, ir_version=10, attributes=attrs)
    _assert_matches_reference(model, feeds)


def test_quantize_saturates_to_the_integer_range():
    x = np.array([-1000.0, -1.0, 0.4, 0.6, 2.5, 3.5, 1000.0], dtype=np.float32)
    model, feeds = node_case("QuantizeLinear", [x, np.array(1.0, np.float32), np.array(10, np.uint8)], 10, ir_version=10)
    (got,) = run_model(model, feeds)
    # round half to even, then add the zero point, then saturate
    _assert_same(got, np.array([0, 9, 10, 11, 12, 14, 255], dtype=np.uint8))


@pytest.mark.parametrize("float8", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fnuz])
@pytest.mark.parametrize("saturate", [0, 1])
def test_quantize_to_float8_matches_reference(float8, saturate):
    inputs = [_X * 100, np.array(0.5, np.float32), np.array(0, float8)]
    model, feeds = node_case("QuantizeLinear", inputs, 21, ir_version=10, attributes={"saturate": saturate})
    with np.errstate(all="ignore"):
        _assert_matches_reference(model, feeds)


def test_quantize_with_output_dtype_and_no_zero_point():
    model, feeds = node_case("QuantizeLinear", [_X, np.array(0.5, np.float32)], 21, ir_version=10, attributes={"output_dtype": TensorProto.INT4})
    (got,) = run_model(model, feeds)
    assert got.dtype == ml_dtypes.int4
    _assert_same(got, np.clip(np.rint(_X / np.float32(0.5)), -8, 7).astype(ml_dtypes.int4))


def test_quantize_precision_attribute_computes_in_the_requested_type():
    x = _X.astype(np.float16)
    inputs = [x, np.array(0.05, np.float32), np.array(3, np.uint8)]
    model, feeds = node_case("QuantizeLinear", inputs, 23, ir_version=10, attributes={"precision": TensorProto.FLOAT})
    _assert_matches_reference(model, feeds)


@pytest.mark.parametrize("scale_type", [np.float16, ml_dtypes.bfloat16])
def test_dequantize_output_takes_the_scale_type(scale_type):
    x = np.arange(-5, 5, dtype=np.int8)
    model, feeds = node_case("DequantizeLinear", [x, np.array(0.25, scale_type), np.array(3, np.int8)], 21, ir_version=10)
    (got,) = run_model(model, feeds)
    assert got.dtype == np.dtype(scale_type)
    np.testing.assert_array_equal(got.astype(np.float32), (x.astype(np.float32) - 3) * 0.25)


def test_dequantize_output_dtype_overrides_the_scale_type():
    x = np.arange(-5, 5, dtype=np.int8)
    model, feeds = node_case("DequantizeLinear", [x, np.array(0.25, np.float32)], 23, ir_version=10, attributes={"output_dtype": TensorProto.FLOAT16})
    (got,) = run_model(model, feeds)
    _assert_same(got, (x.astype(np.float32) * 0.25).astype(np.float16))


def test_dequantize_int32_is_exact_beyond_float32_integers():
    x = np.array([2**24 + 1, -(2**24) - 3], dtype=np.int32)
    model, feeds = node_case("DequantizeLinear", [x, np.array(1.0, np.float32)], 21, ir_version=10)
    (got,) = run_model(model, feeds)
    _assert_same(got, x.astype(np.float64).astype(np.float32))


@pytest.mark.parametrize("x", [_X, np.abs(_X), -np.abs(_X), np.zeros(3, np.float32)], ids=["mixed", "positive", "negative", "zeros"])
def test_dynamic_quantize_linear_matches_reference(x):
    model, feeds = node_case("DynamicQuantizeLinear", [x], 11, outputs=3, ir_version=10)
    _assert_matches_reference(model, feeds)


# ----------------------------------------------------------------------------- integer matmul / conv


def _random_integers(dtype, shape):
    info = np.iinfo(dtype)
    return RNG.integers(info.min, info.max, shape, endpoint=True).astype(dtype)


@pytest.mark.parametrize("opset", [10, 21])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize(("a_shape", "b_shape"), [((5, 300), (300, 7)), ((2, 3, 4, 5), (2, 1, 5, 3))])
def test_qlinear_matmul_matches_reference(opset, dtype, a_shape, b_shape):
    # K = 300 accumulates past float32's exact integers: the kernel must switch to float64
    a, b = _random_integers(dtype, a_shape), _random_integers(dtype, b_shape)
    inputs = [
        a, np.array([0.01], np.float32), np.array([3], dtype), b, np.array([0.02], np.float32),
        np.array([5], dtype), np.array([0.5], np.float32), np.array([10], dtype),
    ]
    model, feeds = node_case("QLinearMatMul", inputs, opset, ir_version=10)
    _assert_matches_reference(model, feeds)


_CONV_CASES = [
    ((1, 2, 7, 7), (4, 2, 3, 3), {}),
    ((2, 4, 8, 6), (6, 2, 3, 2), {"group": 2, "pads": [1, 0, 2, 1], "strides": [2, 1]}),
    ((1, 3, 9, 9), (2, 3, 3, 3), {"dilations": [2, 2], "pads": [2, 2, 2, 2]}),
    ((1, 3, 9, 8), (2, 3, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((1, 3, 9, 8), (2, 3, 2, 2), {"auto_pad": "SAME_LOWER", "strides": [2, 3]}),
    ((1, 3, 9, 8), (2, 3, 2, 2), {"auto_pad": "VALID", "strides": [2, 3]}),
]
_CONV_CASES_ND = [
    ((2, 4, 10), (4, 1, 3), {"group": 4, "pads": [1, 1]}),
    ((1, 2, 5, 4, 4), (3, 2, 2, 2, 2), {"strides": [1, 2, 1], "pads": [1, 0, 0, 0, 1, 1]}),
]


@pytest.mark.parametrize(("x_shape", "w_shape", "attrs"), _CONV_CASES + _CONV_CASES_ND)
def test_conv_integer_matches_reference(x_shape, w_shape, attrs):
    x, w = _random_integers(np.uint8, x_shape), _random_integers(np.int8, w_shape)
    inputs = [x, w, np.array(131, np.uint8), np.array(-3, np.int8)]
    model, feeds = node_case("ConvInteger", inputs, 10, ir_version=10, attributes=attrs)
    _assert_matches_reference(model, feeds)


@pytest.mark.parametrize(("x_shape", "w_shape", "attrs"), _CONV_CASES)
@pytest.mark.parametrize("per_channel", [False, True])
def test_qlinear_conv_matches_reference(x_shape, w_shape, attrs, per_channel):
    x, w = _random_integers(np.uint8, x_shape), _random_integers(np.int8, w_shape)
    channels = w_shape[0]
    w_scale = (RNG.random(channels) * 0.05 + 0.01).astype(np.float32) if per_channel else np.array(0.03, np.float32)
    w_zero_point = np.zeros(channels, np.int8) if per_channel else np.array(0, np.int8)
    bias = RNG.integers(-5000, 5000, channels).astype(np.int32)
    inputs = [
        x, np.array(0.02, np.float32), np.array(120, np.uint8), w, w_scale, w_zero_point,
        np.array(3.1, np.float32), np.array(7, np.uint8), bias,
    ]
    model, feeds = node_case("QLinearConv", inputs, 10, ir_version=10, attributes=attrs)
    _assert_matches_reference(model, feeds)


@pytest.mark.parametrize(("x_shape", "w_shape", "attrs"), _CONV_CASES_ND)
def test_qlinear_conv_in_1d_and_3d_requantizes_conv_integer(x_shape, w_shape, attrs):
    # onnx.reference's QLinearConv assumes 2-D; build the expectation from its ConvInteger
    x, w = _random_integers(np.uint8, x_shape), _random_integers(np.int8, w_shape)
    x_zero, y_zero = np.array(120, np.uint8), np.array(7, np.uint8)
    x_scale, w_scale, y_scale = np.float32(0.02), np.float32(0.03), np.float32(3.1)
    conv_model, conv_feeds = node_case("ConvInteger", [x, w, x_zero], 10, ir_version=10, attributes=attrs)
    (accumulated,) = ReferenceEvaluator(conv_model).run(None, conv_feeds)
    expected = np.round(np.clip(accumulated * np.float64(x_scale * w_scale / y_scale) + 7, 0, 255)).astype(np.uint8)
    inputs = [
        x, np.array(x_scale), x_zero, w, np.array(w_scale), np.array(0, np.int8), np.array(y_scale), y_zero,
    ]
    model, feeds = node_case("QLinearConv", inputs, 10, ir_version=10, attributes=attrs)
    (got,) = run_model(model, feeds)
    _assert_same(got, expected)
