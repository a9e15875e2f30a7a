"""Strategies and the comparison the property suite shares: random arrays with NaN, inf
and empty dims, and a one-node model checked against onnx.reference."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from hypothesis import reject
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from helpers import node_case, reference_model, run_model
from plugrt.errors import PlugrtError

FLOAT_DTYPES = (np.float16, np.float32, np.float64)
INT_DTYPES = (np.int8, np.uint8, np.int32, np.int64)
SPECIALS = (np.nan, np.inf, -np.inf)

#: relative and absolute tolerance per float dtype for ops computed in one step
TOLERANCE = {np.dtype(np.float16): (2e-3, 2e-3), np.dtype(np.float32): (1e-5, 1e-6), np.dtype(np.float64): (1e-12, 1e-14)}


def shapes(min_dims: int = 0, max_dims: int = 4, min_side: int = 0, max_side: int = 4) -> st.SearchStrategy:
    """Array shapes, empty dimensions included unless ``min_side`` > 0."""
    return hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=min_side, max_side=max_side)


def float_elements(dtype: Any, low: float = -1e4, high: float = 1e4, special: bool = True) -> st.SearchStrategy:
    """Finite values in [low, high] of ``dtype``, and NaN/inf when ``special``."""
    width = np.dtype(dtype).itemsize * 8
    finite = st.floats(low, high, width=width, allow_subnormal=False)
    # one element in four is NaN or an infinity: enough to meet them, few enough that
    # outputs mixing many elements are not all NaN
    return st.one_of(finite, finite, finite, st.sampled_from(SPECIALS)) if special else finite


def int_elements(dtype: Any, low: int | None = None, high: int | None = None) -> st.SearchStrategy:
    info = np.iinfo(dtype)
    return st.integers(info.min if low is None else max(low, info.min), info.max if high is None else min(high, info.max))


def arrays(dtype: Any, shape: Any, elements: st.SearchStrategy | None = None, **bounds: Any) -> st.SearchStrategy:
    """Arrays of ``dtype`` and ``shape`` (a shape or a strategy of shapes)."""
    dtype = np.dtype(dtype)
    if elements is None:
        if dtype.kind == "f":
            elements = float_elements(dtype, **bounds)
        elif dtype.kind in "iu":
            elements = int_elements(dtype, **bounds)
        else:
            elements = st.booleans()
    return hnp.arrays(dtype, shape, elements=elements)


def assert_same_result(got: Any, expected: Any, rtol: float | None = None, atol: float | None = None) -> None:
    """Same dtype and shape; NaN where NaN, the same infinities, finite values within
    tolerance (the dtype's default unless given); integers and booleans exactly."""
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.dtype == expected.dtype, f"dtype {got.dtype} != reference {expected.dtype}"
    assert got.shape == expected.shape, f"shape {got.shape} != reference {expected.shape}"
    if expected.dtype.kind != "f":
        np.testing.assert_array_equal(got, expected)
        return
    default_rtol, default_atol = TOLERANCE.get(expected.dtype, (1e-5, 1e-6))
    np.testing.assert_allclose(
        got.astype(np.float64),
        expected.astype(np.float64),
        rtol=default_rtol if rtol is None else rtol,
        atol=default_atol if atol is None else atol,
        equal_nan=True,
    )


def _widened(inputs: Any) -> Any:
    """``inputs`` (a mapping or a sequence) with float arrays as float64."""

    def widen(value: Any) -> Any:
        return value.astype(np.float64) if isinstance(value, np.ndarray) and value.dtype.kind == "f" else value

    if isinstance(inputs, dict):
        return {name: widen(value) for name, value in inputs.items()}
    return [widen(value) for value in inputs]


def check_node(
    op_type: str,
    inputs: Any,
    opset: int,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    expected: Callable[[list[Any]], list[Any]] | None = None,
    exact_reference: bool = False,
    **options: Any,
) -> list[Any]:
    """Run a one-node model on plugrt and on onnx.reference and compare every output.

    Where onnx.reference refuses the case, plugrt may compute it or refuse with a typed
    error, never with another exception, and the example is rejected. ``exact_reference``
    runs the reference on float64 copies of float inputs and rounds its float outputs back
    to the float inputs' type (accumulations done in the narrow type are not an oracle).
    ``expected`` adjusts the reference's outputs where the ONNX spec and onnx.reference
    disagree (the caller says why)."""
    model, feeds = node_case(op_type, inputs, opset, **options)
    reference_model_proto, reference_feeds = model, feeds
    narrow = next((np.asarray(v).dtype for v in feeds.values() if np.asarray(v).dtype.kind == "f"), None)
    if exact_reference and narrow is not None:
        reference_model_proto, reference_feeds = node_case(op_type, _widened(inputs), opset, **options)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        try:
            reference = reference_model(reference_model_proto, reference_feeds)
            if exact_reference and narrow is not None:
                reference = [r.astype(narrow) if np.asarray(r).dtype.kind == "f" else r for r in reference]
        except Exception:
            try:
                run_model(model, feeds)
            except PlugrtError:
                pass
            # nothing to compare: not a valid example, so a test whose every example the
            # reference refuses fails as unsatisfiable instead of passing on nothing
            reject()
        if expected is not None:
            reference = expected(reference)
        got = run_model(model, feeds)
    assert len(got) == len(reference)
    for index, (g, e) in enumerate(zip(got, reference)):
        try:
            assert_same_result(g, e, rtol, atol)
        except AssertionError as error:
            raise AssertionError(f"{op_type} output {index} differs from onnx.reference: {error}") from None
    return got


def broadcastable(count: int, dtype_strategy: st.SearchStrategy, **shape_options: Any) -> st.SearchStrategy:
    """``count`` arrays of mutually broadcastable shapes, all of one dtype drawn once."""

    @st.composite
    def draw(data: st.DrawFn) -> list[np.ndarray]:
        dtype = data(dtype_strategy)
        shape = data(hnp.mutually_broadcastable_shapes(num_shapes=count, max_dims=4, max_side=4, **shape_options))
        return [data(arrays(dtype, s)) for s in shape.input_shapes]

    return draw()


def one_of_dtypes(dtypes: Sequence[Any]) -> st.SearchStrategy:
    return st.sampled_from([np.dtype(d) for d in dtypes])
