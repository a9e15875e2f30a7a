"""plugrt's CUDA execution provider (cupy arrays, own CUDA C kernels, CUDA graphs)."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
