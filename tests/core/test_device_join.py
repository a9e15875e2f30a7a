"""An accelerator that joins when ready: the CPU serves while the device plan compiles."""

from __future__ import annotations

import numpy as np
import pytest

import plugrt

from core.test_placement_estimate import _chain, registry_with

X = np.linspace(-3, 3, 1 << 12, dtype=np.float32)


@pytest.fixture
def slow(monkeypatch):
    import fake_plugins

    monkeypatch.setattr(fake_plugins.SlowCompileProvider, "compile_seconds", 0.5)
    return registry_with("fake_plugins:with_slow_compile")


def _providers_used(session) -> set[str]:
    return {p for p, n in session.placement.nodes_per_provider.items() if n}


def test_a_session_starts_on_the_cpu_while_its_accelerator_compiles(slow):
    session = plugrt.load(_chain(1 << 12), registry=slow)
    assert session.device_join.state == "compiling"
    assert _providers_used(session) == {"cpu"}
    assert session.run({"x": X})["y"].shape == X.shape


def test_runs_after_the_compile_run_on_the_accelerator_with_equal_outputs(slow):
    session = plugrt.load(_chain(1 << 12), registry=slow)
    first = session.run({"x": X})["y"]
    status = session.wait_for_device_plan(timeout=30)
    assert status.state == "switched" and status.switched_at_run == 2
    assert _providers_used(session) == {"cpu", "slowaccel"}
    np.testing.assert_allclose(session.run({"x": X})["y"], first, rtol=1e-6)


def test_the_profile_names_the_plan_of_each_run_and_the_switch(slow):
    session = plugrt.load(_chain(1 << 12), registry=slow, profiling=True)
    session.run({"x": X})
    session.wait_for_device_plan(timeout=30)
    session.run({"x": X})
    events = session.profile()
    assert [e["args"].get("plan") for e in events if e["name"] == "model_run"] == ["cpu", "slowaccel+cpu"]
    (switch,) = [e for e in events if e["name"] == "plan_switch"]
    assert switch["args"]["to"] == "slowaccel+cpu" and switch["args"]["after_runs"] == 1


def test_a_device_plan_whose_outputs_differ_is_never_switched_in(slow, monkeypatch):
    import fake_plugins

    monkeypatch.setattr(fake_plugins.SlowCompileProvider, "wrong", True)
    session = plugrt.load(_chain(1 << 12), registry=slow)
    first = session.run({"x": X})["y"]
    status = session.wait_for_device_plan(timeout=30)
    assert status.state == "kept" and "checked against the CPU plan: output 0 differs" in status.reason
    assert _providers_used(session) == {"cpu"}
    np.testing.assert_array_equal(session.run({"x": X})["y"], first)


def test_waiting_for_the_device_builds_its_plan_before_load_returns(slow):
    session = plugrt.load(_chain(1 << 12), registry=slow, wait_for_device=True)
    assert session.device_join is None
    assert _providers_used(session) == {"cpu", "slowaccel"}


def test_a_provider_named_by_the_user_is_waited_for(slow):
    session = plugrt.load(_chain(1 << 12), registry=slow, providers=["slowaccel", "cpu"])
    assert session.device_join is None
    assert _providers_used(session) == {"cpu", "slowaccel"}


def test_a_session_restored_from_an_epcontext_uses_its_device_partitions_at_once(tmp_path):
    from helpers import NEG_ADD

    registry = registry_with("fake_plugins:with_context")
    source = tmp_path / "m.onnx"
    source.write_bytes(NEG_ADD)
    exported = plugrt.load(source, device="ctxaccel", registry=registry, **{"ep.context_enable": 1, "ep.context_embed_mode": 1})
    restored = plugrt.load(exported.context_model_path, registry=registry)
    assert restored.device_join is None
    assert [(p.provider, p.restored) for p in restored.placement.partitions] == [("ctxaccel", True), ("cpu", False)]
