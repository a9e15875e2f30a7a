"""The tensor-family CPU kernels against onnx.reference and plain numpy, one node at a time."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import plugrt_cpu.kernels  # noqa: F401  (registers the kernels)
from helpers import reference_node, run_kernel
from plugrt_cpu.kernels.tensor import squeeze_1

INT_MAX = np.iinfo(np.int64).max
INT_MIN = np.iinfo(np.int64).min


def assert_matches_reference(node: onnx.NodeProto, opset: int, *inputs) -> list:
    got = run_kernel(node, opset, *inputs)
    expected = reference_node(node, [*inputs], opset)
    assert len(got) >= len(expected)
    for g, e in zip(got, expected):
        g = np.asarray(g)
        assert g.dtype == e.dtype
        assert g.shape == e.shape
        np.testing.assert_array_equal(g, e)
    return got


def node(op_type: str, inputs: list[str], outputs: list[str] | None = None, **attributes) -> onnx.NodeProto:
    return helper.make_node(op_type, inputs, outputs or ["y"], **attributes)


rng = np.random.default_rng(0)


# --- older opsets: attributes that later became inputs ----------------------------------


def test_reshape_5_copies_zero_dims_from_the_input():
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    assert_matches_reference(node("Reshape", ["x", "s"]), 5, x, np.array([0, -1, 2], np.int64))


def test_reshape_1_reads_the_shape_attribute():
    x = np.arange(12, dtype=np.float32)
    (y,) = run_kernel(node("Reshape", ["x"], shape=[3, 0, 2]), 1, x.reshape(3, 2, 2))
    np.testing.assert_array_equal(y, x.reshape(3, 2, 2))


def test_reshape_allowzero_keeps_a_zero_dimension():
    x = np.zeros((0, 3), np.float32)
    (y,) = assert_matches_reference(node("Reshape", ["x", "s"], allowzero=1), 14, x, np.array([3, 0], np.int64))
    assert y.shape == (3, 0)


def test_slice_1_reads_starts_ends_axes_attributes():
    x = rng.standard_normal((4, 5, 6)).astype(np.float32)
    assert_matches_reference(node("Slice", ["x"], starts=[1, -4], ends=[1000, -1], axes=[0, 2]), 1, x)


@pytest.mark.parametrize(
    ("starts", "ends", "steps"),
    [
        ([-1, INT_MAX], [INT_MIN, 0], [-1, -2]),
        ([10, 2], [-10, 7], [-3, 2]),
        ([0, -100], [INT_MAX, 100], [1, 1]),
        ([3, 4], [3, 4], [1, -1]),
        ([-1, 5], [-10, -10], [-2, -1]),
    ],
)
def test_slice_clamps_starts_and_ends_for_both_step_signs(starts, ends, steps):
    x = rng.standard_normal((5, 6)).astype(np.float32)
    ints = lambda v: np.array(v, np.int64)  # noqa: E731
    assert_matches_reference(
        node("Slice", ["x", "s", "e", "a", "t"]), 13, x, ints(starts), ints(ends), ints([0, 1]), ints(steps)
    )


def test_split_2_reads_the_split_attribute():
    x = rng.standard_normal((2, 7)).astype(np.float32)
    assert_matches_reference(node("Split", ["x"], ["a", "b", "c"], axis=1, split=[1, 4, 2]), 2, x)


def test_split_11_splits_equally_by_output_count():
    x = rng.standard_normal((6, 2)).astype(np.float32)
    assert_matches_reference(node("Split", ["x"], ["a", "b", "c"], axis=-2), 11, x)


def test_split_18_uneven_num_outputs_makes_the_last_part_smaller():
    x = np.arange(10, dtype=np.int64)
    parts = run_kernel(node("Split", ["x"], ["a", "b", "c", "d"], num_outputs=4), 18, x)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_squeeze_and_unsqueeze_11_read_the_axes_attribute():
    x = rng.standard_normal((1, 3, 1, 2)).astype(np.float32)
    assert_matches_reference(node("Squeeze", ["x"], axes=[0, -2]), 11, x)
    assert_matches_reference(node("Unsqueeze", ["x"], axes=[-1, 0]), 11, x)


def test_squeeze_with_empty_axes_removes_every_size_one_axis():
    x = rng.standard_normal((1, 3, 1)).astype(np.float32)
    (y,) = run_kernel(node("Squeeze", ["x", "a"]), 13, x, np.array([], np.int64))
    assert y.shape == (3,)
    assert squeeze_1(x, axes=[]).shape == (3,)


def test_split_with_an_empty_split_input_splits_equally():
    x = np.arange(6, dtype=np.float32)
    parts = run_kernel(node("Split", ["x", "s"], ["a", "b"]), 13, x, np.array([], np.int64))
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5]]


def test_pad_2_reads_pads_and_value_attributes():
    x = rng.standard_normal((2, 3)).astype(np.float32)
    assert_matches_reference(node("Pad", ["x"], pads=[1, 0, 2, 3], value=1.5), 2, x)


def test_pad_negative_pads_crop():
    x = np.arange(20, dtype=np.int32).reshape(4, 5)
    (y,) = run_kernel(node("Pad", ["x", "p"]), 11, x, np.array([-1, 2, 1, -2], np.int64))
    expected = np.pad(x[1:, :3], [(0, 1), (2, 0)])
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("mode", ["reflect", "edge", "wrap"])
def test_pad_modes_match_numpy_on_chosen_axes(mode):
    x = rng.standard_normal((3, 4, 5)).astype(np.float32)
    pads = np.array([2, 1, 1, 3], np.int64)
    (y,) = run_kernel(node("Pad", ["x", "p", "", "a"], mode=mode), 19, x, pads, None, np.array([-1, 0], np.int64))
    np.testing.assert_array_equal(y, np.pad(x, [(1, 3), (0, 0), (2, 1)], mode=mode))
    assert y.dtype == np.float32


def test_tile_1_repeats_along_one_axis():
    x = rng.standard_normal((2, 3)).astype(np.float32)
    (y,) = run_kernel(node("Tile", ["x", "t", "a"]), 1, x, np.array(3, np.int64), np.array(1, np.int64))
    np.testing.assert_array_equal(y, np.tile(x, (1, 3)))


def test_topk_1_reads_k_from_its_attribute():
    x = rng.standard_normal((3, 8)).astype(np.float32)
    assert_matches_reference(node("TopK", ["x"], ["v", "i"], k=3), 1, x)


def test_concat_1_defaults_to_axis_1():
    a, b = np.ones((2, 2), np.float32), np.zeros((2, 3), np.float32)
    (y,) = run_kernel(node("Concat", ["a", "b"]), 1, a, b)
    assert y.shape == (2, 5)


def test_depth_to_space_1_uses_dcr_order():
    x = rng.standard_normal((1, 8, 2, 3)).astype(np.float32)
    assert_matches_reference(node("DepthToSpace", ["x"], blocksize=2), 1, x)


# --- larger random inputs against onnx.reference -----------------------------------------


@pytest.mark.parametrize("largest", [0, 1])
@pytest.mark.parametrize(("n", "k"), [(40, 25), (200, 7), (9, 1)])
def test_topk_breaks_ties_by_lower_index(largest, n, k):
    x = rng.integers(0, 4, size=(5, n, 3)).astype(np.float32)
    values, indices = assert_matches_reference(
        node("TopK", ["x", "k"], ["v", "i"], axis=1, largest=largest), 11, x, np.array([k], np.int64)
    )
    assert indices.dtype == np.int64


@pytest.mark.parametrize("largest", [0, 1])
def test_topk_orders_nan_above_every_number(largest):
    x = rng.standard_normal((4, 30)).astype(np.float32)
    x[:, ::7] = np.nan
    assert_matches_reference(node("TopK", ["x", "k"], ["v", "i"], largest=largest), 11, x, np.array([3], np.int64))


def test_topk_keeps_unsigned_values_on_axis_0():
    x = rng.integers(0, 2**63, size=(30, 3), dtype=np.uint64)
    assert_matches_reference(node("TopK", ["x", "k"], ["v", "i"], axis=0), 24, x, np.array([4], np.int64))


def test_gather_nd_with_two_batch_dims():
    data = rng.standard_normal((2, 3, 4, 5, 6)).astype(np.float32)
    indices = rng.integers(-4, 4, size=(2, 3, 7, 2))
    indices[..., 1] = rng.integers(0, 5, size=(2, 3, 7))
    assert_matches_reference(node("GatherND", ["d", "i"], batch_dims=2), 13, data, indices)


def test_gather_elements_with_indices_smaller_than_data():
    data = rng.standard_normal((4, 5)).astype(np.float32)
    indices = rng.integers(-4, 4, size=(3, 2))
    (y,) = run_kernel(node("GatherElements", ["d", "i"], axis=0), 13, data, indices)
    expected = np.array([[data[indices[i, j], j] for j in range(2)] for i in range(3)])
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
def test_scatter_elements_reductions_with_duplicates(reduction):
    data = rng.standard_normal((4, 6)).astype(np.float32)
    indices = rng.integers(-6, 6, size=(4, 9))
    updates = rng.standard_normal((4, 9)).astype(np.float32)
    node_ = node("ScatterElements", ["d", "i", "u"], axis=1, reduction=reduction)
    (y,) = run_kernel(node_, 18, data, indices, updates)
    np.testing.assert_allclose(y, reference_node(node_, [data, indices, updates], 18)[0], rtol=1e-6)


@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
def test_scatter_nd_reductions_with_duplicates(reduction):
    data = rng.standard_normal((5, 4, 3)).astype(np.float32)
    indices = rng.integers(0, 4, size=(6, 2))
    updates = rng.standard_normal((6, 3)).astype(np.float32)
    node_ = node("ScatterND", ["d", "i", "u"], reduction=reduction)
    (y,) = run_kernel(node_, 18, data, indices, updates)
    np.testing.assert_allclose(y, reference_node(node_, [data, indices, updates], 18)[0], rtol=1e-6)


def test_scatter_does_not_modify_its_input():
    data = np.zeros((3, 3), np.float32)
    run_kernel(node("ScatterND", ["d", "i", "u"]), 13, data, np.array([[1]]), np.ones((1, 3), np.float32))
    assert not data.any()


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensor_scatter_writes_each_batch_row_at_its_index(mode):
    cache = rng.standard_normal((3, 2, 8, 4)).astype(np.float32)
    update = rng.standard_normal((3, 2, 3, 4)).astype(np.float32)
    write = np.array([0, 5, 7 if mode == "circular" else 2], np.int64)
    assert_matches_reference(node("TensorScatter", ["c", "u", "w"], mode=mode), 24, cache, update, write)


@pytest.mark.parametrize(("batch_axis", "time_axis"), [(0, 1), (1, 0)])
def test_reverse_sequence_on_rank_3(batch_axis, time_axis):
    x = rng.standard_normal((5, 6, 2)).astype(np.float32)
    lens = rng.integers(1, x.shape[time_axis] + 1, size=x.shape[batch_axis])
    assert_matches_reference(
        node("ReverseSequence", ["x", "l"], batch_axis=batch_axis, time_axis=time_axis), 10, x, lens
    )


def test_unique_unsorted_with_axis_orders_by_first_occurrence():
    x = np.array([[3, 1, 3, 2, 1], [0, 5, 0, 4, 5]], np.int64)
    y, first, inverse, counts = run_kernel(node("Unique", ["x"], ["y", "i", "v", "c"], axis=1, sorted=0), 11, x)
    np.testing.assert_array_equal(y, [[3, 1, 2], [0, 5, 4]])
    np.testing.assert_array_equal(first, [0, 1, 3])
    np.testing.assert_array_equal(inverse, [0, 1, 0, 2, 1])
    np.testing.assert_array_equal(counts, [2, 2, 1])


@pytest.mark.parametrize(("exclusive", "reverse"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum_keeps_int32_on_a_middle_axis(exclusive, reverse):
    x = rng.integers(-5, 5, size=(3, 4, 2)).astype(np.int32)
    (y,) = assert_matches_reference(
        node("CumSum", ["x", "a"], exclusive=exclusive, reverse=reverse), 14, x, np.array(1, np.int32)
    )
    assert y.dtype == np.int32


def test_one_hot_accepts_float_indices_and_depth():
    indices = np.array([[0.0, 2.0], [-1.0, 7.0]], np.float32)
    (y,) = run_kernel(node("OneHot", ["i", "d", "v"], axis=0), 11, indices, np.array(3.0, np.float32),
                      np.array([-1, 4], np.int32))
    expected = np.full((3, 2, 2), -1, np.int32)
    expected[0, 0, 0] = expected[2, 0, 1] = expected[2, 1, 0] = 4
    np.testing.assert_array_equal(y, expected)


def test_non_zero_of_a_scalar_has_rank_zero_coordinates():
    (y,) = run_kernel(node("NonZero", ["x"]), 13, np.array(5.0, np.float32))
    assert y.shape == (0, 1) and y.dtype == np.int64


def test_center_crop_pad_crops_one_axis_and_pads_another():
    x = rng.standard_normal((5, 2, 3)).astype(np.float32)
    (y,) = run_kernel(node("CenterCropPad", ["x", "s"], axes=[0, 1]), 18, x, np.array([2, 5], np.int64))
    expected = np.zeros((2, 5, 3), np.float32)
    expected[:, 1:3] = x[1:3]
    np.testing.assert_array_equal(y, expected)


def test_trilu_works_on_a_batch_of_matrices():
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float16)
    (y,) = assert_matches_reference(node("Trilu", ["x", "k"], upper=0), 14, x, np.array(-1, np.int64))
    assert y.dtype == np.float16


# --- strings move through data-movement ops ---------------------------------------------

WORDS = np.array([["a", "bb", "ccc"], ["d", "ee", "fff"]], dtype=object)


@pytest.mark.parametrize(
    ("op", "opset", "extra", "attributes", "expected"),
    [
        ("Identity", 13, [], {}, WORDS),
        ("Transpose", 13, [], {}, WORDS.T),
        ("Reshape", 14, [np.array([3, 2], np.int64)], {}, WORDS.reshape(3, 2)),
        ("Gather", 13, [np.array([2, 0], np.int64)], {"axis": 1}, WORDS[:, [2, 0]]),
        ("Slice", 13, [np.array([1]), np.array([3]), np.array([1])], {}, WORDS[:, 1:3]),
        ("Pad", 18, [np.array([0, 1, 0, 0], np.int64)], {}, np.array([["", "a", "bb", "ccc"], ["", "d", "ee", "fff"]], dtype=object)),
        ("Tile", 13, [np.array([1, 2], np.int64)], {}, np.tile(WORDS, (1, 2))),
        ("Expand", 13, [np.array([2, 2, 3], np.int64)], {}, np.stack([WORDS, WORDS])),
        ("Compress", 11, [np.array([False, True])], {"axis": 0}, WORDS[1:]),
    ],
)
def test_string_tensors_move_through(op, opset, extra, attributes, expected):
    inputs = ["x"] + [f"i{k}" for k in range(len(extra))]
    (y,) = run_kernel(node(op, inputs, **attributes), opset, WORDS, *extra)
    assert y.dtype == object
    np.testing.assert_array_equal(y, expected)


def test_string_tensors_concat_and_split():
    (joined,) = run_kernel(node("Concat", ["a", "b"], axis=0), 13, WORDS, WORDS)
    assert joined.shape == (4, 3) and joined.dtype == object
    first, second = run_kernel(node("Split", ["x"], ["a", "b"], axis=0), 13, joined)
    np.testing.assert_array_equal(first, WORDS)
    np.testing.assert_array_equal(second, WORDS)


# --- shape-like ops return views -----------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "opset", "extra", "attributes"),
    [
        ("Reshape", 14, [np.array([4, -1], np.int64)], {}),
        ("Transpose", 13, [], {"perm": [2, 0, 1]}),
        ("Squeeze", 13, [np.array([0], np.int64)], {}),
        ("Unsqueeze", 13, [np.array([0, -1], np.int64)], {}),
        ("Flatten", 13, [], {"axis": 2}),
        ("Slice", 13, [np.array([0, 5]), np.array([1, 0]), np.array([0, 2]), np.array([1, -2])], {}),
        ("Expand", 13, [np.array([3, 1, 1, 1], np.int64)], {}),
        ("Identity", 13, [], {}),
        ("Split", 13, [], {"axis": 2}),
    ],
)
def test_shape_ops_return_views_of_their_input(op, opset, extra, attributes):
    x = rng.standard_normal((1, 4, 6)).astype(np.float32)
    inputs = ["x"] + [f"i{k}" for k in range(len(extra))]
    outputs = run_kernel(node(op, inputs, ["y"], **attributes), opset, x, *extra)
    assert all(np.shares_memory(y, x) for y in outputs)


def test_top_k_of_an_empty_axis_returns_empty_values_and_indices():
    x = np.zeros((2, 0, 3), np.float32)
    values, indices = run_kernel("TopK", 11, x, np.array([0], np.int64), axis=1, num_outputs=2)
    assert values.shape == indices.shape == (2, 0, 3)
    assert values.dtype == np.float32 and indices.dtype == np.int64
