"""Careless providers are caught at the border: fallback with a reason, or a typed error."""

from __future__ import annotations

import numpy as np
import pytest

import plugrt
from plugrt import passes
from plugrt.errors import KernelError, ModelBuildError, PlugrtError
from plugrt.registry import ProviderRegistry

from helpers import NEG_ADD, fake_entry_points

X = np.array([1, -2, 3], np.float32)


def _registry(monkeypatch, plugin: str, name: str = "careless") -> ProviderRegistry:
    fake_entry_points(monkeypatch, (name, f"security.bad_plugins:{plugin}"))
    return ProviderRegistry()


@pytest.mark.parametrize("plugin", ["garbage_compile", "garbage_steps"])
def test_compile_returning_garbage_falls_back_to_cpu_with_the_reason(monkeypatch, plugin):
    session = plugrt.load(NEG_ADD, registry=_registry(monkeypatch, plugin), wait_for_device=True)
    np.testing.assert_array_equal(session.run({"x": X})["y"], np.zeros(3, np.float32))
    assert session.placement.nodes_per_provider == {"cpu": 2}
    (fallback,) = [fb for fb in session.placement.fallbacks if fb.declined_by == "careless"]
    assert fallback.placed_on == "cpu" and "careless.compile returned" in fallback.reason


@pytest.mark.parametrize("plugin, problem", [("wrong_dtype", "dtype float64"), ("wrong_shape", "shape [1]")])
def test_output_contradicting_its_declared_type_is_a_kernel_error_naming_provider_and_node(monkeypatch, plugin, problem):
    session = plugrt.load(NEG_ADD, registry=_registry(monkeypatch, plugin), wait_for_device=True)
    assert session.placement.nodes_per_provider.get("careless") == 1
    with pytest.raises(KernelError) as info:
        session.run({"x": X})
    assert info.value.provider == "careless" and info.value.op_type == "Neg"
    assert problem in str(info.value)


def test_kernel_writing_into_its_input_cannot_change_the_callers_array(monkeypatch):
    session = plugrt.load(NEG_ADD, registry=_registry(monkeypatch, "writes_into_input"), wait_for_device=True)
    x = X.copy()
    with pytest.raises(KernelError) as info:
        session.run({"x": x})
    assert info.value.provider == "careless"
    np.testing.assert_array_equal(x, X)


def test_third_party_provider_named_cpu_is_refused_with_a_reason(monkeypatch):
    registry = _registry(monkeypatch, "impostor_cpu", name="impostor")
    assert type(registry.get("cpu")).__module__.startswith("plugrt_cpu")
    failure = registry.failures()["impostor"]
    assert "reserved for the built-in CPU provider" in failure.cause
    y = plugrt.load(NEG_ADD, registry=registry).run({"x": X})["y"]
    np.testing.assert_array_equal(y, np.zeros(3, np.float32))  # Neg(x) + x, not the impostor's zeros + x
    assert registry.get("cpu").__class__.__name__ != "_Impostor"


def test_impostor_reason_is_shown_by_the_providers_command(monkeypatch, capsys):
    fake_entry_points(monkeypatch, ("impostor", "security.bad_plugins:impostor_cpu"))
    from plugrt import registry as registry_module
    from plugrt.cli import main

    registry_module.reset_default_registry()
    try:
        assert main(["providers"]) == 0
    finally:
        registry_module.reset_default_registry()
    assert "reserved for the built-in CPU provider" in capsys.readouterr().out


def test_unanticipated_exception_while_building_is_typed_with_the_cause_chained(monkeypatch):
    def broken(model):
        raise TypeError("an unanticipated bug")

    monkeypatch.setattr(passes, "name_nodes", broken)
    with pytest.raises(ModelBuildError) as info:
        plugrt.load(NEG_ADD)
    assert isinstance(info.value, PlugrtError) and isinstance(info.value.__cause__, TypeError)


def test_a_fault_inside_replay_is_a_kernel_error_naming_its_node_with_its_cause():
    import onnx.parser

    from plugrt.capture import DEFAULT_SLOT

    model = onnx.parser.parse_model(
        '<ir_version: 8, opset_import: ["" : 17]> g (float[2,3] x) => (float[2,3] y) { y = Relu(x) }'
    )
    session = plugrt.load(model.SerializeToString(), device="cpu")
    assert session.try_capture({"x": np.ones((2, 3), np.float32)})

    def faulty_step() -> None:
        raise IndexError("list index out of range")

    session._captures.get(DEFAULT_SLOT)._runs = [faulty_step]  # the Relu's step, faulting as a kernel might
    with pytest.raises(plugrt.KernelError) as caught:
        session.replay({"x": np.ones((2, 3), np.float32)})
    assert caught.value.op_type == "Relu" and caught.value.provider == "cpu"
    assert isinstance(caught.value.__cause__, IndexError)
