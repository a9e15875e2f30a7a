"""onnxruntime's SparseTensor: COO and CSR(C) values with their indices, held on the host."""

from __future__ import annotations

import enum
from typing import Any, Sequence

import numpy as np

from ._dtypes import onnx_type_name
from .errors import InvalidInputError, ProviderUnavailableError

__all__ = ["SparseTensor", "OrtSparseFormat"]


class OrtSparseFormat(enum.IntEnum):
    ORT_SPARSE_UNDEFINED = 0
    ORT_SPARSE_COO = 1
    ORT_SPARSE_CSRC = 2
    ORT_SPARSE_BLOCK_SPARSE = 4


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


class _CooView:
    def __init__(self, indices: np.ndarray) -> None:
        self._indices = indices

    def indices(self) -> np.ndarray:
        """Linear (or 2-D) indices of the values, read-only."""
        return _read_only(self._indices)


class _CsrcView:
    def __init__(self, inner: np.ndarray, outer: np.ndarray) -> None:
        self._inner, self._outer = inner, outer

    def inner(self) -> np.ndarray:
        return _read_only(self._inner)

    def outer(self) -> np.ndarray:
        return _read_only(self._outer)


class SparseTensor:
    """A sparse tensor's dense shape, values and indices (the arrays are kept, not copied).
    plugrt's kernels are dense: a SparseTensor is data to hold and pass on, not a session feed."""

    def __init__(self, fmt: OrtSparseFormat, dense_shape: Sequence[int], values: np.ndarray, indices: tuple[np.ndarray, ...]) -> None:
        self._format = fmt
        self._shape = [int(d) for d in dense_shape]
        self._values = values
        self._indices = indices

    @classmethod
    def sparse_coo_from_numpy(cls, dense_shape: Sequence[int], values: np.ndarray, coo_indices: np.ndarray, ort_device: Any = None) -> "SparseTensor":
        values, indices = np.asarray(values), np.asarray(coo_indices, dtype=np.int64)
        if indices.ndim == 1 and len(indices) != len(values):
            raise InvalidInputError(f"COO: {len(indices)} linear indices for {len(values)} values")
        _host_only(ort_device)
        return cls(OrtSparseFormat.ORT_SPARSE_COO, dense_shape, values, (indices,))

    @classmethod
    def sparse_csr_from_numpy(
        cls, dense_shape: Sequence[int], values: np.ndarray, inner_indices: np.ndarray, outer_indices: np.ndarray, ort_device: Any = None
    ) -> "SparseTensor":
        values = np.asarray(values)
        inner, outer = np.asarray(inner_indices, dtype=np.int64), np.asarray(outer_indices, dtype=np.int64)
        if len(inner) != len(values) or len(outer) != int(dense_shape[0]) + 1:
            raise InvalidInputError("CSR: inner indices need one per value and outer indices rows + 1 entries")
        _host_only(ort_device)
        return cls(OrtSparseFormat.ORT_SPARSE_CSRC, dense_shape, values, (inner, outer))

    def format(self) -> OrtSparseFormat:
        return self._format

    def dense_shape(self) -> list[int]:
        return list(self._shape)

    def data_type(self) -> str:
        return "sparse_" + onnx_type_name(self._values.dtype)

    def device_name(self) -> str:
        return "cpu"

    def values(self) -> np.ndarray:
        return _read_only(self._values)

    def as_coo_view(self) -> _CooView:
        if self._format != OrtSparseFormat.ORT_SPARSE_COO:
            raise InvalidInputError(f"this sparse tensor is {self._format.name}, not COO")
        return _CooView(self._indices[0])

    def as_csrc_view(self) -> _CsrcView:
        if self._format != OrtSparseFormat.ORT_SPARSE_CSRC:
            raise InvalidInputError(f"this sparse tensor is {self._format.name}, not CSR(C)")
        return _CsrcView(*self._indices)

    def to_cuda(self, ort_device: Any) -> "SparseTensor":
        raise ProviderUnavailableError(
            "cuda", "plugrt keeps sparse tensors on the host", hint="densify it and upload with OrtValue.ortvalue_from_numpy(x, 'cuda')"
        )


def _host_only(ort_device: Any) -> None:
    if ort_device is not None and ort_device.device_type() != 0:
        raise ProviderUnavailableError("cuda", "plugrt keeps sparse tensors on the host", hint="make it with OrtDevice.make('cpu', 0)")
