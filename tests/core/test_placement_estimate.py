"""Placement by estimate: which provider gets which node under device="auto", and why."""

from __future__ import annotations

import importlib_metadata
import numpy as np
import pytest

import plugrt
from plugrt.conformance.light_models import light_models
from plugrt.registry import ProviderRegistry

from helpers import model_bytes

GROUP = "plugrt.providers"
LIGHT = {m.name: m for m in light_models()}


def registry_with(*plugins: str) -> ProviderRegistry:
    """The installed providers plus test plugins ("module:attr"), as if installed."""
    installed = list(importlib_metadata.entry_points(group=GROUP))
    fake = [importlib_metadata.EntryPoint(p.rsplit(":", 1)[1], p, GROUP) for p in plugins]
    return ProviderRegistry(entry_points=installed + fake)


def _chain(size: int) -> bytes:
    """Sigmoid, then Relu and Add (what the Relu+Add provider runs), then Sigmoid."""
    return model_bytes(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[{size}] x) => (float[{size}] y) {{
            s = Sigmoid(x)
            r = Relu(s)
            a = Add(r, s)
            y = Sigmoid(a)
        }}
        """
    )


def _stating(provider_class: type, **costs: object) -> type:
    return type(f"Stating{provider_class.__name__}", (provider_class,), dict(costs))


@pytest.fixture
def relu_add_registry():
    return registry_with("fake_plugins:with_relu_add")


@pytest.mark.parametrize("name", ["squeezenet", "resnet50"])
def test_a_provider_stating_no_costs_gets_no_isolated_node_under_auto(relu_add_registry, name):
    session = plugrt.load(LIGHT[name].path, registry=relu_add_registry)
    assert session.providers == ["reluadd", "cpu"]
    assert set(session.placement.nodes_per_provider) == {"cpu"}
    assert len(session.placement.partitions) == 1


def test_the_report_says_why_the_nodes_stayed_on_the_cpu(relu_add_registry):
    session = plugrt.load(LIGHT["resnet50"].path, registry=relu_add_registry)
    declined = [fb for fb in session.placement.fallbacks if fb.declined_by == "reluadd" and fb.op_type == "Relu"]
    assert declined and all(fb.cause == "estimate" and fb.placed_on == "cpu" for fb in declined)
    assert "partition boundaries" in declined[0].reason and declined[0].reason.startswith("estimate: on reluadd")
    assert "estimate: on reluadd" in session.placement.summary()


def test_nodes_the_provider_cannot_run_say_so_under_auto(relu_add_registry):
    session = plugrt.load(LIGHT["resnet50"].path, registry=relu_add_registry)
    conv = [fb for fb in session.placement.fallbacks if fb.op_type == "Conv"]
    assert conv and all(fb.cause == "unsupported" and "not Conv" in fb.reason for fb in conv)


def test_priority_placement_keeps_node_by_node_priority(relu_add_registry):
    session = plugrt.load(LIGHT["resnet50"].path, registry=relu_add_registry, placement="priority")
    assert session.placement.nodes_per_provider["reluadd"] > 0
    assert session.placement.estimate.strategy == "priority"


def test_an_explicit_provider_list_places_by_priority(relu_add_registry):
    session = plugrt.load(LIGHT["resnet50"].path, providers=["reluadd", "cpu"], registry=relu_add_registry)
    assert session.placement.nodes_per_provider["reluadd"] > 0
    assert session.placement.estimate.strategy == "priority"


def test_the_chosen_placement_is_never_estimated_slower_than_all_on_the_cpu(relu_add_registry):
    session = plugrt.load(LIGHT["squeezenet"].path, registry=relu_add_registry, placement="estimate")
    estimate = session.placement.estimate
    alternatives = dict(estimate.alternatives)
    assert estimate.strategy == "estimate"
    assert estimate.total_s <= alternatives["all on cpu"]
    assert alternatives["priority order"] > alternatives["all on cpu"]


def test_a_provider_stating_it_is_faster_wins_a_stretch_that_pays(monkeypatch, relu_add_registry):
    import fake_plugins

    monkeypatch.setattr(fake_plugins.ReluAddProvider, "relative_costs", {"*": 0.1}, raising=False)
    session = plugrt.load(_chain(1 << 20), registry=relu_add_registry, wait_for_device=True)
    assert session.placement.nodes_per_provider == {"cpu": 2, "reluadd": 2}
    x = np.linspace(-3, 3, 1 << 20, dtype=np.float32)
    s = 1 / (1 + np.exp(-x))
    np.testing.assert_allclose(session.run({"x": x})["y"], 1 / (1 + np.exp(-(np.maximum(s, 0) + s))), rtol=1e-6)


def test_a_claim_too_small_to_pay_for_its_partition_is_declined(monkeypatch, relu_add_registry):
    import fake_plugins

    monkeypatch.setattr(fake_plugins.ReluAddProvider, "relative_costs", {"*": 0.1}, raising=False)
    session = plugrt.load(_chain(4), registry=relu_add_registry)
    assert session.placement.nodes_per_provider == {"cpu": 4}
    (relu, add) = [fb for fb in session.placement.fallbacks if fb.declined_by == "reluadd" and fb.cause == "estimate"]
    assert (relu.op_type, add.op_type) == ("Relu", "Add") and "partition boundaries" in relu.reason


def test_a_device_claim_that_would_not_pay_for_its_transfers_is_declined(monkeypatch):
    from device import fake_device

    from plugrt import costs

    # 10 % faster than the CPU on Relu and Add: 4 MiB each way at 5 GB/s (as if measured)
    # costs more than that gains
    monkeypatch.setitem(costs._RATES, ("fakedevice", fake_device.MEMORY), (20e-6, 1 / 5e9))
    monkeypatch.setattr(fake_device.FakeDevice, "relative_costs", {"Relu": 0.9, "Add": 0.9}, raising=False)
    session = plugrt.load(_chain(1 << 20), registry=registry_with("device.fake_device:plugin"))
    assert session.providers[0] == "fakedevice"
    assert session.placement.nodes_per_provider == {"cpu": 4}
    reasons = [fb.reason for fb in session.placement.fallbacks if fb.declined_by == "fakedevice" and fb.op_type == "Relu"]
    assert reasons and "of transfers" in reasons[0]


def test_a_device_far_faster_than_the_cpu_wins_in_spite_of_its_transfers(monkeypatch):
    from device import fake_device

    monkeypatch.setattr(fake_device.FakeDevice, "relative_costs", {"*": 0.0}, raising=False)
    monkeypatch.setattr(fake_device.FakeDevice, "partition_overhead", 0.0, raising=False)
    model = LIGHT["resnet50"]
    session = plugrt.load(model.path, registry=registry_with("device.fake_device:full_plugin"), wait_for_device=True)
    assert set(session.placement.nodes_per_provider) == {"fakedevice_full"}
    expected = plugrt.load(model.path, device="cpu").run(model.inputs)
    got = session.run(model.inputs)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-4, atol=1e-5)


def test_a_tie_goes_to_the_higher_priority_provider(monkeypatch, relu_add_registry):
    import fake_plugins

    # free partitions and the CPU's costs: moving the stretch changes nothing, priority decides
    monkeypatch.setattr(fake_plugins.ReluAddProvider, "partition_overhead", 0.0, raising=False)
    session = plugrt.load(_chain(4), registry=relu_add_registry, wait_for_device=True)
    assert session.placement.nodes_per_provider == {"cpu": 2, "reluadd": 2}


def test_the_template_at_a_positive_priority_gets_nothing_under_auto():
    session = plugrt.load(LIGHT["resnet50"].path, registry=registry_with("fake_plugins:with_template_10"))
    assert session.providers == ["template10", "cpu"]
    assert set(session.placement.nodes_per_provider) == {"cpu"}


def test_strict_placement_stays_by_priority(relu_add_registry):
    from plugrt.errors import PlacementError

    with pytest.raises(PlacementError) as info:
        plugrt.load(_chain(4), registry=relu_add_registry, strict=True)
    assert info.value.provider == "reluadd"


# -- the providers' own fusions run after placement, on their nodes only ----------------------


def test_a_provider_is_never_asked_about_an_op_the_cpu_fusions_invented():
    session = plugrt.load(LIGHT["resnet50"].path, device="template")
    assert session.placement.nodes_per_provider["template"] > 0
    assert not [fb for fb in session.placement.fallbacks if "plugrt.cpu" in fb.reason]
    assert all(not fb.op_type.startswith("Fused") for fb in session.placement.fallbacks)


def test_the_cpu_fusions_still_fire_where_the_cpu_runs_everything():
    session = plugrt.load(LIGHT["resnet50"].path, device="cpu")
    assert "FusedConv" in {step.op_type for step in session._plan.steps}
    assert session.optimization_stats["FuseConvReluPass"] == 1


def test_the_cpu_fusions_leave_alone_a_node_placed_on_another_provider(relu_add_registry):
    conv_relu = model_bytes(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 2, 5, 5] x) => (float[1, 3, 5, 5] y) <float[3, 2, 1, 1] w = {1, 2, 3, 4, 5, 6}> {
            c = Conv(x, w)
            y = Relu(c)
        }
        """
    )
    session = plugrt.load(conv_relu, providers=["reluadd", "cpu"], registry=relu_add_registry)
    assert [(p.provider, p.node_names) for p in session.placement.partitions] == [
        ("cpu", ("Conv_0",)),
        ("reluadd", ("Relu_0",)),
    ]
    x = np.linspace(-1, 1, 50, dtype=np.float32).reshape(1, 2, 5, 5)
    w = np.arange(1, 7, dtype=np.float32).reshape(3, 2)
    np.testing.assert_allclose(session.run({"x": x})["y"], np.maximum(np.einsum("oc,nchw->nohw", w, x), 0), rtol=1e-6)


def test_the_cuda_provider_states_costs_that_win_a_convolution_network_and_lose_a_tiny_graph():
    pytest.importorskip("plugrt_cuda")
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "cuda"))
    from cuda_helpers import NumpyCUDA, registry_of

    registry = registry_of(NumpyCUDA())
    big = plugrt.load(LIGHT["resnet50"].path, registry=registry, wait_for_device=True)
    on_cuda = {name for part in big.placement.partitions if part.provider == "cuda" for name in part.node_names}
    convolutions = {node.name for node in big.model.graph if node.op_type == "Conv"}
    assert convolutions and convolutions <= on_cuda and len(big.placement.partitions) <= 2
    tiny = plugrt.load(_chain(4), registry=registry)
    assert set(tiny.placement.nodes_per_provider) == {"cpu"}
    assert any(fb.declined_by == "cuda" and fb.cause == "estimate" for fb in tiny.placement.fallbacks)


# -- placement="measure" ---------------------------------------------------------------------


def test_measuring_keeps_the_cpu_plan_when_a_provider_that_claims_speed_is_slow(monkeypatch, relu_add_registry):
    import time

    import fake_plugins

    monkeypatch.setattr(fake_plugins.ReluAddProvider, "relative_costs", {"*": 0.0}, raising=False)
    monkeypatch.setattr(fake_plugins.ReluAddProvider, "partition_overhead", 0.0, raising=False)
    real = fake_plugins.ReluAddProvider.compile

    def slow_compile(self, partition):
        compiled = real(self, partition)
        for step in compiled.steps:
            fn = step.fn
            step.fn = lambda *a, fn=fn: (time.sleep(0.02), fn(*a))[1]
        return compiled

    monkeypatch.setattr(fake_plugins.ReluAddProvider, "compile", slow_compile)
    model = _chain(1 << 10)
    estimated = plugrt.load(model, registry=relu_add_registry, wait_for_device=True)
    assert estimated.placement.nodes_per_provider.get("reluadd") == 2
    measured = plugrt.load(model, registry=relu_add_registry, placement="measure")
    assert set(measured.placement.nodes_per_provider) == {"cpu"}
    timed = dict(measured.placement.estimate.measured)
    assert set(timed) == {"by estimate", "all on cpu"} and timed["all on cpu"] < timed["by estimate"]
    assert all(p.measured_s is not None for p in measured.placement.partitions)


def test_a_measured_verdict_is_reused_for_the_same_model_and_providers(relu_add_registry):
    from plugrt import calibration

    model = _chain(1 << 10)
    first = plugrt.load(model, registry=relu_add_registry, placement="measure")
    before = dict(calibration.VERDICTS)
    second = plugrt.load(model, registry=relu_add_registry, placement="measure")
    assert calibration.VERDICTS == before
    assert second.placement.estimate.measured == first.placement.estimate.measured


def test_explain_shows_measured_time_per_partition(monkeypatch, capsys):
    from helpers import fake_entry_points
    from plugrt import registry as registry_module
    from plugrt.cli import main

    fake_entry_points(monkeypatch, ("reluadd", "fake_plugins:with_relu_add"))
    registry_module.reset_default_registry()
    try:
        assert main(["explain", LIGHT["squeezenet"].path, "--placement", "measure", "--no-capture"]) == 0
    finally:
        registry_module.reset_default_registry()
    printed = capsys.readouterr().out
    assert "chosen by: measure" in printed and "measured: by estimate:" in printed
    assert "cpu_0: cpu, 40 node(s), estimated" in printed and ", measured " in printed
