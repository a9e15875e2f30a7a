"""A broken plugin never breaks the runtime; device intent; strict placement."""

from __future__ import annotations

import numpy as np
import pytest

import plugrt
from plugrt.errors import InvalidOptionValueError, PlacementError, ProviderUnavailableError
from plugrt.registry import ProviderRegistry

from helpers import LOCAL_DOUBLE, NEG_ADD, fake_entry_points
X = np.array([1, -2, 3], np.float32)


def _registry(monkeypatch, plugin: str, name: str = "fakeaccel") -> ProviderRegistry:
    fake_entry_points(monkeypatch, (name, f"fake_plugins:{plugin}"))
    return ProviderRegistry()


def _runs_on_cpu_alone(session) -> None:
    np.testing.assert_array_equal(session.run({"x": X})["y"], np.zeros(3, np.float32))
    assert session.placement.nodes_per_provider == {"cpu": 2}


def test_plugin_whose_init_raises_is_recorded(monkeypatch):
    registry = _registry(monkeypatch, "failing_init")
    failure = registry.failures()["fakeaccel"]
    assert failure.stage == "init" and "plugin init exploded" in failure.cause
    _runs_on_cpu_alone(plugrt.load(NEG_ADD, registry=registry))


def test_provider_whose_devices_raises_is_unavailable_but_harmless(monkeypatch):
    registry = _registry(monkeypatch, "failing_devices")
    session = plugrt.load(NEG_ADD, registry=registry)
    _runs_on_cpu_alone(session)
    assert registry.failures()["fakeaccel"].stage == "devices"
    with pytest.raises(ProviderUnavailableError) as info:
        plugrt.load(NEG_ADD, device="fakeaccel", registry=registry)
    assert "driver exploded" in info.value.cause
    assert "choose device='cpu'" in info.value.hint


def test_provider_whose_supports_op_raises_falls_back_with_the_reason(monkeypatch):
    registry = _registry(monkeypatch, "failing_supports_op")
    session = plugrt.load(NEG_ADD, registry=registry)
    _runs_on_cpu_alone(session)
    reasons = {fb.reason for fb in session.placement.fallbacks if fb.declined_by == "fakeaccel"}
    assert reasons == {"supports_op raised RuntimeError: supports_op exploded"}
    assert registry.failures()["fakeaccel"].stage == "supports_op"
    with pytest.raises(ProviderUnavailableError, match="supports_op exploded"):
        plugrt.load(NEG_ADD, device="fakeaccel", registry=registry)


def test_provider_whose_compile_raises_falls_back_with_the_reason(monkeypatch):
    registry = _registry(monkeypatch, "failing_compile")
    session = plugrt.load(NEG_ADD, registry=registry, wait_for_device=True)
    _runs_on_cpu_alone(session)
    (fallback,) = [fb for fb in session.placement.fallbacks if fb.declined_by == "fakeaccel"]
    assert fallback.op_type == "Neg" and "compiler exploded" in fallback.reason and fallback.placed_on == "cpu"
    assert registry.failures()["fakeaccel"].stage == "compile"
    with pytest.raises(ProviderUnavailableError, match="compiler exploded"):
        plugrt.load(NEG_ADD, device="fakeaccel", registry=registry)


def test_providers_command_shows_each_failure(monkeypatch, capsys):
    fake_entry_points(
        monkeypatch, ("broken", "fake_plugins:failing_init"), ("ghost", "no_such_module_for_plugrt_tests:x")
    )
    from plugrt import registry as registry_module
    from plugrt.cli import main

    registry_module.reset_default_registry()
    try:
        assert main(["providers"]) == 0
    finally:
        registry_module.reset_default_registry()
    out = capsys.readouterr().out
    assert "broken: init failed: RuntimeError: plugin init exploded" in out
    assert "ghost: import failed: ModuleNotFoundError" in out


def test_provider_disabled_by_option(monkeypatch):
    fake_entry_points(monkeypatch, ("fakeaccel", "fake_plugins:good"))
    session = plugrt.load(NEG_ADD, disabled_providers=["fakeaccel"])
    assert session.providers == ["cpu"]


class TestDeviceIntent:
    @pytest.fixture
    def registry(self, monkeypatch):
        return _registry(monkeypatch, "good")

    @pytest.mark.parametrize("intent", ["auto", "max_performance", "prefer_npu", "npu", "npu:0", "fakeaccel"])
    def test_intents_that_pick_the_accelerator(self, registry, intent):
        session = plugrt.load(NEG_ADD, device=intent, registry=registry)
        assert session.providers == ["fakeaccel", "cpu"]
        assert str(session.devices["fakeaccel"]) == "npu:0 (Fake NPU)"

    @pytest.mark.parametrize("intent", ["cpu", "cpu:0", "prefer_cpu"])
    def test_intents_that_pick_the_cpu_first(self, registry, intent):
        session = plugrt.load(NEG_ADD, device=intent, registry=registry)
        assert session.providers[0] == "cpu"
        assert session.placement.nodes_per_provider == {"cpu": 2}

    @pytest.mark.parametrize("intent", ["gpu", "gpu:1", "cuda:0"])
    def test_a_device_nobody_offers_is_unavailable(self, registry, intent):
        with pytest.raises(ProviderUnavailableError) as info:
            plugrt.load(NEG_ADD, device=intent, registry=registry)
        assert info.value.hint

    def test_explicit_provider_list(self, registry):
        session = plugrt.load(NEG_ADD, providers=["fakeaccel"], registry=registry)
        assert session.providers == ["fakeaccel", "cpu"]

    def test_nonsense_intent_lists_the_choices(self, registry):
        with pytest.raises(InvalidOptionValueError) as info:
            plugrt.load(NEG_ADD, device="warp-drive", registry=registry)
        assert "prefer_gpu" in info.value.choices and "fakeaccel" in info.value.choices


def test_strict_placement_turns_fallback_into_an_error(monkeypatch):
    registry = _registry(monkeypatch, "good")
    with pytest.raises(PlacementError) as info:
        plugrt.load(NEG_ADD, device="fakeaccel", strict=True, registry=registry)
    err = info.value
    assert err.provider == "fakeaccel"
    assert err.fallbacks == (("Add_0", "Add", "fakeaccel only runs Neg, not Add"),)


def test_placement_report_lists_partitions_and_fallbacks(monkeypatch):
    registry = _registry(monkeypatch, "good")
    session = plugrt.load(NEG_ADD, registry=registry, wait_for_device=True)
    report = session.placement
    assert [(p.provider, p.nodes) for p in report.partitions] == [("fakeaccel", 1), ("cpu", 1)]
    assert "fakeaccel only runs Neg, not Add" in report.summary()


def test_model_local_function_claimed_by_a_provider_is_not_inlined(monkeypatch):
    data = LOCAL_DOUBLE
    registry = _registry(monkeypatch, "with_function", name="funcaccel")
    session = plugrt.load(data, registry=registry)
    assert session.placement.nodes_per_provider == {"funcaccel": 1}
    np.testing.assert_array_equal(session.run({"x": np.array([1, 2], np.float32)})["y"], [2, 4])
    inlined = plugrt.load(data, device="cpu", registry=registry)
    assert inlined.placement.nodes_per_provider == {"cpu": 1}


def test_a_saved_context_the_provider_finds_incompatible_is_refused_with_its_reason(monkeypatch, tmp_path):
    from fake_plugins import VersionedContextProvider

    from plugrt.errors import EpContextError

    fake_entry_points(monkeypatch, ("ctxversioned", "fake_plugins:with_versioned_context"))
    source = tmp_path / "m.onnx"
    source.write_bytes(NEG_ADD)
    options = {"ep.context_enable": 1, "ep.context_embed_mode": 1}
    exported = plugrt.load(source, device="ctxversioned", registry=ProviderRegistry(), **options).context_model_path
    restored = plugrt.load(exported, registry=ProviderRegistry())  # same SDK: restored
    assert [p.restored for p in restored.placement.partitions] == [True, False]
    monkeypatch.setattr(VersionedContextProvider, "sdk_version", "3.0")
    with pytest.raises(EpContextError, match="saved by SDK 2.0, this is 3.0: export the model again"):
        plugrt.load(exported, registry=ProviderRegistry())
