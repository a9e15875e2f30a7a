"""The decode step of the tiny builder decoders is capturable, checked without a GPU: run on
the CUDA provider's kernels over a numpy that stands in for device memory and refuses, while
"recording", every read of an array's value on the host (int(), bool(), .item(), .tolist())
and every copy of host data into a new array. A step that passes reads only shapes on the
host, so a graph recorded for one decode step is right for the next, whose seqlens_k,
attention mask and cache contents differ."""

from __future__ import annotations

import contextlib
import types
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from plugrt import genai
from plugrt.provider import Step

from cuda_helpers import NumpyCUDA, registry_of
from plugrt_cuda._backend import NumpyBackend

ASSETS = Path(__file__).parent.parent / "genai" / "assets" / "tiny_llama"
PROMPT = [1, 17, 42, 99, 7, 200, 3]


class HostAccess(AssertionError):
    """A kernel touched a device value from the host while a step was being recorded."""


_RECORDING = [False]


@contextlib.contextmanager
def recording() -> Iterator[None]:
    _RECORDING[0] = True
    try:
        yield
    finally:
        _RECORDING[0] = False


def _refuse(what: str) -> None:
    if _RECORDING[0]:
        raise HostAccess(f"{what} while recording: a device value read on the host (a sync, not capturable)")


class DeviceArray(np.ndarray):
    """A numpy array standing in for device memory: its values cannot be read on the host
    while recording (numpy keeps the subclass through ufuncs, methods and views; a
    scalar result stays a 0-d array, as cupy's do)."""

    def __array_wrap__(self, obj: Any, context: Any = None, return_scalar: bool = False) -> Any:
        return super().__array_wrap__(obj, context, False)

    def __getitem__(self, key: Any) -> Any:
        found = super().__getitem__(key)
        return found if isinstance(found, np.ndarray) else np.asarray(found).view(DeviceArray)

    def __bool__(self) -> bool:
        _refuse("bool(array)")
        return bool(np.asarray(self))

    def __int__(self) -> int:
        _refuse("int(array)")
        return int(np.asarray(self))

    def __float__(self) -> float:
        _refuse("float(array)")
        return float(np.asarray(self))

    def __index__(self) -> int:
        _refuse("operator.index(array)")
        return int(np.asarray(self))

    def item(self, *args: Any) -> Any:
        _refuse("array.item()")
        return np.asarray(self).item(*args)

    def tolist(self) -> Any:
        _refuse("array.tolist()")
        return np.asarray(self).tolist()


def _device(value: Any) -> Any:
    if isinstance(value, np.ndarray) and not isinstance(value, DeviceArray):
        return value.view(DeviceArray)
    if isinstance(value, (tuple, list)):
        return type(value)(_device(v) for v in value)
    return value


class _DeviceNumpy(types.ModuleType):
    """numpy as the kernels' ``xp``: results are device arrays, and building an array from
    host data (asarray/array of anything but a device array) is refused while recording."""

    def __init__(self) -> None:
        super().__init__("device_numpy")

    def __getattr__(self, name: str) -> Any:
        found = getattr(np, name)
        if not callable(found) or isinstance(found, type):
            return found  # dtypes, constants, scalar types

        def call(*args: Any, **kwargs: Any) -> Any:
            if name in ("asarray", "array", "ascontiguousarray") and args and not isinstance(args[0], DeviceArray):
                if isinstance(args[0], (np.ndarray, list, tuple, int, float)):
                    _refuse(f"xp.{name} of host data (a host-to-device copy)")
            return _device(found(*args, **kwargs))

        return call


class _DeviceNumpyBackend(NumpyBackend):
    def __init__(self) -> None:
        super().__init__()
        self.xp = _DeviceNumpy()


class _DeviceNumpyCUDA(NumpyCUDA):
    """The numpy stand-in whose steps see their inputs as device arrays."""

    def __init__(self) -> None:
        super().__init__()
        self._backend = _DeviceNumpyBackend()

    def _bind(self, node: Any, opset_imports: dict[str, int], backend: Any) -> Step:
        step = super()._bind(node, opset_imports, backend)
        fn = step.fn

        def on_device(*inputs: Any) -> Any:
            return fn(*_device(list(inputs)))

        step.fn = on_device
        return step


def test_the_stand_in_refuses_a_host_read_and_a_host_copy_while_recording():
    xp = _DeviceNumpy()
    lengths = xp.ones(3, np.int64)
    assert int(lengths[0]) == 1  # not recording: allowed
    with recording():
        with pytest.raises(HostAccess):
            lengths.tolist()
        with pytest.raises(HostAccess):
            bool(lengths[0] > 0)
        with pytest.raises(HostAccess):
            xp.asarray([1, 2])
        (lengths + 1).sum(axis=0, keepdims=True)  # device work is fine


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_a_decode_step_reads_no_device_value_on_the_host(precision):
    model = genai.Model(ASSETS / precision, device="cuda", registry=registry_of(_DeviceNumpyCUDA()))
    assert model.session.placement.fallbacks == []
    generator = genai.Generator(model, max_length=len(PROMPT) + 4, capture=False)
    generator.append_tokens(PROMPT)
    generator.generate_next_token()  # the prompt
    generator.generate_next_token()  # a first decode step: the warm-up a capture runs
    with recording():
        token = generator.generate_next_token()  # as it would be recorded
    expected = genai.generate(genai.Model(ASSETS / precision), PROMPT, max_length=len(PROMPT) + 3)
    assert [*generator.get_sequence()[len(PROMPT):]] == expected
    assert token == expected[-1]
