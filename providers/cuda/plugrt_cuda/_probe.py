"""Find CUDA lazily: cupy, a driver, devices, and why not when any is missing."""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import importlib.util
from typing import Any, Callable

from plugrt.provider import Device, DeviceKind

__all__ = ["Probe", "probe", "import_cupy", "install_hint", "driver_version_without_cupy", "CUPY_PACKAGES"]

#: the cupy wheels, by the CUDA major version they are built for (each installs ``cupy``)
CUPY_PACKAGES = {12: "cupy-cuda12x", 13: "cupy-cuda13x"}

# cudaError_t values that mean "no usable driver" and "no device"
_INSUFFICIENT_DRIVER = 35
_NO_DEVICE = 100


@dataclasses.dataclass(frozen=True)
class Probe:
    """What a probe found: the devices, or why there are none."""

    devices: tuple[Device, ...]
    reason: str | None  # None when there is at least one device
    cupy_version: str = ""
    driver_version: int = 0  # cudaDriverGetVersion, e.g. 12040; 0 when no driver
    runtime_version: int = 0
    architectures: tuple[str, ...] = ()  # per device, "sm_90"


def import_cupy() -> Any:
    """cupy, imported on first use (tests replace this to fake a machine)."""
    return importlib.import_module("cupy")


def driver_version_without_cupy() -> int:
    """cuDriverGetVersion straight from libcuda (e.g. 13000), 0 when no driver loads.
    Touches no device: it only asks the driver library which CUDA it supports."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return 0
        return int(version.value)
    except (OSError, AttributeError):
        return 0


def install_hint(driver_version: int = 0) -> str:
    """The pip command that brings cupy and NVRTC for this driver's CUDA (both when unknown)."""
    major = driver_version // 1000
    if major in CUPY_PACKAGES:
        return (
            f"pip install './providers/cuda[cuda{major}]' (installs {CUPY_PACKAGES[major]} and NVRTC for the "
            f"CUDA {major} driver found here)"
        )
    return (
        "pip install './providers/cuda[cuda12]' for a CUDA 12 driver, or './providers/cuda[cuda13]' for "
        "CUDA 13 (nvidia-smi shows the driver's CUDA version)"
    )


def _cupy_version() -> str:
    """The installed cupy's version, from its metadata ("?" when it has none)."""
    from importlib import metadata

    for name in (*CUPY_PACKAGES.values(), "cupy"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "?"


def _installed_cupy_packages() -> list[str]:
    from importlib import metadata

    found = []
    for name in (*CUPY_PACKAGES.values(), "cupy"):
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


def probe(
    importer: Callable[[], Any] = import_cupy, read_driver: Callable[[], int] = driver_version_without_cupy
) -> Probe:
    """Look for cupy, a CUDA driver and devices, in that order; say which is missing.

    ``read_driver`` reads the driver's CUDA version without cupy, to name the right cupy
    package when cupy is missing or broken (tests replace it). With the real cupy installed
    and no driver library to load (a machine without an NVIDIA GPU), cupy is not imported
    to find that out: its import takes 0.2 s and maps its CUDA libraries (100-160 MiB
    resident, by the page cache) into every CPU-only process that loads a model."""
    if importer is import_cupy and importlib.util.find_spec("cupy") is not None and read_driver() == 0:
        return Probe(
            (), "no CUDA driver: the NVIDIA driver (libcuda) is not installed or cannot be loaded; install the NVIDIA "
            "driver, or use device='cpu'",
            cupy_version=_cupy_version(),
        )
    try:
        cupy = importer()
    except ImportError as exc:
        return Probe((), f"cupy is not installed ({exc}); install it with {install_hint(read_driver())}")
    except Exception as exc:  # a broken cupy install must not break the runtime
        installed = _installed_cupy_packages()
        if len(installed) > 1:
            fix = (
                f"{' and '.join(installed)} are installed together and overwrite each other's files: "
                f"uninstall them all, then {install_hint(read_driver())}"
            )
        else:
            fix = f"reinstall it: pip uninstall {installed[0] if installed else 'cupy'}, then {install_hint(read_driver())}"
        return Probe((), f"cupy failed to import ({type(exc).__name__}: {exc}); {fix}")
    version = str(getattr(cupy, "__version__", "?"))
    runtime = cupy.cuda.runtime
    try:
        driver = int(runtime.driverGetVersion())
    except Exception as exc:
        driver, driver_error = 0, f" ({type(exc).__name__}: {exc})"
    else:
        driver_error = ""
    if driver == 0:
        return Probe(
            (), "no CUDA driver: the NVIDIA driver (libcuda) is not installed or cannot be loaded"
            + driver_error + "; install the NVIDIA driver, or use device='cpu'",
            cupy_version=version,
        )
    try:
        runtime_version = int(runtime.runtimeGetVersion())
    except Exception:
        runtime_version = 0
    try:
        count = int(runtime.getDeviceCount())
    except Exception as exc:
        status = getattr(exc, "status", None)
        if status == _INSUFFICIENT_DRIVER:
            why = (
                f"the CUDA driver ({_version_text(driver)}) is older than cupy's CUDA runtime "
                f"({_version_text(runtime_version)}); update the NVIDIA driver, or use the cupy built for "
                f"this driver: pip uninstall {CUPY_PACKAGES.get(runtime_version // 1000, 'cupy')}, then "
                f"{install_hint(driver)}"
            )
        elif status == _NO_DEVICE:
            why = "no CUDA device: the driver is installed but reports no GPU"
        else:
            why = f"no CUDA device: getDeviceCount failed ({type(exc).__name__}: {exc})"
        return Probe((), why, version, driver, runtime_version)
    if count == 0:
        return Probe((), "no CUDA device: the driver is installed but reports no GPU", version, driver, runtime_version)
    devices, architectures = [], []
    for index in range(count):
        try:
            props = runtime.getDeviceProperties(index)
            name = props["name"]
            name = name.decode() if isinstance(name, bytes) else str(name)
            architectures.append(f"sm_{props['major']}{props['minor']}")
        except Exception:
            name = f"CUDA device {index}"
            architectures.append("")
        devices.append(Device(DeviceKind.GPU, index, name))
    return Probe(tuple(devices), None, version, driver, runtime_version, tuple(architectures))


def _version_text(version: int) -> str:
    return f"CUDA {version // 1000}.{version % 1000 // 10}" if version else "unknown"
