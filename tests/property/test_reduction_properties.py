"""Reductions and arg-reductions agree with onnx.reference on random shapes, axes,
keepdims, dtypes, NaN, inf and empty tensors."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from property.oracle import FLOAT_DTYPES, arrays, check_node, one_of_dtypes, shapes

REDUCTIONS = [
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd",
    "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
]
INTEGER_REDUCTIONS = ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceSumSquare"]


@st.composite
def _axes(draw, rank: int) -> list[int]:
    if rank == 0:
        return []
    chosen = draw(st.lists(st.integers(0, rank - 1), unique=True, max_size=rank))
    return [a - rank if draw(st.booleans()) else a for a in chosen]


def _same_type_as(x: np.ndarray):
    # the spec gives every reduction's output the input's type; onnx.reference's np.sum
    # widens 8- to 32-bit integers to int64 for the L1/L2/SumSquare ops
    return lambda outputs: [np.asarray(o).astype(x.dtype) for o in outputs]


def _tolerance(x: np.ndarray, op: str) -> dict:
    if x.dtype.kind != "f":
        return {}
    eps = float(np.finfo(x.dtype).eps)
    count = max(x.size, 1)
    return {"rtol": eps * 8 * np.log2(count + 1) + eps, "atol": eps * 4 * (1 if op == "ReduceProd" else count)}


@given(st.sampled_from(REDUCTIONS), st.booleans(), st.booleans(), st.data())
def test_float_reduction_matches_reference(op, keepdims, noop, data):
    dtype = data.draw(one_of_dtypes(FLOAT_DTYPES), label="dtype")
    magnitude = 3.0 if op in ("ReduceProd", "ReduceLogSumExp") else 100.0
    # logsumexp of +inf is +inf, but onnx.reference shifts by the maximum (inf - inf = NaN)
    special = op != "ReduceLogSumExp"
    x = data.draw(arrays(dtype, shapes(max_dims=4), low=-magnitude, high=magnitude, special=special), label="x")
    axes = data.draw(_axes(x.ndim), label="axes")
    inputs = {"x": x, "axes": np.array(axes, np.int64)}
    check_node(
        op, inputs, 18, keepdims=int(keepdims), noop_with_empty_axes=int(noop),
        exact_reference=True, **_tolerance(x, op),
    )


@given(st.sampled_from(INTEGER_REDUCTIONS), st.booleans(), st.data())
def test_integer_reduction_keeps_the_integer_type(op, keepdims, data):
    dtype = data.draw(one_of_dtypes([np.int32, np.int64, np.uint8, np.int8]), label="dtype")
    # overflow is undefined: keep every sum of squares inside the type (27 * 2**2 < 127)
    bound, side = (2, 3) if dtype.itemsize == 1 else (20, 4)
    x = data.draw(arrays(dtype, shapes(max_dims=3, max_side=side), low=-bound, high=bound), label="x")
    axes = data.draw(_axes(x.ndim), label="axes")
    check_node(op, {"x": x, "axes": np.array(axes, np.int64)}, 18, keepdims=int(keepdims), expected=_same_type_as(x))


@given(st.sampled_from(INTEGER_REDUCTIONS), st.data())
def test_integer_reduction_with_the_axes_attribute(op, data):
    dtype = data.draw(one_of_dtypes([np.int32, np.int64]), label="dtype")
    x = data.draw(arrays(dtype, shapes(min_dims=1, max_dims=3), low=-20, high=20), label="x")
    axes = data.draw(_axes(x.ndim), label="axes") or None
    check_node(op, {"x": x}, 11, axes=axes, expected=_same_type_as(x))


@given(st.sampled_from(["ArgMax", "ArgMin"]), st.booleans(), st.booleans(), st.data())
def test_arg_reduction_matches_reference(op, keepdims, last, data):
    dtype = data.draw(one_of_dtypes(FLOAT_DTYPES + (np.int32, np.int64)), label="dtype")
    # small integers and few distinct values make ties, which select_last_index decides
    x = data.draw(arrays(dtype, shapes(min_dims=1, max_dims=4, min_side=1), low=-2, high=2), label="x")
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1), label="axis")
    check_node(op, {"x": x}, 13, axis=axis, keepdims=int(keepdims), select_last_index=int(last))
