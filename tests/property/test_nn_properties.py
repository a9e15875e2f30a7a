"""Convolution and pooling agree with onnx.reference (or, where onnx.reference is wrong,
with a direct numpy reading of the spec) on random geometry: kernel, strides,
dilations, pads, auto_pad, groups, ceil_mode, count_include_pad."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from property.oracle import arrays, check_node, float_elements, one_of_dtypes

AUTO_PAD = st.sampled_from(["NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"])


@st.composite
def geometry(draw, max_rank: int = 2, max_kernel: int = 3) -> dict:
    """Spatial sizes and window attributes of one convolution or pooling."""
    rank = draw(st.integers(1, max_rank))
    kernel = [draw(st.integers(1, max_kernel)) for _ in range(rank)]
    dilations = [draw(st.integers(1, 3)) for _ in range(rank)]
    strides = [draw(st.integers(1, 3)) for _ in range(rank)]
    auto_pad = draw(AUTO_PAD)
    spans = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    pads = [draw(st.integers(0, k - 1)) for k in kernel * 2] if auto_pad == "NOTSET" else [0] * (2 * rank)
    # the input covers at least one window once padded
    spatial = [draw(st.integers(max(span - pads[i] - pads[i + rank], 1), span + 4)) for i, span in enumerate(spans)]
    return {"rank": rank, "kernel": kernel, "dilations": dilations, "strides": strides, "auto_pad": auto_pad,
            "pads": pads, "spatial": spatial}


def _window_attributes(g: dict) -> dict:
    attributes = {"kernel_shape": g["kernel"], "dilations": g["dilations"], "strides": g["strides"],
                  "auto_pad": g["auto_pad"]}
    if g["auto_pad"] == "NOTSET":
        attributes["pads"] = g["pads"]
    return attributes


@given(geometry(), st.data())
def test_conv_matches_reference(g, data):
    dtype = data.draw(one_of_dtypes([np.float32, np.float64]), label="dtype")
    group = data.draw(st.integers(1, 3), label="group")
    in_per_group, out_per_group = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    batch = data.draw(st.integers(1, 2), label="batch")
    # onnx.reference dilates the kernel with zero taps, so a NaN or inf that falls between
    # two real taps poisons its output (0 * NaN) though the spec never reads it: with
    # dilations, inputs stay finite
    dilated = any(d > 1 for d in g["dilations"])
    x = data.draw(arrays(dtype, (batch, group * in_per_group, *g["spatial"]), low=-4, high=4, special=not dilated),
                  label="x")
    w = data.draw(arrays(dtype, (group * out_per_group, in_per_group, *g["kernel"]), low=-4, high=4,
                         special=False), label="w")
    b = data.draw(arrays(dtype, (group * out_per_group,), low=-4, high=4, special=False) | st.none(), label="b")
    constant = data.draw(st.booleans(), label="constant weights")
    inputs = {"x": x, "w": w, "b": b}
    check_node("Conv", inputs, 11, group=group, constants={"w": w, "b": b} if constant and b is not None else None,
               exact_reference=True, rtol=1e-4 if dtype == np.float32 else 1e-10, atol=1e-4 if dtype == np.float32 else 1e-10,
               **{k: v for k, v in _window_attributes(g).items() if k != "kernel_shape"})


def _numpy_pool(x: np.ndarray, g: dict, kind: str, count_include_pad: int = 0) -> np.ndarray:
    """Pooling as the spec reads, tap by tap (the SAME pads split with the extra one at the
    end for SAME_UPPER and at the beginning for SAME_LOWER, spans including dilation)."""
    spatial, kernel, strides, dilations = x.shape[2:], g["kernel"], g["strides"], g["dilations"]
    rank = len(spatial)
    if g["auto_pad"] in ("SAME_UPPER", "SAME_LOWER"):
        out = [-(-n // s) for n, s in zip(spatial, strides)]
        total = [max((o - 1) * s + (k - 1) * d + 1 - n, 0) for o, s, k, d, n in zip(out, strides, kernel, dilations, spatial)]
        small = [t // 2 for t in total]
        begin = small if g["auto_pad"] == "SAME_UPPER" else [t - s for t, s in zip(total, small)]
        end = [t - b for t, b in zip(total, begin)]
    else:
        begin, end = (g["pads"][:rank], g["pads"][rank:]) if g["auto_pad"] == "NOTSET" else ([0] * rank, [0] * rank)
        out = [(n + b + e - ((k - 1) * d + 1)) // s + 1 for n, b, e, k, d, s in zip(spatial, begin, end, kernel, dilations, strides)]
    fill = -np.inf if kind == "max" else np.nan
    padded = np.full(x.shape[:2] + tuple(n + b + e + max(strides) * 2 for n, b, e in zip(spatial, begin, end)), fill)
    padded[(slice(None), slice(None)) + tuple(slice(b, b + n) for b, n in zip(begin, spatial))] = x
    result = np.empty(x.shape[:2] + tuple(out))
    for position in itertools.product(*(range(o) for o in out)):
        taps = padded[(slice(None), slice(None)) + tuple(
            slice(p * s, p * s + (k - 1) * d + 1, d) for p, s, k, d in zip(position, strides, kernel, dilations))]
        taps = taps.reshape(x.shape[:2] + (-1,))
        if kind == "max":
            value = taps.max(axis=-1)
        elif count_include_pad:
            value = np.nan_to_num(taps, nan=0.0).mean(axis=-1)
        else:
            value = np.nanmean(taps, axis=-1)
        result[(slice(None), slice(None)) + position] = value
    return result.astype(x.dtype)


@given(geometry(max_rank=2), st.integers(0, 1), st.data())
def test_average_pool_19_matches_reference(g, count_include_pad, data):
    dtype = data.draw(one_of_dtypes([np.float32, np.float64]), label="dtype")
    x = data.draw(arrays(dtype, (1, 2, *g["spatial"]), low=-100, high=100, special=False), label="x")
    dilated = g["auto_pad"] != "NOTSET" and any(d > 1 for d in g["dilations"])
    # onnx.reference sizes SAME pads and VALID outputs without the dilation, so its windows
    # land elsewhere (onnxruntime even shrinks a SAME output): there the oracle is the
    # spec read tap by tap
    expected = (lambda _: [_numpy_pool(x, g, "average", count_include_pad)]) if dilated else None
    check_node("AveragePool", {"x": x}, 19, count_include_pad=count_include_pad, expected=expected,
               rtol=1e-5, atol=1e-4, **_window_attributes(g))


@given(geometry(max_rank=2), st.data())
def test_max_pool_matches_reference(g, data):
    dtype = data.draw(one_of_dtypes([np.float32, np.float64, np.int8, np.uint8]), label="dtype")
    # NaN is left out: the spec does not say whether a window's maximum skips it
    # (onnx.reference and onnxruntime do, plugrt propagates it like numpy's max)
    elements = float_elements(dtype, special=False) | st.sampled_from([np.inf, -np.inf]) if dtype.kind == "f" else None
    x = data.draw(arrays(dtype, (1, 2, *g["spatial"]), elements), label="x")
    # onnx.reference sizes a SAME output from the padded span rather than ceil(n / stride)
    # (a side of 1 at stride 2 gives it no output): SAME is checked tap by tap below
    if g["auto_pad"].startswith("SAME"):
        g = {**g, "auto_pad": "VALID"}
    check_node("MaxPool", {"x": x}, 12, **_window_attributes(g))


@given(geometry(max_rank=2), st.data())
def test_max_pool_matches_numpy_taps(g, data):
    x = data.draw(arrays(np.float32, (1, 2, *g["spatial"]), special=False), label="x")
    check_node("MaxPool", {"x": x}, 12, expected=lambda _: [_numpy_pool(x, g, "max")], **_window_attributes(g))


@given(geometry(max_rank=2), st.data())
def test_average_pool_matches_numpy_taps(g, data):
    x = data.draw(arrays(np.float64, (1, 2, *g["spatial"]), special=False), label="x")
    check_node("AveragePool", {"x": x}, 19, expected=lambda _: [_numpy_pool(x, g, "average")],
               rtol=1e-12, atol=1e-9, **_window_attributes(g))


@given(st.sampled_from(["GlobalAveragePool", "GlobalMaxPool"]), st.data())
def test_global_pool_reduces_every_spatial_axis(op, data):
    dtype = data.draw(one_of_dtypes([np.float16, np.float32, np.float64]), label="dtype")
    shape = data.draw(st.lists(st.integers(1, 4), min_size=3, max_size=5), label="shape")
    special = op == "GlobalAveragePool"  # NaN in a max: see test_max_pool_matches_reference
    x = data.draw(arrays(dtype, tuple(shape), low=-100, high=100, special=special), label="x")
    # onnx.reference gets the output rank wrong for 1 and 3 spatial axes; the spec keeps
    # every spatial axis as 1: numpy over float64 is the oracle
    reduce = np.max if op == "GlobalMaxPool" else np.mean
    expected = reduce(x.astype(np.float64), axis=tuple(range(2, x.ndim)), keepdims=True).astype(dtype)
    check_node(op, {"x": x}, 1, expected=lambda _: [expected], rtol=2e-3, atol=1e-3)
