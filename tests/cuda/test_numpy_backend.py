"""The CUDA provider's op table compiled over numpy: every step's wiring (attributes,
constant inputs, multi-output) on onnx's light models and a transformer block, checked
against their expected outputs and onnxruntime. The same builders bind cupy on a GPU."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import plugrt
from plugrt.conformance.light_models import light_models, with_logits, with_random_weights

from cuda_helpers import NumpyCUDA, registry_of


def _session(model) -> plugrt.Session:
    return plugrt.load(model, device="cuda", registry=registry_of(NumpyCUDA()))


def _run(model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Build a session whose every node the CUDA provider claims, and run it."""
    session = _session(model)
    report = session.placement
    assert report.fallbacks == [], report.summary()
    assert {k for k, v in report.nodes_per_provider.items() if v} == {"cuda"}, report.summary()
    outputs = session.run(feeds)
    return [outputs[o.name] for o in session.outputs]


def _onnxruntime(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    ort = pytest.importorskip("onnxruntime")
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)


def _assert_close_to(got: list[np.ndarray], want: list[np.ndarray], rtol: float) -> None:
    # relative to each output's largest value: the light models' logits reach 1e9-1e31
    for actual, expected in zip(got, want):
        assert actual.shape == expected.shape and actual.dtype == expected.dtype
        scale = float(np.max(np.abs(expected))) or 1.0
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


@pytest.mark.slow
@pytest.mark.parametrize("light", light_models(), ids=lambda m: m.name)
def test_light_model_logits_match_onnxruntime(light):
    # The outputs of models whose weights are one constant saturate (equal logits of ~1e10:
    # one ulp flips a one-hot), so the logits before the final Softmax are compared too.
    model, logits = with_logits(onnx.load(light.path))
    data = model.SerializeToString()
    got = _run(data, light.inputs)
    want = _onnxruntime(data, light.inputs)
    if not logits:  # no final Softmax: the outputs themselves say everything
        _assert_close_to(got, want, rtol=1e-3)
    else:
        _assert_close_to(got[1:], want[1:], rtol=1e-4)
        np.testing.assert_allclose(got[0].sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["squeezenet", "resnet50", "inception_v1", "shufflenet"])
def test_light_model_with_random_weights_matches_onnxruntime(name):
    # random weights catch a wrong channel order or layout that the constant ones hide
    (light,) = [m for m in light_models() if m.name == name]
    model, _ = with_random_weights(onnx.load(light.path), seed=0)
    model, _ = with_logits(model)
    data = model.SerializeToString()
    _assert_close_to(_run(data, light.inputs), _onnxruntime(data, light.inputs), rtol=1e-4)


_ENCODER = """
<ir_version: 8, opset_import: ["" : 17]>
encoder (float[B, 8, 16] x, float[16, 48] w_qkv, float[16, 16] w_o, float[16, 32] w_1, float[32, 16] w_2,
         float[16] g, float[16] b) => (float[B, 8, 16] y)
<int64[4] heads = {0, 8, 2, 8}, int64[3] back = {0, 8, 16}, int64[3] split_axis_sizes = {16, 16, 16},
 float scale = {0.35355339}, float half = {0.5}, float one = {1.0}, float root2 = {1.41421356}>
{
    qkv = MatMul(x, w_qkv)
    q, k, v = Split<axis=2>(qkv, split_axis_sizes)
    qh = Reshape(q, heads)
    kh = Reshape(k, heads)
    vh = Reshape(v, heads)
    qt = Transpose<perm=[0, 2, 1, 3]>(qh)
    kt = Transpose<perm=[0, 2, 3, 1]>(kh)
    vt = Transpose<perm=[0, 2, 1, 3]>(vh)
    scores = MatMul(qt, kt)
    scaled = Mul(scores, scale)
    attention = Softmax<axis=-1>(scaled)
    context = MatMul(attention, vt)
    merged = Transpose<perm=[0, 2, 1, 3]>(context)
    flat = Reshape(merged, back)
    projected = MatMul(flat, w_o)
    residual = Add(projected, x)
    normed = LayerNormalization<axis=-1, epsilon=1e-5>(residual, g, b)
    hidden = MatMul(normed, w_1)
    over = Div(hidden, root2)
    erf = Erf(over)
    plus = Add(erf, one)
    gated = Mul(hidden, plus)
    act = Mul(gated, half)
    out = MatMul(act, w_2)
    y = Add(out, normed)
}
"""


def test_transformer_encoder_block_matches_onnxruntime():
    import onnxruntime

    proto = onnx.parser.parse_model(_ENCODER)
    onnx.checker.check_model(proto)
    rng = np.random.default_rng(3)
    shapes = {"x": (2, 8, 16), "w_qkv": (16, 48), "w_o": (16, 16), "w_1": (16, 32), "w_2": (32, 16), "g": (16,), "b": (16,)}
    feeds = {name: (rng.standard_normal(shape) * 0.5).astype(np.float32) for name, shape in shapes.items()}
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, feeds)[0]
    np.testing.assert_allclose(_run(proto.SerializeToString(), feeds)[0], expected, rtol=1e-4, atol=1e-4)


_DECODER_OPS = """
<ir_version: 8, opset_import: ["" : 17]>
decoder (float[1, 4, 8] x, int64[1, 4] ids, float[10, 8] table, float[4, 4] mask) => (float[1, 4, 8] y, float[1, 2, 12] tail)
<int64[1] starts = {2}, int64[1] ends = {4}, int64[1] axes = {1}, int64[3] shape = {1, 4, 4},
 int64[6] pads = {0, 1, 0, 0, 1, 0}, float floor = {-1.0}>
{
    embedded = Gather<axis=0>(table, ids)
    summed = Add(embedded, x)
    flipped = Transpose<perm=[0, 2, 1]>(summed)
    scores = MatMul(summed, flipped)
    masked = Add(scores, mask)
    keep = Greater(masked, floor)
    filler = Expand(floor, shape)
    chosen = Where(keep, masked, filler)
    picked = Slice(chosen, starts, ends, axes)
    widened = Pad<mode="constant">(picked, pads)
    mean = ReduceMean<keepdims=1, axes=[-1]>(summed)
    halfs = Cast<to=10>(summed)
    back = Cast<to=1>(halfs)
    y = Sub(back, mean)
    first = Slice(summed, starts, ends, axes)
    second = Slice(widened, starts, ends, axes)
    tail = Concat<axis=2>(first, second)
}
"""


def test_decoder_block_data_movement_ops_match_onnxruntime():
    import onnxruntime

    proto = onnx.parser.parse_model(_DECODER_OPS)
    rng = np.random.default_rng(5)
    feeds = {
        "x": rng.standard_normal((1, 4, 8)).astype(np.float32),
        "ids": np.array([[1, 9, -1, 3]], np.int64),
        "table": rng.standard_normal((10, 8)).astype(np.float32),
        "mask": np.triu(np.full((4, 4), -1e4, np.float32), 1),
    }
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, feeds)
    for got, want in zip(_run(proto.SerializeToString(), feeds), expected):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


_HALF_NET = """
<ir_version: 8, opset_import: ["" : 17]>
net (%(t)s[2, 3, 12, 12] x, %(t)s[8, 3, 3, 3] w, %(t)s[8] b, %(t)s[8, 1, 3, 3] dw, %(t)s[8] g, %(t)s[8] beta,
     %(t)s[8] mean, %(t)s[8] var, %(t)s[8, 5] fc, %(t)s[5] fc_b, %(t)s[5] ln_g)
    => (%(t)s[2, 5] y)
{
    c = Conv<pads=[1, 1, 1, 1]>(x, w, b)
    r = Relu(c)
    d = Conv<group=8, strides=[2, 2], pads=[1, 1, 1, 1]>(r, dw)
    n = BatchNormalization(d, g, beta, mean, var)
    p = MaxPool<kernel_shape=[2, 2], strides=[2, 2]>(n)
    a = AveragePool<kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1>(p)
    s = GlobalAveragePool(a)
    f = Flatten(s)
    h = Gemm<transB=0>(f, fc, fc_b)
    l = LayerNormalization(h, ln_g)
    y = Softmax(l)
}
"""


def test_float16_network_matches_float32_onnxruntime_within_half_precision():
    import onnxruntime

    rng = np.random.default_rng(9)
    shapes = {
        "x": (2, 3, 12, 12), "w": (8, 3, 3, 3), "b": (8,), "dw": (8, 1, 3, 3), "g": (8,), "beta": (8,),
        "mean": (8,), "var": (8,), "fc": (8, 5), "fc_b": (5,), "ln_g": (5,),
    }
    feeds32 = {k: (rng.standard_normal(s) * 0.5).astype(np.float32) for k, s in shapes.items()}
    feeds32["var"] = np.abs(feeds32["var"]) + 0.5
    feeds16 = {k: v.astype(np.float16) for k, v in feeds32.items()}
    feeds32 = {k: v.astype(np.float32) for k, v in feeds16.items()}  # the same values in both
    proto32 = onnx.parser.parse_model(_HALF_NET % {"t": "float"})
    expected = onnxruntime.InferenceSession(proto32.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds32)[0]
    got = _run(onnx.parser.parse_model(_HALF_NET % {"t": "float16"}).SerializeToString(), feeds16)[0]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), expected, rtol=2e-2, atol=2e-3)


def test_the_provider_uploads_no_constant_and_computes_with_the_one_the_plan_passes():
    # The plan moves every constant to the device once (shared through a WeightStore);
    # a second upload by the provider doubled the weights' device memory (VGG-19: 548 MB).
    from plugrt.provider import Partition

    from plugrt_cuda._backend import NumpyBackend
    from plugrt_cuda._provider import CUDAProvider

    class CountingBackend(NumpyBackend):
        def __init__(self):
            super().__init__()
            numpy, self.uploads = self.xp, []
            self.xp = type("xp", (), {"__getattr__": lambda _, name: getattr(numpy, name)})()
            self.xp.asarray = lambda a, *args, **kw: (self.uploads.append(np.shape(a)), numpy.asarray(a, *args, **kw))[1]

    model = ir.from_proto(onnx.parser.parse_model(
        '<ir_version: 8, opset_import: ["" : 17]> m (float[1,2,3,3] x) => (float[1,4,3,3] y)'
        " <float[4,2,1,1] w = {1,1,1,1,1,1,1,1}> { y = Conv(x, w) }"
    ))
    node = next(iter(model.graph))
    backend = CountingBackend()
    provider = CUDAProvider(importer=lambda: None, backend=backend)
    partition = Partition("p", list(model.graph), list(node.inputs), list(node.outputs), {"": 17})
    (step,) = provider.compile(partition).steps
    assert backend.uploads == []
    x = np.ones((1, 2, 3, 3), np.float32)
    passed = np.full((4, 2, 1, 1), 3.0, np.float32)  # what the plan's device copy would hold
    np.testing.assert_array_equal(step.fn(x, passed), np.full((1, 4, 3, 3), 6.0, np.float32))
