"""The elementwise CPU kernels against onnx.reference, math and plain numpy, one node at a time."""

from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import pytest

import plugrt_cpu.kernels  # noqa: F401  (registers the kernels)
from helpers import model_bytes, reference_node, run_kernel, run_node
from plugrt_cpu._registry import KernelContext, lookup
from plugrt_cpu.kernels.elementwise import erf, sigmoid

RNG = np.random.default_rng(20240611)


def random_float32(*shape: int, scale: float = 3.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


# --- erf --------------------------------------------------------------------------------

_math_erf = np.vectorize(math.erf, otypes=[np.float64])


def test_erf_float64_is_accurate_to_a_few_ulp():
    x = np.concatenate([np.linspace(-7, 7, 200_001), np.logspace(-300, 0.9, 2_000), [0.5, -0.5, 6.0]])
    got = erf(x)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, _math_erf(x), rtol=1e-15, atol=5e-16)


def test_erf_float32_absolute_error_is_below_5e_7():
    x = np.concatenate([np.linspace(-5, 5, 200_001), np.logspace(-30, 0.7, 2_000)]).astype(np.float32)
    got = erf(x)
    assert got.dtype == np.float32
    assert np.abs(got - _math_erf(x.astype(np.float64))).max() < 5e-7
    np.testing.assert_allclose(got[x > 0], _math_erf(x[x > 0].astype(np.float64)), rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_erf_special_values(dtype):
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 100.0, -100.0], dtype=dtype)
    got = erf(x)
    np.testing.assert_array_equal(got, [np.nan, 1, -1, 0, 0, 1, -1])
    assert np.signbit(got[4])


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_erf_keeps_narrow_float_dtypes(dtype):
    x = np.array([-2.0, -0.5, 0.0, 0.25, 1.0, 3.0], dtype=dtype)
    got = run_kernel("Erf", 13, x)[0]
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64), _math_erf(x.astype(np.float64)), atol=1e-2)


def test_erf_of_a_large_strided_tensor_keeps_its_layout():
    x = RNG.standard_normal((300, 400)).T  # not contiguous, and more than one block
    got = erf(x)
    assert got.shape == (400, 300)
    np.testing.assert_allclose(got, _math_erf(x), rtol=1e-15, atol=5e-16)


def test_erf_of_a_scalar_is_a_zero_dim_array():
    got = erf(np.float32(0.5))
    assert got.shape == () and got.dtype == np.float32
    assert abs(float(got) - math.erf(0.5)) < 1e-7


# --- Gelu -------------------------------------------------------------------------------


def test_gelu_exact_matches_math_erf():
    x = random_float32(64, 33)
    x64 = x.astype(np.float64)
    expected = 0.5 * x64 * (1 + _math_erf(x64 / math.sqrt(2)))
    got = run_kernel("Gelu", 20, x)[0]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_gelu_tanh_matches_reference():
    x = random_float32(64, 33)
    got = run_kernel("Gelu", 20, x, approximate="tanh")[0]
    np.testing.assert_allclose(got, reference_node("Gelu", [x], 20, approximate="tanh")[0], rtol=1e-5, atol=1e-6)


def test_gelu_rejects_an_unknown_approximation():
    with pytest.raises(NotImplementedError, match="approximate"):
        run_kernel("Gelu", 20, random_float32(3), approximate="fast")[0]


# --- Sigmoid ----------------------------------------------------------------------------


def test_sigmoid_is_exact_in_both_tails_without_warnings():
    x = np.array([-np.inf, -200.0, -100.0, -30.0, -1.0, 0.0, 1.0, 30.0, 200.0, np.inf], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run_kernel("Sigmoid", 13, x)[0]
    expected = 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
    assert got.dtype == np.float32
    # relative accuracy down to float32's smallest normal number, not just absolute
    np.testing.assert_allclose(got, expected, rtol=2e-7, atol=np.finfo(np.float32).tiny)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_sigmoid_keeps_dtype(dtype):
    x = np.linspace(-20, 20, 101).astype(dtype)
    got = sigmoid(x)
    assert got.dtype == dtype
    expected = 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=2 * float(np.finfo(dtype).smallest_subnormal))


# --- Activations with attributes against onnx.reference ---------------------------------

ACTIVATIONS = [
    ("Elu", 6, {}),
    ("Elu", 22, {"alpha": 0.3}),
    ("Selu", 6, {}),
    ("Selu", 22, {"alpha": 2.0, "gamma": 3.0}),
    ("Celu", 12, {"alpha": 2.0}),
    ("HardSigmoid", 6, {"alpha": 0.3, "beta": 0.4}),
    ("HardSwish", 14, {}),
    ("LeakyRelu", 16, {}),
    ("LeakyRelu", 16, {"alpha": 3.0}),
    ("LeakyRelu", 16, {"alpha": -0.5}),
    ("ThresholdedRelu", 10, {"alpha": 0.5}),
    ("Shrink", 9, {"bias": 0.5, "lambd": 1.5}),
    ("Softplus", 1, {}),
    ("Softsign", 1, {}),
    ("Mish", 18, {}),
    ("Swish", 24, {}),
    ("Swish", 24, {"alpha": 0.5}),
    ("Relu", 14, {}),
    ("Sigmoid", 13, {}),
]


@pytest.mark.parametrize("op, opset, attributes", ACTIVATIONS, ids=lambda v: str(v))
def test_activation_matches_reference(op, opset, attributes):
    x = random_float32(17, 31)
    x[0, :4] = [0.0, -0.0, 80.0, -80.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run_kernel(op, opset, x, **attributes)[0]
    assert got.dtype == np.float32
    assert got.shape == x.shape
    np.testing.assert_allclose(got, reference_node(op, [x], opset, **attributes)[0], rtol=1e-5, atol=1e-6)


def test_activation_keeps_nan():
    x = np.array([np.nan, 1.0], dtype=np.float32)
    for op, opset, attributes in ACTIVATIONS:
        if op in ("ThresholdedRelu", "Shrink"):  # NaN fails both comparisons: 0 by the spec
            continue
        assert np.isnan(run_kernel(op, opset, x, **attributes)[0][0]), op


def test_leaky_relu_with_zero_alpha_keeps_positive_infinity():
    x = np.array([np.inf, 2.0, -3.0, 0.0], np.float32)
    (got,) = run_node("LeakyRelu", {"x": x}, 16, alpha=0.0)
    np.testing.assert_array_equal(got, [np.inf, 2.0, -0.0, 0.0])


def test_prelu_keeps_non_negative_inputs_whatever_the_slope():
    # f(x) = x for x >= 0 by the spec, even where slope * x would be NaN
    x = np.array([3.0, 0.0, -2.0, -1.0, 5.0], np.float32)
    slope = np.array([np.inf, np.nan, 2.0, np.nan, -np.inf], np.float32)
    (got,) = run_node("PRelu", {"x": x, "slope": slope}, 16)
    np.testing.assert_array_equal(got, [3.0, 0.0, -4.0, np.nan, 5.0])


def test_shrink_keeps_integer_dtype():
    x = np.arange(-5, 6, dtype=np.int8)
    got = run_kernel("Shrink", 9, x, bias=1.0, lambd=2.0)[0]
    assert got.dtype == np.int8
    np.testing.assert_array_equal(got, [-4, -3, -2, 0, 0, 0, 0, 0, 2, 3, 4])


def test_prelu_broadcasts_slope_to_x():
    x = random_float32(2, 3, 4, 5)
    slope = random_float32(4, 1)
    np.testing.assert_allclose(run_kernel("PRelu", 16, x, slope)[0], np.where(x < 0, x * slope, x))


def test_prelu_before_opset_7_applies_a_vector_slope_per_channel():
    x = random_float32(2, 3, 4, 3)
    slope = np.array([0.1, 0.2, 0.3], dtype=np.float32)
    expected = np.where(x < 0, x * slope[None, :, None, None], x)
    np.testing.assert_allclose(run_kernel("PRelu", 6, x, slope)[0], expected)


# --- Arithmetic -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64])
def test_integer_div_truncates_toward_zero(dtype):
    info = np.iinfo(dtype)
    a = RNG.integers(info.min + 1, info.max, size=500, dtype=dtype)
    b = RNG.integers(-50, 50, size=500, dtype=dtype)
    b[b == 0] = 7
    a[:4], b[:4] = [-7, 7, -7, 7], [2, -2, -2, 2]
    expected = [int(x) // int(y) if (x < 0) == (y < 0) else -(abs(int(x)) // abs(int(y))) for x, y in zip(a, b)]
    got = run_kernel("Div", 14, a, b)[0]
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got[:4], [-3, -3, 3, 3])


def test_integer_div_without_known_dtypes_still_truncates():
    spec = lookup("", "Div", 14)
    kernel = spec.fn(KernelContext("Div", "", 14, {}, 2, 1, [None, None], [None, None]))
    np.testing.assert_array_equal(kernel(np.int32([-7, 7]), np.int32([2, 2])), [-3, 3])
    np.testing.assert_array_equal(kernel(np.uint8([255, 7]), np.uint8([2, 2])), [127, 3])
    assert kernel(np.float32([1.0]), np.float32([4.0])).dtype == np.float32


@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("dtype", [np.int32, np.float64])
def test_mod_follows_the_divisor_or_the_dividend(fmod, dtype):
    a = np.array([-7, 7, -7, 7, 0, 5], dtype=dtype)
    b = np.array([3, -3, -3, 3, 2, 5], dtype=dtype)
    remainder = math.fmod if fmod else (lambda x, y: x % y)
    expected = [remainder(float(x), float(y)) for x, y in zip(a, b)]
    got = run_kernel("Mod", 13, a, b, fmod=fmod)[0]
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, expected)


def test_pow_keeps_the_base_dtype():
    base = np.array([1.5, 2.0, -3.0], dtype=np.float32)
    exponent = np.array([2, 3, 2], dtype=np.int64)
    got = run_kernel("Pow", 15, base, exponent)[0]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, [2.25, 8.0, 9.0])
    ints = run_kernel("Pow", 15, np.array([4, 9, 2], dtype=np.int64), np.array([0.5, 0.5, 3.0], dtype=np.float32))[0]
    assert ints.dtype == np.int64
    np.testing.assert_array_equal(ints, [2, 3, 8])


def test_integer_pow_with_a_negative_exponent_truncates():
    base = np.array([2, 1, -1, -1, 5], dtype=np.int32)
    exponent = np.array([-1, -3, -3, -2, 0], dtype=np.int32)
    got = run_kernel("Pow", 15, base, exponent)[0]
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, [int(math.pow(a, b)) for a, b in zip(base.tolist(), exponent.tolist())])


def test_pow_with_a_constant_exponent_of_two_squares():
    base = random_float32(10)
    exponent = np.array(2.0, dtype=np.float32)
    got = run_kernel("Pow", 15, base, exponent, constants=[None, exponent])[0]
    np.testing.assert_allclose(got, reference_node("Pow", [base, exponent], 15)[0], rtol=1e-6)
    assert got.dtype == np.float32


# (base, exponent) pairs whose exponent a float32 cannot hold: cast to float32 it would
# become the even 16777216 or 16777218, and lose its sign of the result
_LARGE_INT_EXPONENTS = [
    (-0.0, -16777217), (-0.0, -16777218), (-0.0, 16777217), (-0.0, 16777219),
    (-1.0, 16777217), (-1.0, 16777218), (-1.0, -16777219), (-1.0, 2147483647), (-1.0, -2147483648),
    (-2.0, 16777217), (-2.0, -16777217), (-0.5, 16777217), (0.5, -16777217), (1.0, 16777217),
    (-3.0, 3), (-2.0, -1), (2.0, 10),
]


@pytest.mark.parametrize("exponent_type", [np.int32, np.int64])
@pytest.mark.parametrize("base_type", [np.float16, np.float32])
def test_pow_by_large_integer_exponents_keeps_their_parity(base_type, exponent_type):
    base = np.array([b for b, _ in _LARGE_INT_EXPONENTS], base_type)
    exponent = np.array([e for _, e in _LARGE_INT_EXPONENTS], exponent_type)
    with np.errstate(all="ignore"):
        expected = reference_node("Pow", [base, exponent], 15)[0]
        (got,) = run_node("Pow", {"x": base, "y": exponent}, 15)
    assert got.dtype == base_type
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(expected))
    assert got[0] == -np.inf  # Pow(-0.0, -16777217)


def test_pow_of_float64_by_int64_exponents_beyond_2_to_53_keeps_their_parity():
    # float64 holds these exponents only rounded to even; the sign must come from the integer
    base = np.array([-1.0, -1.0, -0.0, -0.0, -1.0], np.float64)
    exponent = np.array([2**53 + 1, 2**53 + 2, -(2**53 + 1), 2**60 + 1, -(2**62 + 3)], np.int64)
    with np.errstate(all="ignore"):
        got = run_kernel("Pow", 15, base, exponent)[0]
    np.testing.assert_array_equal(got, [-1.0, 1.0, -np.inf, -0.0, -1.0])
    assert np.signbit(got[3])


def test_replayed_pow_by_a_large_odd_integer_exponent_keeps_its_parity():
    import plugrt

    session = plugrt.load(
        model_bytes("""<ir_version: 8, opset_import: ["" : 15]>
        g (float[2] x, int32[2] y) => (float[2] z) { z = Pow(x, y) }"""),
        device="cpu",
    )
    small = {"x": np.array([-0.0, -2.0], np.float32), "y": np.array([3, 2], np.int32)}
    session.try_capture(small)
    large = {"x": np.array([-0.0, -1.0], np.float32), "y": np.array([-16777217, 16777217], np.int32)}
    with np.errstate(all="ignore"):
        replayed = session.replay(large)
    assert replayed.replayed
    np.testing.assert_array_equal(replayed["z"], [-np.inf, -1.0])


def test_round_is_half_to_even():
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 2.4, 2.6], dtype=np.float32)
    np.testing.assert_array_equal(run_kernel("Round", 11, x)[0], [-2, -2, -0, 0, 2, 2, 2, 3])


@pytest.mark.parametrize("op, combine", [("Max", np.maximum), ("Min", np.minimum), ("Sum", np.add)])
def test_variadic_ops_broadcast_all_inputs(op, combine):
    a, b, c = random_float32(3, 1, 4), random_float32(5, 1), random_float32(4)
    got = run_kernel(op, 13, a, b, c)[0]
    assert got.shape == (3, 5, 4)
    np.testing.assert_allclose(got, combine(combine(a, b), c), rtol=1e-6)
    assert run_kernel(op, 13, a)[0] is a or np.array_equal(run_kernel(op, 13, a)[0], a)


def test_mean_of_three_broadcast_inputs():
    a, b, c = random_float32(3, 1), random_float32(1, 4), random_float32(4)
    got = run_kernel("Mean", 13, a, b, c)[0]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, (a.astype(np.float64) + b + c) / 3, rtol=1e-5, atol=1e-6)


# --- Clip -------------------------------------------------------------------------------


def test_clip_inputs_may_be_omitted_or_cross():
    x = np.array([-3.0, -1.0, 0.0, 2.0, np.inf], dtype=np.float32)
    high = np.array(1.0, dtype=np.float32)
    np.testing.assert_array_equal(run_kernel("Clip", 13, x, None, high)[0], [-3, -1, 0, 1, 1])
    np.testing.assert_array_equal(run_kernel("Clip", 13, x)[0], x)
    low = np.array(2.0, dtype=np.float32)
    np.testing.assert_array_equal(run_kernel("Clip", 13, x, low, high)[0], reference_node("Clip", [x, low, high], 13)[0])


def test_clip_integers_keep_dtype():
    x = np.arange(-5, 5, dtype=np.int64)
    got = run_kernel("Clip", 13, x, np.array(-2, dtype=np.int64), np.array(3, dtype=np.int64))[0]
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, np.clip(x, -2, 3))


def test_clip_opset_6_takes_attributes():
    x = random_float32(20)
    x[0] = np.inf
    np.testing.assert_array_equal(run_kernel("Clip", 6, x, min=-0.5, max=0.5)[0], reference_node("Clip", [x], 6, min=-0.5, max=0.5)[0])
    np.testing.assert_array_equal(run_kernel("Clip", 6, x)[0], reference_node("Clip", [x], 6)[0])


def test_clip_opset_6_default_bounds_leave_float16_alone():
    x = np.array([-np.inf, -1.0, 60000.0, np.inf], dtype=np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run_kernel("Clip", 6, x, max=2.0)[0]
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, [-np.inf, -1, 2, 2])


# --- Opset 1-6 broadcasting -------------------------------------------------------------


@pytest.mark.parametrize("op, combine", [("Add", np.add), ("Sub", np.subtract), ("Mul", np.multiply),
                                         ("Div", np.divide), ("Pow", np.power)])
def test_opset_6_broadcast_aligns_b_at_axis(op, combine):
    a = np.abs(random_float32(2, 3, 4, 5)) + 0.5
    b = np.abs(random_float32(3, 4)) + 0.5
    got = run_kernel(op, 6, a, b, broadcast=1, axis=1)[0]
    np.testing.assert_allclose(got, combine(a, b[None, :, :, None]), rtol=1e-6)
    trailing = random_float32(5)
    np.testing.assert_allclose(run_kernel(op, 6, a, np.abs(trailing), broadcast=1)[0], combine(a, np.abs(trailing)), rtol=1e-6)


def test_opset_1_comparison_with_broadcast_axis():
    a = random_float32(2, 3)
    b = random_float32(2)
    np.testing.assert_array_equal(run_kernel("Greater", 1, a, b, broadcast=1, axis=0)[0], a > b[:, None])


# --- Comparison, logic, bitwise ---------------------------------------------------------


def test_equal_compares_strings():
    a = np.array(["a", "bc", ""], dtype=object)
    b = np.array(["a", "b", ""], dtype=object)
    np.testing.assert_array_equal(run_kernel("Equal", 19, a, b)[0], [True, False, True])


@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int64])
def test_bitshift_out_of_range_amounts_match_reference(direction, dtype):
    bits = np.iinfo(dtype).bits
    x = np.array([1, 5, -3, 100, -128, 7, 1, -1], dtype=np.int64).astype(dtype)
    y = np.array([0, 1, 2, bits - 1, bits, bits + 3, -1, 3], dtype=np.int64).astype(dtype)
    got = run_kernel("BitShift", 28, x, y, direction=direction)[0]
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, reference_node("BitShift", [x, y], 28, direction=direction)[0])


def test_bitshift_rejects_an_unknown_direction():
    with pytest.raises(ValueError, match="direction"):
        run_kernel("BitShift", 11, np.uint8([1]), np.uint8([1]), direction="UP")[0]


@pytest.mark.parametrize("negative, positive, expected", [
    (1, 1, [True, True, False, False]),
    (1, 0, [False, True, False, False]),
    (0, 1, [True, False, False, False]),
    (0, 0, [False, False, False, False]),
])
def test_isinf_detects_the_requested_signs(negative, positive, expected):
    x = np.array([np.inf, -np.inf, np.nan, 1.0], dtype=np.float32)
    got = run_kernel("IsInf", 20, x, detect_negative=negative, detect_positive=positive)[0]
    np.testing.assert_array_equal(got, expected)
    assert got.dtype == np.bool_


@pytest.mark.parametrize("base_type", [np.int32, np.int64])
@pytest.mark.parametrize("exponent_type", [np.float32, np.float64])
def test_pow_of_an_integer_base_by_a_float_exponent_truncates_the_real_power(base_type, exponent_type):
    base = np.array([2, 3, 7, 10, 0, 5, 9], base_type)
    exponent = np.array([0.5, 1.5, 0.49, 2.9, 2.5, -1.0, 0.5], exponent_type)
    (got,) = run_node("Pow", {"x": base, "y": exponent}, 15)
    assert got.dtype == base_type
    expected = np.trunc(np.power(base.astype(np.float64), exponent.astype(np.float64))).astype(base_type)
    np.testing.assert_array_equal(got, expected)  # [1, 5, 2, 794, 0, 0, 3]
