"""Stand-ins the CUDA provider's tests share: a missing or fake cupy, the provider bound to
numpy, and a registry holding a given provider and the CPU provider."""

from __future__ import annotations

import types
from typing import Any

import plugrt
from plugrt.hookspecs import hookimpl
from plugrt.provider import Device, DeviceKind

from plugrt_cuda._backend import NumpyBackend
from plugrt_cuda._provider import CUDAProvider

__all__ = ["missing_cupy", "FakeRuntimeError", "fake_cupy", "NumpyCUDA", "registry_of"]


def missing_cupy() -> Any:
    """An importer for a machine without cupy."""
    raise ImportError("No module named 'cupy'")


class FakeRuntimeError(Exception):
    """Stands in for cupy_backends' CUDARuntimeError: carries a cudaError_t ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def fake_cupy(*, driver: int = 12040, runtime: int = 12090, count: int | Exception = 1, arch=(9, 0)) -> Any:
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


class NumpyCUDA(CUDAProvider):
    """The CUDA provider with numpy standing in for the device: host memory, one fake GPU.
    Everything but the memory space and the cupy-only kernels is the real provider."""

    memory = "host"

    def __init__(self) -> None:
        super().__init__(importer=missing_cupy, backend=NumpyBackend())

    def devices(self) -> list[Device]:
        return [Device(DeviceKind.GPU, 0, "numpy stand-in")]


def registry_of(provider: Any) -> plugrt.ProviderRegistry:
    """A registry with ``provider`` and the CPU provider, and no installed entry points."""
    from plugrt_cpu._provider import CPUProvider

    plugin = types.SimpleNamespace(plugrt_providers=hookimpl(lambda: [provider, CPUProvider()]))
    return plugrt.ProviderRegistry(entry_points=[], plugins=[plugin], disabled=())
