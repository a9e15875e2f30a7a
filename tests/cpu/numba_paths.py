"""Running a test twice, with a kernel's compiled numba loops and with its numpy path."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Iterator

import pytest

PATHS = ["numba", "numpy"]


def numba_or_numpy(request: Any, monkeypatch: pytest.MonkeyPatch, loops: Callable[[], Any]) -> Iterator[str]:
    """The body of a fixture parametrized by ``PATHS``: "numba" checks that ``loops`` (a
    loader such as ``depthwise_loops``) finds the compiled module (built before the first
    test: see conftest) and is skipped under PLUGRT_NUMBA=0 or without numba; "numpy" sets
    PLUGRT_NUMBA=0 and has it read again around the test, so the kernel takes its numpy path."""
    if request.param == "numba":
        if os.environ.get("PLUGRT_NUMBA", "1") == "0":
            pytest.skip("PLUGRT_NUMBA=0 turns the compiled loops off")
        pytest.importorskip("numba")
        assert loops() is not None
        yield request.param
        return
    monkeypatch.setenv("PLUGRT_NUMBA", "0")
    _forget_loaders()
    yield request.param
    _forget_loaders()


def _forget_loaders() -> None:
    """Clear the ``functools.cache``d functions of ``plugrt_cpu.kernels`` modules (among
    them ``_compiled._mode``, PLUGRT_NUMBA as read), so that none keeps what it found under
    PLUGRT_NUMBA=0 past the test, nor what it found before it into the test. Not the
    compiled pool: its workers run on its state, which must outlive them."""
    for name, module in list(sys.modules.items()):
        if name.startswith("plugrt_cpu.kernels") and module is not None:
            for value in list(vars(module).values()):
                if isinstance(value, functools._lru_cache_wrapper) and value.__module__ == name and not name.endswith("._compiled_parallel"):
                    value.cache_clear()


def compiled_or_skip(loops: Callable[[], Any]) -> Any:
    """What ``loops`` (a loader such as ``decode_loops``) returns once the background build
    has finished; the test is skipped under PLUGRT_NUMBA=0, without numba, or where the
    compiled loops are off."""
    if os.environ.get("PLUGRT_NUMBA", "1") == "0":
        pytest.skip("PLUGRT_NUMBA=0 turns the compiled loops off")
    pytest.importorskip("numba")
    from plugrt_cpu.kernels import _compiled

    assert _compiled.wait_ready(600)
    found = loops()
    if found is None:
        pytest.skip("the compiled loops are off here")
    return found


def record_faster(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[bool]:
    """The answers of ``module._faster`` (a first call's timed choice between two ways of
    a step), recorded as it gives them: the list fills as the choices are made."""
    asked: list[bool] = []
    original = module._faster

    def recorded(first: Callable[[], None], second: Callable[[], None], rounds: int = 2) -> bool:
        asked.append(original(first, second, rounds))
        return asked[-1]

    monkeypatch.setattr(module, "_faster", recorded)
    return asked


def choose_faster(monkeypatch: pytest.MonkeyPatch, module: Any, first_wins: bool) -> None:
    """``module._faster`` answering ``first_wins`` without timing: it runs the second way
    once, as the real one runs it last, so that the first call's output is the chosen
    way's either way (the first way runs again when it wins)."""

    def choose(first: Callable[[], None], second: Callable[[], None], rounds: int = 2) -> bool:
        second()
        return first_wins

    monkeypatch.setattr(module, "_faster", choose)


def count_blocked_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The channel-blocked depthwise (or grouped) jobs a test runs, by their blocks of 16
    channels (``conv._Convolution._depthwise_blocked``'s weight)."""
    from plugrt_cpu.kernels import conv

    runs: list[int] = []
    original = conv._Convolution._depthwise_blocked

    def counted(*args: Any, **kwargs: Any) -> Any:
        runs.append(args[4].shape[0])  # the blocked weight's blocks
        return original(*args, **kwargs)

    monkeypatch.setattr(conv._Convolution, "_depthwise_blocked", staticmethod(counted))
    return runs

