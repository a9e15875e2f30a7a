"""Depthwise Conv: both the per-group product over gathered taps and the per-tap passes,
checked against onnx.reference."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from helpers import graph_model, reference_model, run_model
from plugrt_cpu.kernels.conv import _Convolution


def _random(*shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# (x shape, w shape, attributes): planes long for their channel count, the product path
PRODUCT_CASES = {
    "strided_dilated_asymmetric_pads": ((1, 3, 20, 19), (3, 1, 3, 3), dict(group=3, strides=[2, 2], dilations=[2, 1], pads=[1, 0, 2, 1])),
    "stride_3_kernel_5": ((2, 4, 23, 17), (4, 1, 5, 5), dict(group=4, strides=[3, 3], pads=[2, 2, 2, 2])),
    "multiplier_strided": ((1, 5, 16, 16), (15, 1, 3, 3), dict(group=5, strides=[2, 2], pads=[1, 1, 1, 1])),
    # 64 planes of 30 x 31 columns: several blocks of groups
    "many_groups_in_blocks": ((1, 64, 60, 60), (64, 1, 3, 3), dict(group=64, pads=[1, 1, 1, 1], strides=[2, 2])),
    "unpadded_many_groups_in_blocks": ((2, 64, 30, 30), (64, 1, 3, 3), dict(group=64, pads=[1, 1, 1, 1])),
    "1d": ((2, 3, 40), (3, 1, 4), dict(group=3, strides=[2], pads=[1, 2])),
    "3d": ((1, 2, 6, 7, 8), (2, 1, 3, 2, 3), dict(group=2, strides=[1, 2, 1], pads=[1, 0, 1, 1, 1, 0])),
    "same_lower_even_kernel": ((1, 4, 12, 13), (4, 1, 2, 4), dict(group=4, auto_pad="SAME_LOWER", strides=[2, 1])),
    # unit strides, output the input's size: unpadded planes, wrapped columns zeroed
    "unpadded_many_channels_small_planes": ((2, 96, 7, 7), (96, 1, 3, 3), dict(group=96, pads=[1, 1, 1, 1])),
    "unpadded_dilated_asymmetric": ((1, 3, 11, 12), (6, 1, 3, 5), dict(group=3, dilations=[2, 1], pads=[1, 3, 3, 1])),
    "unpadded_same_upper_even_kernel": ((1, 4, 9, 10), (4, 1, 4, 2), dict(group=4, auto_pad="SAME_UPPER")),
    "unpadded_3d": ((1, 2, 5, 6, 7), (2, 1, 3, 3, 3), dict(group=2, pads=[1, 1, 1, 1, 1, 1])),
    "unpadded_1d": ((1, 5, 30), (5, 1, 5), dict(group=5, pads=[2, 2])),
}


def _plan(x_shape, w_shape, attrs):
    return _Convolution(dict(attrs))._plans(tuple(x_shape), tuple(w_shape), 4)


def _uses_product(x_shape, w_shape, attrs) -> bool:
    plan = _plan(x_shape, w_shape, attrs)
    return plan.kind == "depthwise" and plan.depthwise_product


@pytest.mark.parametrize("name", sorted(PRODUCT_CASES))
def test_depthwise_product_matches_reference(name):
    x_shape, w_shape, attrs = PRODUCT_CASES[name]
    assert _uses_product(x_shape, w_shape, attrs), "the case must exercise the product path"
    unpadded = _plan(x_shape, w_shape, attrs).wrap_zeros is not None
    assert unpadded == name.startswith("unpadded"), "the case must exercise the planes it is named for"
    x, w, b = _random(*x_shape), _random(*w_shape, seed=1), _random(w_shape[0], seed=2)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], **attrs)
    model = graph_model([node], {"x": x}, ["y"], 11, {"w": w, "b": b})
    (got,) = run_model(model, {"x": x})
    (expected,) = reference_model(model, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_depthwise_product_with_fused_relu_matches_reference():
    # Conv + Relu become one FusedConv node at the default optimization level
    x, w = _random(1, 6, 24, 24), _random(6, 1, 3, 3, seed=1)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["h"], group=6, pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["h"], ["y"]),
    ]
    model = graph_model(nodes, {"x": x}, ["y"], 11, {"w": w})
    (got,) = run_model(model, {"x": x})
    (expected,) = reference_model(model, {"x": x})
    assert (got == 0).any() and (got > 0).any()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_many_channels_on_short_strided_planes_take_the_tap_passes():
    assert not _uses_product((1, 272, 14, 14), (272, 1, 3, 3), dict(group=272, pads=[1, 1, 1, 1], strides=[2, 2]))
    assert _uses_product((1, 136, 28, 28), (136, 1, 3, 3), dict(group=136, pads=[1, 1, 1, 1], strides=[2, 2]))
