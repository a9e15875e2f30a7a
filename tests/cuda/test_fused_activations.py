"""The rewritten GELU, SiLU and Conv + Relu on the CUDA provider over numpy: the core's
rewrites give it standard and contrib ops it claims, its own fusions make one step of
each chain, and the values match onnxruntime (the same math the NVRTC kernels compute,
which tests/cuda/test_nvrtc.py compiles)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import plugrt
from plugrt_cuda import _xp

from cuda_helpers import NumpyCUDA, registry_of
from helpers import written_out_gelu

ort = pytest.importorskip("onnxruntime")


def _model(text: str, **constants: np.ndarray) -> bytes:
    model = onnx.parser.parse_model(text)
    model.graph.initializer.extend(numpy_helper.from_array(np.asarray(a), name) for name, a in constants.items())
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _steps_and_outputs(model: bytes, feeds: dict[str, np.ndarray]) -> tuple[list[str], list[np.ndarray]]:
    """Every node placed on the CUDA provider; the plan's steps and one run's outputs."""
    session = plugrt.load(model, device="cuda", registry=registry_of(NumpyCUDA()), optimization="all", profiling=True)
    report = session.placement
    assert report.fallbacks == [] and set(report.nodes_per_provider) == {"cuda"}, report.summary()
    outputs = list(session.run(feeds).values())
    steps = [event["args"]["op_name"] for event in session.profile() if event["cat"] == "Node"]
    return steps, outputs


def _onnxruntime(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize(("form", "op_type"), [("erf", "Gelu"), ("tanh", "FastGelu")])
def test_a_written_out_gelu_runs_on_cuda_as_the_contrib_op(form, op_type):
    model = written_out_gelu(form, 17).SerializeToString()
    feeds = {"x": _random(4, 32, seed=1) * 3}
    steps, (y,) = _steps_and_outputs(model, feeds)
    assert steps == [op_type]
    np.testing.assert_allclose(y, _onnxruntime(model, feeds)[0], rtol=1e-5, atol=1e-6)


def test_fast_gelu_with_a_bias_matches_onnxruntime():
    model = _model(
        """
        <ir_version: 9, opset_import: ["" : 17, "com.microsoft" : 1]>
        g (float[2, 3, 16] x) => (float[2, 3, 16] y) {
            y = com.microsoft.FastGelu (x, bias)
        }
        """,
        bias=_random(16, seed=3),
    )
    feeds = {"x": _random(2, 3, 16, seed=4) * 2}
    steps, (y,) = _steps_and_outputs(model, feeds)
    assert steps == ["FastGelu"]
    np.testing.assert_allclose(y, _onnxruntime(model, feeds)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order", ["Mul (x, s)", "Mul (s, x)"])
def test_sigmoid_times_its_input_runs_as_one_silu_step(order):
    model = _model(
        f"""
        <ir_version: 9, opset_import: ["" : 17]>
        g (float[2, 8, 5, 5] x) => (float[2, 8, 5, 5] y) {{
            s = Sigmoid (x)
            y = {order}
        }}
        """
    )
    feeds = {"x": _random(2, 8, 5, 5, seed=5) * 4}
    steps, (y,) = _steps_and_outputs(model, feeds)
    assert steps == ["Silu"]
    np.testing.assert_allclose(y, _onnxruntime(model, feeds)[0], rtol=1e-5, atol=1e-6)


def test_a_sigmoid_read_elsewhere_too_is_not_fused():
    model = _model(
        """
        <ir_version: 9, opset_import: ["" : 17]>
        g (float[2, 8] x) => (float[2, 8] y, float[2, 8] s) {
            s = Sigmoid (x)
            y = Mul (x, s)
        }
        """
    )
    steps, _ = _steps_and_outputs(model, {"x": _random(2, 8, seed=6)})
    assert steps == ["Sigmoid", "Mul"]


def test_conv_batch_normalization_relu_runs_as_one_fused_conv():
    scale, bias, mean = _random(4, seed=7), _random(4, seed=8), _random(4, seed=9)
    var = np.abs(_random(4, seed=10)) + 0.5
    model = _model(
        """
        <ir_version: 9, opset_import: ["" : 17]>
        g (float[1, 3, 8, 8] x) => (float[1, 4, 6, 6] y) {
            c = Conv (x, w, b)
            n = BatchNormalization (c, scale, bias, mean, var)
            y = Relu (n)
        }
        """,
        w=_random(4, 3, 3, 3, seed=11), b=_random(4, seed=12), scale=scale, bias=bias, mean=mean, var=var,
    )
    feeds = {"x": _random(1, 3, 8, 8, seed=13)}
    steps, (y,) = _steps_and_outputs(model, feeds)
    assert steps == ["FusedConv"]  # BatchNormalization folded by the core, Relu by the provider
    np.testing.assert_allclose(y, _onnxruntime(model, feeds)[0], rtol=1e-5, atol=1e-5)


def test_silu_math_matches_numpy_in_float64():
    x = _random(1000, seed=14) * 10
    want = x.astype(np.float64) / (1 + np.exp(-x.astype(np.float64)))
    np.testing.assert_allclose(_xp.silu(np, x), want, rtol=1e-6, atol=1e-7)
