"""The CPU kernels' ``into`` variants: each op below is captured (no seam), replays bitwise
what ``Session.run`` gives, also after new input values, and allocates nothing per replay.
The light ResNet-50 and DenseNet-121 replay with under 1% of a plain run's allocations."""

from __future__ import annotations

import dataclasses
import tracemalloc
from typing import Any, Callable

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import plugrt
from plugrt.capture import Captured
from plugrt.conformance.light_models import light_models

_TYPES = {
    np.dtype(np.float32): "float",
    np.dtype(np.float16): "float16",
    np.dtype(np.float64): "double",
    np.dtype(ml_dtypes.bfloat16): "bfloat16",
    np.dtype(np.int64): "int64",
    np.dtype(np.int32): "int32",
    np.dtype(np.uint8): "uint8",
    np.dtype(np.bool_): "bool",
}

# What one replay of a captured one-node model may allocate: Session.replay's own small
# Python objects (a few hundred bytes), far below any of the tensors here (16 KiB and up).
# Measured with numpy's ufunc buffers shrunk (see replay_bytes(small_buffers=True)).
REPLAY_BYTES = 8192


def _declare(name: str, array: np.ndarray) -> str:
    shape = f"[{','.join(map(str, array.shape))}]" if array.ndim else ""
    return f"{_TYPES[array.dtype]}{shape} {name}"


def one_node(
    node: str,
    inputs: dict[str, np.ndarray],
    outputs: dict[str, str],
    *,
    constants: dict[str, np.ndarray] | None = None,
    opset: int = 17,
) -> bytes:
    """A model of ``node`` (ONNX text syntax): graph inputs shaped like ``inputs``,
    ``constants`` as initializers, ``outputs`` (name: element type) of any shape."""
    ir_version = 11 if opset >= 23 else 10 if opset >= 21 else 8
    text = (
        f'<ir_version: {ir_version}, opset_import: ["" : {opset}]>\n'
        f"g ({', '.join(_declare(n, a) for n, a in inputs.items())}) => "
        f"({', '.join(f'{t}[1] {n}' for n, t in outputs.items())}) {{\n    {node}\n}}"
    )
    model = onnx.parser.parse_model(text)
    for name, array in (constants or {}).items():
        model.graph.initializer.append(numpy_helper.from_array(array, name))
    onnx.checker.check_model(model)
    for output in model.graph.output:  # any rank (the checker wants a shape; plugrt does not)
        output.type.tensor_type.ClearField("shape")
    return model.SerializeToString()


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def replay_bytes(fn: Callable[[], Any], *, small_buffers: bool = False) -> int:
    """Peak bytes traced by tracemalloc while ``fn`` runs. ``small_buffers``: with numpy's
    ufunc buffers at their minimum, leaving out the iteration buffers (up to 8192 elements
    per operand) numpy allocates inside any broadcasting or casting ufunc call."""
    buffer_size = np.setbufsize(16) if small_buffers else None
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        if buffer_size is not None:
            np.setbufsize(buffer_size)


def check_captured(model: bytes, feeds: Callable[[np.random.Generator], dict], *, allocates: bool = False) -> None:
    """Every node captured, replay == run bitwise (for two sets of input values), and a
    replay allocates nothing (unless ``allocates``: a documented temporary)."""
    session = plugrt.load(model, optimization="none")
    first = feeds(np.random.default_rng(1))
    result = session.try_capture(first)
    assert isinstance(result, Captured)
    assert result.report.seams == []
    steps = [step.name for compiled in session._built.compiled for step in compiled.steps]
    assert result.report.segments == [steps]
    second = feeds(np.random.default_rng(2))
    for values in (first, second, first):
        eager = session.run(values)
        replayed = session.replay(values)
        assert eager.keys() == replayed.keys()
        for name in eager:
            assert _same(replayed[name], eager[name]), name
    assert session.capture_stats.eager_fallbacks == 0
    if not allocates:
        assert replay_bytes(lambda: session.replay(second), small_buffers=True) < REPLAY_BYTES


@dataclasses.dataclass
class Case:
    id: str
    node: str
    inputs: Callable[[np.random.Generator], dict[str, np.ndarray]]
    outputs: dict[str, str] = dataclasses.field(default_factory=lambda: {"y": "float"})
    constants: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    opset: int = 17
    allocates: bool = False


def normal(*shape, dtype=np.float32, scale=2.0):
    return lambda rng: (rng.standard_normal(shape) * scale).astype(dtype)


def inputs(**makers):
    """A feeds factory: name -> fn(rng) -> array."""
    return lambda rng: {name: make(rng) for name, make in makers.items()}


def integers(low, high, *shape, dtype=np.int64):
    return lambda rng: np.asarray(rng.integers(low, high, size=shape)).astype(dtype)


def uniform(*shape, low=0.0):
    return lambda rng: (rng.random(shape) + low).astype(np.float32)


def infinities(*shape):
    return lambda rng: rng.choice(np.array([np.inf, -np.inf, 1.0, np.nan], np.float32), size=shape)


def mask(*shape):
    return lambda rng: rng.random(shape) > 0.5


X = dict(x=normal(64, 256))  # 64 KiB of float32
X_NCHW = dict(x=normal(2, 8, 16, 32))
R = np.random.default_rng(0)
W_256x64 = (R.standard_normal((256, 64)) * 0.1).astype(np.float32)
B_64 = R.standard_normal(64).astype(np.float32)
C8 = R.standard_normal(8).astype(np.float32)
POSITIVE_C8 = (R.random(8) + 0.5).astype(np.float32)

ELEMENTWISE = [
    Case("Relu", "y = Relu(x)", inputs(**X)),
    Case("LeakyRelu", "y = LeakyRelu<alpha = 0.1>(x)", inputs(**X)),
    Case("LeakyRelu-steep", "y = LeakyRelu<alpha = 3.0>(x)", inputs(**X)),
    Case("Sigmoid", "y = Sigmoid(x)", inputs(x=normal(64, 256, scale=40.0))),
    Case("Sigmoid-f16", "y = Sigmoid(x)", inputs(x=normal(64, 256, dtype=np.float16)), {"y": "float16"}),
    Case("Tanh", "y = Tanh(x)", inputs(**X)),
    Case("Sqrt", "y = Sqrt(x)", inputs(x=lambda rng: rng.random((64, 256)).astype(np.float32))),
    Case("Erf", "y = Erf(x)", inputs(**X)),
    Case("Erf-blocks", "y = Erf(x)", inputs(x=normal(300, 256))),
    Case("Erf-f64", "y = Erf(x)", inputs(x=normal(32, 256, dtype=np.float64)), {"y": "double"}),
    Case("Erf-f64-blocks", "y = Erf(x)", inputs(x=normal(300, 256, dtype=np.float64)), {"y": "double"}),
    Case("Erf-f16", "y = Erf(x)", inputs(x=normal(64, 256, dtype=np.float16)), {"y": "float16"}),
    Case("Gelu", "y = Gelu(x)", inputs(**X), opset=20),
    Case("Gelu-tanh", 'y = Gelu<approximate = "tanh">(x)', inputs(**X), opset=20),
    Case("Add", "y = Add(x, b)", inputs(x=normal(64, 256), b=normal(256))),
    Case("Sub", "y = Sub(x, b)", inputs(x=normal(64, 256), b=normal(64, 1))),
    Case("Mul", "y = Mul(x, b)", inputs(x=normal(64, 256), b=normal(256))),
    Case("Div", "y = Div(x, b)", inputs(x=normal(64, 256), b=normal(256))),
    Case(
        "Div-int32",
        "y = Div(a, b)",
        inputs(a=integers(-1000, 1000, 64, 256, dtype=np.int32), b=integers(1, 9, 256, dtype=np.int32)),
        {"y": "int32"},
    ),
    Case("Pow-square", "y = Pow(x, two)", inputs(**X), constants={"two": np.array(2.0, np.float32)}),
    Case(
        "Pow",
        "y = Pow(x, e)",
        inputs(x=lambda rng: rng.random((64, 256)).astype(np.float32), e=normal(256)),
    ),
    Case(
        "Pow-int-exponent",
        "y = Pow(x, e)",
        inputs(x=normal(64, 256), e=integers(0, 4, 256)),
    ),
    Case(
        "Pow-double-exponent",
        "y = Pow(x, e)",
        inputs(x=lambda rng: rng.random((64, 256)).astype(np.float32), e=normal(256, dtype=np.float64)),
    ),
    Case(
        "Pow-int",
        "y = Pow(a, e)",
        inputs(a=integers(-9, 9, 64, 256), e=integers(0, 5, 256)),
        {"y": "int64"},
    ),
    # numpy refuses negative integer exponents: they go through float64, as the kernel
    Case(
        "Pow-int-negative",
        "y = Pow(a, e)",
        inputs(a=integers(1, 9, 64, 256), e=integers(-3, 3, 256)),
        {"y": "int64"},
        allocates=True,
    ),
    Case("Where", "y = Where(c, x, z)", inputs(c=mask(64, 256), x=normal(64, 256), z=normal(256))),
    Case("Max", "y = Max(a, b, c)", inputs(a=normal(64, 256), b=normal(256), c=normal(64, 1))),
    Case("Min", "y = Min(a, b, c)", inputs(a=normal(64, 256), b=normal(256), c=normal(64, 1))),
    Case("Sum", "y = Sum(a, b, c)", inputs(a=normal(64, 256), b=normal(256), c=normal(64, 1))),
    Case("Sum-two", "y = Sum(a, b)", inputs(a=normal(64, 256), b=normal(64, 256))),
    Case("Mean", "y = Mean(a, b, c)", inputs(a=normal(64, 256), b=normal(256), c=normal(64, 1))),
    Case("Clip", "y = Clip(x, lo, hi)", inputs(**X), constants={"lo": np.float32(-0.5), "hi": np.float32(1.5)}),
    Case("Clip-max-only", 'y = Clip(x, "", hi)', inputs(**X), constants={"hi": np.float32(0.25)}),
    Case("Clip-6", "y = Clip<min = -1.0, max = 6.0>(x)", inputs(**X), opset=6),
    Case("Shrink", "y = Shrink<bias = 0.5, lambd = 0.7>(x)", inputs(**X), opset=9),
    Case("Shrink-int", "y = Shrink<bias = 1.5, lambd = 2.0>(x)", inputs(x=integers(-5, 5, 64, 256)), {"y": "int64"}),
    Case("IsInf-negative", "y = IsInf<detect_positive = 0>(x)", inputs(x=infinities(64, 256)), {"y": "bool"}, opset=10),
    Case("IsInf-positive", "y = IsInf<detect_negative = 0>(x)", inputs(x=infinities(64, 256)), {"y": "bool"}, opset=10),
    Case(
        "IsInf-neither",
        "y = IsInf<detect_negative = 0, detect_positive = 0>(x)",
        inputs(x=infinities(64, 256)),
        {"y": "bool"},
        opset=10,
    ),
    Case("PRelu", "y = PRelu(x, s)", inputs(x=normal(64, 256), s=normal(256))),
    Case("Elu", "y = Elu<alpha = 0.7>(x)", inputs(**X)),
    Case("Selu", "y = Selu(x)", inputs(**X)),
    Case("Celu", "y = Celu<alpha = 2.0>(x)", inputs(**X), opset=12),
    Case("ThresholdedRelu", "y = ThresholdedRelu<alpha = 0.5>(x)", inputs(**X), opset=10),
    Case("HardSigmoid", "y = HardSigmoid(x)", inputs(**X)),
    Case("HardSwish", "y = HardSwish(x)", inputs(**X), opset=14),
    Case("Softsign", "y = Softsign(x)", inputs(**X)),
    Case("Softplus", "y = Softplus(x)", inputs(x=normal(64, 256, scale=30.0))),
    Case("Mish", "y = Mish(x)", inputs(**X), opset=18),
    Case("Swish", "y = Swish<alpha = 1.5>(x)", inputs(**X), opset=24),
]

LINALG = [
    Case("MatMul", "y = MatMul(a, b)", inputs(a=normal(64, 256), b=normal(256, 64))),
    Case("MatMul-batched", "y = MatMul(a, b)", inputs(a=normal(4, 32, 64), b=normal(64, 48))),
    Case(
        "MatMul-f16",
        "y = MatMul(a, b)",
        inputs(a=normal(64, 256, dtype=np.float16), b=normal(256, 64, dtype=np.float16)),
        {"y": "float16"},
    ),
    Case("MatMul-const", "y = MatMul(a, w)", inputs(a=normal(64, 256)), constants={"w": W_256x64}),
    Case(
        "Einsum-attention",
        'y = Einsum<equation = "bhqd,bhkd->bhqk">(q, k)',
        inputs(q=normal(2, 4, 64, 32), k=normal(2, 4, 48, 32)),
        opset=12,
    ),
    Case(
        "Einsum-permuted-output",
        'y = Einsum<equation = "bqd,dk->kbq">(a, w)',
        inputs(a=normal(2, 64, 32), w=normal(32, 48)),
        opset=12,
    ),
    Case("Einsum-one-operand", 'y = Einsum<equation = "bqhd->bhqd">(x)', inputs(x=normal(2, 64, 4, 32)), opset=12),
    # a letter summed out of one input first: that sum is a temporary
    Case(
        "Einsum-summed-letter",
        'y = Einsum<equation = "ij,jk->k">(a, b)',
        inputs(a=normal(64, 32), b=normal(32, 48)),
        opset=12,
        allocates=True,
    ),
    Case("Gemm", "y = Gemm(a, b, c)", inputs(a=normal(64, 256), b=normal(256, 64), c=normal(64))),
    Case(
        "Gemm-prepared-transB-alpha",
        "y = Gemm<transB = 1, alpha = 0.5, beta = 2.0>(a, w, c)",
        inputs(a=normal(64, 256)),
        constants={"w": np.ascontiguousarray(W_256x64.T), "c": B_64},
    ),
    Case(
        "Gemm-transA-alpha-beta",
        "y = Gemm<transA = 1, alpha = 0.25, beta = 3.0>(a, b, c)",
        inputs(a=normal(256, 64), b=normal(256, 64), c=normal(64, 1)),
    ),
    Case("Gemm-no-C", "y = Gemm<transB = 1>(a, b)", inputs(a=normal(64, 256), b=normal(64, 256))),
    Case(
        "Gemm-f16-prepared",
        "y = Gemm(a, w, c)",
        inputs(a=normal(64, 256, dtype=np.float16)),
        {"y": "float16"},
        constants={"w": W_256x64.astype(np.float16), "c": B_64.astype(np.float16)},
    ),
    Case(
        "Gemm-int32-scaled",
        "y = Gemm<alpha = 2.0, beta = 3.0>(a, b, c)",
        inputs(a=integers(-5, 5, 64, 32, dtype=np.int32), b=integers(-5, 5, 32, 64, dtype=np.int32),
               c=integers(-5, 5, 64, dtype=np.int32)),
        {"y": "int32"},
    ),
]

NORMALIZATION = [
    Case(
        "BatchNormalization",
        "y = BatchNormalization(x, s, b, m, v)",
        inputs(**X_NCHW),
        constants={"s": C8, "b": C8[::-1].copy(), "m": C8 * 0.5, "v": POSITIVE_C8},
        opset=15,
    ),
    Case(
        "BatchNormalization-9",
        "y = BatchNormalization<epsilon = 0.001>(x, s, b, m, v)",
        inputs(**X_NCHW),
        constants={"s": C8, "b": C8[::-1].copy(), "m": C8 * 0.5, "v": POSITIVE_C8},
        opset=9,
    ),
    Case(
        "BatchNormalization-statistics-fed",
        "y = BatchNormalization(x, s, b, m, v)",
        inputs(**X_NCHW, s=normal(8), b=normal(8), m=normal(8), v=lambda rng: rng.random(8).astype(np.float32) + 0.5),
        opset=15,
    ),
    Case("InstanceNormalization", "y = InstanceNormalization(x, s, b)", inputs(**X_NCHW, s=normal(8), b=normal(8))),
    Case(
        "InstanceNormalization-f16",
        "y = InstanceNormalization(x, s, b)",
        inputs(x=normal(2, 8, 16, 32, dtype=np.float16), s=normal(8, dtype=np.float16), b=normal(8, dtype=np.float16)),
        {"y": "float16"},
    ),
    Case(
        "LayerNormalization",
        "y = LayerNormalization(x, s, b)",
        inputs(x=normal(4, 64, 256), s=normal(256), b=normal(256)),
    ),
    Case(
        "LayerNormalization-statistics",
        "y, mean, inv_std = LayerNormalization<axis = 1>(x, s)",
        inputs(x=normal(4, 64, 256), s=normal(64, 256)),
        {"y": "float", "mean": "float", "inv_std": "float"},
    ),
    Case(
        "LayerNormalization-f16",
        "y = LayerNormalization(x, s, b)",
        inputs(x=normal(64, 256, dtype=np.float16), s=normal(256, dtype=np.float16), b=normal(256, dtype=np.float16)),
        {"y": "float16"},
    ),
    Case(
        "GroupNormalization",
        "y = GroupNormalization<num_groups = 4>(x, s, b)",
        inputs(**X_NCHW, s=normal(8), b=normal(8)),
        opset=21,
    ),
    Case("RMSNormalization", "y = RMSNormalization(x, s)", inputs(x=normal(4, 64, 256), s=normal(256)), opset=23),
    Case("LpNormalization-1", "y = LpNormalization<p = 1, axis = 1>(x)", inputs(**X_NCHW)),
    Case("LpNormalization-2", "y = LpNormalization(x)", inputs(**X_NCHW)),
    Case("MeanVarianceNormalization", "y = MeanVarianceNormalization(x)", inputs(**X_NCHW)),
]

AXES_1 = {"axes": np.array([1])}
REDUCTION = [
    Case("ReduceMean", "y = ReduceMean(x, axes)", inputs(**X_NCHW), constants={"axes": np.array([2, 3])}, opset=18),
    Case("ReduceMean-all", "y = ReduceMean<keepdims = 0>(x)", inputs(**X), opset=18),
    Case("ReduceMean-13", "y = ReduceMean<axes = [-1], keepdims = 0>(x)", inputs(**X), opset=13),
    Case(
        "ReduceMean-f16",
        "y = ReduceMean(x, axes)",
        inputs(x=normal(64, 256, dtype=np.float16)),
        {"y": "float16"},
        constants=AXES_1,
        opset=18,
    ),
    Case("ReduceSum", "y = ReduceSum<keepdims = 0>(x, axes)", inputs(**X), constants=AXES_1, opset=13),
    Case("ReduceMax", "y = ReduceMax(x, axes)", inputs(**X), constants=AXES_1, opset=18),
    Case("ReduceMin", "y = ReduceMin<keepdims = 0>(x)", inputs(**X), opset=18),
    Case("ReduceProd", "y = ReduceProd(x, axes)", inputs(x=uniform(64, 8, low=0.5)), constants=AXES_1, opset=18),
    Case("ReduceL1", "y = ReduceL1(x, axes)", inputs(**X), constants=AXES_1, opset=18),
    Case("ReduceL2", "y = ReduceL2(x, axes)", inputs(**X), constants=AXES_1, opset=18),
    Case(
        "ReduceL2-int", "y = ReduceL2(x, axes)", inputs(x=integers(-9, 9, 64, 256)), {"y": "int64"}, AXES_1, opset=18
    ),
    Case("ReduceSumSquare", "y = ReduceSumSquare(x, axes)", inputs(**X), constants=AXES_1, opset=18),
    Case("ReduceLogSum", "y = ReduceLogSum(x, axes)", inputs(x=uniform(64, 256)), constants=AXES_1, opset=18),
    Case("ReduceLogSumExp", "y = ReduceLogSumExp<keepdims = 0>(x, axes)", inputs(**X), constants=AXES_1, opset=18),
    Case("ArgMax", "y = ArgMax<axis = 1>(x)", inputs(**X), {"y": "int64"}),
    Case(
        "ArgMin-last-index",
        "y = ArgMin<axis = 0, keepdims = 0, select_last_index = 1>(x)",
        inputs(x=integers(0, 3, 64, 256)),
        {"y": "int64"},
    ),
    Case(
        "ArgMax-last-index",
        "y = ArgMax<axis = -1, select_last_index = 1>(x)",
        inputs(x=integers(0, 3, 64, 256)),
        {"y": "int64"},
    ),
]

PADS = np.array([0, 0, 1, 2, 0, 0, 3, 1])
TENSOR = [
    Case(
        "Concat",
        "y = Concat<axis = 1>(a, b, c)",
        inputs(a=normal(2, 8, 16, 16), b=normal(2, 4, 16, 16), c=normal(2, 12, 16, 16)),
    ),
    Case(
        "Gather",
        "y = Gather(table, ids)",
        inputs(ids=integers(-1000, 1000, 4, 64)),
        constants={"table": R.random((1000, 64)).astype(np.float32)},
    ),
    Case("Gather-axis-1", "y = Gather<axis = 1>(x, ids)", inputs(**X, ids=integers(-256, 256, 32))),
    Case("GatherElements", "y = GatherElements(x, ids)", inputs(**X, ids=integers(-64, 64, 32, 256))),
    Case("GatherElements-axis-1", "y = GatherElements<axis = 1>(x, i)", inputs(**X, i=integers(-256, 256, 64, 100))),
    Case("Gather-scalar-index", "y = Gather(x, i)", inputs(x=normal(4096), i=integers(-4096, 4096))),
    # reshaping a transposed or broadcast view copies: into writes the copy
    Case(
        "Transpose-Reshape",
        "t = Transpose<perm = [0, 2, 1, 3]>(x)\n    y = Reshape(t, shape)",
        inputs(x=normal(2, 64, 4, 32)),
        constants={"shape": np.array([2, 4, -1])},
    ),
    Case("Transpose-Flatten", "t = Transpose<perm = [1, 0]>(x)\n    y = Flatten<axis = 0>(t)", inputs(**X)),
    Case(
        "Expand-Reshape",
        "e = Expand(x, shape)\n    y = Reshape(e, flat)",
        inputs(x=normal(64, 1)),
        constants={"shape": np.array([64, 256]), "flat": np.array([-1])},
    ),
    # views need no into, but an empty one shares no memory with its input: copied then
    Case(
        "Slice-empty-Transpose-Split",
        "s = Slice(x, starts, ends)\n    t = Transpose(s)\n    a, b = Split<axis = 1>(t, sizes)\n    y = Identity(b)",
        inputs(**X),
        {"a": "float", "y": "float"},
        constants={"starts": np.array([5]), "ends": np.array([5]), "sizes": np.array([0, 0])},
        opset=13,
    ),
    Case("Shape-Size", "s = Shape<start = 1>(x)\n    n = Size(x)", inputs(**X), {"s": "int64", "n": "int64"}),
    Case("Pad", "y = Pad(x, pads, value)", inputs(**X_NCHW), constants={"pads": PADS, "value": np.float32(1.5)}),
    Case("Pad-negative", "y = Pad(x, pads)", inputs(**X_NCHW), constants={"pads": PADS - np.array([0, 1, 3, 0] * 2)}),
    # numpy.pad has no out=: the modes other than constant pad a new array, then copy it
    Case(
        "Pad-reflect", 'y = Pad<mode = "reflect">(x, pads)', inputs(**X_NCHW), constants={"pads": PADS}, allocates=True
    ),
    Case("Tile", "y = Tile(x, reps)", inputs(x=normal(8, 1, 64)), constants={"reps": np.array([2, 8, 3])}),
    Case(
        "ScatterND",
        "y = ScatterND(x, idx, u)",
        inputs(x=normal(64, 256), u=normal(2, 256)),
        constants={"idx": np.array([[3], [60]])},
    ),
    Case(
        "ScatterElements",
        "y = ScatterElements<axis = 1>(x, idx, u)",
        inputs(x=normal(64, 256), idx=lambda rng: np.tile(rng.permutation(256)[:4], (64, 1)), u=normal(64, 4)),
    ),
    # np.add.at allocates index buffers of its own, in proportion to the updates
    Case(
        "ScatterElements-add",
        'y = ScatterElements<axis = 1, reduction = "add">(x, idx, u)',
        inputs(x=normal(64, 256), idx=integers(0, 256, 64, 4), u=normal(64, 4)),
        opset=18,
        allocates=True,
    ),
    Case("DepthToSpace", 'y = DepthToSpace<blocksize = 2, mode = "CRD">(x)', inputs(x=normal(2, 16, 16, 32))),
    Case("SpaceToDepth", "y = SpaceToDepth<blocksize = 2>(x)", inputs(**X_NCHW)),
    Case("Trilu", "y = Trilu(x)", inputs(x=normal(4, 64, 256))),
    Case("Trilu-lower", "y = Trilu<upper = 0>(x, k)", inputs(x=normal(4, 64, 256), k=integers(-3, 3))),
    Case("CumSum", "y = CumSum(x, axis)", inputs(**X), constants={"axis": np.array(1)}),
    Case(
        "CumSum-reverse-exclusive",
        "y = CumSum<exclusive = 1, reverse = 1>(x, axis)",
        inputs(**X),
        constants={"axis": np.array(0)},
    ),
    Case(
        "TensorScatter",
        "y = TensorScatter<axis = 2>(cache, update, at)",
        inputs(cache=normal(2, 4, 64, 32), update=normal(2, 4, 3, 32), at=integers(0, 60, 2)),
        opset=24,
    ),
]


W_CONV = (R.standard_normal((16, 8, 3, 3)) * 0.2).astype(np.float32)
W_POINTWISE = (R.standard_normal((16, 8, 1, 1)) * 0.2).astype(np.float32)
B_16 = R.standard_normal(16).astype(np.float32)
NN = [
    Case("Conv", "y = Conv<pads = [1, 1, 1, 1]>(x, w, b)", inputs(**X_NCHW), constants={"w": W_CONV, "b": B_16}),
    Case(
        "Conv-strided",
        "y = Conv<pads = [1, 1, 1, 1], strides = [2, 2]>(x, w)",
        inputs(**X_NCHW),
        constants={"w": W_CONV},
    ),
    Case("Conv-weight-fed", "y = Conv(x, w, b)", inputs(**X_NCHW, w=normal(16, 8, 3, 3), b=normal(16))),
    Case("Conv-pointwise", "y = Conv(x, w, b)", inputs(**X_NCHW), constants={"w": W_POINTWISE, "b": B_16}),
    Case("Conv-pointwise-strided", "y = Conv<strides = [2, 2]>(x, w)", inputs(**X_NCHW), constants={"w": W_POINTWISE}),
    Case(
        "Conv-grouped",
        "y = Conv<group = 2, pads = [1, 1, 1, 1]>(x, w)",
        inputs(**X_NCHW),
        constants={"w": W_CONV[:, :4].copy()},
    ),
    Case(
        "Conv-f16",
        "y = Conv<pads = [1, 1, 1, 1]>(x, w, b)",
        inputs(x=normal(2, 8, 16, 32, dtype=np.float16)),
        {"y": "float16"},
        constants={"w": W_CONV.astype(np.float16), "b": B_16.astype(np.float16)},
    ),
    Case(
        "Conv-depthwise",
        "y = Conv<group = 8, pads = [1, 1, 1, 1]>(x, w, b)",
        inputs(**X_NCHW),
        constants={"w": W_CONV[:8, :1].copy(), "b": B_16[:8].copy()},
    ),
    Case(
        "Conv-depthwise-strided",
        "y = Conv<group = 8, pads = [1, 1, 1, 1], strides = [2, 2], dilations = [1, 2]>(x, w, b)",
        inputs(**X_NCHW),
        constants={"w": W_CONV[:8, :1].copy(), "b": B_16[:8].copy()},
    ),
    Case(
        "Conv-depthwise-channels-last-strided",
        "y = Conv<group = 64, pads = [1, 1, 1, 1], strides = [2, 2]>(x, w, b)",
        inputs(x=normal(2, 64, 8, 8)),
        constants={"w": (R.standard_normal((128, 1, 3, 3)) * 0.2).astype(np.float32), "b": normal(128)(R)},
    ),
    Case(
        "Conv-depthwise-channels-last",
        "y = Conv<group = 64, pads = [1, 1, 1, 1]>(x, w)",
        inputs(x=normal(2, 64, 8, 8)),
        constants={"w": (R.standard_normal((64, 1, 3, 3)) * 0.2).astype(np.float32)},
    ),
    Case("MaxPool", "y = MaxPool<kernel_shape = [3, 3], pads = [1, 1, 1, 1], strides = [2, 2]>(x)", inputs(**X_NCHW)),
    Case("MaxPool-stride-1", "y = MaxPool<kernel_shape = [2, 2]>(x)", inputs(**X_NCHW)),
    # the Indices output compares tap by tap: eager, then copied
    Case(
        "MaxPool-indices",
        "y, i = MaxPool<kernel_shape = [2, 2], strides = [2, 2]>(x)",
        inputs(**X_NCHW),
        {"y": "float", "i": "int64"},
        allocates=True,
    ),
    Case("AveragePool", "y = AveragePool<kernel_shape = [2, 2], strides = [2, 2]>(x)", inputs(**X_NCHW)),
    Case(
        "AveragePool-padded",
        "y = AveragePool<kernel_shape = [3, 3], pads = [1, 1, 1, 1], count_include_pad = 1>(x)",
        inputs(**X_NCHW),
    ),
    Case("AveragePool-whole", "y = AveragePool<kernel_shape = [16, 32]>(x)", inputs(**X_NCHW)),
    Case("LpPool", "y = LpPool<kernel_shape = [2, 2], strides = [2, 2], p = 3>(x)", inputs(**X_NCHW), opset=18),
    Case("GlobalAveragePool", "y = GlobalAveragePool(x)", inputs(**X_NCHW)),
    Case("GlobalAveragePool-long-rows", "y = GlobalAveragePool(x)", inputs(x=normal(2, 4, 64, 128))),
    Case("GlobalMaxPool", "y = GlobalMaxPool(x)", inputs(**X_NCHW)),
    Case("GlobalLpPool", "y = GlobalLpPool(x)", inputs(**X_NCHW)),
    Case("Softmax", "y = Softmax(x)", inputs(x=normal(4, 64, 256, scale=10.0))),
    Case("Softmax-axis-1", "y = Softmax<axis = 1>(x)", inputs(x=normal(4, 64, 256, scale=10.0))),
    Case("Softmax-2d", "y = Softmax<axis = 1>(x)", inputs(x=normal(4, 64, 256)), opset=11),
    Case("LogSoftmax", "y = LogSoftmax(x)", inputs(x=normal(64, 256, scale=10.0))),
    Case("LogSoftmax-2d", "y = LogSoftmax(x)", inputs(x=normal(4, 64, 256)), opset=11),
    Case("Softmax-f16", "y = Softmax(x)", inputs(x=normal(64, 256, dtype=np.float16)), {"y": "float16"}),
    Case("Hardmax", "y = Hardmax(x)", inputs(x=integers(0, 4, 64, 256, dtype=np.float32))),
    Case("LRN", "y = LRN<size = 5>(x)", inputs(**X_NCHW)),
    Case("LRN-long", "y = LRN<size = 3, beta = 0.6>(x)", inputs(x=normal(2, 8, 64, 128))),
    Case("Dropout-mask", "y, mask = Dropout(x)", inputs(**X), {"y": "float", "mask": "bool"}),
    Case("Dropout-legacy-mask", "y, mask = Dropout(x)", inputs(**X), {"y": "float", "mask": "float"}, opset=7),
]


ALL = ELEMENTWISE + LINALG + NORMALIZATION + REDUCTION + TENSOR + NN


@pytest.mark.parametrize("case", ALL, ids=lambda c: c.id)
def test_kernel_is_captured_and_replays_bitwise(case: Case):
    first = case.inputs(np.random.default_rng(1))
    model = one_node(case.node, first, case.outputs, constants=case.constants, opset=case.opset)
    check_captured(model, case.inputs, allocates=case.allocates)


def test_gather_replay_still_refuses_an_out_of_range_index():
    model = one_node("y = Gather(x, i)", {"x": np.zeros(8, np.float32), "i": np.zeros(3, np.int64)}, {"y": "float"})
    session = plugrt.load(model, optimization="none")
    x = np.arange(8, dtype=np.float32)
    session.try_capture({"x": x, "i": np.array([0, -8, 7])})
    assert session.capture_report.seams == []
    with pytest.raises(Exception, match="out of range|out of bounds"):
        session.replay({"x": x, "i": np.array([0, 8, 1])})


def test_work_arrays_are_kept_per_output_buffer_and_freed_with_it():
    from plugrt_cpu.kernels import elementwise

    out = np.empty(4, np.float32)
    first = elementwise.scratch(out, "slot", (4,), np.float32)
    assert elementwise.scratch(out, "slot", (4,), np.float32) is first
    assert elementwise.scratch(out.reshape(2, 2), "slot", (4,), np.float32) is first  # a view: its base's
    assert elementwise.scratch(np.empty(4, np.float32), "slot", (4,), np.float32) is not first
    key = id(out)
    del out
    assert key not in elementwise._SCRATCH


def test_small_buffers_cap_numpy_buffer_size_and_restore_it():
    from plugrt_cpu.kernels import elementwise

    before = np.getbufsize()
    assert elementwise.with_small_buffers(np.getbufsize) == min(before, elementwise._INTO_BUFSIZE)
    assert np.getbufsize() == before
    with pytest.raises(ZeroDivisionError):
        elementwise.with_small_buffers(lambda: 1 // 0)
    assert np.getbufsize() == before


# --- real models: a replay allocates under 1% of what a plain run does


@pytest.mark.parametrize("name", ["resnet50", pytest.param("densenet121", marks=pytest.mark.slow)])
def test_light_model_replay_allocates_under_one_percent_of_a_run(name):
    model = {m.name: m for m in light_models()}[name]
    session = plugrt.load(model.path)
    eager = session.run(model.inputs)
    result = session.try_capture(model.inputs)
    assert isinstance(result, Captured)
    assert result.report.seams == [], result.report.summary()
    session.replay(model.inputs)  # warm-up
    session.run(model.inputs)
    run_bytes = replay_bytes(lambda: session.run(model.inputs))
    replayed_bytes = replay_bytes(lambda: session.replay(model.inputs))
    replayed = session.replay(model.inputs)
    assert all(_same(replayed[k], eager[k]) for k in eager)
    assert replayed_bytes < 0.01 * run_bytes, (replayed_bytes, run_bytes)
