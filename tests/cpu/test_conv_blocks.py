"""Conv's im2col and pointwise paths in blocks of output rows, each block on one thread from
gathering its columns to its bias and Relu: every geometry matches onnx.reference, with the
blocks cut small and shared out between two threads, and a replay allocates nothing."""

from __future__ import annotations

import types

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

import plugrt
from plugrt_cpu.kernels import conv as convolution
from plugrt_cpu.kernels import conv_units

from cpu.numba_paths import PATHS, numba_or_numpy
from cpu.test_conv_gemm import _conv_model
from cpu.test_into import check_captured, one_node

# (input shape, weight shape, attributes): none of them on the tap grid or Winograd (fewer
# than 16 channels per group or more outputs than inputs per group), so im2col computes them
_IM2COL = {
    "3x3-same": ((1, 6, 13, 11), (10, 6, 3, 3), {"pads": [1, 1, 1, 1]}),
    "stride-2": ((1, 3, 23, 23), (8, 3, 3, 3), {"strides": [2, 2]}),
    "strided-dilated-asymmetric": (
        (1, 5, 21, 19), (7, 5, 3, 2), {"pads": [2, 0, 1, 3], "strides": [2, 3], "dilations": [2, 2]}
    ),
    "kernel-wider-than-stride": ((1, 3, 45, 45), (8, 3, 11, 11), {"pads": [2, 2, 2, 2], "strides": [4, 4]}),
    "valid-input-left-over": ((1, 4, 17, 16), (6, 4, 3, 3), {"strides": [3, 3]}),
    "grouped": ((1, 12, 15, 15), (24, 4, 3, 3), {"pads": [1, 1, 1, 1], "group": 3}),
    "batch": ((3, 5, 14, 9), (8, 5, 3, 3), {"pads": [1, 0, 1, 0]}),
    "batch-grouped-strided": ((2, 8, 16, 16), (12, 4, 5, 5), {"pads": [2, 2, 2, 2], "strides": [2, 2], "group": 2}),
    "pads-wider-than-the-kernel": ((1, 3, 6, 5), (4, 3, 3, 3), {"pads": [3, 4, 3, 4]}),  # whole windows in padding
    "stride-3-dilation-2-pads": ((2, 5, 19, 23), (6, 5, 3, 3), {"pads": [1, 3, 2, 0], "strides": [3, 3], "dilations": [2, 2]}),
    # 64 taps or more: with numba on AVX-512, read from the zero-padded input (READ_DIRECT)
    "direct-strided-dilated-batch": (
        (2, 9, 21, 19), (20, 9, 3, 3), {"pads": [2, 0, 1, 3], "strides": [2, 3], "dilations": [2, 2]}
    ),
    "direct-grouped-strided": ((1, 32, 15, 15), (32, 16, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2], "group": 2}),
    "direct-pads-wider-than-the-kernel": ((1, 4, 9, 8), (18, 4, 5, 5), {"pads": [6, 5, 6, 5]}),
    "direct-deep-sliced": ((1, 130, 9, 9), (17, 130, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    # tiles of 7 output positions that run on from one output row into the next (8 x 8, 10 x 5)
    "direct-rows-run-on": ((2, 24, 8, 8), (40, 24, 3, 3), {"pads": [1, 1, 1, 1]}),
    "direct-rows-run-on-strided": ((1, 12, 20, 9), (20, 12, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    # fewer taps at column stride 1 or 2: read by tiles of 16 positions of a row (a stem's 27 taps)
    "rows-shallow-stride-2": ((2, 3, 23, 37), (20, 3, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    "rows-shallow-stride-1-dilated": ((1, 4, 19, 35), (33, 4, 3, 3), {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
    "rows-shallow-stride-2x1-asymmetric": ((1, 2, 17, 18), (16, 2, 5, 3), {"pads": [2, 0, 1, 3], "strides": [2, 1]}),
    "1d": ((2, 4, 37), (9, 4, 5), {"pads": [2, 1], "strides": [2]}),
    "3d": ((1, 3, 7, 9, 8), (5, 3, 3, 3, 2), {"pads": [1, 1, 0, 1, 1, 1], "strides": [1, 2, 1]}),
}

_POINTWISE = {
    "pointwise": ((1, 16, 13, 15), (24, 16, 1, 1), {}),
    "pointwise-grouped-batch": ((2, 12, 9, 10), (8, 6, 1, 1), {"group": 2}),
    "pointwise-strided": ((1, 8, 17, 17), (12, 8, 1, 1), {"strides": [2, 2]}),
}


@pytest.fixture(params=[*PATHS, "numba-blas"])
def units(request, monkeypatch):
    """Each test three times: the units as one compiled job without the GIL
    (``conv_units``) with the packed-weight kernel where the host has AVX-512
    (``_numba_gemm``), the same with the BLAS GEMM ("numba-blas"), and as Python blocks on
    ``parallel_for``. Yields the path and the list of the compiled jobs' calls."""
    calls: list = []  # the plan of each compiled call
    original = convolution.run_units

    def counted(*args, **kwargs):
        calls.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(convolution, "run_units", counted)
    if request.param == "numba-blas":
        monkeypatch.setattr(conv_units, "packing", lambda: None)
        request = types.SimpleNamespace(param="numba")
    for path in numba_or_numpy(request, monkeypatch, conv_units._loops):
        yield path, calls


@pytest.fixture
def small_blocks(monkeypatch, units):
    """Blocks of one to three output rows, shared out between two threads whatever the
    machine has: every block boundary and the pool's workers are exercised (on both
    paths: see ``units``)."""
    monkeypatch.setattr(convolution, "_BLOCK_BYTES", 2048)
    monkeypatch.setattr(convolution, "_MIN_BLOCK_POSITIONS", 1)
    monkeypatch.setattr(convolution, "split_threads", lambda work: 2)
    monkeypatch.setattr(convolution, "_COMPILED_SPLIT_WORK", 0)


@pytest.fixture
def im2col_calls(monkeypatch):
    calls = []
    original = convolution._Convolution._im2col

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(convolution._Convolution, "_im2col", counted)
    return calls


def _random(*shape: int, seed: int = 0, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _compare(case: tuple, relu: bool, dtype=np.float32, bias: bool = True, tolerance: float = 1e-4) -> None:
    x_shape, w_shape, attributes = case
    x, w = _random(*x_shape, seed=1, dtype=dtype), _random(*w_shape, seed=2, dtype=dtype)
    b = _random(w_shape[0], seed=3, dtype=dtype) if bias else None
    model = _conv_model(x_shape, w, b, attributes, relu, dtype)
    (actual,) = plugrt.load(model, device="cpu").run({"x": x}).values()
    reference = ReferenceEvaluator(onnx.load_from_string(model))
    (expected,) = reference.run(None, {"x": x.astype(np.float64)} if dtype == np.float16 else {"x": x})
    assert actual.dtype == dtype and actual.shape == expected.shape
    np.testing.assert_allclose(actual.astype(np.float64), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("relu", [False, True], ids=["plain", "relu"])
@pytest.mark.parametrize("case", list(_IM2COL), ids=list(_IM2COL))
def test_im2col_in_small_blocks_on_two_threads_matches_the_reference(units, small_blocks, im2col_calls, case, relu):
    _compare(_IM2COL[case], relu)
    assert im2col_calls
    path, compiled = units
    assert bool(compiled) == (path == "numba" and case not in ("1d", "3d"))  # the compiled units are 2-D


@pytest.mark.parametrize("case", ["3x3-same", "batch-grouped-strided", "1d"])
def test_im2col_in_one_block_matches_the_reference(im2col_calls, case):
    _compare(_IM2COL[case], relu=True)
    assert im2col_calls


def test_im2col_without_a_bias_matches_the_reference(small_blocks):
    _compare(_IM2COL["strided-dilated-asymmetric"], relu=True, bias=False)


@pytest.mark.parametrize("case", ["3x3-same", "batch-grouped-strided", "3d"])
def test_im2col_in_float64_matches_the_reference(small_blocks, case):
    _compare(_IM2COL[case], relu=True, dtype=np.float64, tolerance=1e-10)


@pytest.mark.parametrize("case", ["3x3-same", "kernel-wider-than-stride"])
def test_im2col_in_float16_matches_the_reference(small_blocks, case):
    _compare(_IM2COL[case], relu=True, dtype=np.float16, tolerance=2e-2)


@pytest.mark.parametrize("relu", [False, True], ids=["plain", "relu"])
@pytest.mark.parametrize("case", list(_POINTWISE), ids=list(_POINTWISE))
def test_pointwise_in_small_blocks_on_two_threads_matches_the_reference(units, small_blocks, case, relu):
    _compare(_POINTWISE[case], relu)
    path, compiled = units
    assert bool(compiled) == (path == "numba")


@pytest.mark.parametrize("w_shape", [(8, 5, 3, 3), (8, 5, 1, 1)], ids=["im2col", "pointwise"])
def test_an_empty_batch_gives_an_empty_output(small_blocks, w_shape):
    model = _conv_model((0, 5, 9, 9), _random(*w_shape), _random(8), {}, relu=True)
    (actual,) = plugrt.load(model, device="cpu").run({"x": np.zeros((0, 5, 9, 9), np.float32)}).values()
    assert actual.shape == (0, 8, 9 - w_shape[2] + 1, 9 - w_shape[3] + 1)


def _attributes_text(attributes: dict) -> str:
    return ", ".join(f"{k} = [{', '.join(map(str, v))}]" if isinstance(v, list) else f"{k} = {v}" for k, v in attributes.items())


@pytest.mark.parametrize("case", ["batch-grouped-strided", "kernel-wider-than-stride", "pointwise-strided"])
def test_blocks_on_two_threads_are_captured_and_replay_without_allocating(small_blocks, case):
    x_shape, w_shape, attributes = {**_IM2COL, **_POINTWISE}[case]
    model = one_node(
        f"c = Conv<{_attributes_text(attributes)}>(x, w, b)\n    y = Relu(c)",
        {"x": _random(*x_shape)},
        {"y": "float"},
        constants={"w": _random(*w_shape, seed=2), "b": _random(w_shape[0], seed=3)},
    )
    check_captured(model, lambda rng: {"x": rng.standard_normal(x_shape).astype(np.float32)})


def _plan(x_shape, w_shape, attributes: dict):
    return convolution._Convolution(attributes)._plans(tuple(x_shape), tuple(w_shape), 4)


def test_blocks_share_out_evenly_between_the_threads():
    plan = _plan((1, 16, 55, 55), (64, 16, 3, 3), {"pads": [1, 1, 1, 1]})
    assert plan.block_count(1, 1) == 1  # one block fits
    assert plan.block_count(1, 2) == 2
    assert plan.block_count(3, 2) == 2  # six units
    assert plan.block_count(4, 2) == 1


def test_a_lone_product_with_more_outputs_than_positions_is_not_cut_into_blocks():
    plan = _plan((1, 64, 13, 13), (256, 64, 3, 3), {"pads": [1, 1, 1, 1]})
    assert plan.block_count(1, 2) == 1  # split_gemm splits its output channels instead


def test_blocks_keep_their_least_positions():
    plan = _plan((1, 16, 20, 20), (16, 16, 3, 3), {"pads": [1, 1, 1, 1]})  # 400 positions
    assert plan.block_count(1, 4) == 1


@pytest.mark.parametrize(
    "case",
    [
        ((1, 8, 14, 14), (64, 8, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),  # im2col, 7x7 out: gathered once
        ((1, 16, 7, 7), (96, 16, 1, 1), {}),
        ((1, 8, 14, 14), (20, 8, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),  # too few channels to split
    ],
    ids=["im2col", "pointwise", "few-channels"],
)
def test_a_lone_product_on_two_threads_splits_its_output_channels(units, monkeypatch, case):
    monkeypatch.setattr(convolution, "split_threads", lambda work: 2)
    monkeypatch.setattr(convolution, "_COMPILED_SPLIT_WORK", 0)
    _compare(case, relu=True)
    path, compiled = units
    assert len(compiled) == (1 if path == "numba" else 0)


def test_a_weight_fed_at_run_time_is_read_afresh_each_call(units, monkeypatch):
    """The compiled units keep a call's context on the plan; a weight fed at run time (a
    new array each call) replaces it instead of adding one per call."""
    monkeypatch.setattr(convolution, "split_threads", lambda work: 2)
    monkeypatch.setattr(convolution, "_COMPILED_SPLIT_WORK", 0)
    x_shape, w_shape = (1, 16, 13, 15), (24, 16, 3, 3)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2])],
        "conv",
        [
            onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x_shape),
            onnx.helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, w_shape),
        ],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    session = plugrt.load(model.SerializeToString(), device="cpu")
    reference = ReferenceEvaluator(model)
    x = _random(*x_shape, seed=1)
    for seed in range(5):
        feeds = {"x": x, "w": _random(*w_shape, seed=10 + seed)}
        np.testing.assert_allclose(session.run(feeds)["y"], reference.run(None, feeds)[0], rtol=1e-4, atol=1e-4)
    path, compiled = units
    assert len(compiled) == (5 if path == "numba" else 0)
    if path == "numba":
        assert len({id(plan) for plan in compiled}) == 1
        assert len(compiled[0].units) == 1  # one context, replaced for each new weight


@pytest.mark.parametrize(
    "case",
    [
        "direct-strided-dilated-batch", "direct-deep-sliced", "direct-grouped-strided", "direct-rows-run-on", "stride-2",
        "rows-shallow-stride-2", "rows-shallow-stride-1-dilated", "rows-shallow-stride-2x1-asymmetric", "stride-3-dilation-2-pads",
    ],
)
def test_im2col_convs_read_the_padded_input_when_deep_or_at_column_stride_1_or_2(monkeypatch, case):
    """With the packed-weight GEMM, an im2col Conv of 64 taps or more, or of fewer at
    column stride 1 or 2, reads its columns from the zero-padded input (READ_DIRECT); a
    shallow one at another column stride keeps the gathered blocks."""
    if conv_units.packing() is None:
        pytest.skip("needs numba and AVX-512 (the packed-weight GEMM)")
    modes = []
    prepare = conv_units._prepare

    def recording(*args):
        prepared = prepare(*args)
        modes.append(prepared.mode)
        return prepared

    monkeypatch.setattr(conv_units, "_prepare", recording)
    _compare(_IM2COL[case], relu=True)
    loops = conv_units._loops()
    direct = case != "stride-3-dilation-2-pads"
    assert modes and all((mode == loops.READ_DIRECT) == direct for mode in modes)


def test_the_shallow_read_threshold_is_the_gemms():
    """conv_units sends a shallow Conv to READ_DIRECT only at column stride 1 or 2, which
    the GEMM's row tiles take below the same depth."""
    gemm = conv_units.packing()
    if gemm is None:
        pytest.skip("needs numba and AVX-512 (the packed-weight GEMM)")
    assert conv_units._READ_DIRECT_MIN_DEPTH == gemm.READ_ROWS_MAX_DEPTH
