"""Shared fixtures."""

from __future__ import annotations

import pytest

from helpers import model_bytes


@pytest.fixture(scope="session", autouse=True)
def _compiled_loops_built():
    """The CPU provider's compiled loops (where numba is installed) built before the first
    test, as the first step to use them built them before they were built in the
    background: every test then takes the same path on every run. Tests of the
    background build use a loader of their own."""
    try:
        from plugrt_cpu.kernels import _compiled
    except ImportError:
        yield
        return
    _compiled.wait_ready()
    yield


@pytest.fixture
def add_relu_model() -> bytes:
    return model_bytes(
        """
        <ir_version: 8, opset_import: ["" : 17], producer_name: "tests">
        add_relu (float[N, 4] x, float[N, 4] y) => (float[N, 4] z) {
            s = Add(x, y)
            z = Relu(s)
        }
        """
    )
