"""Make plugrt_cuda importable from the source tree when it is not installed, and fakes of
cupy's runtime for the availability tests."""

from __future__ import annotations

import os
import sys
import types

import pytest

try:
    import plugrt_cuda  # noqa: F401
except ImportError:  # not installed: test the source tree's copy
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "providers", "cuda"))


class FakeRuntimeError(Exception):
    """Stands in for cupy_backends' CUDARuntimeError: carries a cudaError_t ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _fake_cupy(*, driver: int = 12040, runtime: int = 12090, count: int | Exception = 1, arch=(9, 0)):
    """A module shaped like cupy as far as the probe looks."""

    def device_count() -> int:
        if isinstance(count, Exception):
            raise count
        return count

    runtime_module = types.SimpleNamespace(
        driverGetVersion=lambda: driver,
        runtimeGetVersion=lambda: runtime,
        getDeviceCount=device_count,
        getDeviceProperties=lambda i: {"name": b"NVIDIA H200", "major": arch[0], "minor": arch[1]},
    )
    return types.SimpleNamespace(__version__="14.2.0", cuda=types.SimpleNamespace(runtime=runtime_module))


@pytest.fixture
def fake_cupy():
    """``fake_cupy(driver=..., runtime=..., count=int or error, arch=(9, 0))``: a cupy stand-in."""
    return _fake_cupy


@pytest.fixture
def runtime_error():
    """``runtime_error(status, message)``: an error like cupy's CUDARuntimeError."""
    return FakeRuntimeError


@pytest.fixture
def gpu_provider():
    """The real CUDA provider when this machine has a CUDA device; skips otherwise."""
    from plugrt_cuda._provider import CUDAProvider

    provider = CUDAProvider()
    if not provider.devices():
        pytest.skip(f"no CUDA device: {provider.unavailable_reason}")
    return provider
