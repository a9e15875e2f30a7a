"""The own GEMM kernel reads each operand as (data, transposed, leading dimension, batch
stride); this checks, over numpy, that the operand it is given reads back as the matrix."""

from __future__ import annotations

import numpy as np
import pytest

from plugrt_cuda._backend import _operand


def _as_the_kernel_reads(data, transposed: int, ld: int, stride: int, rows: int, cols: int, batch: int) -> np.ndarray:
    """Element (r, c) of batch z at data[z*stride + (c*ld + r if transposed else r*ld + c)], as in _GEMM."""
    assert data.flags.c_contiguous
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    flat = data.reshape(-1)
    return np.stack([flat[z * stride + (c * ld + r if transposed else r * ld + c)] for z in range(batch)])


RNG = np.random.default_rng(2)


@pytest.mark.parametrize(
    "make,batch",
    [
        (lambda: RNG.standard_normal((5, 3)).astype(np.float32), (4,)),  # shared by every batch
        (lambda: RNG.standard_normal((3, 5)).astype(np.float32).T, (2,)),  # a Gemm transB weight
        (lambda: RNG.standard_normal((2, 5, 3)).astype(np.float32), (2,)),  # one matrix per batch
        (lambda: RNG.standard_normal((1, 5, 3)).astype(np.float32), (3,)),  # broadcast over the batch
        (lambda: RNG.standard_normal((5, 6)).astype(np.float32)[:, ::2], (1,)),  # strided: copied
        (lambda: RNG.standard_normal((5, 3)).astype(np.float16), (2,)),  # another dtype: converted
    ],
    ids=["2d", "transposed", "batched", "broadcast", "strided", "float16"],
)
def test_operand_reads_back_as_the_matrix(make, batch):
    x = make()
    data, transposed, ld, stride = _operand(np, x, batch, np.dtype(np.float32))
    count = int(np.prod(batch))
    read = _as_the_kernel_reads(data, transposed, ld, stride, x.shape[-2], x.shape[-1], count)
    expected = np.broadcast_to(x, batch + x.shape[-2:]).reshape(count, *x.shape[-2:]).astype(np.float32)
    np.testing.assert_array_equal(read, expected)
    assert data.dtype == np.float32


def test_a_transposed_weight_is_read_in_place():
    w = RNG.standard_normal((3, 5)).astype(np.float32)
    data, transposed, _, stride = _operand(np, w.T, (4,), np.dtype(np.float32))
    assert np.shares_memory(data, w) and data.shape == w.shape and transposed == 1 and stride == 0
