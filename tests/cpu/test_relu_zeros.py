"""relu_into, numpy's maximum against chunks of zeros, gives np.maximum(x, 0)'s bits."""

from __future__ import annotations

import numpy as np
import pytest

from plugrt_cpu.kernels._relu import _CHUNK, relu_into


def _values(size: int, dtype) -> np.ndarray:
    x = np.random.default_rng(0).standard_normal(size).astype(dtype)
    x[:6] = [np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0]
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size", [6, _CHUNK, 2 * _CHUNK + 3])
def test_relu_into_matches_maximum_with_zero_bitwise(dtype, size):
    x = _values(size, dtype)
    expected = np.maximum(x, 0)
    got = relu_into(np.empty_like(x), x)
    assert got.dtype == expected.dtype
    assert got.tobytes() == expected.tobytes()


def test_relu_into_works_in_place_on_a_multidimensional_array():
    x = _values(3 * 5 * 7 * 11, np.float32).reshape(3, 5, 7, 11)
    expected = np.maximum(x, 0)
    assert relu_into(x, x) is x
    assert x.tobytes() == expected.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_into_on_a_block_of_rows_of_a_larger_array_matches_maximum_bitwise(dtype):
    whole = _values(7 * 300, dtype).reshape(7, 300)
    whole[3, 100:106] = whole[0, :6]  # NaNs, infinities and signed zeros inside the block
    block = whole[:, 100:250]  # unit-step rows, 300 apart
    expected = np.maximum(block, 0)
    untouched = whole[:, 250:].copy()
    assert relu_into(block, block) is block
    assert block.tobytes() == expected.tobytes()
    assert whole[:, 250:].tobytes() == untouched.tobytes()


@pytest.mark.parametrize(
    "x",
    [
        _values(40, np.float32).reshape(5, 8)[:, ::2],  # not contiguous
        _values(40, np.float16),
        np.arange(-20, 20, dtype=np.int32),
    ],
    ids=["strided", "float16", "int32"],
)
def test_relu_into_falls_back_to_maximum_for_other_arrays(x):
    out = np.empty(x.shape, x.dtype)
    relu_into(out, x)
    assert out.tobytes() == np.maximum(x, 0).tobytes()
