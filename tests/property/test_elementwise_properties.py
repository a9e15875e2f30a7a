"""Elementwise math, arithmetic, comparison, logic and activation kernels agree with
onnx.reference on random shapes, dtypes, NaN, inf and empty tensors."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from property.oracle import (
    FLOAT_DTYPES,
    INT_DTYPES,
    arrays,
    assert_same_result,
    broadcastable,
    check_node,
    float_elements,
    one_of_dtypes,
    shapes,
)

from helpers import run_node

# op -> (opset, float dtypes, the magnitude inputs are kept under: onnx.reference computes
# some of these the naive way and overflows where the true value is finite)
UNARY_MATH = {
    "Abs": (13, FLOAT_DTYPES, 1e4),
    "Neg": (13, FLOAT_DTYPES, 1e4),
    "Exp": (13, FLOAT_DTYPES, 1e4),
    "Log": (13, FLOAT_DTYPES, 1e4),
    "Sqrt": (13, FLOAT_DTYPES, 1e4),
    "Reciprocal": (13, FLOAT_DTYPES, 1e4),
    "Floor": (13, FLOAT_DTYPES, 1e4),
    "Ceil": (13, FLOAT_DTYPES, 1e4),
    "Round": (11, FLOAT_DTYPES, 1e4),
    "Sign": (13, FLOAT_DTYPES, 1e4),
    "Sin": (7, FLOAT_DTYPES, 100),
    "Cos": (7, FLOAT_DTYPES, 100),
    "Tan": (7, FLOAT_DTYPES, 1.5),
    "Asin": (7, FLOAT_DTYPES, 1.5),
    "Acos": (7, FLOAT_DTYPES, 1.5),
    "Atan": (7, FLOAT_DTYPES, 1e4),
    "Sinh": (9, FLOAT_DTYPES, 80),
    "Cosh": (9, FLOAT_DTYPES, 80),
    "Tanh": (13, FLOAT_DTYPES, 1e4),
    "Asinh": (9, FLOAT_DTYPES, 1e4),
    "Acosh": (9, FLOAT_DTYPES, 1e4),
    "Atanh": (9, FLOAT_DTYPES, 1.5),
    "IsNaN": (20, FLOAT_DTYPES, 1e4),
    "IsInf": (20, FLOAT_DTYPES, 1e4),
    "Erf": (13, (np.float16, np.float32), 10),
}

# op -> (opset, float dtypes its schema allows, attribute strategies); Gelu float64 is
# checked against math.erf below (onnx.reference's erf is float32-accurate)
ACTIVATIONS = {
    "Relu": (14, FLOAT_DTYPES, {}),
    "Sigmoid": (13, FLOAT_DTYPES, {}),
    "Softplus": (22, FLOAT_DTYPES, {}),
    "Softsign": (22, FLOAT_DTYPES, {}),
    "HardSwish": (22, FLOAT_DTYPES, {}),
    "Mish": (22, FLOAT_DTYPES, {}),
    "Elu": (22, FLOAT_DTYPES, {"alpha": st.floats(0.1, 2)}),
    "Selu": (22, FLOAT_DTYPES, {"alpha": st.floats(0.5, 2), "gamma": st.floats(0.5, 2)}),
    "Celu": (12, (np.float32,), {"alpha": st.floats(0.1, 2)}),
    "LeakyRelu": (16, FLOAT_DTYPES, {"alpha": st.floats(0, 1) | st.just(0.0)}),
    "HardSigmoid": (22, FLOAT_DTYPES, {"alpha": st.floats(0.05, 1), "beta": st.floats(0, 1)}),
    "ThresholdedRelu": (22, FLOAT_DTYPES, {"alpha": st.floats(-1, 2)}),
    "Gelu": (20, (np.float16, np.float32), {"approximate": st.sampled_from(["none", "tanh"])}),
}


def _tolerance(op: str, dtype: np.dtype) -> dict:
    # float16 transcendental results may be computed in float32 and rounded once, where
    # the reference computes in float16: a few float16 ulps apart
    return {"rtol": 4e-3, "atol": 4e-3} if dtype == np.float16 else {"rtol": 2e-6 if dtype == np.float32 else 1e-12, "atol": 1e-6 if dtype == np.float32 else 1e-13}


@given(st.sampled_from(sorted(UNARY_MATH)), st.data())
def test_unary_math_matches_reference(op, data):
    opset, dtypes, magnitude = UNARY_MATH[op]
    dtype = data.draw(one_of_dtypes(dtypes), label="dtype")
    x = data.draw(arrays(dtype, shapes(), low=-magnitude, high=magnitude), label="x")
    check_node(op, {"x": x}, opset, **_tolerance(op, x.dtype))


@given(st.sampled_from(sorted(ACTIVATIONS)), st.data())
def test_activation_matches_reference(op, data):
    opset, dtypes, attribute_strategies = ACTIVATIONS[op]
    dtype = data.draw(one_of_dtypes(dtypes), label="dtype")
    # onnx.reference's softplus/mish overflow exp() past ~88 (float32): keep below it
    x = data.draw(arrays(dtype, shapes(), low=-30, high=30), label="x")
    attributes = {name: data.draw(strategy, label=name) for name, strategy in attribute_strategies.items()}
    tolerance = _tolerance(op, x.dtype)
    if x.dtype == np.float64:
        # ONNX float attributes are float32 and onnx.reference applies HardSwish's 1/6 as
        # one: float64 results agree to float32 precision only
        tolerance = {"rtol": 1e-7, "atol": 1e-7}
    check_node(op, {"x": x}, opset, **tolerance, **attributes)


_math_erf = np.vectorize(math.erf, otypes=[np.float64])
_math_erfc = np.vectorize(math.erfc, otypes=[np.float64])


@given(arrays(np.float64, shapes(), low=-8, high=8))
def test_erf_float64_matches_math_erf_to_a_few_ulp(x):
    # onnx.reference's Erf is only float32-accurate (about 2e-8 off in float64), so the
    # float64 oracle is the C library's erf
    (got,) = run_node("Erf", {"x": x}, 13)
    assert got.dtype == np.float64 and got.shape == x.shape
    np.testing.assert_allclose(got, _math_erf(x), rtol=4e-16, atol=5e-16, equal_nan=True)


@given(arrays(np.float64, shapes(), low=-8, high=8))
def test_gelu_float64_matches_math_erf(x):
    (got,) = run_node("Gelu", {"x": x}, 20)
    with np.errstate(invalid="ignore"):
        expected = 0.5 * x * _math_erfc(-x / math.sqrt(2))
    assert got.dtype == np.float64 and got.shape == x.shape
    np.testing.assert_allclose(got, expected, rtol=1e-14, atol=1e-15, equal_nan=True)


ARITHMETIC = ["Add", "Sub", "Mul", "Div"]


@given(st.sampled_from(ARITHMETIC), broadcastable(2, one_of_dtypes(FLOAT_DTYPES)))
def test_float_arithmetic_broadcasts_like_reference(op, operands):
    check_node(op, operands, 14)


@given(st.sampled_from(ARITHMETIC), st.data())
def test_integer_arithmetic_wraps_like_reference(op, data):
    operands = data.draw(broadcastable(2, one_of_dtypes(INT_DTYPES)), label="operands")
    if op == "Div":
        # integer division by zero is undefined in ONNX
        operands[1] = np.where(operands[1] == 0, 1, operands[1]).astype(operands[1].dtype)
    check_node(op, operands, 14)


@given(st.data())
def test_pow_with_an_integer_base_and_float_exponent_matches_reference(data):
    base_type = data.draw(one_of_dtypes([np.int32, np.int64]), label="base dtype")
    exponent_type = data.draw(one_of_dtypes([np.float32, np.float64]), label="exponent dtype")
    shape = data.draw(shapes(max_dims=3), label="shape")
    base = data.draw(arrays(base_type, shape, low=0, high=40), label="base")
    exponent = data.draw(arrays(exponent_type, shape, low=0, high=4, special=False), label="exponent")
    # the result is the real power truncated to the base type; keep it inside that type
    # (a cast of an out-of-range float to an integer is undefined)
    exponent = np.where(np.power(base.astype(np.float64), exponent) < 2**30, exponent, 0).astype(exponent_type)
    check_node("Pow", [base, exponent], 15)


@given(st.data())
def test_pow_of_floats_matches_reference(data):
    dtype = data.draw(one_of_dtypes(FLOAT_DTYPES), label="dtype")
    base, exponent = data.draw(broadcastable(2, st.just(dtype)), label="operands")
    check_node("Pow", [base, np.clip(exponent, -8, 8).astype(dtype)], 15, rtol=4e-3 if dtype == np.float16 else 1e-5)


@given(st.sampled_from(["Max", "Min", "Sum", "Mean"]), st.integers(1, 3), st.data())
def test_variadic_ops_match_reference(op, count, data):
    dtype = data.draw(one_of_dtypes(FLOAT_DTYPES if op == "Mean" else FLOAT_DTYPES + (np.int32, np.int64)))
    operands = data.draw(broadcastable(count, st.just(dtype)), label="operands")
    check_node(op, operands, 13)


@given(st.sampled_from(["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"]), st.data())
def test_comparisons_match_reference(op, data):
    operands = data.draw(broadcastable(2, one_of_dtypes(FLOAT_DTYPES + INT_DTYPES)), label="operands")
    check_node(op, operands, 19 if op == "Equal" else 16)


@given(st.sampled_from(["And", "Or", "Xor"]), broadcastable(2, st.just(np.dtype(bool))))
def test_logical_ops_match_reference(op, operands):
    check_node(op, operands, 7)


@given(arrays(bool, shapes()))
def test_not_matches_reference(x):
    check_node("Not", {"x": x}, 1)


@given(st.sampled_from([0, 1]), st.data())
def test_mod_matches_reference(fmod, data):
    kinds = FLOAT_DTYPES if fmod else (np.int32, np.int64)
    a, b = data.draw(broadcastable(2, one_of_dtypes(kinds)), label="operands")
    if b.dtype.kind != "f":
        b = np.where(b == 0, 1, b).astype(b.dtype)  # integer modulo by zero is undefined
    check_node("Mod", [a, b], 13, fmod=fmod)


@given(st.sampled_from(["LEFT", "RIGHT"]), st.data())
def test_bit_shift_matches_reference(direction, data):
    dtype = data.draw(one_of_dtypes([np.uint8, np.uint32, np.uint64]))
    x, shift = data.draw(broadcastable(2, st.just(dtype)), label="operands")
    # shifting by the type's width or more is undefined in C and in ONNX
    shift = (shift % (dtype.itemsize * 8)).astype(dtype)
    check_node("BitShift", [x, shift], 11, direction=direction)


@given(st.data())
def test_clip_matches_reference(data):
    dtype = data.draw(one_of_dtypes(FLOAT_DTYPES + (np.int32, np.int64)))
    x = data.draw(arrays(dtype, shapes()), label="x")
    bounds = data.draw(st.lists(arrays(dtype, ()), min_size=0, max_size=2), label="bounds")
    if dtype.kind == "f":
        bounds = [b for b in bounds if not np.isnan(b)]
    check_node("Clip", [x, *bounds], 13)


@given(broadcastable(3, one_of_dtypes(FLOAT_DTYPES + (np.int64,))))
def test_where_matches_reference(operands):
    condition = operands[0] > operands[0].dtype.type(0) if operands[0].dtype.kind != "f" else operands[0] > 0
    check_node("Where", [condition, operands[1], operands[2].astype(operands[1].dtype)], 16)


@given(st.data())
def test_prelu_matches_reference(data):
    dtype = data.draw(one_of_dtypes(FLOAT_DTYPES))
    x, slope = data.draw(broadcastable(2, st.just(dtype)), label="operands")
    # PRelu broadcasts the slope to X (unidirectionally): keep X's shape the larger
    x = np.broadcast_to(x, np.broadcast_shapes(x.shape, slope.shape)).copy()

    def spec(outputs):
        # the spec's f(x) = x for x >= 0; onnx.reference takes slope * x at x == 0, which
        # differs when the slope is NaN or infinite
        with np.errstate(invalid="ignore"):
            return [np.where(x >= 0, x, x * slope).astype(x.dtype)]

    check_node("PRelu", [x, slope], 16, expected=spec)


@given(float_elements(np.float32))
def test_assert_same_result_sees_a_wrong_value(value):
    # the comparison itself must be able to fail, or every test above proves nothing
    expected = np.array([value, 1.0], np.float32)
    wrong = np.array([value, 1.5], np.float32)
    try:
        assert_same_result(wrong, expected)
    except AssertionError:
        return
    raise AssertionError("a wrong value passed the comparison")
