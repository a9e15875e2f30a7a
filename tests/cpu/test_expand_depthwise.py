"""A 1x1 Conv and the depthwise Conv that alone reads it as one ExpandDepthwise step
(MobileNet's inverted residual): onnxruntime's values through the fused compiled loops
(each block of the wide tensor made in the padded block the depthwise sums read) and
through the two Conv kernels the step falls back to, with the numpy bodies too; NaN kept;
capture/replay without allocating; and no fusion where the pattern does not hold."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import numpy_helper

import plugrt
from plugrt_cpu.kernels import conv as convolution
from plugrt_cpu.kernels import expand_depthwise

from cpu.numba_paths import PATHS, numba_or_numpy
from cpu.test_fusions import _assert_replays_without_allocating, _step_ops

# name -> the nodes after the Conv output ``{c}``, ending in ``{y}`` (ONNX text)
ACTIVATIONS = {
    "none": "",  # the Conv's output is the value itself
    "relu": "{y} = Relu ({c})",
    "relu6": "{y} = Clip ({c}, lo6, hi6)",
    "hard-swish": "{y} = HardSwish ({c})",
    "silu": "{y}_s = Sigmoid ({c})\n {y} = Mul ({c}, {y}_s)",
}

# name -> (input shape, wide channels M, depthwise attributes, depthwise kernel)
SHAPES = {
    "3x3": ((2, 8, 10, 10), 20, "group = 20, pads = [1, 1, 1, 1]", (3, 3)),
    "3x3-stride-2": ((1, 16, 12, 12), 48, "group = 48, pads = [1, 1, 1, 1], strides = [2, 2]", (3, 3)),
    "5x5-stride-2-odd": ((1, 5, 13, 11), 33, "group = 33, pads = [2, 2, 2, 2], strides = [2, 2]", (5, 5)),
    "dilated-uneven-pads": ((1, 6, 9, 7), 16, "group = 16, pads = [2, 1, 0, 2], dilations = [2, 2]", (3, 3)),
    "short-rows": ((1, 40, 3, 5), 96, "group = 96, pads = [1, 1, 1, 1]", (3, 3)),
    # output rows of several gangs of the windowed sums and a remainder, each width and stride
    "7x7-long-rows": ((1, 4, 5, 30), 24, "group = 24, pads = [3, 3, 3, 3]", (7, 7)),
    "3x3-stride-2-long-rows": ((1, 8, 6, 37), 16, "group = 16, pads = [1, 1, 1, 1], strides = [2, 2]", (3, 3)),
    "5x5-stride-2-long-rows": ((1, 8, 7, 40), 17, "group = 17, pads = [2, 2, 2, 2], strides = [2, 2]", (5, 5)),
    "7x7-stride-2-long-rows": ((1, 3, 9, 30), 16, "group = 16, pads = [3, 3, 3, 3], strides = [2, 2]", (7, 7)),
    "5x5-long-rows": ((1, 6, 4, 45), 32, "group = 32, pads = [2, 2, 2, 2]", (5, 5)),
}


def _random(*shape: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _model(shape: str, expand: str, depthwise: str, bias: bool = True) -> tuple[bytes, dict[str, np.ndarray]]:
    x_shape, m, attributes, (kh, kw) = SHAPES[shape]
    b1, b2 = (", b1", ", b2") if bias else ("", "")
    first = ACTIVATIONS[expand].format(c="e", y="ea")
    second = ACTIVATIONS[depthwise].format(c="d", y="y")
    e, d = ("e" if first else "ea"), ("d" if second else "y")
    text = f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[{", ".join(map(str, x_shape))}] x) => (float y) {{
        lo6 = Constant <value = float {{0.0}}> ()
        hi6 = Constant <value = float {{6.0}}> ()
        {e} = Conv (x, w1{b1})
        {first}
        {d} = Conv <{attributes}> (ea, w2{b2})
        {second}
    }}
    """
    model = onnx.parser.parse_model(text)
    k = x_shape[1]
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(_random(m, k, 1, 1, seed=1, scale=2 / np.sqrt(k)), "w1"),
            numpy_helper.from_array(_random(m, 1, kh, kw, seed=2, scale=0.5), "w2"),
        ]
    )
    if bias:
        model.graph.initializer.extend([numpy_helper.from_array(_random(m, seed=3), "b1"), numpy_helper.from_array(_random(m, seed=4), "b2")])
    return model.SerializeToString(), {"x": _random(*x_shape, seed=5, scale=2.0)}


def _onnxruntime(model: bytes, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


class _Spy:
    """The compiled pool, counting the fused loops' jobs it runs."""

    def __init__(self, pool: Any) -> None:
        self.pool, self.jobs = pool, 0

    def slots(self, *args: Any) -> Any:
        return self.pool.slots(*args)

    def run(self, address: int, *args: Any) -> Any:
        from plugrt_cpu.kernels._compiled import compiled_module

        self.jobs += address == compiled_module("_numba_depthwise").expand_job.address
        return self.pool.run(address, *args)


@pytest.fixture(params=["fused", "separate"])
def way(request, monkeypatch):
    """The compiled loops forced to the fused way (its jobs counted) or to the two Convs."""
    if request.param == "fused" and convolution.depthwise_loops() is None:
        pytest.skip("the compiled loops are off here")
    def forced(first: Any, second: Any, rounds: int = 2) -> bool:
        second()  # the callers rely on _faster running the second way last; they run the first again if it wins
        return request.param == "fused"

    monkeypatch.setattr(convolution, "_faster", forced)
    spies: list[_Spy] = []

    def pool() -> Any:
        from plugrt_cpu.kernels._compiled_parallel import compiled_pool

        found = compiled_pool()
        if found is None:
            return None
        spies.append(_Spy(found))
        return spies[-1]

    monkeypatch.setattr(expand_depthwise, "compiled_pool", pool)
    yield request.param, spies


def _fused_jobs(spies: list[_Spy]) -> int:
    return sum(spy.jobs for spy in spies)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(
    "expand, depthwise", [("relu6", "relu6"), ("relu", "none"), ("hard-swish", "hard-swish"), ("silu", "silu"), ("none", "relu")]
)
def test_expand_and_depthwise_run_as_one_step_and_match_onnxruntime(shape, expand, depthwise, way):
    name, spies = way
    model, feeds = _model(shape, expand, depthwise)
    ops, (actual,) = _step_ops(model, feeds)
    assert ops == ["ExpandDepthwise"]
    assert (_fused_jobs(spies) > 0) == (name == "fused")
    expected = _onnxruntime(model, feeds)
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))


def test_without_biases(way):
    model, feeds = _model("3x3-stride-2", "relu6", "relu6", bias=False)
    ops, (actual,) = _step_ops(model, feeds)
    assert ops == ["ExpandDepthwise"]
    expected = _onnxruntime(model, feeds)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """With the compiled loops (skipped without numba) and with the numpy bodies."""
    yield from numba_or_numpy(request, monkeypatch, convolution.depthwise_loops)


def test_first_call_chooses_a_way_and_keeps_it(path):
    model, feeds = _model("3x3", "relu6", "relu6")
    session = plugrt.load(model, device="cpu")
    expected = _onnxruntime(model, feeds)
    for _ in range(3):  # the first call times both ways; the others run the one it kept
        np.testing.assert_allclose(session.run(feeds)["y"], expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))


def test_nan_stays_where_its_taps_reach(way):
    model, feeds = _model("3x3", "relu6", "none")
    feeds["x"][0, 2, 4, 4] = np.nan  # every wide channel at (4, 4) is NaN: the 3x3 outputs around it
    actual = plugrt.load(model, device="cpu").run(feeds)["y"]
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(_onnxruntime(model, feeds)))
    assert np.isnan(actual).sum() == 9 * 20


@pytest.mark.parametrize("expand, depthwise", [("relu6", "relu6"), ("silu", "hard-swish")])
def test_is_captured_and_replays_without_allocating(expand, depthwise, way):
    model, feeds = _model("3x3-stride-2", expand, depthwise)
    _assert_replays_without_allocating(model, feeds, ["ExpandDepthwise"])


def _ops(text: str, **arrays: np.ndarray) -> list[str]:
    model = onnx.parser.parse_model(text)
    model.graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in arrays.items())
    ops, _ = _step_ops(model.SerializeToString(), {"x": _random(1, 4, 6, 6)})
    return ops


def test_not_fused_where_the_pattern_does_not_hold():
    header = '<ir_version: 8, opset_import: ["" : 17]>\n'
    w1, w2 = _random(8, 4, 1, 1, seed=1), _random(8, 1, 3, 3, seed=2)
    # the wide tensor is also a graph output
    assert _ops(header + """g (float[1, 4, 6, 6] x) => (float y, float e) {
        e = Conv (x, w1)
        y = Conv <group = 8, pads = [1, 1, 1, 1]> (e, w2)
    }""", w1=w1, w2=w2) == ["Conv", "Conv"]
    # a strided 1x1 Conv
    assert _ops(header + """g (float[1, 4, 6, 6] x) => (float y) {
        e = Conv <strides = [2, 2]> (x, w1)
        y = Conv <group = 8, pads = [1, 1, 1, 1]> (e, w2)
    }""", w1=w1, w2=w2) == ["Conv", "Conv"]
    # a grouped Conv after it, not a depthwise one
    assert _ops(header + """g (float[1, 4, 6, 6] x) => (float y) {
        e = Conv (x, w1)
        y = Conv <group = 4, pads = [1, 1, 1, 1]> (e, w2)
    }""", w1=w1, w2=_random(8, 2, 3, 3, seed=2)) == ["Conv", "Conv"]
    # a 3x3 Conv first
    assert _ops(header + """g (float[1, 4, 6, 6] x) => (float y) {
        e = Conv <pads = [1, 1, 1, 1]> (x, w1)
        y = Conv <group = 8, pads = [1, 1, 1, 1]> (e, w2)
    }""", w1=_random(8, 4, 3, 3, seed=1), w2=w2) == ["Conv", "Conv"]


def test_depthwise_weight_fed_at_run_time_is_not_fused():
    model = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 4, 6, 6] x, float[8, 1, 3, 3] w2) => (float y) {
            e = Conv (x, w1)
            y = Conv <group = 8, pads = [1, 1, 1, 1]> (e, w2)
        }
        """
    )
    model.graph.initializer.append(numpy_helper.from_array(_random(8, 4, 1, 1, seed=1), "w1"))
    feeds = {"x": _random(1, 4, 6, 6), "w2": _random(8, 1, 3, 3, seed=2)}
    ops, (actual,) = _step_ops(model.SerializeToString(), feeds)
    assert ops == ["Conv", "Conv"]
    np.testing.assert_allclose(actual, _onnxruntime(model.SerializeToString(), feeds), rtol=1e-5, atol=1e-5)


def test_one_session_runs_inputs_of_several_sizes(way):
    model = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 4, H, W] x) => (float y) {
            e = Conv (x, w1, b1)
            ea = Relu (e)
            y = Conv <group = 24, pads = [1, 1, 1, 1], strides = [2, 2]> (ea, w2, b2)
        }
        """
    )
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(_random(24, 4, 1, 1, seed=1), "w1"), numpy_helper.from_array(_random(24, seed=2), "b1"),
            numpy_helper.from_array(_random(24, 1, 3, 3, seed=3), "w2"), numpy_helper.from_array(_random(24, seed=4), "b2"),
        ]
    )
    data = model.SerializeToString()
    session = plugrt.load(data, device="cpu")
    for height, width in [(9, 9), (16, 11), (5, 20), (9, 9)]:
        feeds = {"x": _random(1, 4, height, width, seed=height * width)}
        expected = _onnxruntime(data, feeds)
        np.testing.assert_allclose(session.run(feeds)["y"], expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))
