"""onnxruntime's OrtValue, IOBinding and RunOptions, built on plugrt's device bindings."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ._dtypes import numpy_dtype, onnx_type_name
from .bindings import DeviceBinding, _check_declared
from .errors import ConfigEntryMissingError, InvalidInputError, NotSupportedError, ProviderUnavailableError, RunTerminatedError
from .provider import MemoryCapability, memory_of

if TYPE_CHECKING:
    from .session import Session

__all__ = ["OrtValue", "OrtValueVector", "IOBinding", "RunOptions", "guarded_run", "is_dlpack_uint8_tensor"]

#: onnxruntime's device names and the plugrt providers whose memory they mean.
_DEVICE_PROVIDERS = {"cuda": "cuda", "gpu": "cuda"}
_GPU_GRAPH_ID = "gpu_graph_id"


def _element_dtype(element_type: Any) -> np.dtype:
    """A numpy type or an ONNX element type number, as numpy's dtype."""
    if isinstance(element_type, (int, np.integer)) and not isinstance(element_type, bool):
        try:
            return numpy_dtype(int(element_type))
        except ValueError as exc:
            raise InvalidInputError(f"element type {element_type} has no numpy equivalent in plugrt") from exc
    try:
        return np.dtype(element_type)
    except TypeError as exc:
        raise InvalidInputError(f"element_type must be a numpy type or an ONNX type number, got {element_type!r}") from exc


def _device_memory(device_type: str, session: "Session | None" = None) -> MemoryCapability:
    """The memory ``device_type`` names (``cuda``, or a provider's name): among the
    session's providers when given, else the installed ones (loaded on demand)."""
    kind = device_type.lower()
    name = _DEVICE_PROVIDERS.get(kind, kind)
    if session is not None:
        provider = next((p for p in session.selection.providers if p.name == name), None)
        if provider is None:
            raise ProviderUnavailableError(
                name, f"this session does not use it (its providers: {', '.join(session.providers)})",
                hint="list it in providers= when creating the session, or bind to device_type='cpu'",
            )
    else:
        from .registry import default_registry

        provider = default_registry().get(name)  # ProviderUnavailableError with the cause
    memory = memory_of(provider)
    if memory is None:
        raise ProviderUnavailableError(name, "it keeps its values in host memory", hint="use device_type='cpu' for host arrays")
    return memory


def _device(memory: MemoryCapability, device_id: int) -> Any:
    devices = memory.devices()  # type: ignore[attr-defined]
    if not 0 <= device_id < len(devices):
        raise InvalidInputError(f"device_id {device_id}: {memory.memory} has {len(devices)} device(s)")
    return devices[device_id]


class OrtValue:
    """A tensor on the host (a numpy array, shared, not copied) or on a provider's device."""

    __slots__ = ("_data", "_device", "_memory")

    def __init__(self, data: Any, device: str = "cpu", memory: MemoryCapability | None = None) -> None:
        self._data = data
        self._device = device
        self._memory = memory

    # -- construction ----------------------------------------------------------------

    @classmethod
    def ortvalue_from_numpy(cls, numpy_obj: np.ndarray, /, device_type: str = "cpu", device_id: int = 0, vendor_id: int = -1) -> "OrtValue":
        """Wrap ``numpy_obj`` (no copy on the host, as onnxruntime) or upload it to a device."""
        array = np.asarray(numpy_obj)
        if device_type.lower() == "cpu":
            return cls(array)
        memory = _device_memory(device_type)
        return cls(memory.to_device(np.ascontiguousarray(array), _device(memory, device_id)), device_type.lower(), memory)

    @classmethod
    def ortvalue_from_shape_and_type(
        cls, shape: Sequence[int], element_type: Any, device_type: str = "cpu", device_id: int = 0, vendor_id: int = -1
    ) -> "OrtValue":
        """An uninitialised tensor (zeros here) of ``shape`` and ``element_type``."""
        dtype = _element_dtype(element_type)
        shape = tuple(int(d) for d in shape)
        if device_type.lower() == "cpu":
            return cls(np.zeros(shape, dtype))
        memory = _device_memory(device_type)
        return cls(memory.allocate(shape, dtype, _device(memory, device_id)), device_type.lower(), memory)

    # -- what onnxruntime reports ----------------------------------------------------

    def data_ptr(self) -> int:
        data = self._data
        if isinstance(data, np.ndarray):
            return int(data.ctypes.data)
        return int(data.data.ptr)  # cupy-style device arrays

    def device_name(self) -> str:
        return self._device

    def shape(self) -> list[int]:
        return [int(d) for d in self._data.shape]

    def data_type(self) -> str:
        return onnx_type_name(np.dtype(self._data.dtype))

    def element_type(self) -> int:
        import onnx

        return int(onnx.helper.np_dtype_to_tensor_dtype(np.dtype(self._data.dtype)))

    def tensor_size_in_bytes(self) -> int:
        return int(self._data.nbytes)

    def has_value(self) -> bool:
        return self._data is not None

    def is_tensor(self) -> bool:
        return self._data is not None and hasattr(self._data, "shape")

    def is_sparse_tensor(self) -> bool:
        from ._ort_sparse import SparseTensor

        return isinstance(self._data, SparseTensor)

    def is_tensor_sequence(self) -> bool:
        return isinstance(self._data, list)

    def numpy(self) -> np.ndarray:
        """The host array (shared with this value on the host; a download from a device)."""
        if self._memory is None:
            return self._data
        return self._memory.to_host(self._data)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        array = self.numpy()
        if copy is not None:
            return np.array(array, dtype=dtype, copy=copy)
        return array if dtype is None else np.asarray(array, dtype=dtype)

    def update_inplace(self, data: Any) -> None:
        """Copy ``data`` (a numpy array or an OrtValue) into this value's memory."""
        if isinstance(data, OrtValue):
            data = data.numpy()
        if not isinstance(data, np.ndarray):
            raise InvalidInputError(f"update_inplace takes a numpy array or an OrtValue, got {type(data).__name__}")
        if tuple(data.shape) != tuple(self._data.shape) or data.dtype != self._data.dtype:
            raise InvalidInputError(
                f"update_inplace: this value is {self._data.dtype}{list(self._data.shape)}, "
                f"got {data.dtype}{list(data.shape)}; make a new OrtValue for another shape"
            )
        if self._memory is None:
            np.copyto(self._data, data)
        else:
            self._memory.copy_into(np.ascontiguousarray(data), self._data)

    def binding(self, session: "Session", *, input: str | None = None, output: str | None = None) -> DeviceBinding:
        """This value's memory as a plugrt binding of ``session`` (no copy)."""
        if self._memory is None:
            return session.bind_array(self._data, input=input, output=output)
        return DeviceBinding(
            input=input, output=output, buffer=self._data, shape=self._data.shape,
            device=self._memory.default_device, memory=self._memory,
        )

    @classmethod
    def ortvalue_from_numpy_with_onnx_type(cls, data: np.ndarray, /, onnx_element_type: int) -> "OrtValue":
        """Wrap ``data`` (no copy) as a tensor of ONNX element type ``onnx_element_type``,
        reinterpreting its bytes when the types differ in name only (e.g. uint16 as bfloat16)."""
        dtype = _element_dtype(int(onnx_element_type))
        array = np.asarray(data)
        if array.dtype != dtype:
            if array.dtype.itemsize != dtype.itemsize:
                raise InvalidInputError(f"a {array.dtype} array cannot hold ONNX element type {onnx_element_type} ({dtype})")
            array = array.view(dtype)
        return cls(array)

    # -- DLPack ----------------------------------------------------------------------

    def __dlpack__(self, **kwargs: Any) -> Any:
        """This value's memory as a DLPack capsule (no copy; numpy's or the device array's)."""
        return self._data.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        device_type, device_id = self._data.__dlpack_device__()
        return int(device_type), int(device_id)

    def to_dlpack(self) -> Any:
        return self.__dlpack__()

    @classmethod
    def from_dlpack(cls, data: Any, is_bool_tensor: bool = False) -> "OrtValue":
        """A host value sharing the memory of ``data``: an object with ``__dlpack__`` or a
        DLPack capsule. ``is_bool_tensor`` reads a uint8 tensor as bool (DLPack versions
        before bool had their own code)."""
        source = data if hasattr(data, "__dlpack__") else _Capsule(data)
        array = np.from_dlpack(source)
        if is_bool_tensor and array.dtype == np.uint8:
            array = array.view(np.bool_)
        return cls(array)

    @classmethod
    def ort_value_from_sparse_tensor(cls, sparse_tensor: Any) -> "OrtValue":
        """A value holding a :class:`plugrt._ort_sparse.SparseTensor` (host only)."""
        return cls(sparse_tensor)

    def as_sparse_tensor(self) -> Any:
        from ._ort_sparse import SparseTensor

        if not isinstance(self._data, SparseTensor):
            raise InvalidInputError("this OrtValue holds a dense tensor, not a sparse one")
        return self._data

    @property
    def _ortvalue(self) -> "OrtValue":
        """onnxruntime's native value behind this one; plugrt has one object for both."""
        return self

    def _get_c_value(self) -> "OrtValue":
        """onnxruntime's native value behind this one; plugrt has one object for both."""
        return self

    def __getattr__(self, name: str) -> Any:
        raise NotSupportedError(
            f"OrtValue.{name}", "plugrt OrtValues hold dense tensors; use numpy() for the array"
        )

    def __repr__(self) -> str:
        return f"OrtValue({self.data_type()}, shape={self.shape()}, device={self._device!r})"


class _Capsule:
    """A bare DLPack capsule, given the protocol so numpy can take it."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return _capsule_tensor(self._capsule)[1]


#: DLPack's DLDataType codes.
_DLPACK_UINT = 1


def _capsule_tensor(capsule: Any) -> tuple[tuple[int, int], tuple[int, int]]:
    """((type code, bits), (device type, device id)) of the DLTensor a capsule holds,
    read without consuming it."""
    import ctypes

    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    name = get_name(capsule)
    if name not in (b"dltensor", b"dltensor_versioned"):
        raise InvalidInputError(f"not an unused DLPack capsule (its name is {name!r})")
    pointer = get_pointer(capsule, name)
    if name == b"dltensor_versioned":  # DLManagedTensorVersioned: version, manager_ctx, deleter, flags, then the tensor
        pointer += 8 + 8 + 8 + 8
    # DLTensor: void* data; int32 device_type, device_id; int32 ndim; uint8 code, bits; uint16 lanes
    device = (ctypes.c_int32 * 2).from_address(pointer + 8)
    dtype = (ctypes.c_uint8 * 2).from_address(pointer + 20)
    return (int(dtype[0]), int(dtype[1])), (int(device[0]), int(device[1]))


def is_dlpack_uint8_tensor(capsule: Any) -> bool:
    """Whether a DLPack capsule holds uint8 values (the capsule stays unused)."""
    return _capsule_tensor(capsule)[0] == (_DLPACK_UINT, 8)


class OrtValueVector(list):
    """A list of OrtValues (what onnxruntime's native ``run_with_ort_values`` returns)."""


def host_value(value: Any) -> Any:
    """A feed as the session takes it: an OrtValue's array, anything else unchanged."""
    if isinstance(value, OrtValue):
        return value._data if value._memory is None else value.numpy()
    return value


class RunOptions:
    """Per-run settings. ``terminate`` stops a run between steps (RunTerminatedError);
    ``gpu_graph_id`` selects a capture slot for ``run_with_iobinding``."""

    def __init__(self) -> None:
        self.log_severity_level = 2
        self.log_verbosity_level = 0
        self.logid = ""  # onnxruntime's run tag
        self.terminate = False
        self.only_execute_path_to_fetches = False
        self._configs: dict[str, str] = {}

    @property
    def run_tag(self) -> str:
        """The C API's name for ``logid``."""
        return self.logid

    @run_tag.setter
    def run_tag(self, tag: str) -> None:
        self.logid = tag

    def add_run_config_entry(self, key: str, value: str) -> None:
        self._configs[str(key)] = str(value)

    def get_run_config_entry(self, key: str) -> str:
        try:
            return self._configs[key]
        except KeyError:
            raise ConfigEntryMissingError("RunOptions", key) from None

    def add_active_adapter(self, adapter: Any) -> None:
        raise NotSupportedError("RunOptions.add_active_adapter", "plugrt has no LoRA adapters; merge them into the model")

    def graph_id(self) -> int | None:
        """The capture slot this run selects, or None (``gpu_graph_id`` unset or -1)."""
        entry = self._configs.get(_GPU_GRAPH_ID)
        if entry is None:
            return None
        try:
            graph = int(entry)
        except ValueError:
            raise InvalidInputError(f"run option {_GPU_GRAPH_ID!r} must be an integer, got {entry!r}") from None
        return None if graph == -1 else graph


def guarded_run(run_options: RunOptions | None, run: Callable[[], Any]) -> Any:
    """``run()``, stopped with RunTerminatedError before the next step once
    ``run_options.terminate`` is set (from any thread). Costs nothing without RunOptions."""
    if run_options is None:
        return run()
    if run_options.terminate:
        raise RunTerminatedError(run_options.run_tag)

    # Every step of a plan is a call: a profile hook sees each one before it starts, so
    # a flag set by another thread stops the run at the next step boundary.
    def check(frame: Any, event: str, arg: Any) -> None:
        if run_options.terminate and event in ("call", "c_call"):
            sys.setprofile(None)
            raise RunTerminatedError(run_options.run_tag)

    previous = sys.getprofile()
    sys.setprofile(check)
    try:
        return run()
    finally:
        sys.setprofile(previous)


class IOBinding:
    """Inputs and outputs bound to memory for ``run_with_iobinding``: host arrays without a
    copy, device values (OrtValues on a device) left on the device."""

    def __init__(self, session: Any) -> None:
        # an InferenceSession (as optimum constructs it) or a plugrt Session
        self._session: "Session" = getattr(session, "session", session)
        self._inputs: dict[str, DeviceBinding] = {}
        self._outputs: dict[str, tuple[str, DeviceBinding | None]] = {}  # name -> (device, binding)
        self._results: list[OrtValue] = []
        self._captured_slots: set[Any] = set()

    # -- inputs ----------------------------------------------------------------------

    def bind_cpu_input(self, name: str, arr_on_cpu: Any) -> None:
        """Bind a host array; the run reads it as it is then (no copy now)."""
        array = arr_on_cpu if isinstance(arr_on_cpu, np.ndarray) else np.asarray(arr_on_cpu)
        self._inputs[name] = self._session.bind_array(array, input=name)

    def bind_input(self, name: str, device_type: str, device_id: int, element_type: Any, shape: Sequence[int], buffer_ptr: int) -> None:
        """Bind memory the caller owns at ``buffer_ptr`` (no copy; it must stay alive while
        bound): host memory with ``device_type="cpu"``, a provider's device memory (``"cuda"``)
        through its ``from_pointer``."""
        self._inputs[name] = self._pointer_binding(name, device_type, device_id, element_type, shape, buffer_ptr, True)

    def _pointer_binding(
        self, name: str, device_type: str, device_id: int, element_type: Any, shape: Any, buffer_ptr: Any, is_input: bool
    ) -> DeviceBinding:
        """A binding over caller-owned memory at ``buffer_ptr``, checked against the model's
        declared type and shape of ``name``."""
        session = self._session
        role = "input" if is_input else "output"
        info = session._info_for(name, None) if is_input else session._info_for(None, name)
        dtype, dims, pointer = _pointer_spec(name, element_type, shape, buffer_ptr)
        if info.dtype is not None and np.dtype(info.dtype) != dtype:
            raise InvalidInputError(
                f"{role} {name!r} is {np.dtype(info.dtype)} in the model; the memory bound at {pointer:#x} was "
                f"given as {dtype}: pass element_type={np.dtype(info.dtype)}",
                input_name=name if is_input else None,
            )
        if is_input:
            _check_declared(info, dims)  # an output's buffer is checked when the run stores into it
        io = {"input": name} if is_input else {"output": name}
        if device_type.lower() == "cpu":
            return session.bind_array(_host_array(dtype, dims, pointer), **io)
        memory = _device_memory(device_type, session)
        from_pointer = getattr(memory, "from_pointer", None)
        if not callable(from_pointer):
            raise NotSupportedError(
                f"IOBinding.bind_{role} on {device_type!r} by address",
                f"provider {getattr(memory, 'name', memory.memory)!r} cannot wrap raw device memory (no "
                "from_pointer); make an OrtValue on that device and bind it with "
                f"bind_ortvalue_{role}",
            )
        device = _device(memory, device_id)
        array = from_pointer(pointer, dims, dtype, device)
        return DeviceBinding(
            input=name if is_input else None, output=None if is_input else name, buffer=array, shape=dims,
            device=device, memory=memory, caller_owned=True,
        )

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue) -> None:
        self._inputs[name] = ortvalue.binding(self._session, input=name)

    def synchronize_inputs(self) -> None:
        _synchronize(self._inputs.values())

    # -- outputs ---------------------------------------------------------------------

    def bind_output(
        self,
        name: str,
        device_type: str = "cpu",
        device_id: int = 0,
        element_type: Any = None,
        shape: Sequence[int] | None = None,
        buffer_ptr: int | None = None,
    ) -> None:
        """Bind an output: to memory the caller owns at ``buffer_ptr`` (host, or a device
        whose provider wraps addresses), or to a device, where the session allocates it
        on each run (it stays there)."""
        device = device_type.lower()
        if buffer_ptr is not None:
            if element_type is None or shape is None:
                raise InvalidInputError("`element_type` and `shape` are to be provided if pre-allocated memory is provided")
            self._outputs[name] = (device, self._pointer_binding(name, device_type, device_id, element_type, shape, buffer_ptr, False))
            return
        outputs = {o.name: o for o in self._session.outputs}
        if name not in outputs:
            raise InvalidInputError(f"unknown output {name!r}; the model's outputs are {list(outputs)}")
        binding = None
        if device != "cpu":
            memory = _device_memory(device_type, self._session)  # refused now if the session has no such memory
            declared = outputs[name].shape
            dims = [d for d in declared or () if isinstance(d, int)]
            if declared is not None and len(dims) == len(declared) and outputs[name].dtype is not None:
                # a static output gets a buffer in that memory: the run stores into it there
                buffer = memory.allocate(tuple(dims), outputs[name].dtype, _device(memory, device_id))
                binding = DeviceBinding(
                    input=None, output=name, buffer=buffer, shape=dims, device=memory.default_device, memory=memory
                )
        self._outputs[name] = (device, binding)

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue) -> None:
        self._outputs[name] = (ortvalue.device_name(), ortvalue.binding(self._session, output=name))

    def synchronize_outputs(self) -> None:
        _synchronize(b for _, b in self._outputs.values() if b is not None)

    # -- results ---------------------------------------------------------------------

    def get_outputs(self) -> list[OrtValue]:
        """The outputs of the last run, in the order they were bound."""
        return list(self._results)

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        return [np.array(v.numpy(), copy=True) for v in self._results]

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()
        self._results = []

    # -- running ---------------------------------------------------------------------

    def run(self, run_options: RunOptions | None) -> None:
        """Run the session on these bindings (``InferenceSession.run_with_iobinding``)."""
        if not self._outputs:
            raise InvalidInputError("At least one output should be requested: bind one with bind_output")
        session = self._session
        bindings = list(self._inputs.values()) + [b for _, b in self._outputs.values() if b is not None]
        slot = run_options.graph_id() if run_options is not None else None
        if slot is not None:
            results = guarded_run(run_options, lambda: self._replay(slot, bindings))
        else:
            results = guarded_run(run_options, lambda: session.run(bindings=bindings))
        values = []
        for name, (device, binding) in self._outputs.items():
            if binding is not None:
                values.append(OrtValue(binding.view(), device, binding.memory))
            elif device == "cpu":
                values.append(OrtValue(results[name]))
            else:
                # an output of symbolic shape comes back to the host and is moved once
                memory = _device_memory(device, session)
                values.append(OrtValue(memory.to_device(results[name], memory.default_device), device, memory))
        self._results = values

    def _replay(self, slot: Any, bindings: list[DeviceBinding]) -> dict[str, Any]:
        """Capture on the first run of a ``gpu_graph_id``, replay on the next ones."""
        from .capture import Captured

        session = self._session
        slotted = _takes_slot(session)
        if slot != 0 and not slotted:
            raise NotSupportedError(
                f"gpu_graph_id {slot}", "this plugrt session keeps one capture: use gpu_graph_id 0 or -1"
            )
        extra: dict[str, Any] = {"slot": _slot_name(slot)} if slotted else {}
        if slot not in self._captured_slots:
            captured = session.try_capture(bindings=bindings, **extra)
            if not isinstance(captured, Captured):
                return session.run(bindings=bindings)
            self._captured_slots.add(slot)
        return session.replay(bindings=bindings, **extra)

    def __getattr__(self, name: str) -> Any:
        raise NotSupportedError(f"IOBinding.{name}", "use get_outputs() or copy_outputs_to_cpu()")


def _slot_name(graph_id: int) -> str:
    """The capture slot for onnxruntime's ``gpu_graph_id``: 0, its default, is plugrt's default slot."""
    from .capture import DEFAULT_SLOT

    return DEFAULT_SLOT if graph_id == 0 else str(graph_id)


def _takes_slot(session: "Session") -> bool:
    import inspect

    return "slot" in inspect.signature(session.try_capture).parameters


def _pointer_spec(name: str, element_type: Any, shape: Any, buffer_ptr: Any) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, address) of memory bound by address, or InvalidInputError saying what is wrong."""
    if isinstance(buffer_ptr, bool) or not isinstance(buffer_ptr, (int, np.integer)):
        raise InvalidInputError(
            f"buffer_ptr for {name!r} must be an integer address (e.g. array.ctypes.data, "
            f"tensor.data_ptr()), got {type(buffer_ptr).__name__}"
        )
    pointer = int(buffer_ptr)
    if pointer <= 0:
        raise InvalidInputError(f"buffer_ptr for {name!r} is {pointer}: a null or negative address holds no tensor")
    dtype = _element_dtype(element_type)
    if dtype.kind in "OUSV":
        raise InvalidInputError(
            f"element_type {dtype} for {name!r} cannot be bound by address: only numeric and bool tensors have a "
            "fixed-size layout in memory; pass strings as a numpy array with bind_cpu_input"
        )
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (Sequence, np.ndarray)):
        raise InvalidInputError(f"shape for {name!r} must be a sequence of non-negative integers, got {shape!r}")
    dims = tuple(shape)
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and int(d) >= 0 for d in dims):
        raise InvalidInputError(f"shape for {name!r} must be a sequence of non-negative integers, got {list(dims)}")
    return dtype, tuple(int(d) for d in dims), pointer


def _host_array(element_type: Any, shape: Sequence[int], buffer_ptr: int) -> np.ndarray:
    """The host memory at ``buffer_ptr`` as an array (no copy): the caller keeps it alive."""
    import ctypes

    dtype = _element_dtype(element_type)
    shape = tuple(int(d) for d in shape)
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.empty(shape, dtype)  # nothing to read: no memory to wrap
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(int(buffer_ptr))
    return np.frombuffer(memoryview(raw).cast("B"), dtype=dtype, count=count).reshape(shape)


def _synchronize(bindings: Any) -> None:
    for binding in bindings:
        sync = getattr(binding.buffer, "device", None)
        synchronize = getattr(sync, "synchronize", None)
        if synchronize is not None:
            synchronize()
