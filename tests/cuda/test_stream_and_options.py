"""The ``cuda.tf32`` option from the session to the provider's compute types, and the
provider's own stream and pinned staging, checked with a fake cupy that records which
stream each launch and copy went to."""

from __future__ import annotations

import types

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import plugrt
from plugrt.errors import InvalidOptionValueError
from plugrt.options import parse_options
from plugrt.provider import Device, DeviceKind

from cuda_helpers import NumpyCUDA, registry_of

# -- the option ------------------------------------------------------------------------

def test_tf32_is_on_by_default_and_takes_booleans():
    assert parse_options({})["cuda.tf32"] is True  # as onnxruntime's CUDA provider
    assert parse_options({"cuda.tf32": "false"})["cuda.tf32"] is False
    assert parse_options({"cuda.tf32": 0})["cuda.tf32"] is False
    with pytest.raises(InvalidOptionValueError, match="'cuda.tf32'") as info:
        parse_options({"cuda.tf32": "fast"})
    assert "boolean" in str(info.value)


def _matmul_model() -> bytes:
    w = helper.make_tensor("w", TensorProto.FLOAT, [3, 2], np.arange(6, dtype=np.float32).tolist())
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2])], [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


class _Recording(NumpyCUDA):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict] = []

    def compile(self, partition):
        self.seen.append(dict(partition.options))
        return super().compile(partition)


@pytest.mark.parametrize("given,expected", [({}, None), ({"cuda.tf32": False}, False), ({"cuda.tf32": "1"}, True)])
def test_the_session_gives_each_partition_its_providers_options(given, expected):
    provider = _Recording()
    session = plugrt.load(_matmul_model(), device="cuda", registry=registry_of(provider), **given)
    x = np.ones((4, 3), np.float32)
    np.testing.assert_array_equal(session.run({"x": x})["y"], x @ np.arange(6, dtype=np.float32).reshape(3, 2))
    # only its own keys: every cuda.* option, nothing of the session's or another provider's
    assert provider.seen and all(set(seen) == {"cuda.tf32", "cuda.float16_decoding"} for seen in provider.seen)
    assert provider.seen[-1]["cuda.tf32"] is (True if expected is None else expected)


# -- a fake cupy that records streams --------------------------------------------------

class FakeStream:
    def __init__(self, cuda, ptr: int, non_blocking: bool = False):
        self.cuda, self.ptr, self.non_blocking = cuda, ptr, non_blocking
        self.synchronized = 0

    def __enter__(self):
        self.cuda.stack.append(self)
        return self

    def __exit__(self, *exc):
        self.cuda.stack.pop()
        return False

    def synchronize(self):
        self.synchronized += 1
        self.cuda.log.append(("synchronize", self.ptr))

    def is_capturing(self):
        return False


class FakeDeviceArray:
    """A device array: numpy data, copies logged with their stream."""

    def __init__(self, cuda, data: np.ndarray):
        self.cuda, self.host = cuda, data
        self.shape, self.dtype, self.nbytes, self.size = data.shape, data.dtype, data.nbytes, data.size

    def set(self, arr, stream=None):
        self.cuda.log.append(("h2d", stream.ptr if stream is not None else None, self.cuda.pinned_source(arr)))
        self.host[...] = arr

    def get(self, stream=None, out=None):
        self.cuda.log.append(("d2h", stream.ptr if stream is not None else None, self.cuda.pinned_source(out)))
        out[...] = self.host
        return out


class FakeEvent:
    def __init__(self, cuda, **kw):
        self.cuda, self.done = cuda, True

    def record(self, stream):
        self.cuda.log.append(("event", stream.ptr))


class FakeCuda:
    def __init__(self):
        self.log: list = []
        self.null = FakeStream(self, 0)
        self.stack = [self.null]
        self.pinned: list[bytearray] = []
        self.runtime = types.SimpleNamespace(runtimeGetVersion=lambda: 13000)

    def get_current_stream(self):
        return self.stack[-1]

    def Stream(self, non_blocking=False):
        return FakeStream(self, 7, non_blocking)

    def Event(self, **kw):
        return FakeEvent(self, **kw)

    def alloc_pinned_memory(self, nbytes):
        buffer = bytearray(nbytes)
        self.pinned.append(buffer)
        return buffer

    def pinned_source(self, arr) -> bool:
        base = arr
        while getattr(base, "base", None) is not None:
            base = base.base
        return any(base is p or (isinstance(base, memoryview) and base.obj is p) for p in self.pinned)

    def Device(self, index):
        import contextlib

        return contextlib.nullcontext()


def fake_cupy():
    cuda = FakeCuda()

    class XP:
        ndarray = FakeDeviceArray

        def __init__(self):
            self.cuda = cuda

        def empty(self, shape, dtype):
            return FakeDeviceArray(cuda, np.empty(shape, dtype))

        def ascontiguousarray(self, x, dtype=None):
            return x

        def __getattr__(self, name):
            return getattr(np, name)

    return XP()


@pytest.fixture
def provider():
    from plugrt_cuda._backend import CupyBackend
    from plugrt_cuda._provider import CUDAProvider

    cp = fake_cupy()
    return CUDAProvider(importer=lambda: cp, backend=CupyBackend(cp))


GPU0 = Device(DeviceKind.GPU, 0)


def test_uploads_stage_through_pinned_memory_asynchronously_on_the_providers_stream(provider):
    cuda = provider.backend().xp.cuda
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    device = provider.to_device(host, GPU0)
    host[...] = -1  # the caller may reuse its array at once: the copy came from the staging buffer
    np.testing.assert_array_equal(device.host, np.arange(12, dtype=np.float32).reshape(3, 4))
    stream = provider.backend().stream
    assert stream.ptr != 0 and stream.non_blocking is False  # ordered with the legacy default stream
    assert ("h2d", stream.ptr, True) in cuda.log and ("event", stream.ptr) in cuda.log
    assert not any(entry[0] == "synchronize" for entry in cuda.log)  # asynchronous: nobody waited


def test_downloads_wait_for_the_providers_stream_before_the_result_is_read(provider):
    cuda = provider.backend().xp.cuda
    stream = provider.backend().stream
    array = FakeDeviceArray(cuda, np.arange(6, dtype=np.float16))
    got = provider.to_host(array)
    np.testing.assert_array_equal(got, np.arange(6, dtype=np.float16))
    copy, wait = cuda.log.index(("d2h", stream.ptr, True)), cuda.log.index(("synchronize", stream.ptr))
    assert copy < wait
    into = np.empty(6, np.float16)
    provider.copy_into(array, into)
    np.testing.assert_array_equal(into, np.arange(6, dtype=np.float16))


def test_a_stream_the_caller_made_current_is_used_instead(provider):
    cuda = provider.backend().xp.cuda
    mine = FakeStream(cuda, 99)
    with mine:
        provider.to_device(np.ones(3, np.float32), GPU0)
    assert ("h2d", 99, True) in cuda.log


def test_every_step_runs_on_the_providers_stream_unless_another_is_current(provider):
    from plugrt_cuda._provider import _on_stream

    backend = provider.backend()
    cuda = backend.xp.cuda
    seen = []

    def kernel(x):
        seen.append(cuda.get_current_stream().ptr)
        return x

    kernel.multi_output = False  # type: ignore[attr-defined]
    kernel.into = lambda out, x: seen.append(("into", cuda.get_current_stream().ptr))  # type: ignore[attr-defined]
    run = _on_stream(kernel, backend)
    run(1)
    with FakeStream(cuda, 55):  # a capture's stream, say
        run(2)
    run.into(None, 3)
    assert seen == [backend.stream.ptr, 55, ("into", backend.stream.ptr)]
    assert run.multi_output is False


def test_compiled_steps_are_bound_to_the_stream_and_the_partitions_precision(provider):
    from plugrt.provider import Partition

    import onnx_ir as ir

    model = ir.serde.deserialize_model(onnx.load_from_string(_matmul_model()))
    nodes = list(model.graph)
    partition = Partition("p", nodes, list(model.graph.inputs), list(model.graph.outputs), {"": 17},
                          options={"cuda.tf32": False})
    compiled = provider.compile(partition)
    assert compiled.state.backend.tf32 is False and provider.backend().tf32 is True
    assert all(hasattr(step.fn, "__wrapped__") for step in compiled.steps)


def test_the_numpy_backend_is_unaffected():
    from plugrt_cuda._backend import NumpyBackend

    provider = NumpyCUDA()
    assert isinstance(provider.backend(), NumpyBackend)
    model = _matmul_model()
    session = plugrt.load(model, device="cuda", registry=registry_of(provider), **{"cuda.tf32": False})
    x = np.ones((4, 3), np.float32)
    np.testing.assert_array_equal(session.run({"x": x})["y"], x @ np.arange(6, dtype=np.float32).reshape(3, 2))


def test_a_float16_model_runs_wholly_on_the_provider():
    """float16 end to end: every node claimed (none falls back for its dtype), outputs
    against onnxruntime's float16 CPU run."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(5)
    w = helper.make_tensor("w", TensorProto.FLOAT16, [16, 8], rng.standard_normal((16, 8)).astype(np.float16).tobytes(),
                           raw=True)
    b = helper.make_tensor("b", TensorProto.FLOAT16, [8], rng.standard_normal(8).astype(np.float16).tobytes(), raw=True)
    k = helper.make_tensor("k", TensorProto.FLOAT16, [2, 16, 3, 3],
                           (rng.standard_normal((2, 16, 3, 3)) / 12).astype(np.float16).tobytes(), raw=True)
    nodes = [
        helper.make_node("Conv", ["img", "k"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["a"]),
        helper.make_node("Softmax", ["a"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4, 16]),
         helper.make_tensor_value_info("img", TensorProto.FLOAT16, [1, 16, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [4, 8]),
         helper.make_tensor_value_info("f", TensorProto.FLOAT16, [1, 2])], [w, b, k],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    session = plugrt.load(model, device="cuda", registry=registry_of(NumpyCUDA()))
    assert session.placement.fallbacks == [], session.placement.summary()
    feeds = {"x": rng.standard_normal((4, 16)).astype(np.float16),
             "img": rng.standard_normal((1, 16, 6, 6)).astype(np.float16)}
    got = session.run(feeds)
    want = dict(zip(["y", "f"], ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(["y", "f"], feeds)))
    for name in ("y", "f"):
        assert got[name].dtype == np.float16
        np.testing.assert_allclose(got[name].astype(np.float32), want[name].astype(np.float32), rtol=2e-2, atol=2e-3)


def test_importing_the_provider_loads_no_cuda_library():
    import subprocess
    import sys

    code = ("import sys, plugrt_cuda.plugin, plugrt_cuda._provider; "
            "print(sorted(m for m in ('cupy', 'cudnn', 'plugrt_cuda._cublas', 'plugrt_cuda._cudnn') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
