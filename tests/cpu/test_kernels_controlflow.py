"""If, Loop and Scan through a session, against onnx.reference and plain numpy."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import pytest
from onnx.reference import ReferenceEvaluator

from helpers import run_model, text_model


def _check_against_reference(model: onnx.ModelProto, feeds: dict) -> list:
    expected = ReferenceEvaluator(model).run(None, feeds)
    actual = run_model(model, feeds)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6)
    return actual


# -- If ---------------------------------------------------------------------------------

IF_NESTED = """
<ir_version: 8, opset_import: ["" : 17]>
g (bool c1, bool c2, float[3] x, float[3] b) => (float[3] y) {
    y = If (c1) <
        then_branch = t1 () => (float[3] r1) { r1 = Add (x, b) },
        else_branch = e1 () => (float[3] r2) {
            r2 = If (c2) <
                then_branch = t2 () => (float[3] r3) { r3 = Mul (x, b) },
                else_branch = e2 () => (float[3] r4) { r4 = Sub (x, b) }
            >
        }
    >
}
"""


@pytest.mark.parametrize("c1,c2", [(True, False), (False, True), (False, False)])
def test_if_nested_reads_outer_scope(c1, c2):
    rng = np.random.default_rng(0)
    feeds = {
        "c1": np.array(c1), "c2": np.array(c2),
        "x": rng.standard_normal(3).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32),
    }
    _check_against_reference(text_model(IF_NESTED), feeds)


def test_if_cond_of_shape_one_and_multiple_outputs():
    model = text_model("""
    <ir_version: 8, opset_import: ["" : 13]>
    g (bool[1] c, int32[2] x) => (int32[2] y, int32[2] z) {
        y, z = If (c) <
            then_branch = t () => (int32[2] a, int32[2] b) { a = Identity (x)  b = Neg (x) },
            else_branch = e () => (int32[2] a2, int32[2] b2) { a2 = Neg (x)  b2 = Identity (x) }
        >
    }
    """)
    x = np.array([1, -2], dtype=np.int32)
    y, z = run_model(model, {"c": np.array([False]), "x": x})
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, -x)
    np.testing.assert_array_equal(z, x)


# -- Loop -------------------------------------------------------------------------------

LOOP_FOR = """
<ir_version: 8, opset_import: ["" : 17]>
g (int64 m, bool c, float[2] s0, float[2] w) => (float[2] s, float[N, 2] trace) {
    s, trace = Loop (m, c, s0) <body = body (int64 i, bool cin, float[2] sin) => (bool cout, float[2] sout, float[2] t) {
        cout = Identity (cin)
        fi = Cast <to = 1> (i)
        scaled = Mul (w, fi)
        sout = Add (sin, scaled)
        t = Identity (sout)
    }>
}
"""


def test_loop_for_matches_reference():
    feeds = {
        "m": np.array(5, dtype=np.int64), "c": np.array(True),
        "s0": np.array([1.0, -1.0], dtype=np.float32), "w": np.array([0.5, 2.0], dtype=np.float32),
    }
    s, trace = _check_against_reference(text_model(LOOP_FOR), feeds)
    assert trace.shape == (5, 2) and trace.dtype == np.float32
    np.testing.assert_allclose(s, feeds["s0"] + feeds["w"] * 10)


def test_loop_zero_trips_keeps_initial_values_and_typed_empty_scan_output():
    feeds = {
        "m": np.array(0, dtype=np.int64), "c": np.array(True),
        "s0": np.array([1.0, -1.0], dtype=np.float32), "w": np.array([0.5, 2.0], dtype=np.float32),
    }
    s, trace = run_model(text_model(LOOP_FOR), feeds)
    np.testing.assert_array_equal(s, feeds["s0"])
    assert trace.shape == (0, 2) and trace.dtype == np.float32


def test_loop_false_initial_cond_runs_no_iteration():
    feeds = {
        "m": np.array(4, dtype=np.int64), "c": np.array(False),
        "s0": np.array([1.0, -1.0], dtype=np.float32), "w": np.array([0.5, 2.0], dtype=np.float32),
    }
    s, trace = run_model(text_model(LOOP_FOR), feeds)
    np.testing.assert_array_equal(s, feeds["s0"])
    assert trace.shape == (0, 2)


def test_loop_while_without_trip_count():
    model = text_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (bool c, int64 limit) => (int64 n, int64[K] its) {
        n, its = Loop ("", c, limit) <body = body (int64 i, bool cin, int64 lim) => (bool cout, int64 lout, int64 iout) {
            one = Constant <value = int64 {1}> ()
            nxt = Add (i, one)
            cout = Less (nxt, lim)
            lout = Identity (lim)
            iout = Identity (i)
        }>
    }
    """)
    # (onnx.reference stacks 0-d scan outputs with vstack, giving shape (4, 1); the spec
    # stacks them on a new leading axis, shape (4,), as onnxruntime does.)
    feeds = {"c": np.array(True), "limit": np.array(4, dtype=np.int64)}
    n, its = run_model(model, feeds)
    assert n.dtype == np.int64 and int(n) == 4
    assert its.dtype == np.int64
    np.testing.assert_array_equal(its, np.arange(4, dtype=np.int64))


def test_loop_without_cond_input_ignores_the_body_condition():
    # Spec: with cond omitted ("for" loop) the body's condition output is ignored.
    model = text_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (int64 m, float x0) => (float x) {
        x = Loop (m, "", x0) <body = body (int64 i, bool cin, float xin) => (bool cout, float xout) {
            cout = Constant <value = bool {0}> ()
            two = Constant <value = float {2}> ()
            xout = Mul (xin, two)
        }>
    }
    """)
    (x,) = run_model(model, {"m": np.array(3, dtype=np.int64), "x0": np.array(1.5, dtype=np.float32)})
    assert x.dtype == np.float32
    np.testing.assert_allclose(x, 12.0)


def test_loop_carries_a_sequence_and_nests_an_if():
    model = text_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (int64 m, float[2] x) => (seq(float[2]) out) {
        empty = SequenceEmpty <dtype = 1> ()
        out = Loop (m, "", empty) <body = body (int64 i, bool cin, seq(float[2]) sin) => (bool cout, seq(float[2]) sout) {
            cout = Identity (cin)
            two = Constant <value = int64 {2}> ()
            zero = Constant <value = int64 {0}> ()
            r = Mod (i, two)
            even = Equal (r, zero)
            v = If (even) <
                then_branch = t () => (float[2] a) { a = Identity (x) },
                else_branch = e () => (float[2] b) { b = Neg (x) }
            >
            sout = SequenceInsert (sin, v)
        }>
    }
    """)
    x = np.array([1.0, 2.0], dtype=np.float32)
    (out,) = run_model(model, {"m": np.array(3, dtype=np.int64), "x": x})
    assert isinstance(out, list) and len(out) == 3
    for k, item in enumerate(out):
        np.testing.assert_array_equal(item, x if k % 2 == 0 else -x)


# -- Scan -------------------------------------------------------------------------------

def _scan9(attrs: str, opset: int = 16) -> onnx.ModelProto:
    return text_model(f"""
    <ir_version: 8, opset_import: ["" : {opset}]>
    g (float[2, 3] s0, float[2, 4, 3] x, float[2, 3] w) => (float[2, 3] s, float[A, B, C] y) {{
        s, y = Scan (s0, x) <num_scan_inputs = 1{attrs}, body = body (float[2, 3] sin, float[2, 3] xi) => (float[2, 3] sout, float[2, 3] yo) {{
            sout = Add (sin, xi)
            yo = Mul (sout, w)
        }}>
    }}
    """)


def _scan9_feeds():
    rng = np.random.default_rng(1)
    return {
        "s0": rng.standard_normal((2, 3)).astype(np.float32),
        "x": rng.standard_normal((2, 4, 3)).astype(np.float32),
        "w": rng.standard_normal((2, 3)).astype(np.float32),
    }


@pytest.mark.parametrize(
    "in_dir,out_axis,out_dir",
    [(0, 0, 0), (1, 0, 0), (0, 2, 1), (1, -1, 1), (0, 1, 0), (1, -2, 0)],
)
def test_scan9_axes_and_directions(in_dir, out_axis, out_dir):
    feeds = _scan9_feeds()
    attrs = (
        f", scan_input_axes = [1], scan_input_directions = [{in_dir}]"
        f", scan_output_axes = [{out_axis}], scan_output_directions = [{out_dir}]"
    )
    s, y = run_model(_scan9(attrs), feeds)
    steps = np.moveaxis(feeds["x"], 1, 0)  # (4, 2, 3)
    if in_dir:
        steps = steps[::-1]
    states = feeds["s0"][None] + np.cumsum(steps, axis=0)
    elems = states * feeds["w"]
    if out_dir:
        elems = elems[::-1]
    expected = np.moveaxis(elems, 0, out_axis)
    assert s.dtype == np.float32 and y.dtype == np.float32
    np.testing.assert_allclose(s, states[-1], rtol=1e-5, atol=1e-6)
    assert y.shape == expected.shape
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


def test_scan9_axis0_matches_reference_with_outer_value():
    model = text_model("""
    <ir_version: 8, opset_import: ["" : 19]>
    g (float[3] s0, float[5, 3] x, float[5, 3] z, float[3] w) => (float[3] s, float[5, 3] y) {
        s, y = Scan (s0, x, z) <num_scan_inputs = 2, body = body (float[3] sin, float[3] xi, float[3] zi) => (float[3] sout, float[3] yo) {
            p = Mul (xi, zi)
            sout = Add (sin, p)
            yo = Add (sout, w)
        }>
    }
    """)
    rng = np.random.default_rng(2)
    feeds = {
        "s0": rng.standard_normal(3).astype(np.float32),
        "x": rng.standard_normal((5, 3)).astype(np.float32),
        "z": rng.standard_normal((5, 3)).astype(np.float32),
        "w": rng.standard_normal(3).astype(np.float32),
    }
    _check_against_reference(model, feeds)


def test_scan9_zero_length_gives_typed_empty_output():
    model = text_model("""
    <ir_version: 8, opset_import: ["" : 16]>
    g (float[3] s0, float[N, 3] x) => (float[3] s, float[M, 3] y) {
        s, y = Scan (s0, x) <num_scan_inputs = 1, scan_output_axes = [1], body = body (float[3] sin, float[3] xi) => (float[3] sout, float[3] yo) {
            sout = Add (sin, xi)
            yo = Identity (sout)
        }>
    }
    """)
    s0 = np.ones(3, dtype=np.float32)
    s, y = run_model(model, {"s0": s0, "x": np.zeros((0, 3), dtype=np.float32)})
    np.testing.assert_array_equal(s, s0)
    assert y.shape == (3, 0) and y.dtype == np.float32


SCAN8 = """
<ir_version: 8, opset_import: ["" : 8]>
g ({lens_decl}float[2, 2] s0, float[2, 3, 2] x) => (float[2, 2] s, float[2, 3, 2] y) {{
    s, y = Scan ({lens_arg}, s0, x) <num_scan_inputs = 1, directions = [{direction}], body = body (float[2] sin, float[2] xi) => (float[2] sout, float[2] yo) {{
        sout = Add (sin, xi)
        yo = Identity (sout)
    }}>
}}
"""


@pytest.mark.parametrize("direction", [0, 1])
@pytest.mark.parametrize("lens", [None, [3, 2], [0, 1]])
def test_scan8_batch_and_sequence_lens(direction, lens):
    text = SCAN8.format(
        direction=direction,
        lens_decl="" if lens is None else "int32[2] lens, ",
        lens_arg='""' if lens is None else "lens",
    )
    model = onnx.parser.parse_model(text)
    rng = np.random.default_rng(3)
    s0 = rng.standard_normal((2, 2)).astype(np.float32)
    x = rng.standard_normal((2, 3, 2)).astype(np.float32)
    feeds = {"s0": s0, "x": x}
    if lens is not None:
        feeds["lens"] = np.array(lens, dtype=np.int32)
    s, y = run_model(model, feeds)
    assert s.dtype == np.float32 and y.dtype == np.float32 and y.shape == (2, 3, 2)
    for b in range(2):
        length = 3 if lens is None else lens[b]
        steps = x[b, :length]
        if direction:
            steps = steps[::-1]
        cum = s0[b] + np.cumsum(steps, axis=0)
        expected_y = np.zeros((3, 2), dtype=np.float32)
        expected_y[:length] = cum
        np.testing.assert_allclose(s[b], cum[-1] if length else s0[b], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(y[b], expected_y, rtol=1e-5, atol=1e-6)
