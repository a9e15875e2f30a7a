"""A run with bound outputs stores each into its binding as soon as it is final, not all
at the end: what a state binding's input still has to give is read first, and the bound
outputs need not all stay alive to the end of the run (a KV cache's presents)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import onnx
import onnxruntime

import plugrt


def _load(text: str) -> tuple[plugrt.Session, bytes]:
    model = onnx.parser.parse_model(text)
    onnx.checker.check_model(model)
    data = model.SerializeToString()
    return plugrt.load(data, optimization="none"), data


def test_a_state_bindings_input_is_read_by_every_step_before_its_output_overwrites_it():
    # present is made first, and past is read again after it: storing present into the
    # shared buffer as soon as it is made would hand the second reader the new values
    session, data = _load(
        '<ir_version: 8, opset_import: ["" : 17]> g (float[4] past, float[4] x) => (float[4] present, float[4] y) '
        "{ present = Add(past, x) doubled = Add(past, past) y = Mul(doubled, x) }"
    )
    past = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    x = np.array([10.0, 20.0, 30.0, 40.0], np.float32)
    state = session.allocate_binding(input="past", output="present", shape=(4,))
    state.view()[...] = past
    out = session.run({"x": x}, bindings=[state])
    expected = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"past": past, "x": x})
    assert out["present"] is None
    np.testing.assert_array_equal(state.view(), expected[0])
    np.testing.assert_array_equal(out["y"], expected[1])


def test_bound_outputs_do_not_all_stay_alive_to_the_end_of_the_run():
    # eight 1 MiB outputs, each made by its own step and bound: stored as each is made, the
    # run holds about one of them at a time instead of all eight
    outputs = ", ".join(f"float[262144] o{i}" for i in range(8))
    body = " ".join(f"o{i} = Add(x, c{i})" for i in range(8))
    constants = " ".join(f"c{i} = Constant <value_float = {i}.0> ()" for i in range(8))
    session, _ = _load(
        f'<ir_version: 8, opset_import: ["" : 17]> g (float[262144] x) => ({outputs}) {{ {constants} {body} }}'
    )
    bindings = [session.allocate_binding(output=f"o{i}", shape=(262144,)) for i in range(8)]
    x = np.random.default_rng(0).standard_normal(262144).astype(np.float32)
    session.run({"x": x}, bindings=bindings)  # a first run makes what the first run makes
    tracemalloc.start()
    try:
        session.run({"x": x}, bindings=bindings)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * x.nbytes  # all eight alive would be 8 MiB
    for i, binding in enumerate(bindings):
        np.testing.assert_array_equal(binding.view(), x + np.float32(i))


def test_an_input_passed_through_to_a_bound_output_is_still_stored():
    session, _ = _load(
        '<ir_version: 8, opset_import: ["" : 17]> g (float[3] x) => (float[3] y, float[3] z) { z = Neg(x) y = Identity(x) }'
    )
    session_plain = session.run({"x": np.ones(3, np.float32)})
    y = session.allocate_binding(output="y", shape=(3,))
    z = session.allocate_binding(output="z", shape=(3,))
    x = np.array([1.0, -2.0, 3.0], np.float32)
    out = session.run({"x": x}, bindings=[y, z])
    assert out == {"y": None, "z": None} and set(session_plain) == {"y", "z"}
    np.testing.assert_array_equal(y.view(), x)
    np.testing.assert_array_equal(z.view(), -x)
