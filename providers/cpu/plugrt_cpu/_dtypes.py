"""ONNX element types as numpy dtypes; the CPU provider shares the core's table."""

from __future__ import annotations

from plugrt.provider import numpy_dtype, onnx_type

__all__ = ["numpy_dtype", "onnx_type"]
