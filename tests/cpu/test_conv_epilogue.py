"""The epilogue of a product block (``+ residual``, ``+ bias``, Relu) in its compiled and numpy
forms against numpy written out here, NaN and infinities included; and the fused pointwise
Conv + Add (+ Relu) that adds its residual block by block, against onnx.reference, with
groups, batches, more blocks than threads, and an output that is the residual's own buffer."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper, TensorProto
from onnx.reference import ReferenceEvaluator

from plugrt.threads import begin_run
from plugrt_cpu._registry import KernelContext, capture_variant
from plugrt_cpu.kernels import _gemm
from plugrt_cpu.kernels.conv_residual import build_residual_conv

from cpu.numba_paths import PATHS, numba_or_numpy


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    yield from numba_or_numpy(request, monkeypatch, _gemm.epilogue_loops)


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _expected(block: np.ndarray, bias, relu: bool, residual) -> np.ndarray:
    out = block.astype(np.float64)
    if residual is not None:
        out = out + residual
    if bias is not None:
        out = out + bias
    out = out.astype(np.float32)
    return np.where(out < 0, np.float32(0), out) if relu else out


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("relu", [True, False], ids=["relu", "no_relu"])
@pytest.mark.parametrize("rows, columns", [(slice(None), slice(None)), (slice(3, 11), slice(5, 70)), (slice(0, 1), slice(99, 100))])
def test_epilogue_on_a_block_matches_numpy(path, bias, residual, relu, rows, columns):
    matrix = _random(16, 100, seed=1)
    before = matrix.copy()
    b = _random(16, 1, seed=2)[rows] if bias else None
    z = _random(16, 100, seed=3) if residual else None
    _gemm.epilogue(matrix, rows, columns, b, relu, z)
    expected = before.copy()
    expected[rows, columns] = _expected(before[rows, columns], b, relu, None if z is None else z[rows, columns])
    np.testing.assert_allclose(matrix, expected, rtol=1e-6, atol=1e-6)  # outside the block: untouched, bit for bit
    outside = np.ones(matrix.shape, bool)
    outside[rows, columns] = False
    assert np.array_equal(matrix[outside], before[outside])


def test_epilogue_keeps_nan_and_clamps_negative_infinity(path):
    matrix = np.array([[np.nan, -np.inf, np.inf, -1.0, 2.0, 0.0]], np.float32)
    _gemm.epilogue(matrix, slice(None), slice(None), np.zeros((1, 1), np.float32), True, None)
    np.testing.assert_array_equal(matrix, [[np.nan, 0.0, np.inf, 0.0, 2.0, 0.0]])
    matrix = np.array([[1.0, -1.0]], np.float32)
    _gemm.epilogue(matrix, slice(None), slice(None), None, True, np.array([[np.nan, -np.inf]], np.float32))
    np.testing.assert_array_equal(matrix, [[np.nan, 0.0]])


def test_epilogue_of_other_dtypes_takes_numpy(path):
    matrix = _random(4, 9).astype(np.float64)
    before = matrix.copy()
    bias = np.arange(4, dtype=np.float64).reshape(4, 1)
    _gemm.epilogue(matrix, slice(None), slice(2, 7), bias, True, None)
    expected = before.copy()
    expected[:, 2:7] = np.maximum(before[:, 2:7] + bias, 0)
    np.testing.assert_array_equal(matrix, expected)


def _reference(x, w, b, z, group: int, relu: bool, **attributes) -> np.ndarray:
    """onnx.reference's Relu(Conv(x, w, b) + z) (Identity for the Relu when not ``relu``)."""
    conv = helper.make_node("Conv", ["x", "w", "b"], ["c"], group=group, **attributes)
    nodes = [conv, helper.make_node("Add", ["c", "z"], ["s"])]
    nodes.append(helper.make_node("Relu" if relu else "Identity", ["s"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, a.shape) for n, a in (("x", x), ("z", z))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    return ReferenceEvaluator(model).run(None, {"x": x, "z": z})[0]


# (batch, channels, output channels, size, group): one block; blocks over threads; groups; batches
POINTWISE = {
    "one-block": (1, 32, 64, 6, 1),
    "blocks": (1, 64, 128, 40, 1),
    "groups": (1, 48, 96, 30, 3),
    "batch-3": (3, 16, 24, 20, 1),
}


@pytest.mark.parametrize("case", POINTWISE)
@pytest.mark.parametrize("relu", [True, False], ids=["relu", "no_relu"])
@pytest.mark.parametrize("threads", [1, 2])
def test_pointwise_conv_adds_its_residual_block_by_block(path, case, relu, threads):
    n, c, m, size, group = POINTWISE[case]
    x, z = _random(n, c, size, size, seed=4), _random(n, m, size, size, seed=5)
    w, b = _random(m, c // group, 1, 1, seed=6) * 0.2, _random(m, seed=7)
    expected = _reference(x, w, b, z, group, relu)
    ctx = KernelContext("Conv", "", 11, {"group": group}, 4, 1, [x.dtype] * 4, [None, w, b, None])
    kernel = build_residual_conv(ctx, relu)
    begin_run(threads)
    try:
        got = kernel(x, w, b, z)
        into = np.empty_like(expected)
        capture_variant(kernel)(into, x, w, b, z)
        in_place = z.copy()  # the output in the residual's own buffer, as a capture may plan it
        capture_variant(kernel)(in_place, x, w, b, in_place)
    finally:
        begin_run(0)
    for result in (got, into, in_place):
        np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5)


# (batch, channels, output channels, size, kernel, stride, pad): 3x3 Convs Winograd does not
# take (strided; a 7x7 output has too few tiles) and a 7x7 one: the compiled im2col units
# add the residual in their GEMM's epilogue
IM2COL = {
    "3x3-stride-2": (1, 32, 48, 28, 3, 2, 1),
    "3x3-7x7-output": (2, 64, 40, 7, 3, 1, 1),
    "7x7-stride-2": (1, 3, 16, 40, 7, 2, 3),
}


@pytest.mark.parametrize("case", IM2COL)
@pytest.mark.parametrize("relu", [True, False], ids=["relu", "no_relu"])
def test_an_im2col_conv_adds_its_residual_in_the_units(case, relu, monkeypatch):
    from plugrt_cpu.kernels import conv, conv_units

    if conv_units.compiled_units() is None:
        pytest.skip("needs numba's compiled Conv units")
    n, c, m, size, kernel_size, stride, pad = IM2COL[case]
    out = (size + 2 * pad - kernel_size) // stride + 1
    x, z = _random(n, c, size, size, seed=4), _random(n, m, out, out, seed=5)
    w, b = _random(m, c, kernel_size, kernel_size, seed=6) * 0.2, _random(m, seed=7)
    expected = _reference(x, w, b, z, 1, relu, strides=[stride, stride], pads=[pad] * 4)
    residuals = []
    original = conv.run_units

    def counted(found, plan, n, group, wg, packed, bias, y, residual, *rest, **options):
        residuals.append(residual is not None)
        return original(found, plan, n, group, wg, packed, bias, y, residual, *rest, **options)

    monkeypatch.setattr(conv, "run_units", counted)
    attributes = {"strides": [stride, stride], "pads": [pad] * 4, "kernel_shape": [kernel_size] * 2}
    ctx = KernelContext("Conv", "", 11, attributes, 4, 1, [x.dtype] * 4, [None, w, b, None])
    kernel = build_residual_conv(ctx, relu)
    for threads in (1, 2):
        begin_run(threads)
        try:
            got = kernel(x, w, b, z)
            into = np.empty_like(expected)
            capture_variant(kernel)(into, x, w, b, z)
            in_place = z.copy()  # the residual's own buffer: not the units' (their BLAS GEMM stores first)
            capture_variant(kernel)(in_place, x, w, b, in_place)
        finally:
            begin_run(0)
        for result in (got, into, in_place):
            np.testing.assert_allclose(result, expected, rtol=1e-4, atol=1e-4)
    assert residuals.count(True) == 4  # got and into, on one thread and two
