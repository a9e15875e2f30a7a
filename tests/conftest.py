"""Shared fixtures."""

from __future__ import annotations

import pytest

from helpers import model_bytes


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
