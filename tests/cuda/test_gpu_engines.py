"""cuBLASLt, cuDNN, TF32, the provider's stream and pinned staging on a real GPU: results
against float64 numpy, eager and replayed from a CUDA graph. Skipped without a device."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import plugrt

from cuda_helpers import registry_of

pytestmark = pytest.mark.gpu

RNG = np.random.default_rng(29)


def _error(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / max(1e-30, float(np.max(np.abs(want)))))


def _lt_backend(gpu_provider):
    backend = gpu_provider.backend()
    if backend.lt() is None:
        pytest.fail(f"cuBLASLt did not load on a GPU machine: {backend.lt_reason}")
    return backend


@pytest.mark.parametrize("dtype,tf32,tolerance", [("float32", False, 1e-5), ("float32", True, 5e-3), ("float16", True, 5e-3)])
@pytest.mark.parametrize("shapes", [((1, 2048), (2048, 1000)), ((4, 33, 70), (70, 17)), ((3, 8, 16), (3, 16, 5)),
                                    ((16, 64), (32, 64))], ids=["fc", "batched-2d", "batched", "transposed"])
def test_cublaslt_matches_float64_eager_and_replayed(gpu_provider, shapes, dtype, tf32, tolerance):
    backend = _lt_backend(gpu_provider).configured(tf32=tf32)
    cp = backend.xp
    a_host = RNG.standard_normal(shapes[0]).astype(dtype)
    b_host = RNG.standard_normal(shapes[1]).astype(dtype)
    a, b = cp.asarray(a_host), cp.asarray(b_host)
    if shapes[1] == (32, 64):  # a Gemm transB weight: a transposed view, read in place
        b, b_host = b.T, b_host.T
    want = a_host.astype(np.float64) @ b_host.astype(np.float64)
    assert _error(backend.matmul(a, b).get(), want) <= tolerance
    stream = cp.cuda.Stream(non_blocking=True)
    backend.prepare_capture(stream)
    with stream:
        stream.begin_capture()
        out = backend.matmul(a, b)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    assert _error(out.get(), want) <= tolerance


def test_cublaslt_bias_relu_epilogue(gpu_provider):
    backend = _lt_backend(gpu_provider).configured(tf32=False)
    cp = backend.xp
    a, b, bias = (RNG.standard_normal(s).astype(np.float32) for s in ((9, 40), (40, 24), (24,)))
    got = backend.lt_gemm(cp.asarray(a), cp.asarray(b), cp.asarray(bias), relu=True, alpha=0.5).get()
    want = np.maximum(0.5 * (a.astype(np.float64) @ b) + bias, 0)
    assert _error(got, want) <= 1e-5


def _conv_model() -> bytes:
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 4, 3, 3], RNG.standard_normal(288).astype(np.float32).tolist())
    b = helper.make_tensor("b", TensorProto.FLOAT, [8], RNG.standard_normal(8).astype(np.float32).tolist())
    w1 = helper.make_tensor("w1", TensorProto.FLOAT, [8, 8, 1, 1], RNG.standard_normal(64).astype(np.float32).tolist())
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Conv", ["r", "w1"], ["c1"]),
        helper.make_node("Add", ["c1", "r"], ["s"]),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 10, 10])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 10, 10])], [w, b, w1])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("tf32,tolerance", [(False, 1e-5), (True, 5e-3)])
def test_a_residual_block_matches_the_cpu_provider_eager_and_replayed(gpu_provider, tf32, tolerance):
    model = _conv_model()
    x = RNG.standard_normal((1, 4, 10, 10)).astype(np.float32)
    want = plugrt.load(model, device="cpu").run({"x": x})["y"].astype(np.float64)
    session = plugrt.load(model, device="cuda", registry=registry_of(type(gpu_provider)()), **{"cuda.tf32": tf32})
    assert _error(session.run({"x": x})["y"], want) <= tolerance
    xb, yb = session.allocate_binding(input="x"), session.allocate_binding(output="y")
    xb.write(x)
    captured = session.try_capture(bindings=[xb, yb])
    assert captured.captured and captured.report.seams == []  # cuBLASLt GEMMs are recorded, no seams
    session.replay(bindings=[xb, yb])
    assert _error(yb.read(), want) <= tolerance


def test_host_copies_round_trip_through_pinned_staging(gpu_provider):
    host = RNG.standard_normal((257, 33)).astype(np.float32)
    device = gpu_provider.to_device(host, None)
    host_copy = host.copy()
    host[...] = 0  # the staging buffer, not the caller's array, is what the copy reads
    np.testing.assert_array_equal(gpu_provider.to_host(device), host_copy)
