"""Fixtures of the CPU provider's tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def pool():
    """The process's compiled pool (``plugrt_cpu.kernels._compiled_parallel``); skipped
    where there is none."""
    pytest.importorskip("numba")
    from plugrt_cpu.kernels import _compiled_parallel

    made = _compiled_parallel.compiled_pool()
    if made is None:
        pytest.skip("no compiled pool here (PLUGRT_NUMBA=0, not x86-64, or no BLAS to call)")
    return made
