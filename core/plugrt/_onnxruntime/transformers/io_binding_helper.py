"""``onnxruntime.transformers.io_binding_helper``: the type conversions optimum's IO
binding uses (ONNX type strings to numpy and torch types)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["TypeHelper"]

_NUMPY_OF = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int8)": np.int8, "tensor(int16)": np.int16, "tensor(int32)": np.int32, "tensor(int64)": np.int64,
    "tensor(uint8)": np.uint8, "tensor(uint16)": np.uint16, "tensor(uint32)": np.uint32, "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_, "tensor(string)": np.object_,
}
_TORCH_NAMES = {
    "tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16", "tensor(double)": "float64",
    "tensor(int8)": "int8", "tensor(int16)": "int16", "tensor(int32)": "int32", "tensor(int64)": "int64",
    "tensor(uint8)": "uint8", "tensor(bool)": "bool",
}


def _type_of(values: Any, name: str, what: str) -> str:
    for value in values:
        if value.name == name:
            return value.type
    raise ValueError(f"{what} {name!r} not found; the session's are {[v.name for v in values]}")


class TypeHelper:
    """ONNX type strings (``tensor(float)``) as numpy and torch types."""

    @staticmethod
    def get_input_type(ort_session: Any, name: str) -> str:
        return _type_of(ort_session.get_inputs(), name, "input")

    @staticmethod
    def get_output_type(ort_session: Any, name: str) -> str:
        return _type_of(ort_session.get_outputs(), name, "output")

    @staticmethod
    def ort_type_to_numpy_type(ort_type: str) -> Any:
        try:
            return _NUMPY_OF[ort_type]
        except KeyError:
            raise ValueError(f"{ort_type} has no numpy type here; known: {', '.join(_NUMPY_OF)}") from None

    @staticmethod
    def ort_type_to_torch_type(ort_type: str) -> Any:
        import torch

        try:
            return getattr(torch, _TORCH_NAMES[ort_type])
        except KeyError:
            raise ValueError(f"{ort_type} has no torch type here; known: {', '.join(_TORCH_NAMES)}") from None

    @staticmethod
    def numpy_type_to_torch_type(numpy_type: Any) -> Any:
        import torch

        return torch.from_numpy(np.zeros(0, dtype=numpy_type)).dtype

    @staticmethod
    def torch_type_to_numpy_type(torch_type: Any) -> Any:
        import torch

        return torch.zeros(0, dtype=torch_type).numpy().dtype.type

    @staticmethod
    def get_io_numpy_type_map(ort_session: Any) -> dict[str, Any]:
        """Each input and output name's numpy type."""
        return {v.name: TypeHelper.ort_type_to_numpy_type(v.type) for v in [*ort_session.get_inputs(), *ort_session.get_outputs()]}
