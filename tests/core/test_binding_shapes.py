"""A binding's shape is checked where it is given: at allocation against the model, at write against the binding."""

from __future__ import annotations

import numpy as np
import pytest

import plugrt
from plugrt.errors import BindingShapeError

from helpers import model_bytes

FIXED_BATCH = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 3, 4, 4] image) => (float[1, 3, 4, 4] y) { y = Relu(image) }
"""
SYMBOLIC_BATCH = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 3] x) => (float[N, 3] y) { y = Relu(x) }
"""


def test_allocating_another_size_on_a_fixed_axis_is_refused_naming_input_and_shapes() -> None:
    session = plugrt.load(model_bytes(FIXED_BATCH))
    with pytest.raises(BindingShapeError) as info:
        session.allocate_binding(input="image", shape=(2, 3, 4, 4))
    error = info.value
    assert (error.name, error.expected, error.actual) == ("image", (1, 3, 4, 4), (2, 3, 4, 4))
    assert "'image'" in str(error) and "(1, 3, 4, 4)" in str(error) and "(2, 3, 4, 4)" in str(error)
    assert "axis 0" in str(error)


def test_allocating_another_rank_is_refused() -> None:
    session = plugrt.load(model_bytes(FIXED_BATCH))
    with pytest.raises(BindingShapeError, match="rank 3; the input has rank 4"):
        session.allocate_binding(input="image", shape=(3, 4, 4))


def test_a_symbolic_axis_may_be_allocated_at_any_size() -> None:
    session = plugrt.load(model_bytes(SYMBOLIC_BATCH))
    binding = session.allocate_binding(input="x", shape=(5, 3))
    assert binding.shape == (5, 3)


def test_writing_an_array_of_another_rank_says_the_shapes_differ_and_to_reshape() -> None:
    session = plugrt.load(model_bytes(FIXED_BATCH))
    binding = session.allocate_binding(output="y")
    with pytest.raises(BindingShapeError) as info:
        binding.write(np.zeros((1, 48), np.float32))
    message = str(info.value)
    assert "differ in rank" in message and "reshape" in message.lower()
    assert "shape=(1, 48)" in message
    assert "larger capacity" not in message
    assert (info.value.expected, info.value.actual) == ((1, 3, 4, 4), (1, 48))


def test_writing_a_larger_array_of_the_same_rank_asks_for_a_larger_capacity() -> None:
    session = plugrt.load(model_bytes(SYMBOLIC_BATCH))
    binding = session.allocate_binding(input="x", shape=(2, 3))
    with pytest.raises(BindingShapeError, match=r"capacity=\(4, 3\)"):
        binding.write(np.zeros((4, 3), np.float32))
