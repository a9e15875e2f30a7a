"""Shape and Size of a value whose shape is static fold to constants at build (as
onnxruntime folds them): the steps that computed them are gone, the outputs match
onnxruntime, and a dynamic dimension keeps its Shape, computed at run time."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest

import plugrt
from plugrt.errors import InputShapeError


def _model(dims: list, body: str) -> bytes:
    text = f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[{", ".join(str(d) for d in dims)}] x) => (float[N] y) {{
            {body}
        }}
    """
    return onnx.parser.parse_model(text).SerializeToString()


# Shape (with start and end, negative ones too) and Size feed a Reshape and a Cast
BODY = """
    r = Relu (x)
    s = Shape <start = START, end = END> (r)
    z = Size (r)
    n = Cast <to = 1> (z)
    f = Cast <to = 1> (s)
    k = ReduceSum <keepdims = 0> (f)
    w = Add (k, n)
    flat = Constant <value = int64[1] {-1}> ()
    v = Reshape (r, flat)
    y = Mul (v, w)
"""


def _ops(session: plugrt.Session) -> list[str]:
    return [getattr(step, "op_type", "") for compiled in session._built.compiled for step in compiled.steps]


@pytest.mark.parametrize("start,end", [(0, 3), (1, 3), (-2, 3), (0, -1), (-5, 10)])
def test_a_static_shape_folds_and_matches_onnxruntime(start, end):
    model = _model([2, 3, 4], BODY.replace("START", str(start)).replace("END", str(end)))
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    session = plugrt.load(model, device="cpu")
    ops = _ops(session)
    assert "Shape" not in ops and "Size" not in ops
    (expected,) = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(session.run({"x": x})["y"], expected, rtol=1e-6)


def test_a_dynamic_dimension_keeps_its_shape_computed_at_run_time():
    model = _model(["B", 3, 4], BODY.replace("START", "0").replace("END", "3"))
    session = plugrt.load(model, device="cpu")
    assert "Shape" in _ops(session)
    reference = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    for batch in (1, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 4)).astype(np.float32)
        np.testing.assert_allclose(session.run({"x": x})["y"], reference.run(None, {"x": x})[0], rtol=1e-6)


def test_an_input_of_another_shape_is_still_refused():
    session = plugrt.load(_model([2, 3, 4], BODY.replace("START", "0").replace("END", "3")), device="cpu")
    with pytest.raises(InputShapeError, match="the model expects 2"):
        session.run({"x": np.zeros((3, 3, 4), np.float32)})


# Swin's window padding as exports write it: the pad is computed with Mod from the input's
# width, which onnx's data propagation does not follow, so the model's shape inference
# leaves the Pad's output shape, and the Shape read from it, unknown; folding the pad's
# constants and inferring the Pad alone gives its shape, and the Shape after it folds too
PADDED = """
    s = Shape (x)
    i = Constant <value = int64 {2}> ()
    w = Gather <axis = 0> (s, i)
    four = Constant <value = int64 {5}> ()
    m = Mod (w, four)
    p = Sub (four, m)
    q = Mod (p, four)
    u = Unsqueeze (q, zero)
    zero = Constant <value = int64[1] {0}> ()
    before = Constant <value = int64[5] {0, 0, 0, 0, 0}> ()
    pads = Concat <axis = 0> (before, u)
    xp = Pad (x, pads)
    t = Shape (xp)
    last = Constant <value = int64[1] {-1}> ()
    tail = Slice (t, last, big)
    big = Constant <value = int64[1] {9}> ()
    g = Cast <to = 1> (tail)
    flat = Constant <value = int64[1] {-1}> ()
    v = Reshape (xp, flat)
    y = Mul (v, g)
"""


def test_a_shape_known_only_once_constants_are_folded_folds_in_the_same_pass():
    model = _model([2, 3, 4], PADDED)
    session = plugrt.load(model, device="cpu")
    assert "Shape" not in _ops(session)
    x = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    (expected,) = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert expected.shape == (30,)  # the width padded from 4 to 5
    np.testing.assert_allclose(session.run({"x": x})["y"], expected, rtol=1e-6)
