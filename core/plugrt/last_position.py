"""Outputs read only at their last position (a decoder's logits) computed there alone.

A decoder's prompt step computes logits for every prompt position, and a generator reads
the last: for SmolLM2-135M and a 64-token prompt that is a 64 x 49152 float32 output
(12 MiB, the step's largest value) and 63 rows of the LM head's product spent for nothing;
for Qwen2.5-0.5B and a 2048-token prompt, 1.2 GB and a product of 2048 x 896 x 151936.

``keep_last_position(model, names)`` finds, for each named output of rank 3 (batch,
position, features), the product that makes it: a MatMul with a constant 2-D weight or a
MatMulNBits, reached from the output through ops that act on each position alone (Cast,
Tanh, Identity, and Add, Sub, Mul, Div with a constant of rank 0 or 1, as in logit
soft-capping), each value on the way read by nothing else. It slices the product's input
to the last position (``Slice(x, [-1], [INT64_MAX], axes=[1])``), so the output's shape
becomes (batch, 1, features). An output made any other way is left as it is.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx_ir as ir

from .errors import InvalidOptionValueError

__all__ = ["keep_last_position"]

_DEFAULT_DOMAINS = ("", "ai.onnx")
_PER_POSITION_UNARY = ("Cast", "Tanh", "Identity")
_PER_POSITION_WITH_CONSTANT = ("Add", "Sub", "Mul", "Div")


def keep_last_position(model: ir.Model, names: Sequence[str], option: str = "outputs.last_position") -> list[str]:
    """Slice to the last position the product behind each output in ``names``; returns
    those rewritten. A name that is not an output of the graph is refused (``option``
    names the session option that gave it)."""
    graph = model.graph
    outputs = {value.name: value for value in graph.outputs if value.name is not None}
    unknown = [name for name in names if name not in outputs]
    if unknown:
        raise InvalidOptionValueError(option, list(names), f"names of the model's outputs ({sorted(outputs)})")
    if model.opset_imports.get("", 0) < 10:  # Slice takes its bounds as inputs from opset 10
        return []
    rewritten = []
    for name in dict.fromkeys(names):
        value = outputs[name]
        shape = value.shape
        product = _product_behind(value) if shape is not None and shape.rank() == 3 else None
        if product is None or shape is None:
            continue
        source = product.inputs[0]
        assert source is not None
        bounds = [
            _initializer(graph, f"{name}.last_position.{what}", np.array([number], np.int64))
            for what, number in (("starts", -1), ("ends", np.iinfo(np.int64).max), ("axes", 1))
        ]
        last = ir.Value(name=f"{name}.last_position", type=source.type)
        graph.insert_before(product, ir.Node("", "Slice", [source, *bounds], outputs=[last], name=last.name))
        product.replace_input_with(0, last)
        value.shape = ir.Shape([shape[0], 1, shape[2]])
        rewritten.append(name)
    return rewritten


def _product_behind(value: ir.Value) -> ir.Node | None:
    """The product that makes ``value`` through per-position ops, each value on the way
    (``value`` included) read by nothing but the next op; None when there is none."""
    if value.uses():
        return None
    node = value.producer()
    while node is not None and len(node.outputs) == 1:
        if _is_product(node):
            return node
        if node.domain in _DEFAULT_DOMAINS and node.op_type in _PER_POSITION_UNARY and len(node.inputs) == 1:
            upstream = node.inputs[0]
        elif node.domain in _DEFAULT_DOMAINS and node.op_type in _PER_POSITION_WITH_CONSTANT:
            first, second = node.inputs
            if _small_constant(second):
                upstream = first
            elif _small_constant(first):
                upstream = second
            else:
                return None
        else:
            return None
        if upstream is None or upstream.is_graph_output() or len(upstream.uses()) != 1:
            return None
        node = upstream.producer()
    return None


def _is_product(node: ir.Node) -> bool:
    """A product over the last axis whose rows are the positions: MatMul by a constant
    2-D weight, or MatMulNBits (its weight is 2-D by definition)."""
    if node.domain == "com.microsoft" and node.op_type == "MatMulNBits":
        return node.inputs[0] is not None
    if node.domain in _DEFAULT_DOMAINS and node.op_type == "MatMul":
        weight = node.inputs[1]
        return (
            node.inputs[0] is not None
            and weight is not None
            and weight.const_value is not None
            and len(weight.const_value.shape) == 2
        )
    return False


def _small_constant(value: ir.Value | None) -> bool:
    """A constant of rank 0 or 1: the same for every position."""
    return value is not None and value.const_value is not None and len(value.const_value.shape) <= 1


def _initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.INT64))
    value.const_value = ir.tensor(array, name=name)
    graph.register_initializer(value)
    return value
