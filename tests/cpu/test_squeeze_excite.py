"""Squeeze-excitation (GlobalAveragePool, 1x1 Conv, activation, 1x1 Conv, gate, Mul) as one
SqueezeExcite step: the values onnxruntime gives for each activation and gate, with and
without biases, capture/replay without allocating, no fusion where an intermediate is
read elsewhere or a weight is fed at run time, and the step writing over an input that
dies at it (never over one read later)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import numpy_helper

from cpu.test_fusions import _assert_replays_without_allocating, _step_ops

HIDDEN = {
    "relu": "a = Relu (h)",
    "silu": "hs = Sigmoid (h)\n a = Mul (h, hs)",
    "hard-swish": "a = HardSwish (h)",
}
GATES = {
    "sigmoid": "g = Sigmoid (e)",
    "hard-sigmoid": "g = HardSigmoid <alpha = 0.16666667, beta = 0.5> (e)",
}


def _random(*shape: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _model(
    hidden: str = "relu", gate: str = "sigmoid", *, bias: bool = True, x_first: bool = True, extra_output: str = ""
) -> tuple[bytes, dict[str, np.ndarray]]:
    n, c, r, size = 2, 16, 4, 5
    biases = (", b1", ", b2") if bias else ("", "")
    mul = "y = Mul (x, g)" if x_first else "y = Mul (g, x)"
    outputs = f"float y{', float ' + extra_output if extra_output else ''}"
    text = f"""
    <ir_version: 8, opset_import: ["" : 17]>
    se (float[{n}, {c}, {size}, {size}] x) => ({outputs}) {{
        p = GlobalAveragePool (x)
        h = Conv (p, w1{biases[0]})
        {HIDDEN[hidden]}
        e = Conv (a, w2{biases[1]})
        {GATES[gate]}
        {mul}
    }}
    """
    model = onnx.parser.parse_model(text)
    constants = {"w1": _random(r, c, 1, 1, seed=1), "w2": _random(c, r, 1, 1, seed=2, scale=2.0)}
    if bias:
        constants |= {"b1": _random(r, seed=3), "b2": _random(c, seed=4)}
    model.graph.initializer.extend(numpy_helper.from_array(a, name) for name, a in constants.items())
    return model.SerializeToString(), {"x": _random(n, c, size, size, seed=5, scale=3.0)}


def _onnxruntime(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("hidden", list(HIDDEN))
def test_squeeze_excitation_runs_as_one_step_and_matches_onnxruntime(hidden, gate, bias):
    model, feeds = _model(hidden, gate, bias=bias)
    ops, (actual,) = _step_ops(model, feeds)
    assert ops == ["SqueezeExcite"]
    (expected,) = _onnxruntime(model, feeds)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def test_gate_first_in_the_mul_is_recognised():
    model, feeds = _model(x_first=False)
    ops, (actual,) = _step_ops(model, feeds)
    assert ops == ["SqueezeExcite"]
    np.testing.assert_allclose(actual, _onnxruntime(model, feeds)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hidden, gate", [("relu", "sigmoid"), ("silu", "sigmoid"), ("hard-swish", "hard-sigmoid")])
def test_squeeze_excitation_is_captured_and_replays_without_allocating(hidden, gate):
    model, feeds = _model(hidden, gate)
    _assert_replays_without_allocating(model, feeds, ["SqueezeExcite"])


def test_a_gate_read_elsewhere_too_keeps_the_pattern_apart():
    model, feeds = _model(extra_output="g")
    ops, outputs = _step_ops(model, feeds)
    assert "SqueezeExcite" not in ops
    for actual, expected in zip(outputs, _onnxruntime(model, feeds)):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def test_a_weight_fed_at_run_time_keeps_the_pattern_apart():
    model, feeds = _model()
    proto = onnx.load_from_string(model)
    w1 = next(t for t in proto.graph.initializer if t.name == "w1")
    proto.graph.input.append(onnx.helper.make_tensor_value_info("w1", onnx.TensorProto.FLOAT, list(w1.dims)))
    feeds["w1"] = numpy_helper.to_array(w1)
    proto.graph.initializer.remove(w1)
    ops, _ = _step_ops(proto.SerializeToString(), feeds)
    assert "SqueezeExcite" not in ops


@pytest.mark.parametrize("hidden, gate", [("relu", "sigmoid"), ("silu", "sigmoid"), ("hard-swish", "hard-sigmoid")])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_the_compiled_step_runs_each_image_in_one_call(hidden, gate, bias, monkeypatch):
    """With numba, float32 runs the whole step as one compiled call per image (the values
    onnxruntime gives, its replay as its run)."""
    import plugrt
    from plugrt_cpu.kernels import squeeze_excite

    loops = squeeze_excite.epilogue_loops()
    if loops is None:
        pytest.skip("needs numba's compiled loops")
    calls = []

    class Counted:
        def __getattr__(self, name):
            return getattr(loops, name)

        def squeeze_excite(self, *args):
            calls.append(args[0].shape)
            return loops.squeeze_excite(*args)

    monkeypatch.setattr(squeeze_excite, "epilogue_loops", lambda: Counted())
    model, feeds = _model(hidden, gate, bias=bias)
    session = plugrt.load(model, device="cpu")
    (expected,) = _onnxruntime(model, feeds)
    np.testing.assert_allclose(session.run(feeds)["y"], expected, rtol=1e-5, atol=1e-6)
    assert calls == [(16, 25), (16, 25)]  # two images of 16 channels, 5 x 5


def _dying_input_model(read_later: bool) -> tuple[bytes, dict[str, np.ndarray]]:
    """Relu(x) into a squeeze-excitation of 16 channels of 64 x 64 (above the plan's
    in-place size), the Relu's output dying at it, or read again by an Add after it; a
    last step after it (a step that makes a graph output has its output checked, and
    never runs in place)."""
    c, r, size = 16, 4, 64
    tail = "y = Add (s, a)" if read_later else "y = Relu (s)"
    text = f"""
    <ir_version: 8, opset_import: ["" : 17]>
    se (float[1, {c}, {size}, {size}] x) => (float y) {{
        a = Relu (x)
        p = GlobalAveragePool (a)
        h = Conv (p, w1, b1)
        q = Relu (h)
        e = Conv (q, w2, b2)
        g = Sigmoid (e)
        s = Mul (a, g)
        {tail}
    }}
    """
    model = onnx.parser.parse_model(text)
    constants = {
        "w1": _random(r, c, 1, 1, seed=1), "b1": _random(r, seed=3),
        "w2": _random(c, r, 1, 1, seed=2, scale=2.0), "b2": _random(c, seed=4),
    }
    model.graph.initializer.extend(numpy_helper.from_array(a, name) for name, a in constants.items())
    return model.SerializeToString(), {"x": _random(1, c, size, size, seed=5, scale=3.0)}


def _in_place_steps(session) -> list[str]:
    """The plan's kernels wrapped to write over their first input."""
    return [
        name for name, value in session._plan._fn.__globals__.items()
        if getattr(value, "__qualname__", "").startswith("_in_place")
    ]


def test_the_step_writes_over_an_input_that_dies_at_it():
    import plugrt

    model, feeds = _dying_input_model(read_later=False)
    session = plugrt.load(model, device="cpu")
    assert [step.op_type for step in session._plan.steps] == ["Relu", "SqueezeExcite", "Relu"]
    assert _in_place_steps(session) == ["k1"]  # the gate over the first Relu's output
    expected = _onnxruntime(model, feeds)[0]
    for _ in range(2):  # the second run's buffers come from the first's
        np.testing.assert_allclose(session.run(feeds)["y"], expected, rtol=1e-5, atol=1e-5)


def test_an_input_read_after_the_step_is_not_written_over():
    import plugrt

    model, feeds = _dying_input_model(read_later=True)
    session = plugrt.load(model, device="cpu")
    assert [step.op_type for step in session._plan.steps] == ["Relu", "SqueezeExcite", "Add"]
    assert _in_place_steps(session) == []
    np.testing.assert_allclose(session.run(feeds)["y"], _onnxruntime(model, feeds)[0], rtol=1e-5, atol=1e-5)


def test_the_step_in_place_is_captured_and_replays_without_allocating():
    model, feeds = _dying_input_model(read_later=False)
    _assert_replays_without_allocating(model, feeds, ["Relu", "SqueezeExcite", "Relu"])


def test_the_compiled_step_lays_its_constant_weights_out_once(monkeypatch):
    """The compiled call's weights and biases are made from the node's constants at its
    first call and reused after (a few microseconds of reshapes a call saved)."""
    import plugrt
    from plugrt_cpu.kernels import squeeze_excite

    if squeeze_excite.epilogue_loops() is None:
        pytest.skip("needs numba's compiled loops")
    made = []
    real = squeeze_excite._compiled_arguments

    def counted(*args):
        made.append(args[-2:])
        return real(*args)

    monkeypatch.setattr(squeeze_excite, "_compiled_arguments", counted)
    model, feeds = _model("hard-swish", "hard-sigmoid")
    session = plugrt.load(model, device="cpu")
    (expected,) = _onnxruntime(model, feeds)
    for _ in range(3):
        np.testing.assert_allclose(session.run(feeds)["y"], expected, rtol=1e-5, atol=1e-6)
    assert made == [(4, 16)]  # once: hidden 4, channels 16
