"""What a device error tells the user to do depends on why the device is missing."""

from __future__ import annotations

import importlib_metadata
import pytest

import plugrt
from plugrt.errors import ProviderUnavailableError
from plugrt.registry import ProviderRegistry

from helpers import NEG_ADD

GROUP = "plugrt.providers"


def _registry(*extra: tuple[str, str], disabled: tuple[str, ...] = ()) -> ProviderRegistry:
    """The real CPU provider and only the ``extra`` (name, "module:attr") plugins: no real cuda."""
    cpu = [ep for ep in importlib_metadata.entry_points(group=GROUP) if ep.name == "cpu"]
    fakes = [importlib_metadata.EntryPoint(name, value, GROUP) for name, value in extra]
    return ProviderRegistry(entry_points=cpu + fakes, disabled=disabled)


def _error(device: str, registry: ProviderRegistry) -> ProviderUnavailableError:
    with pytest.raises(ProviderUnavailableError) as info:
        plugrt.load(NEG_ADD, device=device, registry=registry)
    return info.value


@pytest.mark.parametrize("device", ["gpu", "cuda", "cuda:0"])
def test_without_the_cuda_provider_the_hint_installs_it_from_the_checkout(device) -> None:
    error = _error(device, _registry())
    assert "./providers/cuda[cuda12]" in error.hint and "[cuda13]" in error.hint
    assert "plugrt[cuda]" not in str(error)
    assert "uninstall" not in str(error)


@pytest.mark.parametrize("device", ["gpu", "cuda", "cuda:0"])
def test_with_the_cuda_provider_but_no_driver_the_error_gives_its_reason_and_the_cpu(device) -> None:
    error = _error(device, _registry(("cuda", "fake_plugins:driverless_cuda")))
    assert "no CUDA driver" in error.cause
    assert "device='cpu'" in error.hint
    assert "pip install" not in error.hint and "uninstall" not in str(error)


def test_a_disabled_cuda_provider_is_named_as_disabled_not_missing() -> None:
    error = _error("gpu", _registry(("cuda", "fake_plugins:driverless_cuda"), disabled=("cuda",)))
    assert "PLUGRT_DISABLE_PROVIDERS" in error.hint
    assert "pip install" not in error.hint


def test_only_a_plugin_that_failed_to_load_is_called_broken() -> None:
    error = _error("cuda", _registry(("cuda", "no_such_module_for_plugrt_tests:plugin")))
    assert "ModuleNotFoundError" in error.cause
    assert "uninstall" in error.hint and "device='cpu'" in error.hint
