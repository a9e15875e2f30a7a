"""Gather with a single (0-d) index: a copy of the slab at that index, taken as a view
(numpy's basic indexing) rather than element by element: against onnx.reference over axes,
negative indices and a strided input (a Transpose in front, as ViT's query/key/value
split), the index out of range refused, and the ``into`` variant replayed bitwise."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

import plugrt

from cpu.test_into import check_captured, one_node


def _model(shape: tuple[int, ...], perm: list[int], index: int, axis: int, dtype=np.int64) -> bytes:
    nodes = [
        onnx.helper.make_node("Transpose", ["x"], ["t"], perm=perm),
        onnx.helper.make_node("Gather", ["t", "i"], ["y"], axis=axis),
    ]
    graph = onnx.helper.make_graph(
        nodes,
        "gather",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape)],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(index, dtype), "i")],
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


CASES = [
    ((197, 1, 3, 768), [2, 0, 1, 3], 1, 0),  # ViT's split of a transposed (3, 197, 1, 768)
    ((197, 1, 3, 768), [2, 0, 1, 3], -1, 0),
    ((4, 5, 6), [0, 1, 2], 2, 1),
    ((4, 5, 6), [2, 0, 1], -4, 1),
    ((4, 5, 6), [1, 2, 0], 3, -1),
    ((7,), [0], 4, 0),
]


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@pytest.mark.parametrize("shape,perm,index,axis", CASES)
def test_one_index_matches_onnx_reference(shape, perm, index, axis, dtype):
    model = _model(shape, perm, index, axis, dtype)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    actual = plugrt.load(model, device="cpu").run({"x": x})["y"]
    (expected,) = ReferenceEvaluator(onnx.load_from_string(model)).run(None, {"x": x})
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(actual, expected)
    assert not np.shares_memory(actual, x)  # a copy: the output owns its values


@pytest.mark.parametrize("index", [3, -4])
def test_an_index_out_of_range_is_refused(index):
    model = _model((2, 3, 5), [1, 0, 2], index, 0)  # axis 0 of the transposed (3, 2, 5): 3 entries
    x = np.zeros((2, 3, 5), np.float32)
    with pytest.raises(Exception, match="out of bounds|out of range"):
        plugrt.load(model, device="cpu").run({"x": x})


def test_one_index_into_a_buffer_replays_bitwise():
    model = one_node(
        "y = Gather<axis = 1>(x, i)",
        {"x": np.zeros((3, 4, 5), np.float32)},
        {"y": "float"},
        constants={"i": np.array(-2, np.int64)},
    )
    check_captured(model, lambda rng: {"x": rng.standard_normal((3, 4, 5)).astype(np.float32)})
