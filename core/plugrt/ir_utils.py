"""Small helpers over onnx_ir graphs shared by the core and providers."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import onnx_ir as ir

__all__ = ["subgraphs", "implicit_inputs", "graph_free_values", "constant_array", "is_constant", "tensor_array"]


def subgraphs(node: ir.Node) -> Iterator[ir.Graph]:
    """The graphs held by ``node``'s attributes (If branches, Loop/Scan bodies)."""
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            yield attr.value
        elif attr.type == ir.AttributeType.GRAPHS:
            yield from attr.value


def _graph_reads(graph: ir.Graph, defined: set[ir.Value], found: dict[ir.Value, None]) -> None:
    local = set(defined)
    local.update(graph.inputs)
    local.update(graph.initializers.values())
    for node in graph:
        for value in node.inputs:
            if value is not None and value not in local and value not in found:
                producer = value.producer()
                if producer is not None and producer.graph is graph:
                    continue
                found[value] = None
        for sub in subgraphs(node):
            _graph_reads(sub, local | set(node.outputs), found)
        local.update(node.outputs)
    for value in graph.outputs:
        if value not in local and value not in found:
            found[value] = None


def implicit_inputs(node: ir.Node) -> list[ir.Value]:
    """Outer-scope values that ``node``'s subgraphs read, in first-use order."""
    found: dict[ir.Value, None] = {}
    for sub in subgraphs(node):
        _graph_reads(sub, set(), found)
    return list(found)


def is_constant(value: ir.Value) -> bool:
    """True for an initializer that is not also a graph input (so it cannot be overridden)."""
    return value.is_initializer() and not value.is_graph_input() and value.const_value is not None


def constant_array(value: ir.Value) -> np.ndarray | None:
    """The array of a constant value, read-only, or None when the value is not constant."""
    if not is_constant(value) or value.const_value is None:
        return None
    return tensor_array(value.const_value)


def tensor_array(tensor: ir.TensorProtocol) -> np.ndarray:
    """An ir tensor as a read-only numpy array (strings as an object array of str)."""
    array = tensor.numpy()
    if tensor.dtype == ir.DataType.STRING:
        array = np.vectorize(lambda b: b.decode("utf-8") if isinstance(b, bytes) else b, otypes=[object])(
            array
        ) if array.size else np.asarray(array, dtype=object)
    elif not isinstance(array, np.ndarray):
        array = np.asarray(array)
    if array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array


def graph_free_values(graph: ir.Graph) -> list[ir.Value]:
    """Values ``graph`` (or its nested subgraphs) reads from an enclosing scope."""
    found: dict[ir.Value, None] = {}
    _graph_reads(graph, set(), found)
    return list(found)
