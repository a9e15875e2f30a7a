"""What the CUDA provider claims (supports_op) and the reasons it gives when it declines."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

from plugrt.provider import SupportContext

from cuda_helpers import missing_cupy
from plugrt_cuda._ops import OPS
from plugrt_cuda._provider import CUDAProvider


def _decide(text: str, op_type: str | None = None):
    """supports_op for the first node (or the first ``op_type`` node) of an ONNX-text model."""
    model = ir.from_proto(onnx.parser.parse_model(text))
    node = next(n for n in model.graph if op_type is None or n.op_type == op_type)
    ctx = SupportContext(dict(model.opset_imports), model.graph)
    return CUDAProvider(importer=missing_cupy).supports_op(node, ctx)


_HEADER = '<ir_version: 8, opset_import: ["" : 17]>'


@pytest.mark.parametrize("dtype", ["float", "float16"])
def test_conv_is_claimed_for_float32_and_float16(dtype):
    decision = _decide(f"{_HEADER} m ({dtype}[1,3,8,8] x, {dtype}[4,3,3,3] w) => ({dtype}[1,4,6,6] y) {{ y = Conv(x, w) }}")
    assert decision.supported


def test_float64_math_is_declined_with_the_dtypes_it_computes():
    decision = _decide(f"{_HEADER} m (double[2,3] x) => (double[2,3] y) {{ y = Relu(x) }}")
    assert not decision.supported
    assert "float32 and float16 only" in decision.reason and "float64" in decision.reason


def test_an_op_without_a_kernel_is_declined_naming_what_is_claimed():
    decision = _decide(f"{_HEADER} m (float[2,3] x, int64[1] k) => (float[2,1] v, int64[2,1] i) {{ v, i = TopK(x, k) }}")
    assert not decision.supported
    assert "no kernel for ai.onnx::TopK" in decision.reason and "Conv" in decision.reason


def test_another_domain_is_declined():
    text = '<ir_version: 8, opset_import: ["" : 17, "com.example" : 1]> m (float[2] x) => (float[2] y) { y = com.example.Gelu(x) }'
    decision = _decide(text)
    assert not decision.supported and "ai.onnx and com.microsoft ops only" in decision.reason


@pytest.mark.parametrize("op_type", ["Gelu", "FastGelu"])
def test_the_contrib_gelus_the_core_writes_are_claimed(op_type):
    text = (
        f'<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]> m (float[2, 8] x) => (float[2, 8] y) '
        f'{{ y = com.microsoft.{op_type}(x) }}'
    )
    assert _decide(text).supported


def test_a_reshape_whose_shape_is_computed_at_run_time_is_declined():
    decision = _decide(f"{_HEADER} m (float[2,3] x, int64[1] s) => (float[6] y) {{ y = Reshape(x, s) }}")
    assert not decision.supported and "needs it constant" in decision.reason and "'s'" in decision.reason


def test_a_reshape_with_a_constant_shape_is_claimed_for_any_dtype():
    text = f"{_HEADER} m (int64[2,3] x) => (int64[6] y) <int64[1] s = {{6}}> {{ y = Reshape(x, s) }}"
    assert _decide(text).supported


def test_layer_normalization_with_float16_statistics_is_declined():
    text = f"{_HEADER} m (float[2,4] x, float[4] g) => (float[2,4] y) {{ y = LayerNormalization<stash_type=0>(x, g) }}"
    decision = _decide(text)
    assert not decision.supported and "stash_type=0" in decision.reason


def test_layer_normalization_before_opset_17_is_declined_with_the_fix():
    text = '<ir_version: 8, opset_import: ["" : 16]> m (float[2,4] x) => (float[2,4] y) { y = Relu(x) }'
    model = ir.from_proto(onnx.parser.parse_model(text))
    node = ir.Node("", "LayerNormalization", [model.graph.inputs[0], model.graph.inputs[0]])
    decision = CUDAProvider(importer=missing_cupy).supports_op(node, SupportContext({"": 16}))
    assert not decision.supported and "from opset 17" in decision.reason and "convert_version" in decision.reason


def test_resize_cubic_is_declined():
    text = (
        f"{_HEADER} m (float[1,1,2,2] x) => (float[1,1,4,4] y) <float[4] s = {{1.0, 1.0, 2.0, 2.0}}> "
        '{ y = Resize<mode="cubic">(x, , s) }'
    )
    decision = _decide(text)
    assert not decision.supported and "'cubic'" in decision.reason


def test_resize_linear_with_constant_scales_is_claimed():
    text = (
        f"{_HEADER} m (float[1,1,2,2] x) => (float[1,1,4,4] y) <float[4] s = {{1.0, 1.0, 2.0, 2.0}}> "
        '{ y = Resize<mode="linear">(x, , s) }'
    )
    assert _decide(text).supported


def test_maxpool_with_indices_is_declined():
    text = f"{_HEADER} m (float[1,1,4,4] x) => (float[1,1,2,2] y, int64[1,1,2,2] i) {{ y, i = MaxPool<kernel_shape=[2,2], strides=[2,2]>(x) }}"
    decision = _decide(text)
    assert not decision.supported and "Indices" in decision.reason


def test_batch_normalization_in_training_mode_is_declined():
    text = (
        f"{_HEADER} m (float[1,2,3] x, float[2] s, float[2] b, float[2] mu, float[2] v) => (float[1,2,3] y) "
        "{ y = BatchNormalization<training_mode=1>(x, s, b, mu, v) }"
    )
    decision = _decide(text)
    assert not decision.supported and "training mode" in decision.reason


def test_a_cast_to_string_is_declined():
    text = f"{_HEADER} m (float[2] x) => (string[2] y) {{ y = Cast<to=8>(x) }}"
    decision = _decide(text)
    assert not decision.supported and "output 'y' is string" in decision.reason


def test_a_string_input_is_declined_even_for_data_movement():
    text = f"{_HEADER} m (string[2] x) => (string[2] y) {{ y = Identity(x) }}"
    decision = _decide(text)
    assert not decision.supported and "string" in decision.reason


def test_fused_nodes_of_the_cpu_provider_are_claimed():
    text = (
        '<ir_version: 8, opset_import: ["" : 17, "plugrt.cpu" : 1]> m (float[1,3,8,8] x, float[4,3,3,3] w) '
        '=> (float[1,4,6,6] y) { y = plugrt.cpu.FusedConv<activation="Relu">(x, w) }'
    )
    assert _decide(text).supported


def test_the_ops_of_the_light_models_and_a_transformer_are_all_in_the_table():
    needed = {
        "Conv", "Gemm", "MatMul", "MaxPool", "AveragePool", "GlobalAveragePool", "BatchNormalization", "LRN",
        "Relu", "Softmax", "Concat", "Reshape", "Transpose", "Sum", "Add", "Mul", "Unsqueeze", "Dropout",
        "ConstantOfShape", "LayerNormalization", "Gather", "Slice", "Split", "Expand", "Where", "Cast",
        "ReduceMean", "Pad", "Resize", "Gelu", "Erf", "Div", "Sqrt", "Pow", "Tanh",
    }
    claimed = {op for domain, op in OPS if domain == ""}
    assert needed - claimed == set()


_HELD = {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"}


def _identity_of(dtype: ir.DataType):
    """supports_op for Identity over a tensor of ``dtype`` (built in onnx_ir: the text
    parser does not know the newest types)."""
    x = ir.Value(name="x", type=ir.TensorType(dtype), shape=ir.Shape([2]))
    node = ir.Node("", "Identity", [x], num_outputs=1)
    node.outputs[0].type = ir.TensorType(dtype)
    graph = ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 21})
    return CUDAProvider(importer=missing_cupy).supports_op(node, SupportContext({"": 21}, graph))


@pytest.mark.parametrize(
    "dtype", [d for d in ir.DataType if d != ir.DataType.UNDEFINED and d.name.lower() not in _HELD | {"float", "double"}],
    ids=lambda d: d.name.lower(),
)
def test_a_dtype_the_device_cannot_hold_is_declined_naming_it(dtype):
    # int2/uint2, int4, float4/6/8, bfloat16, complex, string: claimed once, they failed at run time
    decision = _identity_of(dtype)
    assert not decision.supported
    assert dtype.name.lower() in decision.reason and "does not hold on the device" in decision.reason


@pytest.mark.parametrize("dtype", [ir.DataType.FLOAT, ir.DataType.INT64, ir.DataType.BOOL, ir.DataType.UINT8])
def test_a_dtype_the_device_holds_is_claimed_for_identity(dtype):
    assert _identity_of(dtype).supported
