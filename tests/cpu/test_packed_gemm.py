"""The packed-weight GEMM of the compiled Conv units (``_numba_gemm``), against numpy in
float64: ragged shapes (rows, columns and depth that are not multiples of its tiles),
deep products that run in slices, the epilogue's residual, bias and Relu, a row step
larger than the columns, and NaN."""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from plugrt_cpu.kernels import _compiled  # noqa: E402

# loaded here, on this thread: ``compiled_module`` answers None while the background load
# is still under way, which skipped this whole file in a run that had not loaded it yet
gemm = _compiled._LOADER.load("_numba_gemm") if _compiled.compiled_enabled() else None
pytestmark = pytest.mark.skipif(gemm is None or not gemm.available(), reason="needs numba and AVX-512")

SHAPES = [
    (1, 1, 1), (16, 16, 16), (17, 3, 33), (30, 37, 20), (64, 256, 49), (5, 2100, 7), (48, 1030, 100), (33, 70, 13),
    (20, 2050, 49),
    # wide products (tiles of 8 rows by 48 columns, two to a row tile): a short second half
    # (13, 29 rows), a tile of fewer than 8 rows (36), groups of three column tiles cut by
    # the last column (200, 150) and by the L2 chunks of a deep product (700)
    (13, 40, 200), (29, 700, 150), (36, 128, 800),
]


def _run(weight, x, *, bias=None, residual=None, relu=False, ldc=None, ldx=None):
    m, k = weight.shape
    n = x.shape[1]
    ldx = ldx or n
    source = np.zeros((k, ldx), np.float32)
    source[:, :n] = x
    ldc = ldc or n
    out = np.full((m, ldc), 7.0, np.float32)  # the columns past n must be left alone
    other = None
    if residual is not None:
        other = np.zeros((m, ldc), np.float32)
        other[:, :n] = residual
    packed = gemm.pack_weight(weight)
    gemm.packed_product(
        packed.ctypes.data, source.ctypes.data, ldx, k, out.ctypes.data, ldc, m, n,
        0 if bias is None else bias.ctypes.data, 0 if other is None else other.ctypes.data, int(relu),
    )  # fmt: skip
    assert (out[:, n:] == 7.0).all()
    return out[:, :n]


def _expected(weight, x, *, bias=None, residual=None, relu=False):
    value = weight.astype(np.float64) @ x.astype(np.float64)
    if residual is not None:
        value = value + residual
    if bias is not None:
        value = value + bias[:, None]
    return np.maximum(value, 0) if relu else value


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("epilogue", ["none", "bias", "bias-relu", "residual-bias-relu", "residual"])
def test_packed_product_matches_numpy(m, k, n, epilogue):
    rng = np.random.default_rng(m * 1000 + k + n)
    weight = rng.standard_normal((m, k), dtype=np.float32)
    x = rng.standard_normal((k, n), dtype=np.float32)
    extra = {}
    if "bias" in epilogue:
        extra["bias"] = rng.standard_normal(m, dtype=np.float32)
    if "residual" in epilogue:
        extra["residual"] = rng.standard_normal((m, n), dtype=np.float32)
    extra["relu"] = "relu" in epilogue
    got = _run(weight, x, **extra)
    expected = _expected(weight, x, **extra)
    scale = np.sqrt(k) * 4  # float32 sums of k products of unit normals
    np.testing.assert_allclose(got, expected, rtol=0, atol=scale * 2e-6)
    if extra["relu"]:
        assert (got >= 0).all()


@pytest.mark.parametrize("n", [19, 70])  # narrow (column tiles) and wide
def test_row_steps_wider_than_the_columns(n):
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((20, 40), dtype=np.float32)
    x = rng.standard_normal((40, n), dtype=np.float32)
    residual = rng.standard_normal((20, n), dtype=np.float32)
    got = _run(weight, x, ldx=n + 18, ldc=n + 31, residual=residual, relu=True)
    np.testing.assert_allclose(got, _expected(weight, x, residual=residual, relu=True), rtol=0, atol=1e-4)


def test_nan_stays_nan_through_the_relu():
    weight = np.ones((3, 4), np.float32)
    x = np.ones((4, 5), np.float32)
    x[2, 1] = np.nan
    got = _run(weight, x, relu=True, bias=np.full(3, -10, np.float32))
    assert np.isnan(got[:, 1]).all()
    assert (got[:, [0, 2, 3, 4]] == 0).all()  # 4 - 10 clamps to 0


def test_pack_weight_layout():
    weight = np.arange(18 * 3, dtype=np.float32).reshape(18, 3)
    packed = gemm.pack_weight(weight)
    assert packed.shape == (2, 3, gemm.MR) and packed.ctypes.data % 64 == 0
    np.testing.assert_array_equal(packed[0], weight[:16].T)
    np.testing.assert_array_equal(packed[1, :, :2], weight[16:].T)
    assert (packed[1, :, 2:] == 0).all()
