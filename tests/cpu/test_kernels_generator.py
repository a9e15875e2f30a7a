"""The generator CPU kernels: constants, Range, EyeLike and the seeded random ops."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import plugrt_cpu.kernels  # noqa: F401  (registers the kernels)
from helpers import node_attributes, run_kernel


def constant_from(opset: int, **attributes) -> np.ndarray:
    """A Constant node built by onnx.helper, its attributes converted as the provider does."""
    return run_kernel("Constant", opset, **node_attributes(helper.make_node("Constant", [], ["y"], **attributes)))[0]


# --- Constant --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attributes", "expected"),
    [
        ({"value_float": 1.5}, np.array(1.5, np.float32)),
        ({"value_floats": [1.0, 2.5]}, np.array([1.0, 2.5], np.float32)),
        ({"value_int": 7}, np.array(7, np.int64)),
        ({"value_ints": [3, -1]}, np.array([3, -1], np.int64)),
        ({"value_string": "hi"}, np.array("hi", dtype=object)),
        ({"value_strings": ["a", "bc"]}, np.array(["a", "bc"], dtype=object)),
        ({"value": numpy_helper.from_array(np.arange(6, dtype=np.int8).reshape(2, 3))}, np.arange(6, dtype=np.int8).reshape(2, 3)),
    ],
)
def test_constant_attribute_kinds(attributes, expected):
    y = constant_from(13, **attributes)
    assert y.dtype == expected.dtype and y.shape == expected.shape
    np.testing.assert_array_equal(y, expected)


def test_constant_is_read_only_so_runs_cannot_corrupt_it():
    y = constant_from(13, value_floats=[1.0, 2.0])
    with pytest.raises(ValueError):
        y[0] = 5.0


def test_constant_sparse_value_is_not_implemented():
    with pytest.raises(NotImplementedError):
        run_kernel("Constant", 13, sparse_value=object())[0]


# --- ConstantOfShape, Range, EyeLike ----------------------------------------------------------


def test_constant_of_shape_defaults_to_float32_zeros():
    y = run_kernel("ConstantOfShape", 20, np.array([2, 3], np.int64))[0]
    assert y.dtype == np.float32 and y.shape == (2, 3) and not y.any()


def test_constant_of_shape_takes_value_dtype_and_empty_shape_is_a_scalar():
    y = run_kernel("ConstantOfShape", 20, np.array([], np.int64), value=np.array([4], np.int32))[0]
    assert y.dtype == np.int32 and y.shape == () and y == 4


@pytest.mark.parametrize(
    ("start", "limit", "delta", "dtype"),
    [
        (3, 9, 3, np.int32),
        (10, 4, -2, np.int64),
        (10, 4, 2, np.int16),
        (1.0, 5.5, 0.75, np.float32),
        (-2.0, -9.0, -0.5, np.float64),
    ],
)
def test_range_counts_ceil_of_span_over_delta(start, limit, delta, dtype):
    y = run_kernel("Range", 11, *(np.array(v, dtype) for v in (start, limit, delta)))[0]
    expected = np.arange(start, limit, delta).astype(dtype)
    assert y.dtype == np.dtype(dtype)
    np.testing.assert_allclose(y, expected, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_range_in_16_bit_floats_does_not_accumulate_rounding(dtype):
    # Past 2048 (float16) or 256 (bfloat16), adding 1 in the type itself no longer moves.
    y = run_kernel("Range", 27, *(np.array(v, dtype) for v in (0.0, 4096.0, 1.0)))[0]
    assert y.dtype == np.dtype(dtype) and y.shape == (4096,)
    expected = np.arange(4096, dtype=np.float32).astype(dtype)
    np.testing.assert_array_equal(y.astype(np.float32), expected.astype(np.float32))


def test_eye_like_with_offset_diagonal_and_dtype():
    y = run_kernel("EyeLike", 9, np.zeros((3, 5), np.float32), dtype=TensorProto.INT32, k=2)[0]
    np.testing.assert_array_equal(y, np.eye(3, 5, k=2, dtype=np.int32))
    assert y.dtype == np.int32


def test_eye_like_defaults_to_the_input_dtype():
    assert run_kernel("EyeLike", 9, np.zeros((2, 2), np.float64))[0].dtype == np.float64


# --- random ops: seeded runs repeat --------------------------------------------------------

X = np.full((40, 50), 0.5, np.float32)
RANDOM_CASES = [
    ("RandomNormal", (), {"shape": [40, 50]}),
    ("RandomUniform", (), {"shape": [40, 50]}),
    ("RandomNormalLike", (X,), {}),
    ("RandomUniformLike", (X,), {}),
    ("Bernoulli", (X,), {}),
    ("Multinomial", (np.zeros((40, 5), np.float32),), {"sample_size": 50}),
]


@pytest.mark.parametrize(("op", "inputs", "attributes"), RANDOM_CASES)
def test_same_seed_gives_the_same_output(op, inputs, attributes):
    first = run_kernel(op, 22, *inputs, seed=3.0, **attributes)[0]
    second = run_kernel(op, 22, *inputs, seed=3.0, **attributes)[0]
    np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize(("op", "inputs", "attributes"), RANDOM_CASES)
def test_different_seeds_give_different_outputs(op, inputs, attributes):
    first = run_kernel(op, 22, *inputs, seed=3.0, **attributes)[0]
    second = run_kernel(op, 22, *inputs, seed=4.0, **attributes)[0]
    assert (first != second).any()


@pytest.mark.parametrize(("op", "inputs", "attributes"), RANDOM_CASES[:4])
def test_unseeded_runs_differ(op, inputs, attributes):
    assert (run_kernel(op, 22, *inputs, **attributes)[0] != run_kernel(op, 22, *inputs, **attributes)[0]).any()


@pytest.mark.parametrize(
    ("dtype", "numpy_type"),
    [(TensorProto.FLOAT16, np.float16), (TensorProto.DOUBLE, np.float64), (TensorProto.BFLOAT16, ml_dtypes.bfloat16)],
)
def test_random_normal_honours_dtype_mean_and_scale(dtype, numpy_type):
    y = run_kernel("RandomNormal", 22, shape=[200, 100], dtype=dtype, mean=5.0, scale=2.0, seed=1.0)[0]
    assert y.dtype == np.dtype(numpy_type) and y.shape == (200, 100)
    values = y.astype(np.float64)
    assert abs(values.mean() - 5.0) < 0.05 and abs(values.std() - 2.0) < 0.05


def test_random_uniform_like_stays_within_bounds_and_keeps_input_dtype():
    y = run_kernel("RandomUniformLike", 22, np.zeros((100, 100), np.float64), low=-3.0, high=-1.0, seed=0.0)[0]
    assert y.dtype == np.float64
    assert y.min() >= -3.0 and y.max() < -1.0 and abs(y.mean() + 2.0) < 0.02


def test_bernoulli_follows_its_probabilities_and_dtype():
    p = np.repeat(np.array([[0.0], [1.0], [0.25]], np.float32), 4000, axis=1)
    y = run_kernel("Bernoulli", 22, p, dtype=TensorProto.INT64, seed=2.0)[0]
    assert y.dtype == np.int64
    assert not y[0].any() and y[1].all() and abs(y[2].mean() - 0.25) < 0.02


def test_multinomial_samples_follow_softmax_of_log_probabilities():
    logits = np.log(np.array([[0.1, 0.0, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0]], np.float32) + 1e-30)
    y = run_kernel("Multinomial", 7, logits, sample_size=20000, dtype=TensorProto.INT64, seed=5.0)[0]
    assert y.dtype == np.int64 and y.shape == (2, 20000)
    np.testing.assert_allclose(np.bincount(y[0], minlength=4) / 20000, [0.1, 0.0, 0.6, 0.3], atol=0.015)
    assert (y[1] == 0).all()


def test_multinomial_defaults_to_int32():
    assert run_kernel("Multinomial", 7, np.zeros((1, 3), np.float32), seed=0.0)[0].dtype == np.int32
