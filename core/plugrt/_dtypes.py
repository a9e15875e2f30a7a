"""ONNX element types as numpy dtypes (ml_dtypes for the types numpy lacks)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

__all__ = ["numpy_dtype", "onnx_type", "onnx_type_name"]

_BY_ONNX: dict[int, np.dtype] = {}
for _member in ir.DataType:
    if _member is ir.DataType.UNDEFINED:
        continue
    try:
        _BY_ONNX[int(_member)] = np.dtype(_member.numpy())
    except Exception:  # a type this ml_dtypes version does not provide
        continue


def numpy_dtype(onnx_elem_type: int) -> np.dtype:
    """The numpy dtype for an ONNX ``TensorProto.DataType`` value (strings are object)."""
    try:
        return _BY_ONNX[int(onnx_elem_type)]
    except KeyError:
        raise ValueError(f"ONNX element type {onnx_elem_type} has no numpy equivalent here") from None


def onnx_type(dtype: np.dtype) -> int:
    """The ONNX ``TensorProto.DataType`` value for a numpy dtype."""
    dtype = np.dtype(dtype)
    if dtype.kind in "OUS":
        return int(ir.DataType.STRING)
    return int(ir.DataType.from_numpy(dtype))



def onnx_type_name(dtype: np.dtype) -> str:
    """onnxruntime's spelling of a tensor type, e.g. ``tensor(float)`` (str, bytes and
    object arrays are ``tensor(string)``)."""
    import onnx

    if dtype.kind in "OUS":
        return "tensor(string)"
    enum = onnx.helper.np_dtype_to_tensor_dtype(dtype)
    return f"tensor({onnx.TensorProto.DataType.Name(enum).lower()})"
