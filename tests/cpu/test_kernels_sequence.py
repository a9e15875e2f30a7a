"""Sequence and optional ops through a session, against onnx.reference and plain numpy."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from helpers import run_model, text_model
from plugrt.errors import PlugrtError


def _assert_same(actual, expected):
    if isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _assert_same(a, e)
        return
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(actual, expected)


def _check(model: onnx.ModelProto, feeds: dict) -> list:
    expected = ReferenceEvaluator(model).run(None, feeds)
    actual = run_model(model, feeds)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        _assert_same(a, e)
    return actual


def _items(n=4, dtype=np.float32):
    rng = np.random.default_rng(0)
    return [rng.standard_normal((2, 3)).astype(dtype) for _ in range(n)]


SEQ_OPS = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 3] a, float[2, 3] b, float[2, 3] c, float[2, 3] t, int64 p) => ({outs}) {{
    s = SequenceConstruct (a, b, c)
    {body}
}}
"""


@pytest.mark.parametrize("p", [-3, -1, 0, 1, 3])
def test_sequence_insert_positions(p):
    model = text_model(SEQ_OPS.format(outs="seq(float[2, 3]) r, int64 n", body="r = SequenceInsert (s, t, p)\n n = SequenceLength (r)"))
    a, b, c, t = _items()
    (r, n) = run_model(model, {"a": a, "b": b, "c": c, "t": t, "p": np.array(p, dtype=np.int64)})
    expected = [a, b, c]
    expected.insert(p + 3 if p < 0 else p, t)
    _assert_same(r, expected)
    assert n.dtype == np.int64 and n.shape == () and int(n) == 4


def test_sequence_insert_default_appends_and_keeps_input():
    model = text_model(SEQ_OPS.format(
        outs="seq(float[2, 3]) r, seq(float[2, 3]) s2",
        body="r = SequenceInsert (s, t)\n s2 = Identity (s)",
    ))
    a, b, c, t = _items()
    r, s2 = run_model(model, {"a": a, "b": b, "c": c, "t": t, "p": np.array(0, dtype=np.int64)})
    _assert_same(r, [a, b, c, t])
    _assert_same(s2, [a, b, c])  # the input sequence is not modified in place


@pytest.mark.parametrize("p", [-3, -1, 0, 2])
def test_sequence_erase_and_at(p):
    model = text_model(SEQ_OPS.format(
        outs="seq(float[2, 3]) r, float[2, 3] at",
        body="r = SequenceErase (s, p)\n at = SequenceAt (s, p)",
    ))
    a, b, c, t = _items()
    _check(model, {"a": a, "b": b, "c": c, "t": t, "p": np.array(p, dtype=np.int64)})


def test_sequence_erase_default_removes_last():
    model = text_model(SEQ_OPS.format(outs="seq(float[2, 3]) r", body="r = SequenceErase (s)"))
    a, b, c, t = _items()
    (r,) = run_model(model, {"a": a, "b": b, "c": c, "t": t, "p": np.array(0, dtype=np.int64)})
    _assert_same(r, [a, b])


def test_sequence_at_out_of_range_raises():
    model = text_model(SEQ_OPS.format(outs="float[2, 3] r", body="r = SequenceAt (s, p)"))
    a, b, c, t = _items()
    with pytest.raises(PlugrtError):
        run_model(model, {"a": a, "b": b, "c": c, "t": t, "p": np.array(3, dtype=np.int64)})


@pytest.mark.parametrize(
    "split,axis,keepdims",
    [(None, 1, 1), (None, -1, 0), (None, 0, 0), (np.array(2, np.int64), 1, 1), (np.array(4, np.int64), 1, 1),
     (np.array([1, 4], np.int64), -1, 1), (np.array([2, 0, 1], np.int32), 0, 1)],
)
def test_split_to_sequence(split, axis, keepdims):
    x = np.arange(3 * 5, dtype=np.float32).reshape(3, 5)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])]
    names = ["x"]
    feeds = {"x": x}
    if split is not None:
        elem = TensorProto.INT64 if split.dtype == np.int64 else TensorProto.INT32
        inputs.append(helper.make_tensor_value_info("split", elem, list(split.shape)))
        names.append("split")
        feeds["split"] = split
    node = helper.make_node("SplitToSequence", names, ["seq"], axis=axis, keepdims=keepdims)
    out = helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, None)
    graph = helper.make_graph([node], "g", inputs, [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    (seq,) = _check(model, feeds)
    assert all(s.dtype == np.float32 for s in seq)


@pytest.mark.parametrize("axis,new_axis", [(0, 0), (1, 0), (-1, 0), (0, 1), (2, 1), (-1, 1), (-3, 1)])
def test_concat_from_sequence(axis, new_axis):
    model = text_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float16[2, 3] a, float16[2, 3] b, float16[2, 3] c) => (float16[A, B, C] y) {{
        s = SequenceConstruct (a, b, c)
        y = ConcatFromSequence <axis = {axis}, new_axis = {new_axis}> (s)
    }}
    """)
    a, b, c = _items(3, np.float16)
    (y,) = run_model(model, {"a": a, "b": b, "c": c})
    expected = np.stack([a, b, c], axis=axis) if new_axis else np.concatenate([a, b, c], axis=axis)
    _assert_same(y, expected)


def test_sequence_map_with_tensor_sequence_and_outer_value():
    model = text_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (seq(float[N]) xs, seq(float[N]) ys, float[1] k, float w) => (seq(float[N]) out, seq(int64[1]) shapes) {
        out, shapes = SequenceMap (xs, ys, k) <body = body (float[N] x, float[N] y, float[1] kk) => (float[N] o, int64[1] sh) {
            p = Mul (x, y)
            q = Add (p, kk)
            o = Mul (q, w)
            sh = Shape (x)
        }>
    }
    """)
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(n).astype(np.float32) for n in (2, 5, 1)]
    ys = [rng.standard_normal(n).astype(np.float32) for n in (2, 5, 1)]
    k = np.array([0.5], dtype=np.float32)
    w = np.array(3.0, dtype=np.float32)
    out, shapes = run_model(model, {"xs": xs, "ys": ys, "k": k, "w": w})
    assert len(out) == 3 and len(shapes) == 3
    for x, y, o, sh in zip(xs, ys, out, shapes):
        assert o.dtype == np.float32
        np.testing.assert_allclose(o, (x * y + k) * w, rtol=1e-6)
        np.testing.assert_array_equal(sh, [x.size])


def test_sequence_map_empty_sequence():
    model = text_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (seq(float[N]) xs) => (seq(float[N]) out) {
        out = SequenceMap (xs) <body = body (float[N] x) => (float[N] o) { o = Neg (x) }>
    }
    """)
    (out,) = run_model(model, {"xs": []})
    assert out == []


def _optional_model(with_input: bool, elem=TensorProto.FLOAT) -> onnx.ModelProto:
    tensor_type = helper.make_tensor_type_proto(elem, [2])
    nodes = [
        helper.make_node("Optional", ["x"] if with_input else [], ["opt"],
                         **({} if with_input else {"type": tensor_type})),
        helper.make_node("OptionalHasElement", ["opt"], ["has"]),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", elem, [2])],
        [helper.make_tensor_value_info("has", TensorProto.BOOL, [])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("with_input", [True, False])
def test_optional_construct_and_has_element(with_input):
    (has,) = run_model(_optional_model(with_input), {"x": np.array([1.0, 2.0], dtype=np.float32)})
    assert has.dtype == np.bool_ and has.shape == () and bool(has) is with_input


def test_optional_through_if_and_get_element():
    # An If whose branches return an optional tensor: full on one side, empty on the other.
    tensor_type = helper.make_tensor_type_proto(TensorProto.FLOAT, [2])
    opt_type = helper.make_optional_type_proto(tensor_type)
    then_graph = helper.make_graph(
        [helper.make_node("Optional", ["x"], ["o1"])], "then", [],
        [helper.make_value_info("o1", opt_type)],
    )
    else_graph = helper.make_graph(
        [helper.make_node("Optional", [], ["o2"], type=tensor_type)], "else", [],
        [helper.make_value_info("o2", opt_type)],
    )
    nodes = [
        helper.make_node("If", ["c"], ["opt"], then_branch=then_graph, else_branch=else_graph),
        helper.make_node("OptionalHasElement", ["opt"], ["has"]),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []), helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("has", TensorProto.BOOL, []), helper.make_value_info("opt", opt_type)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.array([1.0, 2.0], dtype=np.float32)
    has, opt = run_model(model, {"c": np.array(True), "x": x})
    assert bool(has) and opt is not None
    np.testing.assert_array_equal(opt, x)
    has, opt = run_model(model, {"c": np.array(False), "x": x})
    assert not bool(has) and opt is None


def test_optional_get_element_of_a_sequence_and_of_an_empty_optional():
    model = text_model("""
    <ir_version: 8, opset_import: ["" : 18]>
    g (seq(float[2]) s) => (seq(float[2]) r) {
        r = OptionalGetElement (s)
    }
    """)
    items = _items(2)
    (r,) = run_model(model, {"s": items})
    _assert_same(r, items)
    from plugrt_cpu.kernels.sequence import optional_get_element

    with pytest.raises(ValueError):
        optional_get_element(None)


def test_sequence_empty_then_insert_preserves_dtype():
    model = text_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (int8[3] x) => (int8[2, 3] y) {
        e = SequenceEmpty <dtype = 3> ()
        s1 = SequenceInsert (e, x)
        s2 = SequenceInsert (s1, x)
        y = ConcatFromSequence <axis = 0, new_axis = 1> (s2)
    }
    """)
    x = np.array([1, -2, 3], dtype=np.int8)
    (y,) = run_model(model, {"x": x})
    _assert_same(y, np.stack([x, x]))
