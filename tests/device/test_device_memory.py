"""Device memory end to end, on a provider whose arrays numpy cannot read."""

from __future__ import annotations

import sys
import threading

import importlib_metadata
import numpy as np
import pytest

import plugrt
from plugrt.capture import Captured
from plugrt.conformance.light_models import light_models
from plugrt.errors import CaptureThreadError, ProviderUnavailableError, StaleCaptureError
from plugrt.provider import CaptureCapability, MemoryCapability, memory_of
from plugrt.registry import ProviderRegistry

from device.fake_device import DeviceArray, FakeDevice, HostAccessError
from helpers import model_bytes

GROUP = "plugrt.providers"


def device_registry(*plugins: str) -> ProviderRegistry:
    """The installed providers plus fake-device plugins, as if their distributions were installed."""
    installed = list(importlib_metadata.entry_points(group=GROUP))
    fake = [importlib_metadata.EntryPoint(p, f"device.fake_device:{p}", GROUP) for p in plugins]
    return ProviderRegistry(entry_points=installed + fake)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


LIGHT = {m.name: m for m in light_models()}


@pytest.fixture(scope="module")
def cpu_outputs():
    cache: dict = {}

    def outputs(name: str) -> dict:
        if name not in cache:
            model = LIGHT[name]
            cache[name] = plugrt.load(model.path, device="cpu").run(model.inputs)
        return cache[name]

    return outputs


MLP = model_bytes(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    mlp (float[N, 4] x) => (float[N, 3] y) <float[4, 3] w = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, float[3] b = {0.5, -1, 2}> {
        h = MatMul(x, w)
        a = Add(h, b)
        r = Relu(a)
        y = Softmax <axis = -1> (r)
    }
    """
)


def _mlp_expected(x: np.ndarray) -> np.ndarray:
    w = np.arange(1, 13, dtype=np.float32).reshape(4, 3)
    r = np.maximum(x @ w + np.array([0.5, -1, 2], np.float32), 0)
    e = np.exp(r - r.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# -- the provider itself ---------------------------------------------------------------------


def test_device_arrays_refuse_every_numpy_coercion():
    array = FakeDevice().to_device(np.ones(3, np.float32), None)
    for attempt in (np.asarray, lambda a: np.copyto(np.zeros(3, np.float32), a), lambda a: np.add(a, 1)):
        with pytest.raises(TypeError):
            attempt(array)
    with pytest.raises(TypeError):
        list(array)


def test_fake_device_has_the_memory_and_capture_capabilities():
    provider = FakeDevice()
    assert isinstance(provider, MemoryCapability) and isinstance(provider, CaptureCapability)
    assert memory_of(provider) is provider
    from plugrt_cpu import CPUProvider

    assert memory_of(CPUProvider()) is None


def test_fake_device_declines_other_ops_with_a_reason():
    session = plugrt.load(
        model_bytes(
            """
            <ir_version: 8, opset_import: ["" : 17]>
            g (float[2, 3] x) => (float[2, 3] y) { t = Relu(x)
                y = Sigmoid(t) }
            """
        ),
        providers=["fakedevice", "cpu"],
        registry=device_registry("plugin"),
    )
    (fallback,) = session.placement.fallbacks
    assert fallback.op_type == "Sigmoid" and fallback.declined_by == "fakedevice" and fallback.placed_on == "cpu"
    assert "no Sigmoid kernel" in fallback.reason


# -- light models: mixed placement and full device placement ----------------------------


@pytest.mark.parametrize("name", ["squeezenet", "resnet50"])
def test_light_model_split_between_device_and_cpu_equals_an_all_cpu_run(name, cpu_outputs):
    model = LIGHT[name]
    session = plugrt.load(model.path, providers=["fakedevice", "cpu"], registry=device_registry("plugin"))
    placement = session.placement
    assert len(placement.partitions) >= 3
    assert placement.nodes_per_provider["fakedevice"] > 0 and placement.nodes_per_provider["cpu"] > 0
    outputs = session.run(model.inputs)
    expected = cpu_outputs(name)
    # bitwise the all-CPU run, which tests/test_light_models.py checks on its logits (the
    # probabilities saturate: against onnx's expected ones, one ulp flips a one-hot)
    assert all(_same(outputs[k], expected[k]) for k in expected)
    assert next(iter(outputs.values())).shape == model.expected[0].shape


@pytest.mark.parametrize("name", ["squeezenet", "resnet50"])
def test_mixed_placement_with_bound_io_transfers_only_at_its_transfer_steps(name, cpu_outputs):
    model = LIGHT[name]
    session = plugrt.load(model.path, providers=["fakedevice", "cpu"], registry=device_registry("plugin"))
    (input_name, feed), = model.inputs.items()
    output_name = session.outputs[0].name
    x = session.allocate_binding(input=input_name, shape=feed.shape)
    y = session.allocate_binding(output=output_name, shape=model.expected[0].shape)
    x.write(feed)
    before = session.transfers.snapshot()
    assert session.run(bindings=[x, y]) == {output_name: None}
    during = session.transfers.since(before)
    # every transfer step of the plan copies once; the output goes device to device into its binding
    assert during.host_transfers == len(session.placement.transfers) > 0
    assert during.device_copies == 1
    assert _same(y.read(), cpu_outputs(name)[output_name])


@pytest.mark.parametrize("name", ["squeezenet", "resnet50"])
def test_fully_device_bound_run_makes_no_host_transfer(name, cpu_outputs):
    model = LIGHT[name]
    session = plugrt.load(model.path, device="fakedevice_full", registry=device_registry("full_plugin"))
    assert session.placement.nodes_per_provider == {"fakedevice_full": sum(session.placement.nodes_per_provider.values())}
    (input_name, feed), = model.inputs.items()
    output_name = session.outputs[0].name
    x = session.allocate_binding(input=input_name, shape=feed.shape)
    y = session.allocate_binding(output=output_name, shape=model.expected[0].shape)
    assert isinstance(x.buffer, DeviceArray) and isinstance(y.buffer, DeviceArray)
    x.write(feed)
    before = session.transfers.snapshot()
    for _ in range(2):
        session.run(bindings=[x, y])
    during = session.transfers.since(before)
    assert (during.to_device, during.to_host) == (0, 0)
    assert during.device_copies == 2  # the output into its binding, device to device
    assert _same(y.read(), cpu_outputs(name)[output_name])


def test_constants_reach_the_device_once_at_build():
    session = plugrt.load(MLP, providers=["fakedevice", "cpu"], registry=device_registry("plugin"))
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    before = session.transfers.snapshot()
    for _ in range(3):
        y = session.run({"x": x})["y"]
    during = session.transfers.since(before)
    assert (during.to_device, during.to_host) == (3, 3)  # x in and y out, per run; never w or b
    np.testing.assert_allclose(y, _mlp_expected(x), rtol=1e-6)


def test_unbound_device_output_comes_back_to_the_host():
    session = plugrt.load(MLP, providers=["fakedevice", "cpu"], registry=device_registry("plugin"))
    x = np.ones((1, 4), np.float32)
    y = session.run({"x": x})["y"]
    assert type(y) is np.ndarray
    np.testing.assert_allclose(y, _mlp_expected(x), rtol=1e-6)


# -- capture -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["squeezenet", "resnet50"])
def test_capture_over_a_mixed_placement_replays_bitwise_equal_to_eager(name):
    model = LIGHT[name]
    session = plugrt.load(model.path, providers=["fakedevice", "cpu"], registry=device_registry("plugin"))
    eager = session.run(model.inputs)
    result = session.try_capture(model.inputs)
    assert isinstance(result, Captured) and result.report.staged
    assert len(result.report.segments) > 1  # each staged transfer ends a captured segment
    device_bytes = session.registry.providers()["fakedevice"].allocated_bytes()
    for _ in range(2):
        replayed = session.replay(model.inputs)
        assert replayed.replayed and replayed.reason == ""
        assert all(_same(replayed[k], eager[k]) for k in eager)
    assert session.registry.providers()["fakedevice"].allocated_bytes() == device_bytes
    stats = session.capture_stats
    assert (stats.replays, stats.eager_fallbacks, stats.bytes_allocated_during_replay) == (2, 0, 0)


@pytest.mark.parametrize("device", ["fakedevice", "cpu"])
def test_two_slots_with_different_shapes_coexist(device):
    session = plugrt.load(MLP, providers=[device, "cpu"] if device != "cpu" else ["cpu"], registry=device_registry("plugin"))
    rng = np.random.default_rng(0)
    prefill, decode = rng.standard_normal((8, 4), np.float32), rng.standard_normal((1, 4), np.float32)
    assert isinstance(session.try_capture({"x": prefill}, slot="prefill"), Captured)
    assert isinstance(session.try_capture({"x": decode}, slot="decode"), Captured)
    for _ in range(2):
        prefill, decode = prefill * 0.5, decode + 1
        got_decode = session.replay({"x": decode}, slot="decode")
        got_prefill = session.replay({"x": prefill}, slot="prefill")
        assert got_decode.replayed and got_prefill.replayed
        np.testing.assert_allclose(got_decode["y"], _mlp_expected(decode), rtol=1e-5)
        np.testing.assert_allclose(got_prefill["y"], _mlp_expected(prefill), rtol=1e-5)
        assert _same(got_prefill["y"], session.run({"x": prefill})["y"])


@pytest.mark.parametrize("device", ["fakedevice", "cpu"])
def test_replay_with_another_shape_than_the_slot_captured_is_stale(device):
    session = plugrt.load(MLP, providers=[device, "cpu"] if device != "cpu" else ["cpu"], registry=device_registry("plugin"))
    session.try_capture({"x": np.ones((1, 4), np.float32)}, slot="decode")
    with pytest.raises(StaleCaptureError) as info:
        session.replay({"x": np.ones((8, 4), np.float32)}, slot="decode")
    assert info.value.name == "x"


def test_bound_capture_on_the_device_replays_without_host_transfers():
    session = plugrt.load(MLP, device="fakedevice_full", registry=device_registry("full_plugin"))
    x = session.allocate_binding(input="x", shape=(2, 4))
    y = session.allocate_binding(output="y", shape=(2, 3))
    first = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    x.write(first)
    assert isinstance(session.try_capture(bindings=[x, y]), Captured)
    second = first[::-1].copy()
    x.write(second)
    before = session.transfers.snapshot()
    assert session.replay(bindings=[x, y]) == {"y": None}
    assert session.transfers.since(before).host_transfers == 0
    np.testing.assert_allclose(y.read(), _mlp_expected(second), rtol=1e-6)


@pytest.mark.parametrize("device", ["fakedevice", "cpu"])
def test_two_threads_replaying_one_capture_each_get_their_own_result(device):
    session = plugrt.load(MLP, providers=[device, "cpu"] if device != "cpu" else ["cpu"], registry=device_registry("plugin"))
    session.try_capture({"x": np.zeros((16, 4), np.float32)})
    failures: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(50):
            x = rng.standard_normal((16, 4), np.float32)
            y = session.replay({"x": x})["y"]  # off the capturing thread: copies by default
            if not np.allclose(y, _mlp_expected(x), rtol=1e-5):
                failures.append(f"thread {seed} got another input's result")
                return

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so that an unguarded capture would mix results
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert failures == []
    assert session.capture_stats.replays == 100


def test_zero_copy_replay_on_another_thread_is_refused():
    session = plugrt.load(MLP)
    session.try_capture({"x": np.zeros((2, 4), np.float32)})
    errors: list[BaseException] = []

    def replay() -> None:
        try:
            session.replay({"x": np.ones((2, 4), np.float32)}, copy_outputs=False)
        except CaptureThreadError as exc:
            errors.append(exc)

    thread = threading.Thread(target=replay, name="worker")
    thread.start()
    thread.join()
    (error,) = errors
    assert error.replayed_on == "worker" and "copy_outputs=False" in str(error)


# -- protocol versions ------------------------------------------------------------------------


def test_provider_with_an_unsupported_protocol_version_is_listed_and_never_used(monkeypatch, capsys):
    from helpers import fake_entry_points
    from plugrt import registry as registry_module
    from plugrt.cli import main

    fake_entry_points(monkeypatch, ("olddevice", "device.fake_device:old_protocol_plugin"))
    registry = ProviderRegistry()
    assert "olddevice" not in registry.providers()
    failure = registry.failures()["olddevice"]
    assert failure.stage == "protocol" and "protocol_version 99" in failure.cause
    with pytest.raises(ProviderUnavailableError, match="protocol_version 99"):
        plugrt.load(MLP, device="olddevice", registry=registry)
    session = plugrt.load(MLP, registry=registry)
    assert session.providers == ["cpu"]
    registry_module.reset_default_registry()
    try:
        assert main(["providers"]) == 0
    finally:
        registry_module.reset_default_registry()
    assert "olddevice: protocol failed: declares protocol_version 99" in capsys.readouterr().out


def test_a_host_array_reaching_a_device_kernel_fails_loudly():
    provider = FakeDevice()
    run = provider._on_device(np.negative)
    with pytest.raises(HostAccessError, match="skipped a transfer"):
        run(np.ones(2, np.float32))
