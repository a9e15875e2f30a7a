"""Which engine runs each convolution (cuDNN, 1x1 as one GEMM, the own depthwise kernel,
im2col), the reasons given, and the cuDNN graph the provider builds, with fakes for cuDNN's
frontend and cuBLASLt: no GPU needed."""

from __future__ import annotations

import types

import numpy as np
import pytest

from plugrt_cuda import _conv, _cublas
from plugrt_cuda._conv import CUDNN, DEPTHWISE, GEMM_1X1, GENERIC, IM2COL, plan_conv
from plugrt_cuda._cudnn import ConvKey, Cudnn

NO_CUDNN = "nvidia-cudnn-frontend is not installed"


def _plan(x, w, attributes=None, *, cudnn=True, gemm=True, residual=False, dtype="float32"):
    return plan_conv(x, w, dtype, attributes or {}, cudnn_reason=None if cudnn else NO_CUDNN,
                     gemm_reason=None if gemm else "cuBLASLt cannot be used: absent", residual=residual)


@pytest.mark.parametrize(
    "x,w,attributes,cudnn,gemm,residual,engine",
    [
        ((1, 64, 56, 56), (256, 64, 1, 1), {}, True, True, False, GEMM_1X1),  # ResNet's 1x1 expand
        ((1, 64, 56, 56), (256, 64, 1, 1), {}, False, True, False, GEMM_1X1),
        ((1, 64, 56, 56), (256, 64, 1, 1), {}, True, True, True, CUDNN),  # + residual: one fused cuDNN call
        ((1, 64, 56, 56), (256, 64, 1, 1), {}, False, True, True, GEMM_1X1),  # residual added after the GEMM
        ((1, 64, 56, 56), (256, 64, 1, 1), {}, False, False, False, IM2COL),  # neither library
        ((1, 64, 56, 56), (128, 64, 1, 1), {"strides": [2, 2]}, True, True, False, CUDNN),  # strided 1x1
        ((1, 64, 56, 56), (128, 64, 1, 1), {"strides": [2, 2]}, False, True, False, IM2COL),
        ((1, 64, 56, 56), (64, 64, 1, 1), {"pads": [1, 1, 1, 1]}, False, True, False, IM2COL),  # padded 1x1
        ((1, 64, 56, 56), (64, 32, 1, 1), {"group": 2}, False, True, False, IM2COL),  # grouped 1x1
        ((1, 64, 56, 56), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]}, True, True, False, CUDNN),
        ((1, 64, 56, 56), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]}, False, True, False, IM2COL),
        ((1, 32, 56, 56), (32, 1, 3, 3), {"group": 32}, False, True, False, DEPTHWISE),
        ((1, 32, 56, 56), (32, 1, 3, 3), {"group": 32}, True, True, False, CUDNN),
        ((1, 3, 8, 8, 8), (4, 3, 3, 3, 3), {}, True, True, False, GENERIC),  # 3-D
    ],
)
def test_each_convolution_goes_to_its_engine(x, w, attributes, cudnn, gemm, residual, engine):
    assert _plan(x, w, attributes, cudnn=cudnn, gemm=gemm, residual=residual).engine == engine


def test_the_reasons_name_the_engine_and_why_cudnn_is_not_used():
    fallback = _plan((1, 8, 9, 9), (8, 8, 3, 3), cudnn=False)
    assert fallback.engine == IM2COL and "im2col" in fallback.reason and NO_CUDNN in fallback.reason
    depthwise = _plan((1, 8, 9, 9), (8, 1, 3, 3), {"group": 8}, cudnn=False)
    assert NO_CUDNN in depthwise.reason
    assert "no im2col" in _plan((1, 8, 9, 9), (4, 8, 1, 1)).reason
    assert "fused" in _plan((1, 8, 9, 9), (4, 8, 3, 3)).reason
    assert _plan((1, 8, 9, 9), (4, 8, 3, 3), dtype="float64").engine == GENERIC


def test_a_missing_frontend_is_a_reason_with_the_package_to_install():
    def importer():
        raise ImportError("No module named 'cudnn'")

    cudnn = Cudnn(types.SimpleNamespace(), importer=importer)
    assert not cudnn.available
    assert "nvidia-cudnn-frontend is not installed" in cudnn.unavailable_reason
    assert "pip install nvidia-cudnn-frontend" in cudnn.unavailable_reason

    def broken():
        raise RuntimeError("libcudnn.so.9: cannot open shared object file")

    assert "libcudnn.so.9" in Cudnn(types.SimpleNamespace(), importer=broken).unavailable_reason


# -- a fake cuDNN frontend -------------------------------------------------------------

def _reference_conv(x, w, b, pre, post, strides, dilations, group):
    """Direct convolution in float64 (independent of every engine under test)."""
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    xp = np.pad(x.astype(np.float64), [(0, 0), (0, 0), (pre[0], post[0]), (pre[1], post[1])])
    oh = (h + pre[0] + post[0] - ((kh - 1) * dilations[0] + 1)) // strides[0] + 1
    ow = (wd + pre[1] + post[1] - ((kw - 1) * dilations[1] + 1)) // strides[1] + 1
    y = np.zeros((n, m, oh, ow))
    per = m // group
    for o in range(m):
        g = o // per
        for i in range(kh):
            for j in range(kw):
                patch = xp[:, g * cg:(g + 1) * cg, i * dilations[0]: i * dilations[0] + strides[0] * oh: strides[0],
                           j * dilations[1]: j * dilations[1] + strides[1] * ow: strides[1]]
                y[:, o] += np.einsum("nchw,c->nhw", patch, w[o, :, i, j].astype(np.float64))
    if b is not None:
        y += b.reshape(1, m, 1, 1)
    return y


class _FakeTensor:
    def __init__(self, name, **kw):
        self.name, self.kw = name, kw
        self.output = False

    def set_output(self, value):
        self.output = value
        return self

    def set_data_type(self, value):
        self.kw["data_type"] = value
        return self


class _FakeGraph:
    def __init__(self, frontend, **kw):
        self.frontend, self.kw, self.ops, self.notes_removed = frontend, kw, [], []
        frontend.graphs.append(self)

    def tensor(self, name, dim, stride, data_type):
        return _FakeTensor(name, dim=dim, stride=stride, data_type=data_type)

    def conv_fprop(self, image, weight, pre_padding, post_padding, stride, dilation, compute_data_type):
        self.conv = dict(pre=pre_padding, post=post_padding, stride=stride, dilation=dilation)
        self.ops.append(("conv", image.name, weight.name))
        return _FakeTensor("Y")

    def add(self, a, b, compute_data_type):
        self.ops.append(("add", a.name, b.name))
        return _FakeTensor("Y")

    def relu(self, input, compute_data_type):
        self.ops.append(("relu", input.name))
        return _FakeTensor("Y")

    def validate(self):
        self.frontend.log.append("validate")

    def build_operation_graph(self):
        pass

    def create_execution_plans(self, modes):
        self.modes = modes

    def deselect_numeric_notes(self, notes):
        self.notes_removed += notes

    def check_support(self):
        pass

    def build_plans(self):
        self.frontend.log.append("build plans")

    def get_workspace_size(self):
        return 256

    def execute(self, pack, workspace, handle):
        """What cuDNN does with the variant pack: device addresses (here host ones) of tensors
        whose dims and strides the graph declared."""
        from test_cublas import _memory

        self.frontend.log.append(("execute", self.frontend.stream))
        assert all(type(v) is int for v in pack.values()) and type(workspace) is int
        dtype = np.float16 if self.kw["io_data_type"] == "half" else np.float32
        by = {t.name: _memory(p, int(np.prod(t.kw["dim"])), dtype).reshape(t.kw["dim"])
              for t, p in pack.items() if t.name != "Y"}
        c = self.conv
        group = by["X"].shape[1] // by["W"].shape[1]
        y = _reference_conv(by["X"], by["W"], by.get("B"), c["pre"], c["post"], c["stride"], c["dilation"], group)
        if "R" in by:
            y += by["R"]
        if any(op[0] == "relu" for op in self.ops):
            y = np.maximum(y, 0)
        (out,) = [p for t, p in pack.items() if t.name == "Y"]
        _memory(out, y.size, dtype)[...] = y.reshape(-1).astype(dtype)


class _FakeFrontend:
    def __init__(self):
        self.graphs: list[_FakeGraph] = []
        self.log: list = []
        self.stream = None
        self.data_type = types.SimpleNamespace(FLOAT="float", HALF="half")
        self.heur_mode = types.SimpleNamespace(A="A", FALLBACK="FALLBACK")
        self.numerical_note = types.SimpleNamespace(TENSOR_CORE="TENSOR_CORE")

    def pygraph(self, **kw):
        return _FakeGraph(self, **kw)

    def create_handle(self):
        return "handle"

    def set_stream(self, handle, stream):
        self.stream = stream


class _Stream:
    def __init__(self, ptr):
        self.ptr = ptr

    def is_capturing(self):
        return False

    def synchronize(self):
        pass


def _fake_cupy(stream_ptr=0):
    stream = _Stream(stream_ptr)
    ns = types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_current_stream=lambda: stream, runtime=types.SimpleNamespace(runtimeGetVersion=lambda: 13000)))

    class XP:
        def __getattr__(self, name):
            return getattr(ns, name) if hasattr(ns, name) else getattr(np, name)

    return XP()


RNG = np.random.default_rng(3)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cudnn_conv_fuses_bias_residual_and_relu_into_one_graph_built_once(dtype):
    frontend = _FakeFrontend()
    cudnn = Cudnn(_fake_cupy(), importer=lambda: frontend)
    x = RNG.standard_normal((2, 4, 7, 6)).astype(dtype)
    w = RNG.standard_normal((6, 4, 3, 3)).astype(dtype)
    b = RNG.standard_normal(6).astype(dtype)
    key = ConvKey(x.shape, w.shape, np.dtype(dtype).name, (1, 0), (1, 2), (2, 1), (1, 1), 1, True, True, True, True)
    r = RNG.standard_normal(Cudnn.output_shape(key)).astype(dtype)
    for _ in range(2):
        y = cudnn.conv(key, x, w, b, r)
    (graph,) = frontend.graphs  # one graph, built on the first call, reused
    assert frontend.log.count("build plans") == 1
    assert [op[0] for op in graph.ops] == ["conv", "add", "add", "relu"]
    assert graph.ops[1][2] == "B" and graph.ops[2][2] == "R"
    assert graph.conv == dict(pre=[1, 0], post=[1, 2], stride=[2, 1], dilation=[1, 1])
    assert graph.kw["io_data_type"] == ("half" if dtype == np.float16 else "float")
    want = np.maximum(_reference_conv(x, w, b, (1, 0), (1, 2), (2, 1), (1, 1), 1) + r, 0)
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=2e-2 if dtype == np.float16 else 1e-5, atol=5e-2 if dtype == np.float16 else 1e-5)


def test_cudnn_runs_on_the_current_stream_and_tf32_off_removes_tensor_core_plans():
    frontend = _FakeFrontend()
    cudnn = Cudnn(_fake_cupy(stream_ptr=77), importer=lambda: frontend)
    x, w = np.ones((1, 2, 4, 4), np.float32), np.ones((3, 2, 3, 3), np.float32)
    exact = ConvKey(x.shape, w.shape, "float32", (0, 0), (0, 0), (1, 1), (1, 1), 1, False, False, False, False)
    cudnn.conv(exact, x, w)
    assert ("execute", 77) in frontend.log  # the stream was set on the handle before executing
    assert frontend.graphs[0].notes_removed == ["TENSOR_CORE"]
    cudnn.conv(ConvKey(*list(exact.__dict__.values())[:-1], True), x, w)
    assert frontend.graphs[1].notes_removed == []


# -- the backend carries the plan out --------------------------------------------------

@pytest.fixture
def backend(monkeypatch):
    """CupyBackend over numpy with a fake cuBLASLt (test_cublas's) and a fake cuDNN."""
    from test_cublas import FakeLt

    from plugrt_cuda import _cudnn
    from plugrt_cuda._backend import CupyBackend

    lib = FakeLt()
    monkeypatch.setattr(_cublas.Lt, "load", classmethod(lambda cls, majors=(13, 12): cls(lib)))
    monkeypatch.setattr(_cublas, "WORKSPACE_BYTES", 1 << 10)
    frontend = _FakeFrontend()
    monkeypatch.setattr(_cudnn, "import_frontend", lambda: frontend)
    made = CupyBackend(_fake_cupy())
    made.fake_lt, made.fake_cudnn = lib, frontend  # type: ignore[attr-defined]
    return made


def test_a_1x1_convolution_is_one_gemm_and_its_epilogue(backend):
    x = RNG.standard_normal((2, 8, 5, 4)).astype(np.float32)
    w = RNG.standard_normal((6, 8, 1, 1)).astype(np.float32)
    b = RNG.standard_normal(6).astype(np.float32)
    y = backend.conv(x, w, b, True, {})
    want = np.maximum(_reference_conv(x, w, b, (0, 0), (0, 0), (1, 1), (1, 1), 1), 0)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert backend.fake_lt.count("cublasLtMatmul") == 1 and not backend.fake_cudnn.graphs
    (plan,) = backend._shared["conv_notes"].values()
    assert plan.engine == GEMM_1X1


def test_a_3x3_convolution_with_a_residual_is_one_cudnn_call(backend):
    x = RNG.standard_normal((1, 4, 6, 6)).astype(np.float32)
    w = RNG.standard_normal((4, 4, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(4).astype(np.float32)
    z = RNG.standard_normal((1, 4, 6, 6)).astype(np.float32)
    y = backend.conv(x, w, b, True, {"pads": [1, 1, 1, 1]}, residual=z)
    want = np.maximum(_reference_conv(x, w, b, (1, 1), (1, 1), (1, 1), (1, 1), 1) + z, 0)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert [op[0] for op in backend.fake_cudnn.graphs[0].ops] == ["conv", "add", "add", "relu"]
    assert backend.fake_lt.count("cublasLtMatmul") == 0


def test_the_partitions_tf32_reaches_cudnn(backend):
    x, w = np.ones((1, 2, 4, 4), np.float32), np.ones((3, 2, 3, 3), np.float32)
    backend.configured(tf32=False).conv(x, w, None, False, {})
    assert backend.fake_cudnn.graphs[-1].notes_removed == ["TENSOR_CORE"]
    backend.conv(x, w, None, False, {})
    assert backend.fake_cudnn.graphs[-1].notes_removed == []


def test_fused_conv_with_a_residual_and_no_activation_is_claimed_and_adds_it():
    """plugrt.cpu::FusedConv(x, w, b, z), as the CPU provider's Conv+Add fusion writes it."""
    from plugrt_cuda._backend import NumpyBackend
    from plugrt_cuda._ops import OPS, OpInfo

    spec = OPS[("plugrt.cpu", "FusedConv")]
    info = OpInfo({"pads": [1, 1, 1, 1]}, [None] * 4, 1, 4, 1, NumpyBackend())
    assert spec.check(info) is None
    assert spec.check(OpInfo({"activation": "Tanh"}, [None] * 4, 1, 4, 1, NumpyBackend())) is not None
    x = RNG.standard_normal((1, 2, 5, 5)).astype(np.float32)
    w = RNG.standard_normal((3, 2, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(3).astype(np.float32)
    z = RNG.standard_normal((1, 3, 5, 5)).astype(np.float32)
    y = spec.builder(info)(x, w, b, z)
    np.testing.assert_allclose(y, _reference_conv(x, w, b, (1, 1), (1, 1), (1, 1), (1, 1), 1) + z, rtol=1e-5, atol=1e-5)
    relu = OpInfo({"activation": "Relu", "pads": [1, 1, 1, 1]}, [None] * 4, 1, 4, 1, NumpyBackend())
    np.testing.assert_allclose(spec.builder(relu)(x, w, b, z), np.maximum(y, 0), rtol=1e-6)
    assert _conv.IM2COL  # the fallback engine stays named


def test_the_provider_notes_say_which_engine_each_convolution_got_and_why(backend):
    from plugrt_cuda._provider import CUDAProvider

    provider = CUDAProvider(importer=lambda: backend.xp, backend=backend)
    backend.conv(np.ones((1, 8, 5, 5), np.float32), np.ones((4, 8, 1, 1), np.float32), None, False, {})
    notes = provider.notes()
    assert notes[0].startswith("GEMMs: cuBLASLt")
    assert "Conv x[1, 8, 5, 5] w[4, 8, 1, 1] float32: gemm1x1: 1x1 convolution" in notes[1]
