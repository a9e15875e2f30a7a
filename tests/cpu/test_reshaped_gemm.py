"""A Linear layer on a stack of rows as exporters write it, ``Reshape(Gemm(Reshape(x,
(-1, K)), W, b), (*lead, N))`` (transformers' GPT-2 ``Conv1D``, torch.export's ``addmm``):
the CPU provider runs it as one ``FusedMatMul`` step on ``x`` as it is, which the GELU
fusion then joins. Checked against onnxruntime on the unfused graph and against level
"none"; the patterns it must leave alone keep their steps."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnxruntime
import pytest
from onnx import numpy_helper
from onnx_ir.passes.common import LiftConstantsToInitializersPass

import plugrt
from plugrt_cpu import fusions

from cpu.test_fusions import _step_ops
from cpu.test_fusions_transformer import _model, _random


def _check(model: bytes, feeds: dict[str, np.ndarray], expected_ops: list[str]) -> None:
    ops, ours = _step_ops(model, feeds)
    assert ops == expected_ops
    plain = list(plugrt.load(model, device="cpu", optimization="none").run(feeds).values())
    theirs = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    for actual, unfused, ort in zip(ours, plain, theirs):
        np.testing.assert_allclose(actual, unfused, rtol=1e-5, atol=2e-5)
        np.testing.assert_allclose(actual, ort, rtol=1e-5, atol=2e-5)


# GPT-2's layout: (1, 64, 256) -> (64, 256) -> Gemm -> (1, 64, N); the GELU is the
# written-out tanh form transformers exports for ``gelu_new``
_LINEAR = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 12, 32] x) => (float[2, 12, 48] y) {
        flat_shape = Constant <value = int64[2] {FLAT}> ()
        rows = Reshape (x, flat_shape)
        product = Gemm <transB = TRANS_B, alpha = ALPHA> (rows, w, b)
        stack_shape = Constant <value = int64[3] {2, 12, 48}> ()
        y = Reshape (product, stack_shape)
    }
"""


def _linear(trans_b: int = 0, alpha: str = "1.0", flat: str = "-1, 32", bias_shape: tuple[int, ...] = (48,)) -> bytes:
    text = _LINEAR.replace("TRANS_B", str(trans_b)).replace("ALPHA", alpha).replace("FLAT", flat)
    weight = _random(48, 32) if trans_b else _random(32, 48)
    return _model(text, w=weight * 0.2, b=_random(*bias_shape, seed=1))


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("flat", ["-1, 32", "24, 32"])
def test_reshaped_gemm_runs_as_one_fused_matmul(trans_b, flat):
    _check(_linear(trans_b, flat=flat), {"x": _random(2, 12, 32, seed=2)}, ["FusedMatMul"])


def test_reshaped_gemm_with_a_row_of_bias_runs_as_one_step():
    _check(_linear(bias_shape=(1, 48)), {"x": _random(2, 12, 32, seed=2)}, ["FusedMatMul"])


def test_reshaped_gemm_with_an_alpha_keeps_its_steps():
    _check(_linear(alpha="0.5"), {"x": _random(2, 12, 32, seed=2)}, ["Reshape", "Gemm", "Reshape"])


def test_reshape_to_another_stack_keeps_its_steps():
    text = _LINEAR.replace("TRANS_B", "0").replace("ALPHA", "1.0").replace("FLAT", "-1, 32")
    text = text.replace("int64[3] {2, 12, 48}", "int64[3] {12, 2, 48}").replace("float[2, 12, 48] y", "float[12, 2, 48] y")
    model = _model(text, w=_random(32, 48) * 0.2, b=_random(48, seed=1))
    _check(model, {"x": _random(2, 12, 32, seed=2)}, ["Reshape", "Gemm", "Reshape"])


def test_reshaped_gemm_whose_rows_are_read_elsewhere_keeps_its_steps():
    text = _LINEAR.replace("TRANS_B", "0").replace("ALPHA", "1.0").replace("FLAT", "-1, 32")
    text = text.replace("=> (float[2, 12, 48] y)", "=> (float[2, 12, 48] y, float[24, 32] rows)")
    model = _model(text, w=_random(32, 48) * 0.2, b=_random(48, seed=1))
    _check(model, {"x": _random(2, 12, 32, seed=2)}, ["Reshape", "Gemm", "Reshape"])


def test_transposed_weight_is_laid_out_once_and_the_original_forgotten():
    proto = onnx.load_from_string(_linear(trans_b=1))
    weight = numpy_helper.to_array(next(t for t in proto.graph.initializer if t.name == "w"))
    model = ir.serde.deserialize_model(proto)
    LiftConstantsToInitializersPass(size_limit=0)(model)  # the shapes as initializers, as the loader leaves them
    assert fusions.FuseReshapedGemmPass()(model).modified
    (fused,) = [n for n in model.graph if n.op_type != "Constant"]
    assert fused.op_type == "FusedMatMul" and "w" not in model.graph.initializers
    np.testing.assert_array_equal(fused.inputs[1].const_value.numpy(), weight.T)


_GPT2_MLP = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1, 16, 32] x) => (float[1, 16, 32] y) {
        flat = Constant <value = int64[2] {-1, 32}> ()
        rows = Reshape (x, flat)
        up = Gemm (rows, w1, b1)
        up_shape = Constant <value = int64[3] {1, 16, 128}> ()
        h = Reshape (up, up_shape)
        half = Constant <value_float = 0.5> ()
        three = Constant <value_float = 3.0> ()
        c = Constant <value_float = 0.044715> ()
        root = Constant <value_float = 0.7978845608> ()
        one = Constant <value_float = 1.0> ()
        halved = Mul (h, half)
        cube = Pow (h, three)
        scaled = Mul (cube, c)
        inner = Add (h, scaled)
        u = Mul (inner, root)
        t = Tanh (u)
        gate = Add (t, one)
        act = Mul (halved, gate)
        flat2 = Constant <value = int64[2] {-1, 128}> ()
        rows2 = Reshape (act, flat2)
        down = Gemm (rows2, w2, b2)
        out_shape = Constant <value = int64[3] {1, 16, 32}> ()
        y = Reshape (down, out_shape)
    }
"""


def test_gpt2_mlp_runs_as_two_steps_with_the_tanh_gelu_fused():
    model = _model(
        _GPT2_MLP, w1=_random(32, 128) * 0.3, b1=_random(128, seed=1), w2=_random(128, 32, seed=3) * 0.1, b2=_random(32, seed=4)
    )
    _check(model, {"x": _random(1, 16, 32, seed=2)}, ["FusedMatMulGelu", "FusedMatMul"])
