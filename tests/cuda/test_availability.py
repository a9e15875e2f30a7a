"""Discovery of the CUDA provider and every way it can be unavailable (cupy's probe faked)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import plugrt
from plugrt.errors import ProviderUnavailableError
from plugrt.intent import resolve_device
from plugrt.provider import (
    AvailabilityCapability,
    CaptureCapability,
    ContextCapability,
    ContextCompatibilityCapability,
    DeviceKind,
    MemoryCapability,
)

from cuda_helpers import FakeRuntimeError, fake_cupy, missing_cupy, registry_of
from plugrt_cuda._probe import probe
from plugrt_cuda._provider import CUDAProvider


def test_without_cupy_there_is_no_device_and_the_reason_says_cupy_is_missing():
    provider = CUDAProvider(importer=missing_cupy)
    assert provider.devices() == []
    assert "cupy is not installed" in provider.unavailable_reason
    assert "./providers/cuda[cuda1" in provider.unavailable_reason


@pytest.mark.parametrize("driver,extra,package", [(12040, "[cuda12]", "cupy-cuda12x"), (13000, "[cuda13]", "cupy-cuda13x")])
def test_without_cupy_the_hint_names_the_extra_for_the_drivers_cuda(driver, extra, package):
    reason = probe(missing_cupy, read_driver=lambda: driver).reason
    assert f"./providers/cuda{extra}" in reason and package in reason
    assert "cuda12]" not in reason or "cuda13]" not in reason  # one extra, not both


def test_without_cupy_or_a_driver_the_hint_names_both_extras():
    reason = probe(missing_cupy, read_driver=lambda: 0).reason
    assert "./providers/cuda[cuda12]" in reason and "./providers/cuda[cuda13]" in reason


def test_two_cupy_packages_installed_together_are_named(monkeypatch):
    from plugrt_cuda import _probe

    monkeypatch.setattr(_probe, "_installed_cupy_packages", lambda: ["cupy-cuda12x", "cupy-cuda13x"])

    def clash():
        raise AttributeError("module 'cupy' has no attribute 'cuda'")

    reason = probe(clash, read_driver=lambda: 13000).reason
    assert "cupy-cuda12x and cupy-cuda13x are installed together" in reason and "[cuda13]" in reason


def test_the_driver_version_is_read_without_cupy_and_is_zero_without_a_driver():
    from plugrt_cuda._probe import driver_version_without_cupy

    version = driver_version_without_cupy()  # this machine may or may not have libcuda
    assert isinstance(version, int) and (version == 0 or version >= 10000)


def test_without_a_driver_the_reason_says_no_driver():
    found = probe(lambda: fake_cupy(driver=0))
    assert found.devices == ()
    assert found.reason.startswith("no CUDA driver")


def test_a_driver_older_than_the_runtime_is_named():
    error = FakeRuntimeError(35, "cudaErrorInsufficientDriver")
    found = probe(lambda: fake_cupy(driver=12040, runtime=13020, count=error))
    assert found.devices == ()
    assert "older than cupy's CUDA runtime" in found.reason and "CUDA 12.4" in found.reason
    assert "pip uninstall cupy-cuda13x" in found.reason and "[cuda12]" in found.reason


def test_a_driver_without_a_gpu_says_no_device():
    found = probe(lambda: fake_cupy(count=FakeRuntimeError(100, "cudaErrorNoDevice")))
    assert found.devices == ()
    assert found.reason.startswith("no CUDA device")


def test_a_device_count_of_zero_says_no_device():
    found = probe(lambda: fake_cupy(count=0))
    assert found.devices == () and found.reason.startswith("no CUDA device")


def test_a_broken_cupy_import_is_a_reason_not_a_crash():
    def broken():
        raise OSError("libcudart.so.12: cannot open shared object file")

    found = probe(broken)
    assert found.devices == () and "cupy failed to import" in found.reason and "libcudart" in found.reason


def test_a_machine_with_a_gpu_lists_it_with_its_architecture():
    found = probe(lambda: fake_cupy(count=2, arch=(8, 0)))
    assert [d.kind for d in found.devices] == [DeviceKind.GPU, DeviceKind.GPU]
    assert found.devices[1].index == 1 and found.devices[0].name == "NVIDIA H200"
    assert found.architectures == ("sm_80", "sm_80") and found.reason is None


def test_the_probe_runs_once_and_only_when_asked():
    calls = []

    def importer():
        calls.append(1)
        return fake_cupy(driver=0)

    provider = CUDAProvider(importer=importer)
    assert calls == []
    provider.devices()
    provider.devices()
    assert calls == [1]


def test_importing_plugrt_and_the_cuda_plugin_does_not_import_cupy():
    code = (
        "import sys, plugrt, plugrt_cuda, plugrt_cuda.plugin, plugrt_cuda._provider\n"
        "plugrt.ProviderRegistry().providers()\n"
        "assert 'cupy' not in sys.modules, 'cupy imported'\n"
        "print('clean')"
    )
    path = [p for p in sys.path if p]
    env = {"PYTHONPATH": ":".join(path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "clean"


def test_registry_reports_the_provider_unavailable_with_its_reason():
    registry = registry_of(CUDAProvider(importer=lambda: fake_cupy(driver=0)))
    assert "cuda" in registry.providers()
    assert registry.unavailable_reason("cuda").startswith("no CUDA driver")
    assert [p.name for p in registry.available()] == ["cpu"]


@pytest.mark.parametrize("intent", ["cuda", "cuda:0"])
def test_asking_for_cuda_by_name_raises_with_the_reason(intent):
    registry = registry_of(CUDAProvider(importer=missing_cupy))
    with pytest.raises(ProviderUnavailableError) as caught:
        resolve_device(intent, None, registry)
    assert caught.value.provider == "cuda"
    assert "cupy is not installed" in caught.value.cause


def test_asking_for_a_gpu_names_the_cuda_provider_and_why_it_has_none():
    registry = registry_of(CUDAProvider(importer=lambda: fake_cupy(count=FakeRuntimeError(100, "no device"))))
    with pytest.raises(ProviderUnavailableError) as caught:
        resolve_device("gpu", None, registry)
    assert "cuda: no CUDA device" in caught.value.cause


def test_auto_falls_back_to_the_cpu_provider():
    registry = registry_of(CUDAProvider(importer=lambda: fake_cupy(driver=0)))
    selection = resolve_device("auto", None, registry)
    assert [p.name for p in selection.providers] == ["cpu"]


def test_auto_picks_cuda_first_when_a_device_is_found():
    registry = registry_of(CUDAProvider(importer=lambda: fake_cupy(count=1)))
    selection = resolve_device("auto", None, registry)
    assert [p.name for p in selection.providers] == ["cuda", "cpu"]
    assert selection.devices["cuda"].kind == DeviceKind.GPU


def test_a_session_with_device_auto_runs_on_the_cpu(add_relu_model):
    import numpy as np

    registry = registry_of(CUDAProvider(importer=lambda: fake_cupy(driver=0)))
    session = plugrt.load(add_relu_model, device="auto", registry=registry)
    x = np.array([[-1, 2, -3, 4]], np.float32)
    assert session.providers == ["cpu"]
    np.testing.assert_array_equal(session.run({"x": x, "y": x})["z"], np.maximum(2 * x, 0))


def test_plugrt_providers_lists_cuda_as_unavailable_with_its_reason(monkeypatch, capsys):
    from plugrt import registry as registry_module
    from plugrt.cli import main

    monkeypatch.setattr(registry_module, "_default", registry_of(CUDAProvider(importer=lambda: fake_cupy(driver=0))))
    assert main(["providers"]) == 0
    line = next(text for text in capsys.readouterr().out.splitlines() if text.strip().startswith("cuda"))
    assert "unavailable" in line and "no CUDA driver" in line


def test_the_provider_declares_its_capabilities():
    provider = CUDAProvider(importer=lambda: fake_cupy(driver=0))
    assert isinstance(provider, AvailabilityCapability)
    assert isinstance(provider, MemoryCapability) and provider.memory == "cuda"
    assert isinstance(provider, CaptureCapability)
    assert isinstance(provider, ContextCapability) and provider.context_source_keys == ("cuda",)
    assert isinstance(provider, ContextCompatibilityCapability)


def test_without_a_driver_the_real_probe_never_imports_cupy():
    """A CPU-only machine with cupy installed: loading a model finds no driver from libcuda
    alone; importing cupy (0.2 s, its CUDA libraries mapped into the process) is skipped."""
    import importlib.util

    from plugrt_cuda._probe import driver_version_without_cupy

    if importlib.util.find_spec("cupy") is None or driver_version_without_cupy() != 0:
        pytest.skip("needs cupy installed and no NVIDIA driver")
    code = (
        "import sys, plugrt, numpy as np\n"
        "from plugrt.cli import EXAMPLE_MODEL\n"
        "session = plugrt.load(EXAMPLE_MODEL)\n"
        "from plugrt_cuda._probe import probe\n"
        "print(probe().reason)\n"
        "print('cupy' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    reason, imported = done.stdout.strip().splitlines()[-2:]
    assert reason.startswith("no CUDA driver") and "device='cpu'" in reason
    assert imported == "False"
