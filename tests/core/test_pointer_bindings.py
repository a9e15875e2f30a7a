"""onnxruntime's ``IOBinding.bind_input`` / ``bind_output`` with a raw address: host memory
wrapped without a copy, device memory through the provider's ``from_pointer``, and typed
errors for what cannot be right."""

from __future__ import annotations

import types

import numpy as np
import onnx.parser
import pytest

import plugrt
from plugrt._ort_values import IOBinding
from plugrt.errors import BindingShapeError, InvalidInputError, NotSupportedError, ProviderUnavailableError
from plugrt.hookspecs import hookimpl

from device.fake_device import DeviceArray, FakeDevice

MODEL = onnx.parser.parse_model(
    '<ir_version: 8, opset_import: ["" : 17]> g (float[N, 2] X) => (float[N, 2] Y) { Y = Relu(X) }'
).SerializeToString()
X = np.array([[1.0, -2.0], [3.0, -4.0], [5.0, -6.0]], dtype=np.float32)


class PointerDevice(FakeDevice):
    """The fake device, whose "device memory" at an address is a registered host array:
    ``from_pointer`` wraps that memory (no copy) as a device array."""

    name = "pointerdevice"

    def __init__(self) -> None:
        super().__init__()
        self.memory_at: dict[int, np.ndarray] = {}
        self.wrapped: list[tuple[int, tuple[int, ...], np.dtype]] = []

    def device_memory(self, array: np.ndarray) -> int:
        """Register ``array`` as device memory; its address."""
        address = int(array.ctypes.data)
        self.memory_at[address] = array
        return address

    def from_pointer(self, pointer, shape, dtype, device):
        self.wrapped.append((pointer, tuple(shape), np.dtype(dtype)))
        backing = self.memory_at[pointer]
        assert backing.dtype == dtype and backing.shape == tuple(shape)
        return DeviceArray(backing)


def _session(device=None) -> plugrt.Session:
    from plugrt_cpu import CPUProvider

    providers = [device, CPUProvider()] if device is not None else [CPUProvider()]
    plugin = types.SimpleNamespace(plugrt_providers=hookimpl(lambda: providers))
    registry = plugrt.ProviderRegistry(entry_points=[], plugins=[plugin], disabled=())
    return plugrt.load(MODEL, providers=[p.name for p in providers], registry=registry)


# -- host memory ------------------------------------------------------------------------


def test_host_memory_bound_by_address_is_read_and_written_in_place():
    session = _session()
    x, y = X.copy(), np.full((3, 2), np.nan, np.float32)
    binding = IOBinding(session)
    binding.bind_input("X", "cpu", 0, np.float32, x.shape, x.ctypes.data)
    binding.bind_output("Y", "cpu", 0, np.float32, y.shape, y.ctypes.data)
    x[0, 0] = 7.0  # written after binding: the run reads the memory, not a copy made at bind time
    binding.run(None)
    expected = np.maximum(x, 0)
    np.testing.assert_array_equal(y, expected)  # the run stored into the caller's memory
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], expected)


def test_an_onnx_element_type_number_is_accepted():
    session = _session()
    x, y = X.copy(), np.zeros((3, 2), np.float32)
    binding = IOBinding(session)
    binding.bind_input("X", "cpu", 0, 1, list(x.shape), x.ctypes.data)  # 1: TensorProto.FLOAT
    binding.bind_output("Y", "cpu", 0, 1, list(y.shape), y.ctypes.data)
    binding.run(None)
    np.testing.assert_array_equal(y, np.maximum(X, 0))


@pytest.mark.parametrize(
    "pointer, match",
    [(0, "null or negative"), (-16, "null or negative"), ("0x1000", "integer address"), (1.5, "integer address"), (True, "integer address"), (None, "integer address")],
)
def test_a_bad_address_is_a_typed_error(pointer, match):
    binding = IOBinding(_session())
    with pytest.raises(InvalidInputError, match=match):
        binding.bind_input("X", "cpu", 0, np.float32, (3, 2), pointer)


@pytest.mark.parametrize(
    "shape, match",
    [((3, -2), "non-negative integers"), ("32", "sequence of non-negative"), (3, "sequence of non-negative"), ((3.0, 2), "non-negative integers")],
)
def test_a_bad_shape_is_a_typed_error(shape, match):
    binding = IOBinding(_session())
    with pytest.raises(InvalidInputError, match=match):
        binding.bind_input("X", "cpu", 0, np.float32, shape, X.ctypes.data)


def test_a_shape_the_model_rules_out_is_a_binding_shape_error():
    binding = IOBinding(_session())
    with pytest.raises(BindingShapeError, match="fixed axis 1"):
        binding.bind_input("X", "cpu", 0, np.float32, (2, 3), X.ctypes.data)
    with pytest.raises(BindingShapeError, match="rank"):
        binding.bind_input("X", "cpu", 0, np.float32, (6,), X.ctypes.data)


def test_another_dtype_than_the_models_is_refused_naming_both():
    binding = IOBinding(_session())
    with pytest.raises(InvalidInputError, match="float32 in the model.*given as float64"):
        binding.bind_input("X", "cpu", 0, np.float64, (3, 2), X.ctypes.data)
    with pytest.raises(InvalidInputError, match="fixed-size layout"):
        binding.bind_input("X", "cpu", 0, np.object_, (3, 2), X.ctypes.data)
    with pytest.raises(InvalidInputError, match="no numpy equivalent|numpy type"):
        binding.bind_input("X", "cpu", 0, "no-such-type", (3, 2), X.ctypes.data)


def test_an_unknown_name_is_refused():
    binding = IOBinding(_session())
    with pytest.raises(InvalidInputError, match="'Z'"):
        binding.bind_input("Z", "cpu", 0, np.float32, (3, 2), X.ctypes.data)
    with pytest.raises(InvalidInputError, match="'Z'"):
        binding.bind_output("Z", "cpu", 0, np.float32, (3, 2), X.ctypes.data)


# -- device memory -------------------------------------------------------------------------


def test_device_memory_bound_by_address_is_wrapped_by_the_provider_without_a_copy():
    device = PointerDevice()
    session = _session(device)
    x_memory, y_memory = X.copy(), np.zeros((3, 2), np.float32)
    x_address, y_address = device.device_memory(x_memory), device.device_memory(y_memory)
    binding = IOBinding(session)
    binding.bind_input("X", "pointerdevice", 0, np.float32, (3, 2), x_address)
    binding.bind_output("Y", "pointerdevice", 0, np.float32, (3, 2), y_address)
    assert device.wrapped == [(x_address, (3, 2), np.dtype(np.float32)), (y_address, (3, 2), np.dtype(np.float32))]
    x_memory[2, 1] = 9.0  # the device memory as it is at the run is what is read
    binding.run(None)
    (y,) = binding.get_outputs()
    assert y.device_name() == "pointerdevice" and isinstance(y._data, DeviceArray)
    np.testing.assert_array_equal(y_memory, np.maximum(x_memory, 0))  # stored into the caller's memory


def test_device_binding_by_address_needs_the_providers_from_pointer():
    session = _session(FakeDevice())  # device memory, but no from_pointer
    with pytest.raises(NotSupportedError, match="bind_ortvalue_input"):
        IOBinding(session).bind_input("X", "fakedevice", 0, np.float32, (3, 2), 4096)
    with pytest.raises(NotSupportedError, match="bind_ortvalue_output"):
        IOBinding(session).bind_output("Y", "fakedevice", 0, np.float32, (3, 2), 4096)


def test_device_binding_checks_the_device_id_and_the_session_s_memories():
    session = _session(PointerDevice())
    with pytest.raises(InvalidInputError, match="device_id 3"):
        IOBinding(session).bind_input("X", "pointerdevice", 3, np.float32, (3, 2), 4096)
    with pytest.raises(ProviderUnavailableError, match="does not use it"):
        IOBinding(session).bind_input("X", "cuda", 0, np.float32, (3, 2), 4096)
