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
