"""Device bindings (IO binding): persistent buffers bound to inputs and outputs, and
how a run's outputs reach their bindings or the caller."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from .errors import BindingShapeError, InvalidInputError, UnknownInputError
from .provider import MemoryCapability
from .transfers import MemorySpaces

__all__ = [
    "TransferStats",
    "DeviceBinding",
    "allocate_binding",
    "bind_host_array",
    "binding_info",
    "bound_feeds",
    "deliver",
    "deliver_outputs",
]


@dataclasses.dataclass
class TransferStats:
    """Host <-> device traffic through one binding."""

    uploads: int = 0
    upload_bytes: int = 0
    downloads: int = 0
    download_bytes: int = 0


class DeviceBinding:
    """A persistent buffer bound to an input, an output, or both (state carried across
    runs, e.g. a KV cache). Its physical ``capacity`` may exceed the logical ``shape``;
    the logical view is the leading corner of the buffer.

    Create one with :meth:`plugrt.Session.allocate_binding` or
    :meth:`plugrt.Session.bind_array`.
    """

    def __init__(
        self,
        *,
        input: str | None,
        output: str | None,
        buffer: Any,
        shape: Sequence[int],
        device: Any,
        memory: MemoryCapability | None = None,
        spaces: MemorySpaces | None = None,
        caller_owned: bool = False,
    ):
        if input is None and output is None:
            raise InvalidInputError("a binding needs an input name, an output name, or both")
        self.input = input
        self.output = output
        self.buffer = buffer
        self.device = device
        self.caller_owned = caller_owned
        self.stats = TransferStats()
        self.freed = False
        self.generation = 0  # bumped whenever the logical shape changes: captures check it
        self.memory = memory  # the provider owning the buffer's memory; None: host memory
        self._spaces = spaces if spaces is not None else MemorySpaces([memory] if memory is not None else [])
        self._shape = tuple(int(d) for d in shape)
        self._check_fits(self._shape)

    # -- shape ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.input or self.output or ""

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.buffer.dtype)

    @property
    def capacity(self) -> tuple[int, ...]:
        return tuple(self.buffer.shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def _check_fits(self, shape: Sequence[int]) -> None:
        shape, capacity = tuple(shape), self.capacity
        if len(shape) != len(capacity):
            same_size = int(np.prod(shape)) == int(np.prod(self._shape))
            raise BindingShapeError(
                self.name,
                capacity,
                shape,
                f"binding {self.name!r} has shape {self._shape} (rank {len(capacity)}); {shape} has rank "
                f"{len(shape)}: the shapes differ in rank{', not in size' if same_size else ''}. "
                + (f"Reshape the array to {self._shape} (array.reshape{self._shape}), " if same_size else "Reshape the array to rank "
                   f"{len(capacity)}, ")
                + f"or allocate the binding with shape={shape}",
                input_name=self.input,
            )
        if any(s > c for s, c in zip(shape, capacity)):
            larger = tuple(max(s, c) for s, c in zip(shape, capacity))
            raise BindingShapeError(
                self.name,
                capacity,
                shape,
                f"binding {self.name!r}: shape {shape} does not fit its capacity {capacity}; allocate it "
                f"with capacity={larger} (or larger)",
                input_name=self.input,
            )

    def set_shape(self, shape: Sequence[int]) -> None:
        shape = tuple(int(d) for d in shape)
        self._check_fits(shape)
        if shape != self._shape:
            self._shape = shape
            self.generation += 1

    def view(self) -> Any:
        """The logical region of the buffer, on the device (no copy)."""
        self._check_alive()
        if self._shape == self.capacity:
            return self.buffer
        return self.buffer[tuple(slice(0, d) for d in self._shape)]

    # -- data ----------------------------------------------------------------------------

    def write(self, array: Any) -> None:
        """Upload ``array`` into the buffer, setting the logical shape to its shape."""
        self._check_alive()
        array = np.asarray(array)
        if array.dtype != self.dtype:
            raise InvalidInputError(
                f"binding {self.name!r} holds {self.dtype}, got {array.dtype}", input_name=self.input
            )
        self.set_shape(array.shape)
        self._spaces.copy_into(array, self.view())
        self.stats.uploads += 1
        self.stats.upload_bytes += array.nbytes

    def read(self) -> np.ndarray:
        """Download the logical region to a new host array."""
        self._check_alive()
        view = self.view()
        host = self.memory.to_host(view) if self.memory is not None else np.array(view, copy=True)
        self.stats.downloads += 1
        self.stats.download_bytes += host.nbytes
        return host

    def store(self, value: Any) -> None:
        """Put a run's output into the buffer, through the provider owning either (device
        to device when the output was made where the buffer is: no host copy)."""
        if value is self.buffer and value.shape == self._shape:
            return  # written in place (a capture carrying this binding's state)
        self._check_alive()
        if self._spaces.owner(value) is None and not isinstance(value, np.ndarray):
            value = np.asarray(value)
        self.set_shape(value.shape)
        target = self.view()
        if target is not value:
            self._spaces.copy_into(value, target)

    def free(self) -> None:
        """Release the buffer; a capture that uses it must be reset before the next replay."""
        self.freed = True
        self.generation += 1
        self.buffer = None

    def _check_alive(self) -> None:
        if self.freed:
            raise InvalidInputError(f"binding {self.name!r} was freed", input_name=self.input)

    def __repr__(self) -> str:
        io = ", ".join(f"{k}={v!r}" for k, v in (("input", self.input), ("output", self.output)) if v)
        return f"DeviceBinding({io}, dtype={self.dtype}, shape={self.shape}, capacity={self.capacity})"


def bound_feeds(feeds: Any, bindings: Sequence[DeviceBinding]) -> dict[str, Any]:
    """``feeds`` with each bound input read from its buffer (on its device, no copy)."""
    merged = dict(feeds or {})
    for binding in bindings:
        if binding.input is not None:
            merged[binding.input] = binding.view()
    return merged


def deliver(value: Any, args: Sequence[Any], spaces: MemorySpaces) -> Any:
    """An output the caller may keep and mutate: a host array of its own memory (never a
    numpy scalar, a read-only constant, a caller's input or a view of one)."""
    if type(value) is np.ndarray:
        if not value.flags.writeable:
            return value.copy()
        if value.base is not None or any(value is a for a in args):
            if any(type(a) is np.ndarray and np.may_share_memory(value, a) for a in args):
                return value.copy()
        return value
    if isinstance(value, np.generic):
        return np.asarray(value)
    if isinstance(value, list):
        return [deliver(v, args, spaces) for v in value]
    return spaces.to_host(value) if spaces else value


def deliver_outputs(
    names: Sequence[str],
    values: Sequence[Any],
    bindings: Sequence[DeviceBinding],
    args: Sequence[Any],
    spaces: MemorySpaces,
    *,
    persistent: bool = False,
) -> dict[str, Any]:
    """Bound outputs go into their buffers (returned as None; a value already None was
    stored during the run); the rest to the caller on the host. ``persistent``: the values
    are buffers a later run overwrites (a capture), so host outputs are copied."""
    bound = {b.output: b for b in bindings if b.output is not None}
    result: dict[str, Any] = {}
    for name, value in zip(names, values):
        binding = bound.get(name)
        if binding is not None:
            if value is not None:
                binding.store(value)
            result[name] = None
        elif persistent and isinstance(value, np.ndarray):
            result[name] = value.copy()
        else:
            result[name] = deliver(value, args, spaces)
    return result


def allocate_binding(
    info: Any,
    input: str | None,
    output: str | None,
    spaces: MemorySpaces,
    host_device: Any,
    *,
    dtype: Any = None,
    shape: Sequence[int] | None = None,
    capacity: Sequence[int] | None = None,
) -> DeviceBinding:
    """A binding whose buffer comes from the first provider with its own memory (host
    memory when none has); ``info`` (a TensorInfo) gives the declared dtype and shape."""
    dtype = np.dtype(dtype if dtype is not None else info.dtype)
    if shape is None:
        if info.shape is None or not all(isinstance(d, int) for d in info.shape):
            raise InvalidInputError(f"binding {info.name!r} has symbolic dims {info.shape}; pass shape=", input_name=input)
        shape = [int(d) for d in info.shape]
    elif input is not None:
        _check_declared(info, tuple(int(d) for d in shape))
    capacity = tuple(capacity) if capacity is not None else tuple(shape)
    memory = spaces.memories[0] if spaces else None
    device = memory.default_device if memory is not None else host_device
    buffer = memory.allocate(capacity, dtype, device) if memory is not None else np.zeros(capacity, dtype)
    return DeviceBinding(input=input, output=output, buffer=buffer, shape=shape, device=device, memory=memory, spaces=spaces)


def _check_declared(info: Any, shape: tuple[int, ...]) -> None:
    """Refuse, at allocation, a shape the input's declared shape rules out (another rank,
    or another size on a fixed axis): a run would refuse it later, far from the cause."""
    declared = info.shape
    if declared is None:
        return
    declared = tuple(declared)
    fixed = tuple(d if isinstance(d, int) and d >= 0 else s for d, s in zip(declared, shape))
    if len(declared) != len(shape):
        why = f"has rank {len(shape)}; the input has rank {len(declared)}"
    else:
        axes = [i for i, (d, s) in enumerate(zip(declared, shape)) if isinstance(d, int) and d >= 0 and d != s]
        if not axes:
            return
        why = "differs on fixed axis " + ", ".join(f"{i} ({shape[i]}, the model fixes {declared[i]})" for i in axes)
    raise BindingShapeError(
        info.name,
        declared,
        shape,
        f"binding for input {info.name!r}: shape={shape} {why}; the model declares {declared}. Allocate with "
        + (f"shape={fixed}" if len(declared) == len(shape) else f"a shape of rank {len(declared)}")
        + " (only symbolic axes may take another size)",
        input_name=info.name,
    )


def bind_host_array(
    array: Any, input: str | None, output: str | None, spaces: MemorySpaces, host_device: Any
) -> DeviceBinding:
    """A binding over caller-owned host memory (a numpy array)."""
    if not isinstance(array, np.ndarray):
        raise InvalidInputError("bind_array needs a numpy array", input_name=input)
    return DeviceBinding(
        input=input, output=output, buffer=array, shape=array.shape, device=host_device, spaces=spaces, caller_owned=True
    )


def binding_info(inputs: Sequence[Any], outputs: Sequence[Any], input: str | None, output: str | None) -> Any:
    """The TensorInfo a binding of ``input`` and/or ``output`` follows (the input's when both)."""
    if input is None and output is None:
        raise InvalidInputError("name an input, an output, or both")
    input_names = [i.name for i in inputs]
    by_output = {o.name: o for o in outputs}
    if input is not None and input not in input_names:
        raise UnknownInputError(input, input_names)
    if output is not None and output not in by_output:
        raise InvalidInputError(f"unknown output {output!r}; the model's outputs are {list(by_output)}")
    return inputs[input_names.index(input)] if input is not None else by_output[output]
