"""What the CUDA provider reads after a replay, tested over a fake cupy (no GPU): blocks
taken from cupy's pools while a replay runs, the stream's error state, and caller-owned
device memory wrapped by address; and the provider saying plain runs should be graphs."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from plugrt.provider import Device, DeviceKind

from plugrt_cuda._provider import CUDAProvider
from plugrt_cuda._capture import NoAllocations, allocation_counter, stream_error, wrap_pointer

from cuda_helpers import NumpyCUDA


class CUDARuntimeError(RuntimeError):
    """cupy's runtime error: a CUDA status that is not success."""

    def __init__(self, status: int):
        super().__init__(f"cudaError {status}")
        self.status = status


class _Hooks(threading.local):
    def __init__(self) -> None:
        self.active: dict[str, object] = {}


class _FakeCupy:
    """What the hooks use of cupy: ``MemoryHook`` (registered per thread while entered, by
    name, as cupy's), a pool whose ``malloc`` calls the hooks, the runtime's
    ``streamQuery`` and ``CUDARuntimeError``, and UnownedMemory/MemoryPointer/ndarray."""

    def __init__(self, status: int | Exception = 0) -> None:
        hooks = self._hooks = _Hooks()

        class MemoryHook:
            name = "MemoryHook"

            def __enter__(self):
                if self.name in hooks.active:
                    raise RuntimeError(f"hook {self.name} already exists")
                hooks.active[self.name] = self
                return self

            def __exit__(self, *exc):
                del hooks.active[self.name]

            def malloc_preprocess(self, device_id, size, mem_size):
                pass

        def stream_query(pointer: int) -> int:
            self.queried.append(pointer)
            if isinstance(status, Exception):
                raise status
            return status

        self.queried: list[int] = []
        runtime = types.SimpleNamespace(streamQuery=stream_query, CUDARuntimeError=CUDARuntimeError)
        self.cuda = types.SimpleNamespace(
            MemoryHook=MemoryHook,
            runtime=runtime,
            get_current_stream=lambda: types.SimpleNamespace(ptr=0xABC),
            UnownedMemory=lambda ptr, size, owner, device_id: ("unowned", ptr, size, owner, device_id),
            MemoryPointer=lambda memory, offset: ("pointer", memory, offset),
        )
        self.ndarray = lambda shape, dtype, memptr: ("ndarray", shape, np.dtype(dtype), memptr)

    def malloc(self, size: int) -> None:
        """A block taken from a pool: every active hook sees it, as cupy's pools call them."""
        for hook in list(self._hooks.active.values()):
            hook.malloc_preprocess(0, size, (size + 511) // 512 * 512)


def test_blocks_taken_from_the_pool_while_counting_are_counted():
    cp = _FakeCupy()
    cp.malloc(100)  # before: not counted
    with allocation_counter(cp) as counted:
        cp.malloc(1000)
        cp.malloc(10)
    cp.malloc(100)  # after: not counted
    assert (counted.count, counted.bytes) == (2, 1024 + 512)
    with allocation_counter(cp) as again:  # a fresh counter each time, one hook class per cupy
        pass
    assert (again.count, again.bytes) == (0, 0) and type(again) is type(counted)


def test_counting_on_another_thread_does_not_see_this_threads_blocks():
    cp = _FakeCupy()
    seen = []

    def other() -> None:
        with allocation_counter(cp) as counted:
            cp.malloc(64)
        seen.append(counted.count)

    with allocation_counter(cp) as here:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert seen == [1] and here.count == 0


@pytest.mark.parametrize("status, error", [(0, ""), (600, ""), (700, "error 700")])
def test_the_stream_status_says_whether_a_replay_recorded_an_error(status, error):
    cp = _FakeCupy(status)
    why = stream_error(cp)
    assert cp.queried == [0xABC]  # the current stream's handle
    assert (error in why) if error else why == ""


def test_a_stream_query_that_raises_is_an_error_unless_the_work_is_still_running():
    assert stream_error(_FakeCupy(CUDARuntimeError(600))) == ""
    assert "cudaStreamQuery" in stream_error(_FakeCupy(CUDARuntimeError(700)))


def test_device_memory_at_an_address_is_wrapped_as_unowned_memory_without_a_copy():
    cp = _FakeCupy()
    array = wrap_pointer(cp, 0x7F0000, (3, 4), np.float16, 1)
    kind, shape, dtype, memptr = array
    assert (kind, shape, dtype) == ("ndarray", (3, 4), np.dtype(np.float16))
    assert memptr == ("pointer", ("unowned", 0x7F0000, 3 * 4 * 2, None, 1), 0)


def test_the_provider_wraps_pointers_counts_and_checks_through_its_cupy():
    cp = _FakeCupy()
    provider = CUDAProvider(backend=types.SimpleNamespace(xp=cp))
    array = provider.from_pointer(0x1000, (2,), np.float32, Device(DeviceKind.GPU, 0))
    assert array[3] == ("pointer", ("unowned", 0x1000, 8, None, 0), 0)
    assert provider.capture_plain_runs is True
    rtol, atol = provider.replay_tolerance
    assert 0 < rtol < 1e-2 and 0 < atol < 1e-2


def test_without_cupy_the_provider_counts_nothing_and_reports_no_stream_error():
    provider = NumpyCUDA()  # numpy stands in for the device: no pools, no stream
    counter = provider.count_allocations()
    assert isinstance(counter, NoAllocations)
    with counter as counted:
        np.zeros(1000)
    assert (counted.count, counted.bytes) == (0, 0)
    assert provider.stream_error() == ""
