"""Reduce*, ArgMax and ArgMin kernels, checked against onnx.reference and plain numpy."""

from __future__ import annotations

import numpy as np
import pytest
from onnx.reference import ReferenceEvaluator

from helpers import run_model, text_model

REDUCE_OPS = [
    "ReduceSum",
    "ReduceMean",
    "ReduceProd",
    "ReduceMax",
    "ReduceMin",
    "ReduceL1",
    "ReduceL2",
    "ReduceSumSquare",
    "ReduceLogSum",
    "ReduceLogSumExp",
]


def _assert_matches_reference(model, feeds, rtol=1e-5, atol=1e-6):
    (got,) = run_model(model, feeds)
    (expected,) = ReferenceEvaluator(model).run(None, feeds)
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)


def _positive_input(shape=(3, 4, 5)) -> np.ndarray:
    # Positive, so ReduceLogSum is defined everywhere.
    return (np.random.default_rng(0).random(shape) + 0.1).astype(np.float32)


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("opset", [1, 11])
@pytest.mark.parametrize("axes,keepdims", [(None, 1), ("[1]", 0), ("[0, 2]", 1), ("[0, 2]", 0)])
def test_reduce_with_axes_attribute_matches_reference(op, opset, axes, keepdims):
    axes_attribute = f", axes={axes}" if axes else ""
    model = text_model(f'<ir_version: 8, opset_import: ["" : {opset}]> g (float[3,4,5] x) => (y)'
        f" {{ y = {op}<keepdims={keepdims}{axes_attribute}>(x) }}", check=False)
    _assert_matches_reference(model, {"x": _positive_input()})


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("axes", [[-1], [0, 2]])
def test_reduce_with_axes_input_matches_reference(op, axes):
    opset = 13 if op == "ReduceSum" else 18
    model = text_model(f'<ir_version: 8, opset_import: ["" : {opset}]> g (float[3,4,5] x, int64[{len(axes)}] axes) => (y)'
        f" {{ y = {op}<keepdims=0>(x, axes) }}", check=False)
    _assert_matches_reference(model, {"x": _positive_input(), "axes": np.array(axes, np.int64)})


def test_reduce_sum_before_opset_13_takes_axes_attribute():
    model = text_model('<ir_version: 8, opset_import: ["" : 11]> g (float[3,4,5] x) => (y) { y = ReduceSum<axes=[1]>(x) }', check=False)
    x = _positive_input()
    (got,) = run_model(model, {"x": x})
    np.testing.assert_allclose(got, x.sum(axis=1, keepdims=True), rtol=1e-6)


@pytest.mark.parametrize(
    "op,elementwise",
    [
        ("ReduceSum", lambda x: x),
        ("ReduceMax", lambda x: x),
        ("ReduceSumSquare", np.square),
        ("ReduceL1", np.abs),
        ("ReduceLogSum", np.log),
        ("ReduceLogSumExp", lambda x: np.log(np.exp(x))),
    ],
)
def test_noop_with_empty_axes_reduces_nothing_but_keeps_elementwise_steps(op, elementwise):
    opset = 13 if op == "ReduceSum" else 18
    model = text_model(f'<ir_version: 8, opset_import: ["" : {opset}]> g (float[3,4] x) => (y)'
        f" {{ y = {op}<noop_with_empty_axes=1>(x) }}", check=False)
    x = _positive_input((3, 4))
    (got,) = run_model(model, {"x": x})
    np.testing.assert_allclose(got, elementwise(x), rtol=1e-6)


def test_empty_axes_input_without_noop_reduces_all_axes():
    model = text_model('<ir_version: 8, opset_import: ["" : 18]> g (float[3,4] x, int64[0] axes) => (y)'
        " { y = ReduceMean<keepdims=0>(x, axes) }", check=False)
    x = _positive_input((3, 4))
    (got,) = run_model(model, {"x": x, "axes": np.array([], np.int64)})
    assert got.shape == ()
    np.testing.assert_allclose(got, x.mean(), rtol=1e-6)


@pytest.mark.parametrize(
    "op,dtype,expected",
    [
        ("ReduceMin", np.float32, np.inf),
        ("ReduceMax", np.float32, -np.inf),
        ("ReduceMax", np.int32, np.iinfo(np.int32).min),
        ("ReduceMin", np.int64, np.iinfo(np.int64).max),
        ("ReduceProd", np.float32, 1.0),
        ("ReduceSum", np.float32, 0.0),
        ("ReduceL2", np.float32, 0.0),
        ("ReduceLogSum", np.float32, -np.inf),
        ("ReduceLogSumExp", np.float32, -np.inf),
    ],
)
def test_reduction_over_an_empty_set_yields_the_identity(op, dtype, expected):
    type_name = {np.float32: "float", np.int32: "int32", np.int64: "int64"}[dtype]
    model = text_model(f'<ir_version: 8, opset_import: ["" : 18]> g ({type_name}[2,0,3] x, int64[1] axes) => (y)'
        f" {{ y = {op}(x, axes) }}", check=False)
    (got,) = run_model(model, {"x": np.zeros((2, 0, 3), dtype), "axes": np.array([1], np.int64)})
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, np.full((2, 1, 3), expected, dtype))


def test_reduce_max_of_bool_treats_false_as_smaller():
    model = text_model('<ir_version: 8, opset_import: ["" : 20]> g (bool[2,3] x, int64[1] axes) => (y)'
        " { y = ReduceMax<keepdims=0>(x, axes) }", check=False)
    x = np.array([[False, True, False], [False, False, False]])
    (got,) = run_model(model, {"x": x, "axes": np.array([1], np.int64)})
    np.testing.assert_array_equal(got, [True, False])


def test_integer_reduce_sum_keeps_the_input_dtype():
    model = text_model('<ir_version: 8, opset_import: ["" : 13]> g (int8[2,3] x) => (y) { y = ReduceSum<keepdims=0>(x) }', check=False)
    (got,) = run_model(model, {"x": np.array([[1, 2, 3], [4, 5, 6]], np.int8)})
    assert got.dtype == np.int8
    assert got == 21


def test_float16_sum_accumulates_in_float32():
    x = np.full(4096, 0.1, np.float16)
    model = text_model('<ir_version: 8, opset_import: ["" : 13]> g (float16[4096] x) => (y) { y = ReduceSum<keepdims=0>(x) }', check=False)
    (got,) = run_model(model, {"x": x})
    assert got.dtype == np.float16
    exact = x.astype(np.float64).sum()
    np.testing.assert_allclose(float(got), exact, rtol=1e-3)


def test_log_sum_exp_is_stable_for_large_and_infinite_values():
    model = text_model('<ir_version: 8, opset_import: ["" : 18]> g (float[3,3] x, int64[1] axes) => (y)'
        " { y = ReduceLogSumExp<keepdims=0>(x, axes) }", check=False)
    x = np.array([[1000.0, 1000.0, -5.0], [1.0, np.inf, 2.0], [-np.inf, -np.inf, -np.inf]], np.float32)
    (got,) = run_model(model, {"x": x, "axes": np.array([1], np.int64)})
    np.testing.assert_allclose(got, [1000.0 + np.log(2.0), np.inf, -np.inf], rtol=1e-6)


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("axis,keepdims", [(0, 1), (1, 0), (-1, 1)])
@pytest.mark.parametrize("select_last_index", [0, 1])
def test_arg_extreme_matches_reference_with_ties(op, axis, keepdims, select_last_index):
    x = np.random.default_rng(1).integers(0, 3, (3, 4, 5)).astype(np.float32)  # many ties
    model = text_model(f'<ir_version: 8, opset_import: ["" : 13]> g (float[3,4,5] x) => (y)'
        f" {{ y = {op}<axis={axis}, keepdims={keepdims}, select_last_index={select_last_index}>(x) }}", check=False)
    _assert_matches_reference(model, {"x": x})


def test_arg_max_select_last_index_picks_the_last_tie():
    model = text_model('<ir_version: 8, opset_import: ["" : 12]> g (float[5] x) => (y)'
        " { y = ArgMax<keepdims=0, select_last_index=1>(x) }", check=False)
    (got,) = run_model(model, {"x": np.array([1, 3, 2, 3, 0], np.float32)})
    assert got.dtype == np.int64
    assert got == 3


def test_arg_min_at_opset_1_defaults_to_axis_0_keepdims():
    model = text_model('<ir_version: 8, opset_import: ["" : 1]> g (int32[2,3] x) => (y) { y = ArgMin(x) }', check=False)
    (got,) = run_model(model, {"x": np.array([[4, 1, 6], [2, 5, 0]], np.int32)})
    np.testing.assert_array_equal(got, [[1, 0, 1]])


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.int64])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_integer_l2_and_sum_square_keep_the_type_and_truncate_the_root(dtype, keepdims):
    x = np.array([[1, 1, 2], [3, 0, 1]], dtype)
    model = text_model(f"""
        <ir_version: 8, opset_import: ["" : 18]>
        g ({np.dtype(dtype).name}[2, 3] x, int64[1] axes) => (l2, sq) {{
            l2 = ReduceL2 <keepdims: int = {keepdims}> (x, axes)
            sq = ReduceSumSquare <keepdims: int = {keepdims}> (x, axes)
        }}
    """, check=False)
    l2, sq = run_model(model, {"x": x, "axes": np.array([1], np.int64)})
    squares = np.sum(x.astype(np.int64) ** 2, axis=1, keepdims=bool(keepdims))  # [6, 10]
    assert l2.dtype == sq.dtype == dtype
    np.testing.assert_array_equal(sq, squares.astype(dtype))
    np.testing.assert_array_equal(l2, np.trunc(np.sqrt(squares)).astype(dtype))  # [2, 3]
