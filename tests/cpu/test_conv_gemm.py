"""Direct BLAS GEMM calls and the shifted-GEMM convolution: each matches numpy or
onnxruntime, is the path taken where promised, falls back to numpy without the BLAS
symbols, and replays without allocating."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

import plugrt
from plugrt_cpu.kernels import _gemm

from cpu.test_into import check_captured, one_node


def _random(*shape: int, seed: int = 0, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.fixture
def without_blas(monkeypatch):
    """As if numpy's BLAS exported no cblas gemm (another BLAS library)."""
    monkeypatch.setattr(_gemm, "_LIBRARY", _gemm._Library())
    monkeypatch.setattr(_gemm._LIBRARY, "resolved", True)


# --- gemm


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_blas_gemm_is_found_for_float32_and_float64(dtype):
    assert _gemm.available(np.dtype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_accumulates_into_a_strided_output_with_beta(dtype):
    a, b = _random(5, 7, seed=1, dtype=dtype), _random(7, 9, seed=2, dtype=dtype)
    base = _random(5, 12, seed=3, dtype=dtype)
    c = base.copy()
    _gemm.gemm(a, b, c[:, 2:11], beta=1.0)
    expected = base.copy()
    expected[:, 2:11] += a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(c, expected, rtol=1e-5, atol=1e-5)


def test_gemm_reads_transposed_and_strided_operands():
    a = _random(7, 5, seed=1).T  # unit step along axis 0
    b = _random(7, 20, seed=2)[:, 3:12]  # leading dimension 20
    c = np.empty((5, 9), np.float32)
    _gemm.gemm(a, b, c)
    np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-5)


def test_gemm_computes_other_dtypes_and_layouts_with_numpy():
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    b = np.arange(8, dtype=np.int64).reshape(4, 2)
    c = np.ones((3, 2), np.int64)
    _gemm.gemm(a, b, c, beta=1.0)
    np.testing.assert_array_equal(c, a @ b + 1)
    x = _random(6, 6, seed=4)[::2, ::2]  # no unit-step axis
    out = np.empty((3, 3), np.float32)
    _gemm.gemm(x, x, out)
    np.testing.assert_allclose(out, x @ x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_gemm_adds_a_bias_per_row_then_clamps_at_zero(dtype):
    a, b = (_random(6, 5, seed=1) * 4).astype(dtype), (_random(5, 30, seed=2) * 4).astype(dtype)
    bias = (_random(6, 1, seed=3) * 4).astype(dtype)
    c = np.empty((6, 40), dtype)[:, 5:35]  # a block of a wider output
    _gemm.gemm(a, b, c, bias=bias, relu=True)
    np.testing.assert_allclose(c, np.maximum(a @ b + bias, 0), rtol=1e-5, atol=1e-4)


def test_gemm_adds_a_bias_to_an_accumulated_product():
    a, b, start = _random(4, 3, seed=1), _random(3, 5, seed=2), _random(4, 5, seed=3)
    bias = _random(4, 1, seed=4)
    c = start.copy()
    _gemm.gemm(a, b, c, 1.0, bias=bias)
    np.testing.assert_allclose(c, a @ b + start + bias, rtol=1e-5, atol=1e-5)


def test_gemm_without_blas_symbols_computes_with_numpy(without_blas):
    assert not _gemm.available(np.dtype(np.float32))
    a, b = _random(4, 6, seed=1), _random(6, 3, seed=2)
    c = np.full((4, 3), 2.0, np.float32)
    _gemm.gemm(a, b, c, beta=0.5)
    np.testing.assert_allclose(c, a @ b + 1.0, rtol=1e-5, atol=1e-5)


# --- the convolution on a grid of phase planes

# (input shape, weight shape, attributes): each computed on the grid
_GRID = {
    "3x3-same": ((2, 32, 12, 20), (24, 32, 3, 3), {"pads": [1, 1, 1, 1]}),
    "asymmetric-pads": ((1, 32, 24, 22), (16, 32, 3, 2), {"pads": [2, 0, 1, 1]}),
    "dilated": ((1, 16, 48, 48), (8, 16, 3, 3), {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
    "grouped": ((1, 64, 28, 28), (32, 16, 3, 3), {"pads": [1, 1, 1, 1], "group": 4}),
    "valid-5x5": ((1, 16, 60, 60), (8, 16, 5, 5), {}),
    "1d": ((2, 32, 50), (16, 32, 3), {"pads": [1, 1]}),
    "3d": ((1, 16, 4, 56, 56), (8, 16, 3, 3, 3), {"pads": [1, 1, 1, 1, 1, 1]}),
    "strided": ((2, 32, 56, 56), (32, 32, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    "grouped-strided-dilated": (
        (1, 64, 61, 61), (24, 32, 3, 3), {"pads": [2, 1, 2, 1], "strides": [2, 3], "dilations": [2, 1], "group": 2}
    ),
}


def _conv_model(x_shape, w: np.ndarray, b: np.ndarray | None, attributes: dict, relu: bool = False, dtype=np.float32):
    inputs = ["x", "w"] + (["b"] if b is not None else [])
    nodes = [onnx.helper.make_node("Conv", inputs, ["c" if relu else "y"], **attributes)]
    if relu:
        nodes.append(onnx.helper.make_node("Relu", ["c"], ["y"]))
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = onnx.helper.make_graph(
        nodes,
        "conv",
        [onnx.helper.make_tensor_value_info("x", elem, x_shape)],
        [onnx.helper.make_tensor_value_info("y", elem, None)],
        [numpy_helper.from_array(w, "w")] + ([numpy_helper.from_array(b, "b")] if b is not None else []),
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    return model.SerializeToString()


def _on_grid(x_shape, w_shape, attributes) -> bool:
    """Whether the Conv kernel computes these shapes on the grid."""
    from plugrt_cpu.kernels import conv as convolution

    op = convolution._Convolution(attributes)
    return getattr(op._plans(tuple(x_shape), tuple(w_shape), 4), "grid", None) is not None


@pytest.fixture
def grid_path(monkeypatch):
    """The grid path even where numba's compiled units would take a 2-D float32 Conv
    (they gather from the input: ``conv_units``); without numba it is the path anyway."""
    from plugrt_cpu.kernels import conv as convolution

    monkeypatch.setattr(convolution, "compiled_units", lambda: None)


@pytest.mark.parametrize("relu", [False, True], ids=["plain", "relu"])
@pytest.mark.parametrize("case", list(_GRID), ids=list(_GRID))
def test_grid_convolution_matches_onnxruntime(case, relu, grid_path):
    x_shape, w_shape, attributes = _GRID[case]
    assert _on_grid(x_shape, w_shape, attributes)
    x, w, b = _random(*x_shape, seed=1), _random(*w_shape, seed=2) * 0.2, _random(w_shape[0], seed=3)
    model = _conv_model(x_shape, w, b, attributes, relu)
    (actual,) = plugrt.load(model, device="cpu").run({"x": x}).values()
    (expected,) = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["3x3-same", "strided"])
def test_grid_convolution_in_float64_matches_the_reference(case):
    x_shape, w_shape, attributes = _GRID[case]
    x, w = _random(*x_shape, seed=1, dtype=np.float64), _random(*w_shape, seed=2, dtype=np.float64)
    model = _conv_model(x_shape, w, None, attributes, dtype=np.float64)
    (actual,) = plugrt.load(model, device="cpu").run({"x": x}).values()
    (expected,) = ReferenceEvaluator(onnx.load_from_string(model)).run(None, {"x": x})  # onnxruntime: no double Conv
    assert actual.dtype == np.float64
    np.testing.assert_allclose(actual, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", ["3x3-same", "strided"])
def test_grid_convolution_without_blas_symbols_falls_back_to_im2col(case, without_blas, monkeypatch):
    from plugrt_cpu.kernels import conv as convolution

    im2col_calls = []
    original = convolution._Convolution._im2col

    def counted(self, *args, **kwargs):
        im2col_calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(convolution._Convolution, "_im2col", counted)
    monkeypatch.setattr(convolution, "winograd_plan", lambda *args: None)  # it would take 3x3-same first
    x_shape, w_shape, attributes = _GRID[case]
    x, w, b = _random(*x_shape, seed=1), _random(*w_shape, seed=2), _random(w_shape[0], seed=3)
    model = _conv_model(x_shape, w, b, attributes)
    (actual,) = plugrt.load(model, device="cpu").run({"x": x}).values()
    assert im2col_calls  # the im2col path ran, not the grid
    (expected,) = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "x_shape, w_shape, attributes",
    [
        ((1, 64, 4, 4), (8, 64, 3, 3), {"pads": [1, 1, 1, 1]}),  # junk columns: half the grid
        ((1, 64, 14, 14), (8, 64, 3, 3), {"pads": [1, 1, 1, 1]}),  # 14 of 16 columns: measured slower
        ((1, 64, 14, 14), (8, 64, 1, 1), {}),  # pointwise
        ((1, 3, 80, 80), (16, 3, 7, 7), {"pads": [3, 3, 3, 3], "strides": [2, 2]}),  # 3 channels: shallow GEMMs
        ((1, 16, 28, 28), (64, 16, 3, 3), {"pads": [1, 1, 1, 1]}),  # 4 outputs per input channel
    ],
    ids=["narrow", "fourteen-wide", "pointwise", "shallow", "fan-out"],
)
def test_grid_is_not_used_where_im2col_does_better(x_shape, w_shape, attributes):
    assert not _on_grid(x_shape, w_shape, attributes)


@pytest.mark.parametrize("case", ["grouped", "grouped-strided-dilated"])
def test_grid_convolution_is_captured_and_replays_without_allocating(case, grid_path):
    x_shape, w_shape, attributes = _GRID[case]
    text = ", ".join(f"{k} = [{', '.join(map(str, v))}]" if isinstance(v, list) else f"{k} = {v}" for k, v in attributes.items())
    model = one_node(
        f"y = Conv<{text}>(x, w, b)",
        {"x": _random(*x_shape)},
        {"y": "float"},
        constants={"w": _random(*w_shape, seed=2), "b": _random(w_shape[0], seed=3)},
    )
    check_captured(model, lambda rng: {"x": rng.standard_normal(x_shape).astype(np.float32)})


def test_grid_convolution_with_a_fed_weight_replays_without_allocating():
    x_shape, w_shape, _ = _GRID["3x3-same"]
    model = one_node("y = Conv<pads = [1, 1, 1, 1]>(x, w)", {"x": _random(*x_shape), "w": _random(*w_shape)}, {"y": "float"})
    check_captured(
        model,
        lambda rng: {
            "x": rng.standard_normal(x_shape).astype(np.float32),
            "w": rng.standard_normal(w_shape).astype(np.float32),
        },
    )
