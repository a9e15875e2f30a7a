"""Device bindings (IO binding): persistent buffers on the session's device bound to
inputs and outputs, with transfer statistics."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from .errors import InvalidInputError

__all__ = ["TransferStats", "DeviceBinding"]


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
        upload: Callable[[np.ndarray, Any], None] | None = None,
        download: Callable[[Any], np.ndarray] | None = None,
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
        self._upload = upload
        self._download = download
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
        if len(shape) != len(self.capacity) or any(s > c for s, c in zip(shape, self.capacity)):
            raise InvalidInputError(
                f"binding {self.name!r}: logical shape {tuple(shape)} does not fit its capacity "
                f"{self.capacity}; allocate it with a larger capacity",
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
        if self._upload is not None:
            self._upload(array, self.view())
        else:
            np.copyto(self.view(), array)
        self.stats.uploads += 1
        self.stats.upload_bytes += array.nbytes

    def read(self) -> np.ndarray:
        """Download the logical region to a new host array."""
        self._check_alive()
        view = self.view()
        host = self._download(view) if self._download is not None else np.array(view, copy=True)
        self.stats.downloads += 1
        self.stats.download_bytes += host.nbytes
        return host

    def store(self, value: Any) -> None:
        """Put a run's output into the buffer (device to device; not counted as a transfer)."""
        self._check_alive()
        value = np.asarray(value) if self._upload is None else value
        self.set_shape(value.shape)
        target = self.view()
        if target is not value:
            np.copyto(target, value)

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
