"""The CUDA provider's own fusions: onnx_ir passes over the nodes placed on it, each pattern made one kernel.

``CUDAProvider.passes`` returns :func:`fusion_passes`; ``plugrt.build`` runs them at
optimisation level "all", after placement and the core's provider-independent rewrites
(``plugrt.rewrites``: BatchNormalization folded, LayerNorm and GELU as standard or
contrib ops), on the nodes placed on this provider only, so no other provider is ever
asked about what they write. Their nodes live in the private domain ``plugrt.cuda``:

- :class:`FuseSiluPass`: ``Mul(x, Sigmoid(x))`` (SiLU, swish): ``plugrt.cuda::Silu``, one
  elementwise kernel instead of two launches and a temporary.
- :class:`FuseConvReluPass`: Conv whose output only a Relu reads: ``plugrt.cuda::FusedConv``
  with activation="Relu" (the Relu applied by the GEMM's epilogue).
"""

from __future__ import annotations

from typing import Sequence

import onnx_ir as ir
from onnx_ir.convenience import replace_nodes_and_values
from onnx_ir.passes import InPlacePass

from plugrt.passes import CLAIMED_BY
from plugrt.rewrites import PlacedNodePass, sole_reader

from ._ops import CUDA_DOMAIN

__all__ = ["fusion_passes", "FuseSiluPass", "FuseConvReluPass", "PROVIDER_NAME"]

PROVIDER_NAME = "cuda"
DOMAIN_VERSION = 1


def fusion_passes() -> list[InPlacePass]:
    return [FuseConvReluPass(), FuseSiluPass()]


def _ours(node: ir.Node) -> bool:
    return node.meta.get(CLAIMED_BY) == PROVIDER_NAME


def _is(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") and _ours(node)


def _replace(model: ir.Model, pattern: Sequence[ir.Node], op_type: str, inputs: Sequence[ir.Value | None],
             attributes: Sequence[ir.Attr]) -> None:
    """A ``plugrt.cuda`` node (marked as this provider's) where ``pattern`` was; its output
    takes over the last node's (name, type, shape, readers, graph outputs included)."""
    model.opset_imports.setdefault(CUDA_DOMAIN, DOMAIN_VERSION)
    last = pattern[-1]
    node = ir.Node(CUDA_DOMAIN, op_type, inputs, attributes, num_outputs=1, name=pattern[0].name)
    node.meta[CLAIMED_BY] = PROVIDER_NAME
    replace_nodes_and_values(model.graph, last, pattern, [node], [last.outputs[0]], [node.outputs[0]])


class _NodePass(PlacedNodePass):
    def placed(self, node: ir.Node) -> bool:
        return _ours(node)


class FuseSiluPass(_NodePass):
    """``Mul(x, Sigmoid(x))`` in either order, the Sigmoid read by the Mul alone."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if not _is(node, "Sigmoid") or not node.inputs or node.inputs[0] is None:
            return False
        x = node.inputs[0]
        mul = sole_reader(node.outputs[0], _ours)
        if mul is None or not _is(mul, "Mul") or len(mul.inputs) != 2:
            return False
        if {id(v) for v in mul.inputs} != {id(x), id(node.outputs[0])}:
            return False
        _replace(model, [node, mul], "Silu", [x], [])
        return True


class FuseConvReluPass(_NodePass):
    """Conv whose output only a Relu reads."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if not _is(node, "Conv") or len(node.outputs) != 1:
            return False
        relu = sole_reader(node.outputs[0], _ours)
        if relu is None or not _is(relu, "Relu"):
            return False
        attributes = [*node.attributes.values(), ir.AttrString("activation", "Relu")]
        _replace(model, [node, relu], "FusedConv", list(node.inputs), attributes)
        return True
