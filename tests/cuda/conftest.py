"""Make plugrt_cuda importable from the source tree when it is not installed, and the shared
stand-ins in cuda_helpers.py importable by the tests beside it."""

from __future__ import annotations

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(_HERE)
try:
    import plugrt_cuda  # noqa: F401
except ImportError:  # not installed: test the source tree's copy
    sys.path.insert(0, os.path.join(_HERE, "..", "..", "providers", "cuda"))


@pytest.fixture
def gpu_provider():
    """The real CUDA provider when this machine has a CUDA device; skips otherwise."""
    from plugrt_cuda._provider import CUDAProvider

    provider = CUDAProvider()
    if not provider.devices():
        pytest.skip(f"no CUDA device: {provider.unavailable_reason}")
    return provider
