"""Convolution, pooling, softmax, dropout and LRN kernels, checked against onnx.reference
and independently written numpy."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from onnx import helper

import plugrt
from helpers import graph_model, reference_model, run_model


def _random(*shape, dtype=np.float32, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------------------
# Conv
# ---------------------------------------------------------------------------

CONV_CASES = {
    "3x3_pad": ((1, 4, 9, 9), (6, 4, 3, 3), dict(pads=[1, 1, 1, 1])),
    "groups_strides_dilations_asymmetric_pads": (
        (2, 4, 9, 8),
        (6, 2, 3, 2),
        dict(group=2, strides=[2, 1], pads=[0, 1, 2, 0], dilations=[1, 2]),
    ),
    "1d": ((2, 4, 10), (4, 4, 3), dict(strides=[2], pads=[1, 1])),
    "3d": ((1, 3, 5, 6, 7), (4, 3, 2, 3, 2), dict(pads=[1, 0, 1, 0, 1, 1], strides=[1, 2, 2])),
    "depthwise_multiplier": ((2, 6, 9, 9), (12, 1, 3, 3), dict(group=6, pads=[1, 1, 1, 1], strides=[2, 2])),
    "depthwise_same_upper_dilated": ((2, 6, 9, 9), (6, 1, 3, 3), dict(group=6, auto_pad="SAME_UPPER", dilations=[2, 2])),
    # many channels on a small image: the channels-last depthwise layout
    "depthwise_many_channels": ((2, 40, 5, 6), (40, 1, 3, 3), dict(group=40, pads=[1, 1, 1, 1])),
    "depthwise_many_channels_strided": ((1, 40, 7, 6), (80, 1, 3, 2), dict(group=40, pads=[1, 0, 1, 1], strides=[2, 2])),
    "depthwise_1d": ((2, 4, 13), (8, 1, 3), dict(group=4, pads=[2, 1], strides=[2])),
    "depthwise_3d_dilated": ((1, 4, 5, 6, 7), (4, 1, 3, 2, 3), dict(group=4, pads=[1, 0, 1, 1, 1, 0], dilations=[1, 2, 1])),
    "pointwise": ((2, 6, 9, 9), (5, 6, 1, 1), {}),
    "pointwise_grouped_strided": ((2, 6, 9, 9), (6, 3, 1, 1), dict(group=2, strides=[2, 2])),
    "same_lower_strided": ((1, 6, 10, 9), (4, 6, 3, 3), dict(auto_pad="SAME_LOWER", strides=[2, 2])),
    "valid": ((1, 6, 10, 9), (4, 6, 3, 3), dict(auto_pad="VALID", strides=[2, 3])),
    "kernel_larger_than_padded_overlap": ((1, 2, 5, 5), (4, 2, 7, 7), dict(pads=[1, 1, 1, 1])),
}


@pytest.mark.parametrize("name", sorted(CONV_CASES))
@pytest.mark.parametrize("constant_weight", [True, False])
def test_conv_matches_reference(name, constant_weight):
    x_shape, w_shape, attrs = CONV_CASES[name]
    x, w, b = _random(*x_shape), _random(*w_shape, seed=1), _random(w_shape[0], seed=2)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], **attrs)
    if constant_weight:
        model = graph_model([node], {"x": x}, ["y"], 11, {"w": w, "b": b})
        feeds = {"x": x}
    else:
        model = graph_model([node], {"x": x, "w": w, "b": b}, ["y"], 11)
        feeds = {"x": x, "w": w, "b": b}
    (got,) = run_model(model, feeds)
    (expected,) = reference_model(model, feeds)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_conv_over_several_im2col_blocks_and_repeated_runs_matches_reference():
    # 300 output rows of 8*9*200 floats do not fit one im2col block; two convs of
    # different geometry share the scratch buffer between them, run after run.
    x = _random(2, 8, 300, 200)
    w1, w2 = _random(8, 4, 3, 3, seed=1), _random(3, 8, 5, 3, seed=2)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["h"], group=2, pads=[1, 2, 1, 0], strides=[2, 1]),
        helper.make_node("Conv", ["h", "w2"], ["y"], pads=[2, 0, 0, 1]),
    ]
    model = graph_model(nodes, {"x": x}, ["y"], 11, {"w1": w1, "w2": w2})
    session = plugrt.InferenceSession(model.SerializeToString())
    (expected,) = reference_model(model, {"x": x})
    for _ in range(2):
        (got,) = session.run(None, {"x": x})
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3)


def test_conv_float16_stays_float16():
    x, w = _random(1, 3, 8, 8, dtype=np.float16), _random(4, 3, 3, 3, dtype=np.float16, seed=1)
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    (got,) = run_model(graph_model([node], {"x": x}, ["y"], 11, {"w": w}), {"x": x})
    x32, w32 = x.astype(np.float32), w.astype(np.float32)
    (expected,) = reference_model(graph_model([node], {"x": x32}, ["y"], 11, {"w": w32}), {"x": x32})
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), expected, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------
# ConvTranspose, Col2Im, DeformConv, CausalConvWithState
# ---------------------------------------------------------------------------

CONV_TRANSPOSE_CASES = {
    "plain": ((1, 4, 5, 5), (4, 3, 3, 3), {}),
    "strides_pads_dilations": ((2, 4, 5, 6), (4, 3, 3, 2), dict(strides=[2, 3], pads=[1, 0, 0, 1], dilations=[1, 2])),
    "1d": ((1, 4, 5), (4, 2, 3), dict(strides=[2], pads=[1, 2])),
    "3d": ((1, 2, 3, 4, 3), (2, 2, 2, 3, 2), dict(strides=[2, 1, 2])),
    "same_upper": ((1, 3, 4, 4), (3, 2, 3, 3), dict(strides=[2, 2], auto_pad="SAME_UPPER")),
    "same_lower": ((1, 3, 4, 4), (3, 2, 3, 3), dict(strides=[2, 2], auto_pad="SAME_LOWER")),
}


@pytest.mark.parametrize("name", sorted(CONV_TRANSPOSE_CASES))
def test_conv_transpose_matches_reference(name):
    x_shape, w_shape, attrs = CONV_TRANSPOSE_CASES[name]
    x, w, b = _random(*x_shape), _random(*w_shape, seed=1), _random(w_shape[1], seed=2)
    model = graph_model([helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs)], {"x": x}, ["y"], 11, {"w": w, "b": b})
    (got,) = run_model(model, {"x": x})
    (expected,) = reference_model(model, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def _conv_transpose_numpy(x, w, group, strides, pads, output_padding=(0, 0)):
    """Scatter every input pixel times its kernel into the full output, then crop (2-D)."""
    n, c, h, wd = x.shape
    mg, kh, kw = w.shape[1:]
    full = np.zeros((n, mg * group, (h - 1) * strides[0] + kh + output_padding[0],
                     (wd - 1) * strides[1] + kw + output_padding[1]), dtype=np.float64)
    cg = c // group
    for ci, i, j in itertools.product(range(c), range(h), range(wd)):
        g = ci // cg
        patch = x[:, ci, i, j, None, None, None] * w[ci][None]
        full[:, g * mg:(g + 1) * mg, i * strides[0]:i * strides[0] + kh, j * strides[1]:j * strides[1] + kw] += patch
    return full[:, :, pads[0]:full.shape[2] - pads[2], pads[1]:full.shape[3] - pads[3]]


def test_grouped_conv_transpose_with_output_padding_matches_numpy():
    x, w = _random(2, 4, 3, 4), _random(4, 3, 3, 2, seed=1)
    attrs = dict(group=2, strides=[2, 3], pads=[1, 0, 0, 1], output_padding=[1, 1])
    model = graph_model([helper.make_node("ConvTranspose", ["x", "w"], ["y"], **attrs)], {"x": x}, ["y"], 11, {"w": w})
    (got,) = run_model(model, {"x": x})
    expected = _conv_transpose_numpy(x, w, 2, [2, 3], [1, 0, 0, 1], [1, 1])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_conv_transpose_output_shape_splits_padding_as_the_spec_says():
    # total padding 1 on the width: NOTSET puts the odd pixel at the start.
    x, w = _random(1, 3, 4, 4), _random(3, 2, 3, 3, seed=1)
    model = graph_model([helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[3, 2], output_shape=[10, 8])], {"x": x}, ["y"], 11, {"w": w})
    (got,) = run_model(model, {"x": x})
    full = _conv_transpose_numpy(x, w, 1, [3, 2], [0, 0, 0, 0])  # 12 x 9
    np.testing.assert_allclose(got, full[:, :, 1:11, 1:9], rtol=1e-4, atol=1e-4)


def test_col2im_matches_reference():
    x = _random(2, 3 * 2 * 3, 4 * 3)  # C=3, block 2x3, 4x3 blocks over a 7x6 image
    attrs = dict(strides=[2, 1], pads=[1, 0, 0, 1], dilations=[1, 2])
    image, block = np.array([7, 6], np.int64), np.array([2, 3], np.int64)
    model = graph_model([helper.make_node("Col2Im", ["x", "i", "b"], ["y"], **attrs)], {"x": x}, ["y"], 18, {"i": image, "b": block})
    (got,) = run_model(model, {"x": x})
    (expected,) = reference_model(model, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_deform_conv_matches_reference_with_groups_mask_and_out_of_image_offsets():
    x, w, b = _random(2, 4, 5, 4), _random(4, 2, 3, 2, seed=1), _random(4, seed=2)
    attrs = dict(group=2, offset_group=2, pads=[1, 0, 1, 1], strides=[2, 1], dilations=[1, 2])
    offset = _random(2, 2 * 3 * 2 * 2, 3, 3, seed=3) * 2  # pushes some taps outside the image
    mask = np.random.default_rng(4).random((2, 2 * 3 * 2, 3, 3)).astype(np.float32)
    feeds = {"x": x, "offset": offset, "mask": mask}
    node = helper.make_node("DeformConv", ["x", "w", "offset", "b", "mask"], ["y"], **attrs)
    model = graph_model([node], feeds, ["y"], 19, {"w": w, "b": b})
    (got,) = run_model(model, feeds)
    (expected,) = reference_model(model, feeds)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_deform_conv_with_zero_offsets_is_conv():
    x, w = _random(1, 3, 6, 7), _random(4, 3, 3, 3, seed=1)
    offset = np.zeros((1, 2 * 9, 3, 4), np.float32)
    attrs = dict(pads=[1, 1, 1, 1], strides=[2, 2])
    deform = graph_model([helper.make_node("DeformConv", ["x", "w", "o"], ["y"], **attrs)], {"x": x, "o": offset}, ["y"], 19, {"w": w})
    conv = graph_model([helper.make_node("Conv", ["x", "w"], ["y"], **attrs)], {"x": x}, ["y"], 11, {"w": w})
    (got,) = run_model(deform, {"x": x, "o": offset})
    (expected,) = reference_model(conv, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_causal_conv_with_state_in_two_steps_equals_one_step():
    x, w, b = _random(2, 3, 9), _random(3, 1, 4, seed=1), _random(3, seed=2)
    node = helper.make_node("CausalConvWithState", ["x", "w", "b", "s"], ["y", "state"], activation="silu")
    empty = np.zeros((2, 3, 3), np.float32)
    model = graph_model([node], {"x": x, "s": empty}, ["y", "state"], 27, {"w": w, "b": b}, fixed_shapes=False)
    session = plugrt.InferenceSession(model.SerializeToString())
    whole, whole_state = session.run(None, {"x": x, "s": empty})
    first, state = session.run(None, {"x": x[:, :, :5], "s": empty})
    second, last_state = session.run(None, {"x": x[:, :, 5:], "s": state})
    np.testing.assert_allclose(np.concatenate([first, second], axis=2), whole, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(last_state, whole_state)
    np.testing.assert_array_equal(whole_state, x[:, :, -3:])


# ---------------------------------------------------------------------------
# Pooling
# ---------------------------------------------------------------------------

POOL_CASES = {
    "pads_strides": ((2, 3, 7, 8), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "ceil_asymmetric_pads": ((2, 3, 7, 8), dict(kernel_shape=[3, 2], strides=[2, 3], pads=[1, 0, 2, 1], ceil_mode=1)),
    "dilations_ceil": ((2, 3, 9, 8), dict(kernel_shape=[2, 3], strides=[1, 2], dilations=[2, 2], ceil_mode=1)),
    "1d": ((2, 3, 9), dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
    "3d": ((1, 2, 5, 6, 7), dict(kernel_shape=[2, 3, 2], strides=[2, 1, 2], pads=[0, 1, 1, 1, 0, 1])),
    "same_upper": ((2, 3, 7, 8), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER")),
    "valid": ((2, 3, 7, 8), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="VALID")),
}


def _windows(x, kernel, strides, dilations, pads, out):
    """Each pooling window: output position, the input positions it reads (window order),
    their values (last axis) and its size counting explicit padding."""
    rank = len(kernel)
    spatial = x.shape[2:]
    for o in itertools.product(*(range(n) for n in out)):
        taps = [[o[i] * strides[i] - pads[i] + t * dilations[i] for t in range(kernel[i])] for i in range(rank)]
        inside = [[p for p in taps[i] if 0 <= p < spatial[i]] for i in range(rank)]
        padded = [[p for p in taps[i] if -pads[i] <= p < spatial[i] + pads[rank + i]] for i in range(rank)]
        positions = list(itertools.product(*inside))
        values = np.stack([x[(slice(None), slice(None)) + pos] for pos in positions], axis=-1)
        yield o, positions, values, int(np.prod([len(p) for p in padded]))


def _explicit_pads(shape, attrs):
    rank = len(shape) - 2
    if attrs.get("auto_pad") == "SAME_UPPER":
        assert shape[2:] == (7, 8) and attrs["kernel_shape"] == [3, 3] and attrs["strides"] == [2, 2]
        return [1, 0, 1, 1]  # total padding 2 (1 + 1) on the height, 1 (0 + 1) on the width
    return attrs.get("pads", [0] * 2 * rank)


@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_average_pool_with_ceil_mode_counts_only_real_or_explicitly_padded_taps(count_include_pad):
    # 7 wide, kernel 3, stride 2, pads 1/1, ceil: 4 outputs, the last window runs past the padding.
    x = _random(1, 2, 7, 7)
    kernel, strides, pads = [3, 3], [2, 2], [1, 1, 1, 1]
    attrs = dict(kernel_shape=kernel, strides=strides, pads=pads, ceil_mode=1, count_include_pad=count_include_pad)
    model = graph_model([helper.make_node("AveragePool", ["x"], ["y"], **attrs)], {"x": x}, ["y"], 19)
    (got,) = run_model(model, {"x": x})
    expected = np.zeros((1, 2, 4, 4), np.float64)
    for o, _, values, padded_count in _windows(x, kernel, strides, [1, 1], pads, [4, 4]):
        divisor = padded_count if count_include_pad else values.shape[-1]
        expected[(slice(None), slice(None)) + o] = values.sum(axis=-1) / divisor
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(POOL_CASES))
@pytest.mark.parametrize("storage_order", [0, 1])
def test_max_pool_values_and_indices_match_numpy(name, storage_order):
    shape, attrs = POOL_CASES[name]
    x = _random(*shape)
    model = graph_model([helper.make_node("MaxPool", ["x"], ["y", "i"], storage_order=storage_order, **attrs)], {"x": x}, ["y", "i"], 12)
    got, indices = run_model(model, {"x": x})
    rank = len(shape) - 2
    spatial = shape[2:]
    # Flat index of a position: row-major, or column-major in the image plane for storage_order=1.
    plane_strides = [int(np.prod(spatial[i + 1:] if storage_order == 0 else spatial[:i])) for i in range(rank)]
    channel_base = np.arange(shape[0] * shape[1]).reshape(shape[:2]) * int(np.prod(spatial))
    expected, expected_indices = np.zeros(got.shape, np.float32), np.zeros(got.shape, np.int64)
    windows = _windows(x, attrs["kernel_shape"], attrs.get("strides", [1] * rank), attrs.get("dilations", [1] * rank),
                       _explicit_pads(shape, attrs), got.shape[2:])
    for o, positions, values, _ in windows:
        where = (slice(None), slice(None)) + o
        first = values.argmax(axis=-1)  # the first maximum in window order
        expected[where] = values.max(axis=-1)
        flat = np.array([sum(p * s for p, s in zip(pos, plane_strides)) for pos in positions])
        expected_indices[where] = channel_base + flat[first]
    np.testing.assert_array_equal(got, expected)
    assert indices.dtype == np.int64
    np.testing.assert_array_equal(indices, expected_indices)


@pytest.mark.parametrize("name", sorted(POOL_CASES))
@pytest.mark.parametrize("op, extra", [("AveragePool", {}), ("AveragePool", {"count_include_pad": 1}),
                                       ("LpPool", {"p": 2}), ("LpPool", {"p": 3})])
def test_sum_pools_match_numpy(name, op, extra):
    shape, attrs = POOL_CASES[name]
    x = _random(*shape)
    model = graph_model([helper.make_node(op, ["x"], ["y"], **attrs, **extra)], {"x": x}, ["y"], 19)
    (got,) = run_model(model, {"x": x})
    expected = np.zeros(got.shape, np.float64)
    rank = len(shape) - 2
    strides = attrs.get("strides", [1] * rank)
    dilations = attrs.get("dilations", [1] * rank)
    pads = _explicit_pads(shape, attrs)
    for o, _, values, padded_count in _windows(x, attrs["kernel_shape"], strides, dilations, pads, got.shape[2:]):
        where = (slice(None), slice(None)) + o
        if op == "LpPool":
            expected[where] = (np.abs(values.astype(np.float64)) ** extra["p"]).sum(axis=-1) ** (1 / extra["p"])
        else:
            divisor = padded_count if extra.get("count_include_pad") else values.shape[-1]
            expected[where] = values.sum(axis=-1) / divisor
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op, numpy_fn", [
    ("GlobalAveragePool", lambda x, axes: x.mean(axis=axes, keepdims=True)),
    ("GlobalMaxPool", lambda x, axes: x.max(axis=axes, keepdims=True)),
    ("GlobalLpPool", lambda x, axes: np.sqrt((x.astype(np.float64) ** 2).sum(axis=axes, keepdims=True))),
])
@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3, 4, 5), (1, 2, 3, 4, 5)])
def test_global_pools_match_numpy(op, numpy_fn, shape):
    x = _random(*shape)
    (got,) = run_model(graph_model([helper.make_node(op, ["x"], ["y"])], {"x": x}, ["y"], 2), {"x": x})
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, numpy_fn(x, tuple(range(2, len(shape)))), rtol=1e-5, atol=1e-6)


def test_max_unpool_inverts_max_pool_of_an_odd_sized_input_given_its_shape():
    # Indices from a 5x7 input address the 5x7 plane; the inferred unpool shape is 4x6.
    x = _random(2, 3, 5, 7)
    nodes = [
        helper.make_node("MaxPool", ["x"], ["p", "i"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("MaxUnpool", ["p", "i", "shape"], ["y"], kernel_shape=[2, 2], strides=[2, 2]),
    ]
    model = graph_model(nodes, {"x": x}, ["p", "i", "y"], 11, {"shape": np.array(x.shape, np.int64)})
    pooled, indices, got = run_model(model, {"x": x})
    expected = np.zeros(x.size, np.float32)
    expected[indices.reshape(-1)] = pooled.reshape(-1)
    np.testing.assert_array_equal(got, expected.reshape(x.shape))


# ---------------------------------------------------------------------------
# Softmax family
# ---------------------------------------------------------------------------


def _softmax_numpy(x, axis):
    e = np.exp(x.astype(np.float64) - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@pytest.mark.parametrize("axis", [0, 1, 2, 3, -1, -3])
def test_softmax_before_opset_13_flattens_to_2d_at_axis(axis):
    x = _random(2, 3, 4, 5) * 10
    (got,) = run_model(graph_model([helper.make_node("Softmax", ["x"], ["y"], axis=axis)], {"x": x}, ["y"], 11), {"x": x})
    rows = int(np.prod(x.shape[: axis % 4]))
    expected = _softmax_numpy(x.reshape(rows, -1), 1).reshape(x.shape)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_softmax_and_log_softmax_since_opset_13_work_on_one_axis(axis):
    x = _random(2, 3, 4, 5) * 10
    nodes = [helper.make_node("Softmax", ["x"], ["s"], axis=axis), helper.make_node("LogSoftmax", ["x"], ["l"], axis=axis)]
    softmax, log_softmax = run_model(graph_model(nodes, {"x": x}, ["s", "l"], 13), {"x": x})
    expected = _softmax_numpy(x, axis)
    assert softmax.dtype == log_softmax.dtype == np.float32
    np.testing.assert_allclose(softmax, expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(log_softmax, np.log(expected), rtol=1e-5, atol=1e-5)


def test_log_softmax_of_large_logits_stays_finite():
    x = np.array([[0.0, 1000.0, 2000.0]], np.float32)
    (got,) = run_model(graph_model([helper.make_node("LogSoftmax", ["x"], ["y"])], {"x": x}, ["y"], 13), {"x": x})
    np.testing.assert_allclose(got, [[-2000.0, -1000.0, 0.0]])


@pytest.mark.parametrize("opset, axis, expected", [
    (13, -1, [[[0, 1, 0], [1, 0, 0]], [[0, 0, 1], [1, 0, 0]]]),
    (11, 1, [[[0, 1, 0], [0, 0, 0]], [[0, 0, 0], [1, 0, 0]]]),  # rows of 6 elements
])
def test_hardmax_marks_the_first_maximum(opset, axis, expected):
    x = np.array([[[1, 3, 3], [2, 2, 1]], [[0, 1, 2], [5, 5, 5]]], np.float32)
    (got,) = run_model(graph_model([helper.make_node("Hardmax", ["x"], ["y"], axis=axis)], {"x": x}, ["y"], opset), {"x": x})
    np.testing.assert_array_equal(got, np.array(expected, np.float32))


# ---------------------------------------------------------------------------
# Dropout and LRN
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("opset, mask_dtype", [(7, np.float32), (10, np.bool_), (13, np.bool_)])
def test_dropout_at_inference_is_identity_with_an_all_true_mask(opset, mask_dtype):
    x = _random(3, 4)
    (y, mask) = run_model(graph_model([helper.make_node("Dropout", ["x"], ["y", "m"])], {"x": x}, ["y", "m"], opset), {"x": x})
    np.testing.assert_array_equal(y, x)
    assert mask.dtype == mask_dtype and mask.shape == x.shape and np.all(mask == 1)


def test_training_dropout_with_a_seed_follows_numpys_seeded_uniform_stream():
    x, ratio = _random(4, 5), np.array(0.3, np.float32)
    node = helper.make_node("Dropout", ["x", "r", "t"], ["y", "m"], seed=7)
    feeds = {"x": x, "r": ratio, "t": np.array(True)}
    y, mask = run_model(graph_model([node], feeds, ["y", "m"], 13), feeds)
    expected_mask = np.random.RandomState(7).uniform(0, 1, x.shape) >= 0.3
    np.testing.assert_array_equal(mask, expected_mask)
    np.testing.assert_allclose(y, expected_mask * x / np.float32(0.7), rtol=1e-6)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_lrn_matches_numpy_for_odd_and_even_sizes(size):
    x = _random(2, 6, 3, 4)
    node = helper.make_node("LRN", ["x"], ["y"], size=size, alpha=0.01, beta=0.8, bias=1.5)
    (got,) = run_model(graph_model([node], {"x": x}, ["y"], 13), {"x": x})
    square_sum = np.zeros(x.shape, np.float64)
    for c in range(6):
        low, high = max(0, c - (size - 1) // 2), min(5, c + size // 2)  # floor / ceil of (size - 1) / 2
        square_sum[:, c] = (x[:, low:high + 1].astype(np.float64) ** 2).sum(axis=1)
    np.testing.assert_allclose(got, x / (1.5 + 0.01 / size * square_sum) ** 0.8, rtol=1e-5, atol=1e-6)


def test_unknown_auto_pad_is_rejected():
    x = _random(1, 1, 4, 4)
    model = graph_model([helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], auto_pad="SAME")], {"x": x}, ["y"], 12)
    with pytest.raises(Exception, match="auto_pad"):
        run_model(model, {"x": x})


@pytest.mark.parametrize("shape", [(2, 5, 7, 7), (1, 2, 80, 80)])  # a short and a long (> 4096) window
def test_average_pool_over_the_whole_input_is_the_spatial_mean(shape):
    x = _random(*shape)
    model = graph_model([helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=list(shape[2:]))], {"x": x}, ["y"], 19)
    (got,) = run_model(model, {"x": x})
    assert got.shape == (*shape[:2], 1, 1) and got.dtype == np.float32
    np.testing.assert_allclose(got, x.astype(np.float64).mean(axis=(2, 3), keepdims=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["3x3_pad", "depthwise_many_channels", "depthwise_multiplier", "pointwise"])
def test_conv_built_with_a_fused_relu_clamps_its_output(name):
    from plugrt_cpu._registry import KernelContext
    from plugrt_cpu.kernels import conv

    x_shape, w_shape, attrs = CONV_CASES[name]
    x, w, b = _random(*x_shape), _random(*w_shape, seed=1), _random(w_shape[0], seed=2)
    ctx = KernelContext("Conv", "", 11, attrs, 3, 1, [x.dtype] * 3, [None, w, b])
    got = conv.build_conv(ctx, relu=True)(x, w, b)
    model = graph_model([helper.make_node("Conv", ["x", "w", "b"], ["y"], **attrs)], {"x": x}, ["y"], 11, {"w": w, "b": b})
    (expected,) = reference_model(model, {"x": x})
    np.testing.assert_allclose(got, np.maximum(expected, 0), rtol=1e-4, atol=1e-4)


def _same_pads(spatial, kernel, strides, dilations, auto_pad):
    """SAME padding as the spec words it: output ceil(n / stride), the total padding of the
    dilated span split evenly, the odd one at the end (SAME_UPPER) or beginning (SAME_LOWER)."""
    out = [-(-n // s) for n, s in zip(spatial, strides)]
    total = [max((o - 1) * s + (k - 1) * d + 1 - n, 0) for o, s, k, d, n in zip(out, strides, kernel, dilations, spatial)]
    begin = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total]
    return out, begin


def _direct_conv(x, w, strides, dilations, begin, out):
    """Conv (one group, no bias) summed tap by tap over a zero-padded input."""
    kernel = w.shape[2:]
    padded = np.zeros(x.shape[:2] + tuple(n + 2 * (k - 1) * d + s * o for n, k, d, s, o in
                                         zip(x.shape[2:], kernel, dilations, strides, out)), np.float64)
    padded[(slice(None), slice(None)) + tuple(slice(b, b + n) for b, n in zip(begin, x.shape[2:]))] = x
    y = np.zeros((x.shape[0], w.shape[0], *out))
    for taps in itertools.product(*(range(k) for k in kernel)):
        window = padded[(slice(None), slice(None)) + tuple(
            slice(t * d, t * d + s * o, s) for t, d, s, o in zip(taps, dilations, strides, out))]
        y += np.einsum("nc...,oc->no...", window, w[(slice(None), slice(None)) + taps])
    return y


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize(("kernel", "strides", "dilations"), [([2, 3], [1, 1], [2, 3]), ([3, 2], [2, 1], [3, 2])])
def test_conv_same_padding_with_dilations_lands_on_the_side_the_spec_says(auto_pad, kernel, strides, dilations):
    # odd total paddings, so SAME_UPPER and SAME_LOWER differ
    x, w = _random(2, 3, 7, 8), _random(4, 3, *kernel, seed=1)
    model = graph_model([helper.make_node("Conv", ["x", "w"], ["y"], auto_pad=auto_pad, strides=strides,
                                          dilations=dilations)], {"x": x, "w": w}, ["y"], 11)
    (got,) = run_model(model, {"x": x, "w": w})
    out, begin = _same_pads(x.shape[2:], kernel, strides, dilations, auto_pad)
    np.testing.assert_allclose(got, _direct_conv(x, w, strides, dilations, begin, out), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_average_pool_19_with_dilations_averages_the_dilated_taps(auto_pad, count_include_pad):
    # onnx.reference sizes these pads and outputs without the dilation: the oracle is direct
    x = _random(1, 2, 7, 6)
    kernel, strides, dilations = [2, 3], [1, 2], [3, 2]
    model = graph_model([helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=kernel, strides=strides,
                                          dilations=dilations, auto_pad=auto_pad,
                                          count_include_pad=count_include_pad)], {"x": x}, ["y"], 19)
    (got,) = run_model(model, {"x": x})
    if auto_pad == "VALID":
        begin = [0, 0]
        out = [(n - ((k - 1) * d + 1)) // s + 1 for n, k, d, s in zip(x.shape[2:], kernel, dilations, strides)]
    else:
        out, begin = _same_pads(x.shape[2:], kernel, strides, dilations, auto_pad)
    sums = _direct_conv(x.reshape(2, 1, 7, 6), np.ones((1, 1, *kernel)), strides, dilations, begin, out)
    ones = np.ones((1, 1, 7, 6))
    counts = _direct_conv(ones, np.ones((1, 1, *kernel)), strides, dilations, begin, out)
    expected = sums / (np.prod(kernel) if count_include_pad else counts)
    assert got.shape == (1, 2, *out)
    np.testing.assert_allclose(got, expected.reshape(1, 2, *out), rtol=1e-5, atol=1e-6)
