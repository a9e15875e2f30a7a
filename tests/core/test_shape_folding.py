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
