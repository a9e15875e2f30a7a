"""Recurrent kernels (RNN, GRU, LSTM), checked against onnx.reference, onnxruntime (for
what onnx.reference ignores: sequence_lens, clip, activations, input_forget) and
independently written numpy."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from helpers import node_feeds, node_model, reference_node, run_node

_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_HIDDEN = 5


def _recurrence_options(op: str, inputs: dict[str, np.ndarray | None]) -> dict:
    """The node options every recurrence here shares: hidden size and typed outputs."""
    outputs = ["y", "y_h", "y_c"] if op == "LSTM" else ["y", "y_h"]
    elem = helper.np_dtype_to_tensor_dtype(inputs["x"].dtype)
    return {"outputs": outputs, "output_types": [elem] * len(outputs), "hidden_size": _HIDDEN}


def _onnxruntime(op, inputs, **attributes) -> list[np.ndarray]:
    ort = pytest.importorskip("onnxruntime")
    model = node_model(op, inputs, 22, **_recurrence_options(op, inputs), **attributes)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, node_feeds(inputs))


def _inputs(op, *, seq=6, batch=3, size=4, directions=1, layout=0, lengths=None, dtype=np.float32, seed=0):
    """Random X, W, R, B, sequence_lens, initial states (and P for LSTM) for ``op``."""
    rng = np.random.default_rng(seed)
    gates = _GATES[op]

    def draw(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    state_shape = (directions, batch, _HIDDEN) if layout == 0 else (batch, directions, _HIDDEN)
    inputs = {
        "x": draw(seq, batch, size) if layout == 0 else draw(batch, seq, size),
        "w": draw(directions, gates * _HIDDEN, size, scale=0.5),
        "r": draw(directions, gates * _HIDDEN, _HIDDEN, scale=0.5),
        "b": draw(directions, 2 * gates * _HIDDEN, scale=0.5),
        "sequence_lens": None if lengths is None else np.array(lengths, dtype=np.int32),
        "initial_h": draw(*state_shape),
    }
    if op == "LSTM":
        inputs["initial_c"] = draw(*state_shape)
        inputs["p"] = draw(directions, 3 * _HIDDEN, scale=0.5)
    return inputs


def _assert_all_close(got, expected, tol=1e-5):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(g, e, rtol=tol, atol=tol)


_CASES = [("RNN", {}), ("GRU", {}), ("GRU", {"linear_before_reset": 1}), ("LSTM", {})]


@pytest.mark.parametrize(("op", "extra"), _CASES)
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("layout", [0, 1])
def test_recurrence_matches_onnx_reference(op, extra, direction, layout):
    directions = 2 if direction == "bidirectional" else 1
    inputs = _inputs(op, directions=directions, layout=layout)
    attributes = {"direction": direction, "layout": layout, **extra}
    _assert_all_close(run_node(op, inputs, 22, **_recurrence_options(op, inputs), **attributes), reference_node(op, inputs, 22, **_recurrence_options(op, inputs), **attributes))


@pytest.mark.parametrize(("op", "extra"), _CASES)
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_sequence_lens_match_onnxruntime(op, extra, direction):
    directions = 2 if direction == "bidirectional" else 1
    inputs = _inputs(op, directions=directions, lengths=[6, 2, 4], seed=1)
    attributes = {"direction": direction, **extra}
    _assert_all_close(run_node(op, inputs, 22, **_recurrence_options(op, inputs), **attributes), _onnxruntime(op, inputs, **attributes))


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_sequence_lens_equal_running_each_sequence_alone(direction):
    lengths = [6, 3, 1]
    inputs = _inputs("GRU", lengths=lengths, seed=2)
    y, y_h = run_node("GRU", inputs, 22, **_recurrence_options("GRU", inputs), direction=direction)
    for b, length in enumerate(lengths):
        alone = dict(inputs, x=inputs["x"][:length, b : b + 1], sequence_lens=None, initial_h=inputs["initial_h"][:, b : b + 1])
        y_alone, y_h_alone = reference_node("GRU", alone, 22, **_recurrence_options("GRU", alone), direction=direction)
        np.testing.assert_allclose(y[:length, :, b : b + 1], y_alone, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(y[length:, :, b], 0)
        np.testing.assert_allclose(y_h[:, b : b + 1], y_h_alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("op", "extra"), _CASES)
def test_clip_matches_onnxruntime(op, extra):
    inputs = _inputs(op, directions=2, seed=3)
    attributes = {"direction": "bidirectional", "clip": 0.4, **extra}
    _assert_all_close(run_node(op, inputs, 22, **_recurrence_options(op, inputs), **attributes), _onnxruntime(op, inputs, **attributes))


@pytest.mark.parametrize(
    ("op", "activations"),
    [
        ("RNN", ["LeakyRelu", "HardSigmoid"]),
        ("GRU", ["HardSigmoid", "Affine", "Sigmoid", "ScaledTanh"]),
        ("LSTM", ["HardSigmoid", "Elu", "Softsign", "Sigmoid", "Tanh", "Softplus"]),
    ],
)
def test_activations_consume_alpha_and_beta_in_order_like_onnxruntime(op, activations):
    inputs = _inputs(op, directions=2, seed=4)
    attributes = {
        "direction": "bidirectional",
        "activations": activations,
        "activation_alpha": [0.3, 0.4, 0.6, 0.7],
        "activation_beta": [0.2, 0.1, 0.3],
    }
    _assert_all_close(run_node(op, inputs, 22, **_recurrence_options(op, inputs), **attributes), _onnxruntime(op, inputs, **attributes))


def test_lstm_input_forget_couples_the_gates_like_onnxruntime():
    inputs = _inputs("LSTM", seed=5)
    _assert_all_close(run_node("LSTM", inputs, 22, **_recurrence_options("LSTM", inputs), input_forget=1), _onnxruntime("LSTM", inputs, input_forget=1))


def test_relu_rnn_matches_numpy():
    inputs = _inputs("RNN", seed=6)
    x, w, r, b, h = inputs["x"], inputs["w"][0], inputs["r"][0], inputs["b"][0], inputs["initial_h"][0]
    expected = []
    for x_t in x:
        h = np.maximum(x_t @ w.T + h @ r.T + b[:_HIDDEN] + b[_HIDDEN:], 0)
        expected.append(h)
    y, y_h = run_node("RNN", inputs, 22, **_recurrence_options("RNN", inputs), activations=["Relu"])
    np.testing.assert_allclose(y[:, 0], np.stack(expected), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y_h[0], h, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_recurrence_keeps_the_input_dtype(dtype):
    inputs = _inputs("LSTM", dtype=dtype, seed=7)
    got = run_node("LSTM", inputs, 22, **_recurrence_options("LSTM", inputs))
    expected = reference_node("LSTM", {k: None if v is None else v.astype(np.float64) for k, v in inputs.items()}, 22, **_recurrence_options("LSTM", {k: None if v is None else v.astype(np.float64) for k, v in inputs.items()}))
    for g, e in zip(got, expected):
        assert g.dtype == dtype
        tol = 1e-2 if dtype == np.float16 else 1e-12
        np.testing.assert_allclose(g.astype(np.float64), e, rtol=tol, atol=tol)


def test_omitted_optional_inputs_default_to_zero():
    inputs = _inputs("LSTM", seed=8)
    bare = {"x": inputs["x"], "w": inputs["w"], "r": inputs["r"]}
    _assert_all_close(run_node("LSTM", bare, 22, **_recurrence_options("LSTM", bare)), reference_node("LSTM", bare, 22, **_recurrence_options("LSTM", bare)))


def test_unknown_activation_is_rejected():
    inputs = _inputs("RNN", seed=9)
    with pytest.raises(Exception, match="Gelu"):
        run_node("RNN", inputs, 22, **_recurrence_options("RNN", inputs), activations=["Gelu"])


def test_one_direction_node_with_both_directions_activations_uses_the_first():
    inputs = _inputs("RNN", seed=10)
    _assert_all_close(run_node("RNN", inputs, 22, **_recurrence_options("RNN", inputs), activations=["Relu", "Tanh"]), run_node("RNN", inputs, 22, **_recurrence_options("RNN", inputs), activations=["Relu"]))
