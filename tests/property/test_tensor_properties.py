"""Tensor and shape ops agree with onnx.reference on random shapes (empty dims included),
axes, permutations, slices, pads and dtypes."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from property.oracle import FLOAT_DTYPES, arrays, check_node, one_of_dtypes, shapes

ANY_DTYPE = one_of_dtypes(FLOAT_DTYPES + (np.int8, np.int32, np.int64, np.bool_))


@st.composite
def tensors(draw, min_dims: int = 0, max_dims: int = 4, min_side: int = 0, max_side: int = 4) -> np.ndarray:
    dtype = draw(ANY_DTYPE)
    return draw(arrays(dtype, shapes(min_dims, max_dims, min_side, max_side)))


@given(tensors(), st.data())
def test_transpose_matches_reference(x, data):
    perm = list(data.draw(st.permutations(range(x.ndim)), label="perm"))
    check_node("Transpose", {"x": x}, 21, **({"perm": perm} if perm else {}))


@given(tensors(), st.data())
def test_reshape_with_zero_and_minus_one_matches_reference(x, data):
    target = list(data.draw(st.permutations(x.shape), label="target"))
    if target and data.draw(st.booleans(), label="copy a dim with 0"):
        index = data.draw(st.integers(0, min(len(target), x.ndim) - 1), label="zero at")
        target[index] = x.shape[index]
        target[index] = 0
    if target and x.size and data.draw(st.booleans(), label="infer a dim"):
        target[data.draw(st.integers(0, len(target) - 1), label="-1 at")] = -1
    if -1 in target and 0 in target and target.index(0) != -1 and x.shape[target.index(0)] == 0:
        return  # -1 beside a copied 0 has no unique solution
    check_node("Reshape", {"x": x, "shape": np.array(target, np.int64)}, 21)


@given(tensors(), st.data())
def test_flatten_matches_reference(x, data):
    axis = data.draw(st.integers(-x.ndim, x.ndim), label="axis")
    check_node("Flatten", {"x": x}, 21, axis=axis)


@given(tensors(), st.data())
def test_squeeze_and_unsqueeze_match_reference(x, data):
    ones = [i for i, side in enumerate(x.shape) if side == 1]
    axes = data.draw(st.lists(st.sampled_from(ones), unique=True) if ones else st.just([]), label="squeeze axes")
    check_node("Squeeze", {"x": x, "axes": np.array(axes, np.int64) if axes else None}, 21)
    new_rank = x.ndim + data.draw(st.integers(1, 2), label="added")
    added = data.draw(st.lists(st.integers(-new_rank, new_rank - 1), min_size=new_rank - x.ndim,
                               max_size=new_rank - x.ndim, unique_by=lambda a: a % new_rank), label="unsqueeze axes")
    check_node("Unsqueeze", {"x": x, "axes": np.array(added, np.int64)}, 21)


@given(st.data())
def test_concat_matches_reference(data):
    dtype = data.draw(ANY_DTYPE, label="dtype")
    shape = data.draw(shapes(min_dims=1), label="shape")
    axis = data.draw(st.integers(-len(shape), len(shape) - 1), label="axis")
    parts = []
    for _ in range(data.draw(st.integers(1, 3), label="count")):
        part_shape = list(shape)
        part_shape[axis] = data.draw(st.integers(0, 3))
        parts.append(data.draw(arrays(dtype, tuple(part_shape))))
    check_node("Concat", parts, 13, axis=axis)


@given(tensors(min_dims=1), st.data())
def test_split_matches_reference(x, data):
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1), label="axis")
    length = x.shape[axis]
    if data.draw(st.booleans(), label="sizes given"):
        cuts = sorted(data.draw(st.lists(st.integers(0, length), max_size=3), label="cuts"))
        sizes = np.diff([0, *cuts, length]).astype(np.int64)
        check_node("Split", {"x": x, "split": sizes}, 18, outputs=len(sizes), axis=axis)
    else:
        count = data.draw(st.integers(1, max(length, 1)), label="num_outputs")
        check_node("Split", {"x": x}, 18, outputs=count, axis=axis, num_outputs=count)


def _spec_slice(x: np.ndarray, starts, ends, axes, steps) -> np.ndarray:
    """Slice as the spec words it: negative bounds count from the end, then starts clamp
    to [0, dim] ([0, dim - 1] stepping back) and ends to [0, dim] ([-1, dim - 1] back)."""
    index = [slice(None)] * x.ndim
    for start, end, axis, step in zip(starts, ends, axes, steps):
        dim = x.shape[axis % x.ndim]
        start, end = start + dim if start < 0 else start, end + dim if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        else:
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
        index[axis % x.ndim] = slice(start, None if end == -1 else end, step)
    return x[tuple(index)]


_BOUNDS = st.one_of(st.integers(-6, 6), st.sampled_from([np.iinfo(np.int64).max, np.iinfo(np.int64).min]))


@given(tensors(min_dims=1), st.data())
def test_slice_matches_reference(x, data):
    axes = data.draw(st.lists(st.integers(-x.ndim, x.ndim - 1), unique_by=lambda a: a % x.ndim, min_size=1), label="axes")
    starts = data.draw(st.lists(_BOUNDS, min_size=len(axes), max_size=len(axes)), label="starts")
    ends = data.draw(st.lists(_BOUNDS, min_size=len(axes), max_size=len(axes)), label="ends")
    steps = data.draw(st.lists(st.integers(-3, 3).filter(bool), min_size=len(axes), max_size=len(axes)), label="steps")
    inputs = {name: np.array(v, np.int64) for name, v in
              [("starts", starts), ("ends", ends), ("axes", axes), ("steps", steps)]}
    # onnx.reference slices nothing for start = end = INT_MIN stepping back, where the
    # spec's clamping keeps element 0: the spec's own arithmetic is the oracle
    check_node("Slice", {"x": x, **inputs}, 13, expected=lambda _: [_spec_slice(x, starts, ends, axes, steps)])


@given(tensors(min_dims=1, min_side=1), st.data())
def test_gather_with_negative_indices_matches_reference(x, data):
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1), label="axis")
    side = x.shape[axis]
    indices = data.draw(arrays(np.int64, shapes(max_dims=2), low=-side, high=side - 1), label="indices")
    check_node("Gather", {"x": x, "indices": indices}, 13, axis=axis)


@given(tensors(min_dims=1, min_side=1), st.data())
def test_gather_elements_matches_reference(x, data):
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1), label="axis")
    shape = list(x.shape)
    shape[axis] = data.draw(st.integers(0, 4), label="index length")
    side = x.shape[axis]
    indices = data.draw(arrays(np.int64, tuple(shape), low=-side, high=side - 1), label="indices")
    check_node("GatherElements", {"x": x, "indices": indices}, 13, axis=axis)


@given(tensors(max_dims=3), st.data())
def test_tile_matches_reference(x, data):
    repeats = data.draw(st.lists(st.integers(0, 3), min_size=x.ndim, max_size=x.ndim), label="repeats")
    check_node("Tile", {"x": x, "repeats": np.array(repeats, np.int64)}, 13)


@given(tensors(max_dims=3), st.data())
def test_expand_matches_reference(x, data):
    # a target shape of 1s where x has real sides, any side where x has 1, plus leading dims
    target = [data.draw(st.sampled_from([1, side]) if side != 1 else st.integers(0, 3)) for side in x.shape]
    leading = data.draw(st.lists(st.integers(0, 3), max_size=2), label="leading")
    check_node("Expand", {"x": x, "shape": np.array(leading + target, np.int64)}, 13)


@given(st.sampled_from(["constant", "reflect", "edge", "wrap"]), st.data())
def test_pad_matches_reference(mode, data):
    dtype = data.draw(one_of_dtypes(FLOAT_DTYPES + (np.int32, np.int64)), label="dtype")
    min_side = 0 if mode == "constant" else 1
    x = data.draw(arrays(dtype, shapes(min_dims=1, max_dims=3, min_side=min_side)), label="x")
    low = -1 if mode == "constant" else 0
    high = 3
    if mode == "reflect":
        high = min(x.shape) - 1  # reflection cannot reach past the opposite edge
    pads = data.draw(st.lists(st.integers(low, max(high, low)), min_size=2 * x.ndim, max_size=2 * x.ndim), label="pads")
    if mode == "constant":
        # a negative pad crops: never more than the side
        pads = [max(p, -x.shape[i % x.ndim]) for i, p in enumerate(pads)]
    check_node("Pad", {"x": x, "pads": np.array(pads, np.int64)}, 19, mode=mode)


@given(st.booleans(), st.booleans(), st.data())
def test_cumsum_matches_reference(exclusive, reverse, data):
    dtype = data.draw(one_of_dtypes(FLOAT_DTYPES[1:] + (np.int32, np.int64)), label="dtype")
    x = data.draw(arrays(dtype, shapes(min_dims=1), low=-100, high=100), label="x")
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1), label="axis")
    check_node("CumSum", {"x": x, "axis": np.array(axis, np.int64)}, 14,
               exclusive=int(exclusive), reverse=int(reverse), exact_reference=True, rtol=1e-5, atol=1e-3)


@given(tensors(min_dims=2), st.booleans(), st.integers(-5, 5))
def test_trilu_matches_reference(x, upper, k):
    check_node("Trilu", {"x": x, "k": np.array(k, np.int64)}, 14, upper=int(upper))


@given(st.sampled_from(["DCR", "CRD"]), st.integers(1, 3), st.data())
def test_depth_to_space_and_back_match_reference(mode, block, data):
    dtype = data.draw(ANY_DTYPE, label="dtype")
    n, c, h, w = (data.draw(st.integers(0, 2)), data.draw(st.integers(1, 2)) * block * block,
                  data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3)))
    x = data.draw(arrays(dtype, (n, c, h, w)), label="x")
    check_node("DepthToSpace", {"x": x}, 13, blocksize=block, mode=mode)
    y = data.draw(arrays(dtype, (n, c // (block * block), h * block, w * block)), label="y")
    check_node("SpaceToDepth", {"x": y}, 13, blocksize=block)


@given(st.booleans(), st.data())
def test_top_k_of_distinct_values_matches_reference(largest, data):
    shape = data.draw(shapes(min_dims=1, max_dims=3), label="shape")
    # distinct values: the order of ties is not specified
    x = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).permutation(int(np.prod(shape))).reshape(shape)
    x = x.astype(data.draw(one_of_dtypes([np.float32, np.int64]), label="dtype"))
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1), label="axis")
    k = data.draw(st.integers(0, x.shape[axis]), label="k")
    check_node("TopK", {"x": x, "k": np.array([k], np.int64)}, 11, outputs=["values", "indices"],
               axis=axis, largest=int(largest))
