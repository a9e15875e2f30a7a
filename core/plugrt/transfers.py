"""Moving arrays between memory spaces through the providers that own them, counted."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from .provider import MemoryCapability

__all__ = ["TransferCounter", "MemorySpaces", "owner_of"]


@dataclasses.dataclass
class TransferCounter:
    """Copies between host and device memory (and within a device) since the session was built."""

    to_device: int = 0
    to_host: int = 0
    device_copies: int = 0  # device-to-device copies (e.g. an output into its binding)
    to_device_bytes: int = 0
    to_host_bytes: int = 0

    @property
    def host_transfers(self) -> int:
        """Copies that crossed between host and device memory."""
        return self.to_device + self.to_host

    def snapshot(self) -> "TransferCounter":
        return dataclasses.replace(self)

    def since(self, before: "TransferCounter") -> "TransferCounter":
        """The copies made after ``before`` was taken (e.g. by one run)."""
        return TransferCounter(
            *(getattr(self, f.name) - getattr(before, f.name) for f in dataclasses.fields(self))
        )


def _nbytes(array: Any) -> int:
    return int(np.prod(array.shape, dtype=np.int64)) * np.dtype(array.dtype).itemsize


def owner_of(array: Any, memories: Sequence[MemoryCapability]) -> MemoryCapability | None:
    """The provider among ``memories`` whose memory holds ``array``; None for host memory
    (numpy arrays and scalars) or a non-array."""
    if array is None or isinstance(array, (np.ndarray, np.generic)):
        return None
    for memory in memories:
        if memory.owns(array):
            return memory
    return None


class MemorySpaces:
    """The memory spaces of a session's providers: who owns an array, and counted copies.

    Host memory (numpy) needs no provider; every other space belongs to a provider with
    the :class:`~plugrt.provider.MemoryCapability`.
    """

    def __init__(self, memories: Sequence[MemoryCapability]):
        self.memories = list(memories)
        self.counter = TransferCounter()

    def __bool__(self) -> bool:
        return bool(self.memories)

    def owner(self, array: Any) -> MemoryCapability | None:
        """The provider whose memory holds ``array``; None for host memory (or a non-array)."""
        return owner_of(array, self.memories)

    def to_host(self, array: Any) -> Any:
        """``array`` in host memory (unchanged when it is there already)."""
        owner = self.owner(array)
        if owner is None:
            return array
        self.counter.to_host += 1
        self.counter.to_host_bytes += _nbytes(array)
        return owner.to_host(array)

    def to_memory(self, array: Any, target: MemoryCapability | None) -> Any:
        """``array`` in ``target``'s memory (host when None), moved only when needed."""
        if target is None:
            return self.to_host(array)
        if target.owns(array):
            return array
        host = self.to_host(array)
        if not isinstance(host, (np.ndarray, np.generic)):
            return host  # a sequence or None: only tensors live in device memory
        host = np.asarray(host)
        self.counter.to_device += 1
        self.counter.to_device_bytes += host.nbytes
        return target.to_device(host, target.default_device)

    def mover(self, target: MemoryCapability | None) -> Callable[[Any], Any]:
        """A plan step that brings its input into ``target``'s memory (host when None)."""
        if target is None:
            ndarray, to_host = np.ndarray, self.to_host

            def to_host_step(x: Any) -> Any:
                return x if type(x) is ndarray else to_host(x)

            return to_host_step
        owns, to_memory = target.owns, self.to_memory

        def to_device_step(x: Any) -> Any:
            return x if owns(x) else to_memory(x, target)

        return to_device_step

    def copy_into(self, source: Any, target: Any) -> None:
        """Copy ``source`` into the existing array ``target`` (same shape and dtype),
        through the provider owning either; host to host is ``numpy.copyto``."""
        source_owner, target_owner = self.owner(source), self.owner(target)
        if source_owner is None and target_owner is None:
            np.copyto(target, source)
            return
        if source_owner is not None and target_owner is not None and source_owner is not target_owner:
            source, source_owner = self.to_host(source), None  # across two devices: via the host
        if source_owner is None:
            self.counter.to_device += 1
            self.counter.to_device_bytes += _nbytes(target)
            if not isinstance(source, np.ndarray):
                source = np.asarray(source)
            target_owner.copy_into(source, target)  # type: ignore[union-attr]
        elif target_owner is None:
            self.counter.to_host += 1
            self.counter.to_host_bytes += _nbytes(source)
            source_owner.copy_into(source, target)
        else:
            self.counter.device_copies += 1
            target_owner.copy_into(source, target)
