"""Running a test twice, with a kernel's compiled numba loops and with its numpy path."""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import pytest

PATHS = ["numba", "numpy"]


def numba_or_numpy(request: Any, monkeypatch: pytest.MonkeyPatch, loops: Callable[[], Any]) -> Iterator[str]:
    """The body of a fixture parametrized by ``PATHS``: "numba" checks that ``loops`` (a
    ``functools.cache``d loader such as ``depthwise_loops``) finds the compiled module and is
    skipped under PLUGRT_NUMBA=0 or without numba; "numpy" sets PLUGRT_NUMBA=0 and clears the loader's cache
    around the test, so the kernel takes its numpy path."""
    if request.param == "numba":
        if os.environ.get("PLUGRT_NUMBA", "1") == "0":
            pytest.skip("PLUGRT_NUMBA=0 turns the compiled loops off")
        pytest.importorskip("numba")
        assert loops() is not None
        yield request.param
        return
    monkeypatch.setenv("PLUGRT_NUMBA", "0")
    loops.cache_clear()  # type: ignore[attr-defined]
    yield request.param
    loops.cache_clear()  # type: ignore[attr-defined]
