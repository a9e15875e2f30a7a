from __future__ import annotations

import importlib_metadata
import numpy as np
import pytest

import plugrt
from plugrt.errors import ProviderUnavailableError
from plugrt.registry import DISABLE_ENV, ProviderRegistry

from helpers import NEG_ADD, fake_entry_points

def test_cpu_provider_is_found_through_its_entry_point():
    names = [ep.name for ep in importlib_metadata.entry_points(group="plugrt.providers")]
    assert "cpu" in names
    registry = ProviderRegistry()
    assert "cpu" in registry.providers()
    assert type(registry.providers()["cpu"]).__module__ == "plugrt_cpu._provider"


def test_registry_is_not_created_at_import():
    import subprocess
    import sys

    code = "import plugrt, plugrt.registry as r, sys; print(r._default is None, 'plugrt_cpu' in sys.modules, 'cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False", "False"]


def test_provider_from_a_faked_distribution_is_discovered(monkeypatch):
    fake_entry_points(monkeypatch, ("fakeaccel", "fake_plugins:good"))
    registry = ProviderRegistry()
    names = list(registry.providers())
    assert names.index("fakeaccel") < names.index("cpu")  # priority order
    session = plugrt.load(NEG_ADD, registry=registry, wait_for_device=True)
    assert session.providers == ["fakeaccel", "cpu"]
    assert session.placement.nodes_per_provider == {"fakeaccel": 1, "cpu": 1}
    out = session.run({"x": np.array([1, 2, 3], np.float32)})["y"]
    np.testing.assert_array_equal(out, [0, 0, 0])


def test_plugin_that_fails_to_import_is_recorded_not_raised(monkeypatch):
    fake_entry_points(monkeypatch, ("ghost", "no_such_module_for_plugrt_tests:plugin"))
    registry = ProviderRegistry()
    assert "cpu" in registry.providers()
    failure = registry.failures()["ghost"]
    assert failure.stage == "import"
    assert "ModuleNotFoundError" in failure.cause
    session = plugrt.load(NEG_ADD, registry=registry)  # not asked for: still works
    assert session.providers == ["cpu"]
    with pytest.raises(ProviderUnavailableError) as info:
        plugrt.load(NEG_ADD, device="ghost", registry=registry)
    assert info.value.provider == "ghost"
    assert "ModuleNotFoundError" in info.value.cause


def test_provider_declaring_memory_without_memory_capability_is_refused_and_remembered(monkeypatch):
    fake_entry_points(monkeypatch, ("halfnpu", "fake_plugins:half_memory"))
    registry = ProviderRegistry()
    assert "halfnpu" not in registry.providers()
    failure = registry.failures()["halfnpu"]
    assert failure.stage == "memory"
    assert "default_device, to_device, to_host, copy_into" in failure.cause and "'npu'" in failure.cause
    assert plugrt.load(NEG_ADD, registry=registry).providers == ["cpu"]  # not asked for: never used
    with pytest.raises(ProviderUnavailableError) as info:
        plugrt.load(NEG_ADD, device="halfnpu", registry=registry)
    assert info.value.provider == "halfnpu" and "to_host" in info.value.cause


def test_disabled_provider_is_skipped(monkeypatch):
    fake_entry_points(monkeypatch, ("fakeaccel", "fake_plugins:good"))
    monkeypatch.setenv(DISABLE_ENV, "fakeaccel")
    registry = ProviderRegistry()
    assert "fakeaccel" not in registry.providers() and "cpu" in registry.providers()
    with pytest.raises(ProviderUnavailableError, match="disabled"):
        registry.get("fakeaccel")


def test_a_device_intent_of_another_kind_never_probes_a_provider_declaring_its_kinds(monkeypatch):
    import fake_plugins

    fake_entry_points(monkeypatch, ("probednpu", "fake_plugins:probed_npu"))
    provider = fake_plugins.probed_npu.provider
    provider.probes = 0
    registry = ProviderRegistry()
    session = plugrt.load(NEG_ADD, device="cpu", registry=registry)
    assert session.providers == ["cpu"]
    assert provider.probes == 0
    session = plugrt.load(NEG_ADD, device="npu", registry=registry)
    assert session.providers == ["probednpu", "cpu"]
    assert provider.probes > 0


def test_a_cpu_session_does_not_import_cupy_with_the_cuda_provider_installed():
    import subprocess
    import sys

    pytest.importorskip("plugrt_cuda")
    code = (
        "import sys, numpy as np, plugrt\n"
        "from plugrt.conformance.light_models import light_models\n"
        "m = next(m for m in light_models() if m.name == 'squeezenet')\n"
        "plugrt.load(m.path, device='cpu').run(dict(m.inputs))\n"
        "print('cupy' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
