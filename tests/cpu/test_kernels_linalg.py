"""MatMul, Gemm, Einsum, Det and MatMulInteger kernels, checked against onnx.reference and numpy."""

from __future__ import annotations

import numpy as np
import pytest
from onnx.reference import ReferenceEvaluator

import plugrt
from helpers import run_model, text_model


def _random(*shape, dtype=np.float32, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _tensor_text(name: str, array: np.ndarray) -> str:
    """An initializer in ONNX text, so the kernel sees the input as a constant."""
    shape = ",".join(map(str, array.shape))
    return f"float[{shape}] {name} = {{{', '.join(repr(float(v)) for v in array.ravel())}}}"


def _assert_matches_reference(model, feeds, rtol=1e-5, atol=1e-5):
    (got,) = run_model(model, feeds)
    (expected,) = ReferenceEvaluator(model).run(None, feeds)
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "shape_a,shape_b",
    [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((4,), (2, 4, 5)), ((2, 1, 3, 4), (5, 4, 6)), ((4,), (4,))],
)
def test_matmul_broadcasts_like_numpy(shape_a, shape_b):
    a, b = _random(*shape_a), _random(*shape_b, seed=1)
    model = text_model(f'<ir_version: 8, opset_import: ["" : 13]> g (float{list(shape_a)} a, float{list(shape_b)} b) => (y)'
        " { y = MatMul(a, b) }", check=False)
    (got,) = run_model(model, {"a": a, "b": b})
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, np.matmul(a, b), rtol=1e-5, atol=1e-5)


def test_float16_matmul_keeps_float16_and_accumulates_in_float32():
    a, b = _random(3, 512, dtype=np.float16), _random(512, 5, dtype=np.float16, seed=1)
    model = text_model('<ir_version: 8, opset_import: ["" : 13]> g (float16[3,512] a, float16[512,5] b) => (y) { y = MatMul(a, b) }', check=False)
    (got,) = run_model(model, {"a": a, "b": b})
    assert got.dtype == np.float16
    exact = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(got.astype(np.float64), exact, rtol=1e-2, atol=5e-2)


@pytest.mark.parametrize("opset", [6, 7, 11, 13])
@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (0.5, 2.0), (1.5, 0.0)])
@pytest.mark.parametrize("constant_b_c", [False, True])
def test_gemm_matches_reference(opset, trans_a, trans_b, alpha, beta, constant_b_c):
    a = _random(4, 3) if trans_a else _random(3, 4)
    b = _random(5, 4, seed=1) if trans_b else _random(4, 5, seed=1)
    c = _random(5, seed=2)
    broadcast = ", broadcast=1" if opset < 7 else ""
    attributes = f"<transA={trans_a}, transB={trans_b}, alpha={alpha}, beta={beta}{broadcast}>"
    a_type = f"float{list(a.shape)} a"
    if constant_b_c:
        graph = f"g ({a_type}) => (y) <{_tensor_text('b', b)}, {_tensor_text('c', c)}>"
        feeds = {"a": a}
    else:
        graph = f"g ({a_type}, float{list(b.shape)} b, float[5] c) => (y)"
        feeds = {"a": a, "b": b, "c": c}
    model = text_model(f'<ir_version: 8, opset_import: ["" : {opset}]> {graph} {{ y = Gemm{attributes}(a, b, c) }}', check=False)
    _assert_matches_reference(model, feeds)


def test_gemm_without_c_since_opset_11():
    a, b = _random(3, 4), _random(4, 5, seed=1)
    model = text_model('<ir_version: 8, opset_import: ["" : 11]> g (float[3,4] a, float[4,5] b) => (y) { y = Gemm<alpha=2.0>(a, b) }', check=False)
    (got,) = run_model(model, {"a": a, "b": b})
    np.testing.assert_allclose(got, 2 * a @ b, rtol=1e-5)


def test_gemm_before_opset_7_rejects_an_unbroadcast_c_of_another_shape():
    model = text_model('<ir_version: 8, opset_import: ["" : 6]> g (float[3,4] a, float[4,5] b, float[5] c) => (y)'
        " { y = Gemm(a, b, c) }", check=False)
    with pytest.raises(plugrt.KernelError, match="broadcast"):
        run_model(model, {"a": _random(3, 4), "b": _random(4, 5), "c": _random(5)})


def test_gemm_on_int32_keeps_int32():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    b = np.arange(20, dtype=np.int32).reshape(4, 5)
    c = np.arange(5, dtype=np.int32)
    model = text_model('<ir_version: 8, opset_import: ["" : 13]> g (int32[3,4] a, int32[4,5] b, int32[5] c) => (y)'
        " { y = Gemm<alpha=2.0, beta=3.0>(a, b, c) }", check=False)
    (got,) = run_model(model, {"a": a, "b": b, "c": c})
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, 2 * (a @ b) + 3 * c)


@pytest.mark.parametrize(
    "equation,shapes",
    [
        ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
        ("bij,bjk,kl->bil", [(2, 3, 4), (2, 4, 5), (5, 6)]),
        ("...ij,...jk", [(2, 3, 4), (2, 4, 5)]),
        ("b i j , b j k -> b k i", [(2, 3, 4), (2, 4, 5)]),
        ("Bij,Bjk->Bik", [(2, 3, 4), (2, 4, 5)]),
        ("ii->i", [(5, 5)]),
        ("ij->", [(3, 4)]),
        ("i,j->ij", [(3,), (4,)]),
        ("...ij,...jk->...ik", [(2, 1, 3, 4), (5, 4, 6)]),  # broadcast batch dimensions
        ("bij,jk->k", [(2, 3, 4), (4, 5)]),  # letters summed out of one input only
        ("ii,ij->j", [(4, 4), (4, 5)]),  # a diagonal: einsum's general path
        ("bhqd,bhkd->bhqk", [(2, 3, 5, 4), (2, 3, 6, 4)]),
    ],
)
def test_einsum_matches_numpy(equation, shapes):
    inputs = {f"x{i}": _random(*shape, seed=i) for i, shape in enumerate(shapes)}
    signature = ", ".join(f"float{list(x.shape)} {name}" for name, x in inputs.items())
    model = text_model(f'<ir_version: 8, opset_import: ["" : 12]> g ({signature}) => (y)'
        f' {{ y = Einsum<equation="{equation}">({", ".join(inputs)}) }}', check=False)
    (got,) = run_model(model, inputs)
    expected = np.einsum(equation.replace(" ", ""), *inputs.values())
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_einsum_on_integers_stays_integer():
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    model = text_model('<ir_version: 8, opset_import: ["" : 12]> g (int64[3,4] a, int64[3,4] b) => (y)'
        ' { y = Einsum<equation="ij,ij->i">(a, b) }', check=False)
    (got,) = run_model(model, {"a": a, "b": a})
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, (a * a).sum(axis=1))


@pytest.mark.parametrize("shape", [(3, 3), (2, 4, 4)])
def test_det_matches_numpy(shape):
    x = _random(*shape)
    model = text_model(f'<ir_version: 8, opset_import: ["" : 11]> g (float{list(shape)} x) => (y) {{ y = Det(x) }}', check=False)
    (got,) = run_model(model, {"x": x})
    assert got.dtype == np.float32
    assert got.shape == shape[:-2]
    np.testing.assert_allclose(got, np.linalg.det(x.astype(np.float64)), rtol=1e-4)


def _matmul_integer_expected(a, b, a_zero=0, b_zero=0):
    return (a.astype(np.int64) - a_zero) @ (b.astype(np.int64) - b_zero)


def test_matmul_integer_with_scalar_zero_points_is_exact_for_long_rows():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (3, 1000)).astype(np.uint8)  # too deep for exact float32 sums
    b = rng.integers(-128, 128, (1000, 5)).astype(np.int8)
    model = text_model('<ir_version: 8, opset_import: ["" : 10]> g (uint8[3,1000] a, int8[1000,5] b, uint8 az, int8 bz) => (y)'
        " { y = MatMulInteger(a, b, az, bz) }", check=False)
    feeds = {"a": a, "b": b, "az": np.array(12, np.uint8), "bz": np.array(-3, np.int8)}
    (got,) = run_model(model, feeds)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, _matmul_integer_expected(a, b, 12, -3))


def test_matmul_integer_zero_points_are_per_row_of_a_and_per_column_of_b():
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, (3, 8)).astype(np.uint8)
    b = rng.integers(0, 256, (8, 4)).astype(np.uint8)
    a_zero = np.array([1, 2, 3], np.uint8)
    b_zero = np.array([4, 5, 6, 7], np.uint8)
    model = text_model('<ir_version: 8, opset_import: ["" : 10]> g (uint8[3,8] a, uint8[8,4] b, uint8[3] az, uint8[4] bz) => (y)'
        " { y = MatMulInteger(a, b, az, bz) }", check=False)
    (got,) = run_model(model, {"a": a, "b": b, "az": a_zero, "bz": b_zero})
    np.testing.assert_array_equal(got, _matmul_integer_expected(a, b, a_zero.astype(np.int64)[:, None], b_zero))


def test_matmul_integer_broadcasts_batches():
    rng = np.random.default_rng(2)
    a = rng.integers(-128, 128, (2, 3, 8)).astype(np.int8)
    b = rng.integers(-128, 128, (8, 4)).astype(np.int8)
    model = text_model('<ir_version: 8, opset_import: ["" : 10]> g (int8[2,3,8] a, int8[8,4] b) => (y) { y = MatMulInteger(a, b) }', check=False)
    (got,) = run_model(model, {"a": a, "b": b})
    np.testing.assert_array_equal(got, _matmul_integer_expected(a, b))
