"""The CUDA provider on a real GPU: own kernels against numpy, sessions against the CPU
provider, device bindings, DLPack, CUDA-graph capture and EPContext. Skipped without a device."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import plugrt
from plugrt.conformance.light_models import light_models, with_logits, with_random_weights
from plugrt.errors import StaleCaptureError

from cuda_helpers import registry_of
from plugrt_cuda import _xp

pytestmark = pytest.mark.gpu

RNG = np.random.default_rng(11)
TOLERANCE = {"float32": 1e-4, "float16": 2e-2}


def _random(*shape, dtype="float32"):
    return RNG.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape", [(1, 5, 7, 3), (3, 64, 130, 70), (2, 1, 200, 129)])
def test_own_gemm_matches_numpy(gpu_provider, dtype, shape):
    cp = gpu_provider.backend().xp
    batch, m, k, n = shape
    a, b, bias = _random(batch, m, k, dtype=dtype), _random(k, n, dtype=dtype), _random(n, dtype=dtype)
    got = gpu_provider.backend().gemm(cp.asarray(a), cp.asarray(b), cp.asarray(bias), alpha=0.5).get()
    expected = 0.5 * (a.astype(np.float32) @ b.astype(np.float32)) + bias.astype(np.float32)
    np.testing.assert_allclose(got.astype(np.float32), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * k)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize(
    "case",
    [
        dict(group=1, pads=[1, 1, 1, 1]),
        dict(group=2, strides=[2, 2], dilations=[2, 1], pads=[0, 1, 2, 1]),
        dict(group=8, strides=[2, 2], pads=[1, 1, 1, 1]),  # depthwise
        dict(group=1, auto_pad="SAME_UPPER", strides=[2, 2]),
    ],
    ids=str,
)
def test_own_conv_kernels_match_the_numpy_binding(gpu_provider, dtype, case):
    backend = gpu_provider.backend()
    cp = backend.xp
    x = _random(2, 8, 11, 9, dtype=dtype)
    group = case["group"]
    w, b = _random(8, 8 // group, 3, 3, dtype=dtype), _random(8, dtype=dtype)
    got = backend.conv(cp.asarray(x), cp.asarray(w), cp.asarray(b), True, case).get()
    expected = np.maximum(_xp.conv(np, x.astype(np.float32), w.astype(np.float32), b.astype(np.float32), **case), 0)
    np.testing.assert_allclose(got.astype(np.float32), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * 10)


@pytest.mark.parametrize("mode,extra", [("max", {}), ("average", {"count_include_pad": 0}), ("average", {"count_include_pad": 1})])
@pytest.mark.parametrize("ceil_mode", [0, 1])
def test_own_pool_kernel_matches_the_numpy_binding(gpu_provider, mode, extra, ceil_mode):
    backend = gpu_provider.backend()
    x = _random(2, 3, 10, 9)
    attributes = dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 0, 1, 1], ceil_mode=ceil_mode, **extra)
    got = backend.pool(backend.xp.asarray(x), mode, attributes).get()
    np.testing.assert_allclose(got, _xp.pool(np, x, mode, **attributes), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("log", [False, True])
def test_own_softmax_kernel_matches_the_numpy_binding(gpu_provider, dtype, log):
    backend = gpu_provider.backend()
    x = _random(6, 1000, dtype=dtype)
    got = backend.softmax(backend.xp.asarray(x), -1, False, log).get().astype(np.float32)
    fn = _xp.log_softmax if log else _xp.softmax
    np.testing.assert_allclose(got, fn(np, x.astype(np.float32), axis=-1), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_own_layernorm_kernel_matches_the_numpy_binding(gpu_provider, dtype):
    backend = gpu_provider.backend()
    cp = backend.xp
    x, g, b = _random(4, 7, 768, dtype=dtype), _random(768, dtype=dtype), _random(768, dtype=dtype)
    y, mean, inv_std = backend.layer_normalization(cp.asarray(x), cp.asarray(g), cp.asarray(b), -1, 1e-5)
    expected, expected_mean, _ = _xp.layer_normalization(np, x.astype(np.float32), g.astype(np.float32), b.astype(np.float32))
    np.testing.assert_allclose(y.get().astype(np.float32), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * 5)
    np.testing.assert_allclose(mean.get(), expected_mean, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("weights", ["constant", "random"])
@pytest.mark.parametrize("light", light_models(), ids=lambda m: m.name)
def test_light_model_on_cuda_matches_the_cpu_provider(gpu_provider, light, weights):
    # on the logits before the final Softmax (its probabilities saturate with the constant
    # weights: one ulp flips a one-hot), relative to their largest value (up to 1e31)
    model, logits = with_logits(onnx.load(light.path))
    if weights == "random":
        model, _ = with_random_weights(model, seed=0)
    data = model.SerializeToString()
    session = plugrt.load(data, device="cuda", registry=registry_of(gpu_provider))
    cpu = plugrt.load(data, device="cpu")
    assert session.placement.fallbacks == [], session.placement.summary()
    got, expected = session.run(light.inputs), cpu.run(light.inputs)
    compared = logits if logits and weights == "constant" else list(expected)
    for name in compared:
        scale = max(1.0, float(np.max(np.abs(expected[name]))))
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-3, atol=1e-3 * scale)


_MLP = """
<ir_version: 8, opset_import: ["" : 17]>
mlp (float[8, 64] x) => (float[8, 16] y)
<float[64, 32] w1 = {%s}, float[32, 16] w2 = {%s}>
{
    h = MatMul(x, w1)
    r = Relu(h)
    y = MatMul(r, w2)
}
"""


def _mlp() -> bytes:
    w1, w2 = _random(64, 32), _random(32, 16)
    text = _MLP % (", ".join(map(str, w1.ravel())), ", ".join(map(str, w2.ravel())))
    return onnx.parser.parse_model(text).SerializeToString()


def test_bound_outputs_stay_in_device_memory_and_transfers_are_counted(gpu_provider):
    session = plugrt.load(_mlp(), device="cuda", registry=registry_of(gpu_provider))
    x = session.allocate_binding(input="x")
    y = session.allocate_binding(output="y")
    x.write(_random(8, 64))
    session.run(bindings=[x, y])
    assert gpu_provider.owns(y.view())
    assert (x.stats.uploads, y.stats.downloads) == (1, 0)
    np.testing.assert_allclose(y.read(), session.run({"x": x.read()})["y"], rtol=1e-5, atol=1e-5)


def test_a_cupy_array_is_taken_without_a_copy_and_a_bound_output_exports_dlpack(gpu_provider):
    cp = gpu_provider.backend().xp
    source = cp.asarray(_random(8, 64))
    assert gpu_provider.to_device(source, None) is source
    session = plugrt.load(_mlp(), device="cuda", registry=registry_of(gpu_provider))
    y = session.allocate_binding(output="y")
    x = session.allocate_binding(input="x")
    x.write(source.get())
    session.run(bindings=[x, y])
    exported = cp.from_dlpack(y.view())
    assert exported.data.ptr == y.view().data.ptr


def test_capture_replays_bitwise_equal_to_an_eager_run(gpu_provider, monkeypatch):
    from plugrt_cuda import _backend

    monkeypatch.setenv(_backend.GEMM_ENV, "own")  # the same GEMM eager and captured
    provider = type(gpu_provider)()
    session = plugrt.load(_mlp(), device="cuda", registry=registry_of(provider))
    x, y = session.allocate_binding(input="x"), session.allocate_binding(output="y")
    data = _random(8, 64)
    x.write(data)
    eager = session.run({"x": data})["y"]
    captured = session.try_capture(bindings=[x, y])
    assert captured.captured and captured.report.seams == []
    result = session.replay(bindings=[x, y])
    assert result.replayed
    np.testing.assert_array_equal(y.read(), eager)
    x.write(data * 2)
    session.replay(bindings=[x, y])
    np.testing.assert_array_equal(y.read(), session.run({"x": data * 2})["y"])


def test_cublas_gemms_become_eager_seams_between_graphs(gpu_provider, monkeypatch):
    from plugrt_cuda import _backend

    monkeypatch.setenv(_backend.GEMM_ENV, "cublas")
    provider = type(gpu_provider)()
    session = plugrt.load(_mlp(), device="cuda", registry=registry_of(provider), optimization="none")
    x, y = session.allocate_binding(input="x"), session.allocate_binding(output="y")
    data = _random(8, 64)
    x.write(data)
    captured = session.try_capture(bindings=[x, y])
    assert captured.captured
    assert {"MatMul<h>", "MatMul<y>"} <= {node for node, _ in captured.report.seams}
    session.replay(bindings=[x, y])
    np.testing.assert_allclose(y.read(), session.run({"x": data})["y"], rtol=1e-5, atol=1e-5)


def test_a_replay_after_a_binding_changed_shape_is_refused(gpu_provider):
    session = plugrt.load(_mlp(), device="cuda", registry=registry_of(gpu_provider))
    x = session.allocate_binding(input="x", shape=(8, 64), capacity=(16, 64))
    y = session.allocate_binding(output="y", shape=(8, 16), capacity=(16, 16))
    x.write(_random(8, 64))
    session.try_capture(bindings=[x, y])
    x.write(_random(4, 64))
    with pytest.raises(StaleCaptureError):
        session.replay(bindings=[x, y])


def test_a_saved_context_restores_its_cubins_on_the_same_gpu(gpu_provider):
    from plugrt.provider import Partition

    session = plugrt.load(_mlp(), device="cuda", registry=registry_of(gpu_provider))
    session.run({"x": _random(8, 64)})
    compiled = next(c for c in session._built.compiled if c.provider == "cuda")
    blob = gpu_provider.save_context(compiled)
    restored = gpu_provider.load_context(blob, {"partition": compiled.partition, "partition_name": "p"})
    assert restored.restored and restored.state.verdict == "restored"
    assert isinstance(compiled.partition, Partition)


def test_a_context_from_another_architecture_is_recompiled_with_the_reason(gpu_provider):
    from plugrt_cuda import _context

    session = plugrt.load(_mlp(), device="cuda", registry=registry_of(gpu_provider))
    compiled = next(c for c in session._built.compiled if c.provider == "cuda")
    saved = _context.loads(gpu_provider.save_context(compiled))
    saved.arch = "sm_1"
    restored = gpu_provider.load_context(_context.dumps(saved), {"partition": compiled.partition})
    assert not restored.restored and "sm_1" in restored.state.verdict
