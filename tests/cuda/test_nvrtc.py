"""Every CUDA C kernel source compiles with NVRTC for sm_80 and sm_90, float32 and float16
(NVRTC needs no GPU; skipped when it cannot be loaded)."""

from __future__ import annotations

import pytest

from plugrt_cuda import _sources


def _nvrtc_or_skip() -> None:
    try:
        _sources._nvrtc()
    except _sources.NvrtcUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", sorted(_sources.DTYPES))
@pytest.mark.parametrize("module", sorted(_sources.SOURCES))
def test_kernel_source_compiles_to_a_cubin(module, dtype, arch):
    _nvrtc_or_skip()
    cubin = _sources.compile_cubin(module, dtype, arch)
    assert cubin[:4] == b"\x7fELF"
    for kernel in _sources.kernel_names(module):
        assert kernel.encode() in cubin  # extern "C": the symbol keeps its name


def test_a_source_that_does_not_compile_raises_with_nvrtcs_log(monkeypatch):
    _nvrtc_or_skip()
    broken = _sources.KernelSource("broken", 'extern "C" __global__ void k() { undeclared_name = 1; }', ("k",), 32)
    monkeypatch.setitem(_sources.SOURCES, "broken", broken)
    with pytest.raises(RuntimeError, match="undeclared_name"):
        _sources.compile_cubin("broken", "float32", "sm_90")


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="float64"):
        _sources.module_source("gemm", "float64")


class _CountingNvrtc:
    """Stands in for NVRTC: counts compiles, returns a cubin naming what it compiled."""

    def __init__(self):
        self.compiles = []

    def getVersion(self):
        return (13, 2)

    def createProgram(self, source, name, headers, includes):
        return [name]

    def compileProgram(self, program, options):
        self.compiles.append((program[0], tuple(options)))

    def getCUBIN(self, program):
        return b"\x7fELF" + program[0].encode()

    def getProgramLog(self, program):
        return ""

    def destroyProgram(self, program):
        pass


@pytest.fixture
def nvrtc(monkeypatch):
    """A counting NVRTC in place of the real one, and an empty cubin cache."""
    counting = _CountingNvrtc()
    monkeypatch.setattr(_sources, "_nvrtc", lambda: counting)
    monkeypatch.setattr(_sources, "_CUBINS", {})
    return counting


def test_a_module_is_compiled_once_per_dtype_and_architecture(nvrtc):
    first = _sources.compile_cubin("gemm", "float32", "sm_90")
    assert _sources.compile_cubin("gemm", "float32", "sm_90") is first
    _sources.compile_cubin("gemm", "float32", "sm_80")
    _sources.compile_cubin("gemm", "float16", "sm_90")
    assert len(nvrtc.compiles) == 3


def test_a_changed_source_is_compiled_again(monkeypatch, nvrtc):
    _sources.compile_cubin("pool", "float32", "sm_90")
    changed = _sources.KernelSource("pool", _sources.SOURCES["pool"].code + "\n// changed\n", ("pool2d",), 256)
    monkeypatch.setitem(_sources.SOURCES, "pool", changed)
    _sources.compile_cubin("pool", "float32", "sm_90")
    assert len(nvrtc.compiles) == 2


def test_saving_contexts_again_compiles_nothing_again(nvrtc):
    import types

    import numpy as np

    from plugrt_cuda._backend import CupyBackend

    loaded = []

    class Module:
        def load(self, cubin):
            loaded.append(cubin)

        def get_function(self, name):
            return name

    cupy = types.SimpleNamespace(dtype=np.dtype, cuda=types.SimpleNamespace(function=types.SimpleNamespace(Module=Module)))
    backend = CupyBackend(cupy, arch="sm_90")
    backend.kernel("gemm", np.float32, "gemm")
    backend.kernel("softmax", np.float16, "softmax_rows")
    for _ in range(3):  # three EPContext exports of the same session
        cubins = backend.compiled_cubins("sm_90")
    assert sorted(cubins) == [("gemm", "float32"), ("softmax", "float16")]
    assert len(nvrtc.compiles) == 2 and loaded == [cubins[("gemm", "float32")], cubins[("softmax", "float16")]]
    assert backend.cubins_nvrtc_version() == 13020


def test_a_cubin_the_driver_refuses_falls_back_to_cupys_own_compile(nvrtc):
    import types

    import numpy as np

    from plugrt_cuda._backend import CupyBackend

    class Module:
        def load(self, cubin):
            raise RuntimeError("CUDA_ERROR_INVALID_IMAGE")

    compiled = []
    cupy = types.SimpleNamespace(
        dtype=np.dtype,
        cuda=types.SimpleNamespace(function=types.SimpleNamespace(Module=Module)),
        RawModule=lambda code, options: compiled.append(code) or types.SimpleNamespace(get_function=lambda name: name),
    )
    backend = CupyBackend(cupy, arch="sm_90")
    assert backend.kernel("pool", np.float32, "pool2d") == "pool2d"
    assert len(compiled) == 1 and "pool2d" in compiled[0]
    assert "CUDA_ERROR_INVALID_IMAGE" in backend.cubins_refused[("pool", "float32")]
