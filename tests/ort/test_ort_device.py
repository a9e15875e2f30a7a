"""IOBinding and OrtValue on a provider with its own memory: device outputs stay there."""

from __future__ import annotations

import importlib_metadata
import numpy as np
import onnx.parser
import pytest

import plugrt
from plugrt._ort_values import IOBinding, OrtValue
from plugrt.errors import ProviderUnavailableError

MODEL = onnx.parser.parse_model(
    '<ir_version: 8, opset_import: ["" : 17]> g (float[3, 2] X) => (float[3, 2] Y) { Y = Relu(X) }'
).SerializeToString()
X = np.array([[1.0, -2.0], [3.0, -4.0], [5.0, -6.0]], dtype=np.float32)


@pytest.fixture
def session():
    group = "plugrt.providers"
    installed = list(importlib_metadata.entry_points(group=group))
    fake = importlib_metadata.EntryPoint("plugin", "device.fake_device:plugin", group)
    registry = plugrt.ProviderRegistry(entry_points=installed + [fake])
    return plugrt.load(MODEL, providers=["fakedevice"], registry=registry)


def test_an_output_bound_to_the_device_stays_in_device_memory(session):
    from device.fake_device import DeviceArray

    binding = IOBinding(session)
    binding.bind_cpu_input("X", X)
    binding.bind_output("Y", "fakedevice")
    binding.run(None)
    (y,) = binding.get_outputs()
    assert y.device_name() == "fakedevice" and isinstance(y._data, DeviceArray)
    np.testing.assert_array_equal(y.numpy(), np.maximum(X, 0))


def test_a_device_ortvalue_input_is_read_in_place(session):
    binding = IOBinding(session)
    x = OrtValue(session.selection.providers[0].to_device(X, None), "fakedevice", session.selection.providers[0])
    binding.bind_ortvalue_input("X", x)
    binding.bind_output("Y")
    binding.run(None)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], np.maximum(X, 0))


def test_binding_to_a_memory_the_session_does_not_use_is_refused(session):
    with pytest.raises(ProviderUnavailableError, match="does not use it"):
        IOBinding(session).bind_output("Y", "cuda")
