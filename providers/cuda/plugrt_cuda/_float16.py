"""float16 decoding (``cuda.float16_decoding``): a float32 model rewritten to compute in
float16 — every float32 weight stored as float16, every float32 activation typed float16 —
with its float32 inputs and outputs kept, through one Cast at each, so callers (and a
decoder's float32 KV-cache bindings) see the same interface. The kernels keep their
statistics in float32 (RMS/LayerNorm, GroupQueryAttention's softmax, GEMM accumulation)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["OPTION", "to_float16"]

OPTION = "cuda.float16_decoding"


def to_float16(model: ir.Model) -> bool:
    """Rewrite ``model`` in place; True when anything changed (a model without float32
    values is left as it is)."""
    import onnx_ir as ir

    graph = model.graph
    float32, float16 = ir.DataType.FLOAT, ir.DataType.FLOAT16
    changed = False
    for value in list(graph.initializers.values()):
        tensor = value.const_value
        if value.dtype == float32 and tensor is not None:
            value.const_value = ir.tensor(tensor.numpy().astype(np.float16), name=value.name)
            value.dtype = float16
            changed = True
    for node in list(graph):
        if node.op_type == "Cast" and node.domain in ("", "ai.onnx") and _attribute(node, "to") == int(float32):
            node.attributes["to"] = ir.AttrInt64("to", int(float16))
        if node.op_type in ("Constant", "ConstantOfShape") and node.domain in ("", "ai.onnx"):
            _constant_to_float16(ir, node)
        for output in node.outputs:
            if output.dtype == float32 and not output.is_graph_output():
                output.dtype = float16
                changed = True
    for value in list(graph.inputs):
        if value.dtype != float32:
            continue
        uses = list(value.uses())
        cast = ir.node("Cast", [value], {"to": int(float16)}, name=f"{value.name}/to_float16")
        cast.outputs[0].name = f"{value.name}/float16"
        cast.outputs[0].dtype = float16
        cast.outputs[0].shape = value.shape
        if graph.num_nodes():
            graph.insert_before(graph.node(0), cast)
        else:
            graph.append(cast)
        for user, index in uses:
            user.replace_input_with(index, cast.outputs[0])
        changed = True
    for position, value in enumerate(list(graph.outputs)):
        if value.dtype != float32 or value.producer() is None:
            continue
        name = value.name
        value.name = f"{name}/float16"
        value.dtype = float16
        cast = ir.node("Cast", [value], {"to": int(float32)}, name=f"{name}/to_float32")
        cast.outputs[0].name = name
        cast.outputs[0].dtype = float32
        cast.outputs[0].shape = value.shape
        graph.append(cast)
        graph.outputs[position] = cast.outputs[0]
        changed = True
    return changed


def _attribute(node: Any, name: str) -> Any:
    attr = node.attributes.get(name)
    return None if attr is None else attr.value


def _constant_to_float16(ir: Any, node: Any) -> None:
    """A Constant's or ConstantOfShape's float32 tensor attribute as float16."""
    attr = node.attributes.get("value")
    if attr is None or attr.type != ir.AttributeType.TENSOR or attr.value.dtype != ir.DataType.FLOAT:
        return
    node.attributes["value"] = ir.AttrTensor("value", ir.tensor(attr.value.numpy().astype(np.float16)))
