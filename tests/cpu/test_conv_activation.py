"""Conv + Clip (ReLU6), HardSwish and SiLU as one FusedConv step: the same values as
onnxruntime on each Conv path (pointwise, depthwise, im2col, grouped) with the compiled
loops and with the numpy bodies, NaN kept, capture/replay without allocating, and no
fusion where another node reads the Conv's output or a Clip bound is not constant."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import numpy_helper

import plugrt
from plugrt_cpu.kernels import _gemm

from cpu.numba_paths import PATHS, numba_or_numpy
from cpu.test_fusions import _assert_replays_without_allocating, _step_ops

# activation -> the nodes that follow the Conv's output "c" and end in "y" (ONNX text)
ACTIVATIONS = {
    "relu6": "lo = Constant <value = float {0.0}> ()\n hi = Constant <value = float {6.0}> ()\n y = Clip (c, lo, hi)",
    "clip-both-sides": "lo = Constant <value = float {-0.5}> ()\n hi = Constant <value = float {0.75}> ()\n y = Clip (c, lo, hi)",
    "clip-max-only": "hi = Constant <value = float {1.5}> ()\n y = Clip (c, , hi)",
    "hard-swish": "y = HardSwish (c)",
    "hard-swish-written-out": "g = HardSigmoid <alpha = 0.16666667, beta = 0.5> (c)\n y = Mul (c, g)",
    "silu": "s = Sigmoid (c)\n y = Mul (c, s)",
    "silu-mul-swapped": "s = Sigmoid (c)\n y = Mul (s, c)",
}

# Conv path -> (input shape, weight shape, attributes)
CONVS = {
    "pointwise": ((1, 16, 9, 9), (24, 16, 1, 1), "pads = [0, 0, 0, 0]"),
    "depthwise-3x3": ((2, 12, 10, 10), (12, 1, 3, 3), "group = 12, pads = [1, 1, 1, 1]"),
    "depthwise-5x5-stride-2": ((1, 8, 13, 13), (8, 1, 5, 5), "group = 8, pads = [2, 2, 2, 2], strides = [2, 2]"),
    "im2col-3x3": ((1, 5, 9, 9), (7, 5, 3, 3), "pads = [1, 1, 1, 1]"),
    "grouped": ((1, 8, 8, 8), (8, 2, 3, 3), "group = 4, pads = [1, 1, 1, 1]"),
}


def _random(*shape: int, seed: int = 0, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _model(conv: str, activation: str) -> tuple[bytes, dict[str, np.ndarray]]:
    x_shape, w_shape, attributes = CONVS[conv]
    text = f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[{", ".join(map(str, x_shape))}] x) => (float y) {{
        c = Conv <{attributes}> (x, w, b)
        {ACTIVATIONS[activation]}
    }}
    """
    model = onnx.parser.parse_model(text)
    model.graph.initializer.extend(
        [numpy_helper.from_array(_random(*w_shape, seed=1, scale=0.5), "w"), numpy_helper.from_array(_random(w_shape[0], seed=2), "b")]
    )
    return model.SerializeToString(), {"x": _random(*x_shape, seed=3)}


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Each test with the compiled loops (skipped without numba) and with the numpy bodies."""
    yield from numba_or_numpy(request, monkeypatch, _gemm.epilogue_loops)


@pytest.mark.parametrize("conv", list(CONVS))
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_conv_activation_runs_as_one_fused_conv_and_matches_onnxruntime(conv, activation, path):
    model, feeds = _model(conv, activation)
    ops, (actual,) = _step_ops(model, feeds)
    assert ops == ["FusedConv"]
    (expected,) = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["relu6", "hard-swish", "silu"])
def test_nan_in_the_input_stays_nan_through_the_activation(activation, path):
    model, feeds = _model("depthwise-3x3", activation)
    feeds["x"][0, 3, 4, 4] = np.nan
    actual = plugrt.load(model, device="cpu").run(feeds)["y"]
    (expected,) = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    assert np.isnan(actual).sum() == 9  # the 3x3 outputs that read the NaN


@pytest.mark.parametrize("conv", ["pointwise", "depthwise-3x3", "im2col-3x3"])
@pytest.mark.parametrize("activation", ["relu6", "hard-swish", "silu"])
def test_fused_conv_activation_is_captured_and_replays_without_allocating(conv, activation, path):
    model, feeds = _model(conv, activation)
    _assert_replays_without_allocating(model, feeds, ["FusedConv"])


def test_sigmoid_of_a_conv_read_elsewhere_too_is_not_fused():
    model, feeds = _model("pointwise", "silu")
    model_proto = onnx.load_from_string(model)
    model_proto.graph.output.append(onnx.helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, None))
    ops, _ = _step_ops(model_proto.SerializeToString(), feeds)
    assert ops == ["Conv", "Sigmoid", "Mul"]


def test_clip_with_a_bound_fed_at_run_time_is_not_fused():
    model = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 4, 5, 5] x, float hi) => (float y) {
            c = Conv (x, w)
            y = Clip (c, , hi)
        }
        """
    )
    model.graph.initializer.append(numpy_helper.from_array(_random(6, 4, 1, 1, seed=1), "w"))
    feeds = {"x": _random(1, 4, 5, 5, seed=3), "hi": np.array(0.5, np.float32)}
    ops, (actual,) = _step_ops(model.SerializeToString(), feeds)
    assert ops == ["Conv", "Clip"]
    assert actual.max() == 0.5


def test_hard_sigmoid_of_another_slope_is_not_taken_for_hard_swish():
    model, feeds = _model("pointwise", "hard-swish-written-out")
    proto = onnx.load_from_string(model)
    for node in proto.graph.node:
        if node.op_type == "HardSigmoid":
            node.attribute[0].f = 0.2
    ops, _ = _step_ops(proto.SerializeToString(), feeds)
    assert ops == ["Conv", "HardSigmoid", "Mul"]


def test_fused_conv_with_an_unknown_activation_names_the_supported_ones():
    model = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 17, "plugrt.cpu" : 1]>
        g (float[1, 4, 5, 5] x) => (float y) {
            y = plugrt.cpu.FusedConv <activation = "Gelu"> (x, w)
        }
        """
    )
    model.graph.initializer.append(numpy_helper.from_array(_random(6, 4, 1, 1, seed=1), "w"))
    with pytest.raises(Exception, match="HardSwish"):
        plugrt.load(model.SerializeToString(), device="cpu").run({"x": _random(1, 4, 5, 5)})


@pytest.mark.parametrize("conv", ["pointwise", "depthwise-3x3", "depthwise-5x5-stride-2", "im2col-3x3"])
@pytest.mark.parametrize("activation", ["relu6", "clip-both-sides", "hard-swish", "silu"])
def test_the_compiled_paths_apply_the_activation_block_by_block(conv, activation, monkeypatch):
    """With numba, the Conv's compiled units (or depthwise planes) apply the activation to
    each block on the thread that computed it: no pass over the whole output follows."""
    from plugrt_cpu.kernels import conv_activation

    if _gemm.epilogue_loops() is None:
        pytest.skip("needs numba's compiled loops")
    passes = []
    loops = conv_activation.epilogue_loops()

    class Counted:
        def __getattr__(self, name):
            passes.append(name)
            return getattr(loops, name)

    monkeypatch.setattr(conv_activation, "epilogue_loops", lambda: Counted())
    monkeypatch.setattr(np, "clip", lambda *a, **k: passes.append("np.clip"))
    model, feeds = _model(conv, activation)
    session = plugrt.load(model, device="cpu")
    expected = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    for _ in range(2):
        np.testing.assert_allclose(session.run(feeds)["y"], expected, rtol=1e-5, atol=1e-5)
    assert passes == []


def test_the_activation_codes_are_the_compiled_loops():
    from plugrt_cpu.kernels import conv_activation

    loops = _gemm.epilogue_loops()
    if loops is None:
        pytest.skip("needs numba's compiled loops")
    assert (conv_activation.SILU, conv_activation.HARD_SWISH, conv_activation.CLIP) == (
        loops.ACT_SILU, loops.ACT_HARD_SWISH, loops.ACT_CLIP
    )


@pytest.mark.parametrize("in_place", [False, True], ids=["apart", "in-place"])
@pytest.mark.parametrize("activation", ["SiLU", "HardSwish", "Clip"])
def test_an_activation_shared_out_on_the_pool_gives_the_formula(activation, in_place, monkeypatch):
    """A whole tensor's activation as one job on the compiled pool (a standalone SiLU, or a
    Conv's activation its path did not apply): every value, the ragged last unit's too,
    against the formula in float64; NaN stays NaN, infinities as the formula gives them."""
    from plugrt_cpu.kernels import _compiled_parallel, conv_activation

    if _gemm.epilogue_loops() is None or _compiled_parallel.compiled_pool() is None:
        pytest.skip("needs numba's compiled loops and their pool")
    monkeypatch.setattr(conv_activation, "parallel_threads", lambda work: 2)
    x = np.random.default_rng(0).standard_normal((3, 70, 317)).astype(np.float32) * 8
    x.flat[[0, 500, 66569]] = [np.nan, np.inf, -np.inf]
    code, low, high = {"SiLU": (conv_activation.SILU, 0.0, 0.0), "HardSwish": (conv_activation.HARD_SWISH, 0.0, 0.0),
                       "Clip": (conv_activation.CLIP, -1.5, 2.0)}[activation]
    wide = x.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = {"SiLU": wide / (1 + np.exp(-wide)), "HardSwish": wide * np.clip(wide / 6 + 0.5, 0, 1),
                    "Clip": np.clip(wide, low, high)}[activation]
    source = x.copy()
    target = source if in_place else np.full_like(x, 7.0)
    assert conv_activation.pooled(target, source, code, low, high)
    np.testing.assert_array_equal(np.isnan(target), np.isnan(expected))
    np.testing.assert_allclose(target, expected.astype(np.float32), rtol=2e-6, atol=1e-6)
    if not in_place:
        np.testing.assert_array_equal(source, x)  # read, not written


def test_a_small_or_strided_activation_is_not_shared_out(monkeypatch):
    from plugrt_cpu.kernels import conv_activation

    monkeypatch.setattr(conv_activation, "parallel_threads", lambda work: 2)
    small = np.ones(1000, np.float32)
    strided = np.ones((400, 400), np.float32).T
    assert not conv_activation.pooled(small, small, conv_activation.SILU)
    assert not conv_activation.pooled(strided, strided, conv_activation.SILU)
