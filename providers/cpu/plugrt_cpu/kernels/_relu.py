"""Relu as numpy's maximum against an array of zeros, which runs about three times faster than against the scalar 0."""

from __future__ import annotations

import numpy as np

# numpy's float maximum with a scalar operand takes a loop that is about three times
# slower than the one for two arrays (measured on float32 rows of 27 K to 800 K elements,
# numpy 2.4, AVX-512 machine: 351 K elements 139 us -> 46 us). The zeros are read a chunk
# at a time, so one small array serves every size.
_CHUNK = 1 << 16
_FAST = (np.dtype(np.float32), np.dtype(np.float64))
_ZEROS: dict[np.dtype, np.ndarray] = {}


def _zeros(dtype: np.dtype) -> np.ndarray:
    zeros = _ZEROS.get(dtype)
    if zeros is None:
        zeros = np.zeros(_CHUNK, dtype)
        zeros.flags.writeable = False
        _ZEROS[dtype] = zeros
    return zeros


def relu_into(out: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``np.maximum(x, 0, out=out)``, the same values bit for bit (NaN stays NaN); ``out``
    may be ``x``. Returns ``out``."""
    if x.dtype not in _FAST or out.dtype != x.dtype or out.shape != x.shape:
        return np.maximum(x, 0, out=out)
    zeros = _zeros(x.dtype)
    if not (x.flags.c_contiguous and out.flags.c_contiguous):
        # a block of rows of a larger array (an output block of Conv): the zeros broadcast
        # along the rows (measured on 64 rows of 1512 of 3025 floats with numpy's ufunc
        # buffers at 1024 values: 16 us against 41 for the scalar 0; at its default 8192,
        # 47 against 62, so callers on such blocks shrink the buffers: see _gemm.bias_relu)
        last = x.shape[-1]
        if last > _CHUNK or x.strides[-1] != x.itemsize or out.strides[-1] != out.itemsize:
            return np.maximum(x, 0, out=out)
        return np.maximum(x, zeros[:last], out=out)
    source, target = x.reshape(-1), out.reshape(-1)
    size = source.size
    for start in range(0, size, _CHUNK):
        stop = min(size, start + _CHUNK)
        np.maximum(source[start:stop], zeros[: stop - start], out=target[start:stop])
    return out
