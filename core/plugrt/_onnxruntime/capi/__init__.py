"""``onnxruntime.capi`` as the stand-in serves it."""

from __future__ import annotations

from . import _pybind_state, onnxruntime_inference_collection, onnxruntime_pybind11_state

__all__ = ["_pybind_state", "onnxruntime_inference_collection", "onnxruntime_pybind11_state"]
