"""The CPU provider's fusions: onnx_ir passes that merge node patterns into one step each.

``CPUProvider.passes`` returns :func:`fusion_passes`; ``plugrt.build`` runs them at
optimisation level "all", after placement, on the nodes placed on the CPU provider, so no
other provider is ever asked about a fused node, and a session built at "none" or
"basic" never sees one. The nodes they write live in the
private domain ``plugrt.cpu`` (version 1, added to the model's opset imports by the pass
that writes one); their kernels are registered at the end of this module and reuse the
standard kernels (Conv from kernels/conv.py, BatchNormalization's per-channel affine pass,
LayerNormalization, Gelu). The provider-independent rewrites (BatchNormalization folded
into a Conv, LayerNorm and GELU written out) run before placement in ``plugrt.rewrites``;
the LayerNorm and GELU passes here take what those leave on the CPU provider's nodes.

Every pass fuses only where each intermediate value is read by the next node of the
pattern alone and is not a graph output, so no value anyone else can see disappears, and
only nodes placed on the CPU provider (``node.meta[plugrt.passes.CLAIMED_BY]``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import onnx_ir as ir
from onnx_ir.convenience import replace_nodes_and_values
from onnx_ir.passes import InPlacePass

from plugrt import rewrites
from plugrt.ir_utils import constant_array
from plugrt.passes import CLAIMED_BY
from plugrt.rewrites import FoldChannelAffinePass

from ._registry import PROVIDER_NAME, KernelContext, declare_into, kernel, kernel_builder
from .kernels import conv as convolution
from .kernels._compiled import CONV_LOOPS, DENSE_LOOPS, ROW_LOOPS
from .kernels._gemm import epilogue_loops
from .kernels import conv_activation, conv_residual, squeeze_excite
from .kernels.expand_depthwise import EXPAND_PREFIX, build_expand_depthwise
from .kernels import dense, elementwise, normalization
from .kernels.elementwise import scratch

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = [
    "DOMAIN",
    "DOMAIN_VERSION",
    "fusion_passes",
    "FoldChannelAffinePass",
    "FuseBatchNormReluPass",
    "FuseConvAddPass",
    "FuseConvReluPass",
    "FuseConvActivationPass",
    "FuseExpandDepthwisePass",
    "FuseSiluMulPass",
    "FuseSiluPass",
    "FuseSqueezeExcitePass",
    "FuseMatMulBiasPass",
    "FuseReshapedGemmPass",
    "FuseLayerNormPass",
    "FuseGeluPass",
]

DOMAIN = "plugrt.cpu"
DOMAIN_VERSION = 1

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def fusion_passes() -> list[InPlacePass]:
    """The CPU fusions in the order they must run (squeeze-excitation before the Conv +
    activation fusions, which would take its Convs apart; Conv + Add + Relu before Conv +
    Relu). BatchNormalization and per-channel affine nodes are folded into the Conv before
    them by the core's ``plugrt.rewrites.FoldChannelAffinePass`` (re-exported here), before
    placement, for every provider."""
    return [
        FuseSqueezeExcitePass(), FuseBatchNormReluPass(), FuseConvAddPass(), FuseConvReluPass(),
        FuseConvActivationPass(), FuseExpandDepthwisePass(), FuseReshapedGemmPass(), FuseMatMulBiasPass(), FuseLayerNormPass(), FuseGeluPass(), FuseSiluMulPass(),
        FuseSiluPass(),
    ]


# ---------------------------------------------------------------------------------------
# Graph helpers


def _ours(node: ir.Node) -> bool:
    """Whether ``node`` is placed on the CPU provider (unmarked: nothing else to run it)."""
    return node.meta.get(CLAIMED_BY, PROVIDER_NAME) == PROVIDER_NAME


def _sole_reader(value: ir.Value | None) -> ir.Node | None:
    """The node reading ``value``, when exactly one input of one node does, it is not a
    graph output, and the node is ours to rewrite."""
    return rewrites.sole_reader(value, _ours)


def _is(node: ir.Node | None, op_type: str) -> TypeIs[ir.Node]:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


_other_input = rewrites.other_input
_scalar = rewrites.scalar_constant
_add_constant = rewrites.add_constant


def _replace(graph: ir.Graph, pattern: Sequence[ir.Node], node: ir.Node) -> None:
    """Put ``node`` where ``pattern`` was; its one output takes over the pattern's last output
    (name, type, shape and readers, graph outputs included)."""
    node.meta[CLAIMED_BY] = PROVIDER_NAME
    last = pattern[-1]
    replace_nodes_and_values(graph, last, pattern, [node], [last.outputs[0]], [node.outputs[0]])


def _private_node(
    model: ir.Model, op_type: str, inputs: Sequence[ir.Value | None], name: str, attributes: Sequence[ir.Attr]
) -> ir.Node:
    """A node in the plugrt.cpu domain; the model imports the domain from now on."""
    model.opset_imports.setdefault(DOMAIN, DOMAIN_VERSION)
    return ir.Node(DOMAIN, op_type, inputs, attributes, num_outputs=1, name=name)


class _NodePass(rewrites.PlacedNodePass):
    """Visit every node placed on the CPU provider once, in order."""

    def placed(self, node: ir.Node) -> bool:
        return _ours(node)


# ---------------------------------------------------------------------------------------
# (1b) BatchNormalization + Relu: one ChannelAffine step that applies the Relu block by block


class FuseBatchNormReluPass(_NodePass):
    """BatchNormalization (inference, constant statistics) that no Conv took in and whose
    output only a Relu reads: ``plugrt.cpu::ChannelAffine(x, multiplier, shift)`` with
    activation="Relu", the pair folded in float64 as the BatchNormalization kernel folds it
    (so the values are the unfused ones bit for bit). DenseNet's Concat, BN, Relu, Conv."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if not _is(node, "BatchNormalization"):
            return False
        arrays = rewrites.batch_norm_constants(node, model.opset_imports.get("", 0))
        if arrays is None or any(a.dtype.kind != "f" for a in arrays):
            return False
        relu = _sole_reader(node.outputs[0])
        if not _is(relu, "Relu"):
            return False
        scale, bias, mean, var = arrays
        epsilon = node.attributes.get_float("epsilon", 1e-5)
        multiplier, shift = rewrites.batch_norm_affine(scale, bias, mean, var, epsilon)
        graph, name = model.graph, node.name or "batch_norm"
        inputs = [
            node.inputs[0],
            _add_constant(graph, f"{name}_multiplier", multiplier),
            _add_constant(graph, f"{name}_shift", shift),
        ]
        fused = _private_node(model, "ChannelAffine", inputs, name, [ir.AttrString("activation", "Relu")])
        _replace(graph, [node, relu], fused)
        return True


# ---------------------------------------------------------------------------------------
# (2) Conv + Add (+ Relu): one FusedConv step that accumulates the product onto the residual


class FuseConvAddPass(_NodePass):
    """Conv whose output only an Add (or a two-input Sum) reads, adding another value z, and
    the Relu when one alone reads the sum: ``plugrt.cpu::FusedConv(x, w, b, z)`` (with
    activation="Relu" for the Relu), the residual connection of ResNet-style blocks."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if not _is(node, "Conv") or len(node.outputs) != 1:
            return False
        add = _sole_reader(node.outputs[0])
        if not (_is(add, "Add") or (_is(add, "Sum") and len(add.inputs) == 2)):
            return False
        if "broadcast" in add.attributes:  # Add before opset 7: broadcasting from an axis
            return False
        z = _other_input(add, node.outputs[0])
        if z is None:
            return False
        pattern, attributes = [node, add], list(node.attributes.values())
        relu = _sole_reader(add.outputs[0])
        if _is(relu, "Relu"):
            pattern.append(relu)
            attributes.append(ir.AttrString("activation", "Relu"))
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        inputs = [node.inputs[0], node.inputs[1], bias, z]
        fused = _private_node(model, "FusedConv", inputs, node.name or "conv", attributes)
        _replace(model.graph, pattern, fused)
        return True


# ---------------------------------------------------------------------------------------
# (3) Conv + Relu: one FusedConv step that applies the Relu in place


class FuseConvReluPass(_NodePass):
    """Conv whose output only a Relu reads: ``plugrt.cpu::FusedConv`` with activation="Relu"."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if not _is(node, "Conv") or len(node.outputs) != 1:
            return False
        relu = _sole_reader(node.outputs[0])
        if not _is(relu, "Relu"):
            return False
        attributes = [*node.attributes.values(), ir.AttrString("activation", "Relu")]
        fused = _private_node(model, "FusedConv", node.inputs, node.name or "conv", attributes)
        _replace(model.graph, [node, relu], fused)
        return True


# ---------------------------------------------------------------------------------------
# (3b) Conv + Clip, HardSwish or SiLU: one FusedConv step that applies it in place


def _clip_bounds(node: ir.Node, opset: int) -> list[float] | None:
    """[min, max] of a Clip whose bounds are constants (attributes before opset 11, inputs
    from it; a missing one is unbounded), else None."""
    if opset < 11:
        return [node.attributes.get_float("min", -math.inf), node.attributes.get_float("max", math.inf)]
    bounds = []
    for index, unbounded in ((1, -math.inf), (2, math.inf)):
        value = node.inputs[index] if len(node.inputs) > index else None
        if value is None:
            bounds.append(unbounded)
            continue
        bound = _scalar(value)
        if bound is None:
            return None
        bounds.append(bound)
    return bounds


def _gated_by(value: ir.Value, gate_op: str) -> list[ir.Node] | None:
    """[gate, mul] when ``value`` is read by exactly a ``gate_op`` node and a Mul of ``value``
    by that gate's output (which the Mul alone reads): ``x * Sigmoid(x)`` and its kin."""
    if value.is_graph_output():
        return None
    readers = [use.node for use in value.uses()]
    if len(readers) != 2 or not all(_ours(r) for r in readers):
        return None
    gate = next((r for r in readers if _is(r, gate_op)), None)
    mul = next((r for r in readers if _is(r, "Mul")), None)
    if gate is None or mul is None or gate is mul or gate.inputs[0] is not value:
        return None
    if _sole_reader(gate.outputs[0]) is not mul or _other_input(mul, value) is not gate.outputs[0]:
        return None
    return [gate, mul]


class FuseConvActivationPass(_NodePass):
    """Conv whose output only a Clip with constant bounds (ReLU6), a HardSwish, or a SiLU
    reads (``Sigmoid(c)`` and ``Mul(c, Sigmoid(c))``, or ``HardSigmoid(c)`` with alpha 1/6
    and beta 0.5 and its Mul, the HardSwish written out): ``plugrt.cpu::FusedConv`` with
    activation="Clip" (activation_params=[min, max]), "HardSwish" or "SiLU", which
    applies it to the Conv's output in place (``kernels.conv_activation``)."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if not _is(node, "Conv") or len(node.outputs) != 1:
            return False
        found = self._activation(model, node.outputs[0])
        if found is None:
            return False
        pattern, name, params = found
        attributes = [*node.attributes.values(), ir.AttrString("activation", name)]
        if params:
            attributes.append(ir.AttrFloat32s("activation_params", params))
        fused = _private_node(model, "FusedConv", node.inputs, node.name or "conv", attributes)
        _replace(model.graph, [node, *pattern], fused)
        return True

    @staticmethod
    def _activation(model: ir.Model, value: ir.Value) -> tuple[list[ir.Node], str, list[float]] | None:
        reader = _sole_reader(value)
        if _is(reader, "Clip"):
            bounds = _clip_bounds(reader, model.opset_imports.get("", 0))
            return None if bounds is None else ([reader], "Clip", bounds)
        if _is(reader, "HardSwish"):
            return [reader], "HardSwish", []
        gated = _gated_by(value, "Sigmoid")
        if gated is not None:
            return gated, "SiLU", []
        gated = _gated_by(value, "HardSigmoid")
        if gated is not None and math.isclose(gated[0].attributes.get_float("alpha", 0.2), 1 / 6, rel_tol=1e-4) and math.isclose(
            gated[0].attributes.get_float("beta", 0.5), 0.5, rel_tol=1e-4
        ):
            return gated, "HardSwish", []
        return None


# ---------------------------------------------------------------------------------------
# (3c) Squeeze-excitation: GlobalAveragePool, Conv 1x1, activation, Conv 1x1, gate, Mul


def _pointwise_conv(node: ir.Node | None) -> tuple[ir.Value, ir.Value | None] | None:
    """(weight, bias) of a plain 1x1 Conv (group 1, unit strides and dilations, no pads)
    with constant weight and bias, or None."""
    if not _is(node, "Conv") or len(node.inputs) < 2 or node.inputs[1] is None:
        return None
    weight = constant_array(node.inputs[1])
    if weight is None or weight.ndim < 3 or any(d != 1 for d in weight.shape[2:]) or weight.dtype not in _FLOATS:
        return None
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    if bias is not None and constant_array(bias) is None:
        return None
    attrs = node.attributes
    if attrs.get_int("group", 1) != 1 or attrs.get_string("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return None
    for name, neutral in (("strides", 1), ("dilations", 1), ("pads", 0)):
        if any(v != neutral for v in attrs.get_ints(name, [])):
            return None
    return node.inputs[1], bias


def _hidden_activation(value: ir.Value) -> tuple[list[ir.Node], str, ir.Value] | None:
    """(its nodes, name, input) of the Relu, HardSwish or SiLU producing ``value``."""
    node = value.producer()
    if _is(node, "Relu") or _is(node, "HardSwish"):
        return [node], node.op_type, node.inputs[0]  # type: ignore[return-value]
    if _is(node, "Mul"):
        for source in node.inputs:
            if source is not None and (gated := _gated_by(source, "Sigmoid")) is not None and gated[1] is node:
                return gated, "SiLU", source
    return None


class FuseSqueezeExcitePass(_NodePass):
    """``Mul(x, gate(Conv(act(Conv(GlobalAveragePool(x))))))`` with 1x1 Convs of constant
    weights, act a Relu, HardSwish or SiLU and gate a Sigmoid or HardSigmoid, every
    intermediate read by the next node alone: ``plugrt.cpu::SqueezeExcite(x, w1, b1, w2,
    b2)`` (``kernels.squeeze_excite``), MobileNet v3's, EfficientNet's and RegNet-Y's
    channel attention as one step."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if not _is(node, "Mul") or len(node.inputs) != 2:
            return False
        for x, gated in (node.inputs, node.inputs[::-1]):
            found = self._pattern(x, gated, node) if x is not None and gated is not None else None
            if found is not None:
                pattern, inputs, attributes = found
                fused = _private_node(model, "SqueezeExcite", inputs, node.name or "squeeze_excite", attributes)
                _replace(model.graph, [*pattern, node], fused)
                return True
        return False

    @staticmethod
    def _pattern(
        x: ir.Value, gated: ir.Value, mul: ir.Node
    ) -> tuple[list[ir.Node], list[ir.Value | None], list[ir.Attr]] | None:
        if x.type is not None and x.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
            return None
        gate = gated.producer()
        if not (_is(gate, "Sigmoid") or _is(gate, "HardSigmoid")) or _sole_reader(gated) is not mul:
            return None
        expand = gate.inputs[0].producer() if gate.inputs[0] is not None else None
        second = _pointwise_conv(expand)
        if second is None or _sole_reader(gate.inputs[0]) is not gate:
            return None
        assert expand is not None
        hidden = _hidden_activation(expand.inputs[0]) if expand.inputs[0] is not None else None
        if hidden is None or _sole_reader(expand.inputs[0]) is not expand:
            return None
        act_nodes, act_name, squeezed = hidden
        reduce = squeezed.producer()
        first = _pointwise_conv(reduce)
        if first is None or (act_name != "SiLU" and _sole_reader(squeezed) is not act_nodes[0]):
            return None
        assert reduce is not None
        pooled = reduce.inputs[0]
        pool = pooled.producer() if pooled is not None else None
        if not _is(pool, "GlobalAveragePool") or pool.inputs[0] is not x or _sole_reader(pooled) is not reduce:
            return None
        attributes = [ir.AttrString("activation", act_name), ir.AttrString("gate", gate.op_type)]
        if gate.op_type == "HardSigmoid":
            attributes += [
                ir.AttrFloat32("alpha", gate.attributes.get_float("alpha", 0.2)),
                ir.AttrFloat32("beta", gate.attributes.get_float("beta", 0.5)),
            ]
        inputs = [x, first[0], first[1], second[0], second[1]]
        return [pool, reduce, *act_nodes, expand, gate], inputs, attributes


# ---------------------------------------------------------------------------------------
# (4) MatMul + Add of a constant bias: one FusedMatMul step


def _drop_unused_initializers(graph: ir.Graph, values: Sequence[ir.Value]) -> None:
    """Forget initializers a rewrite left without readers (their arrays live on in the
    fused constant; keeping both would hold the weights twice)."""
    for value in values:
        name = value.name
        if name is None or name not in graph.initializers or value.is_graph_input():
            continue
        if not value.uses() and not value.is_graph_output():
            graph.initializers.pop(name)


def _ints(value: ir.Value | None) -> tuple[int, ...] | None:
    """The ints of a constant 1-D integer tensor, else None."""
    array = constant_array(value) if value is not None else None
    if array is None or array.dtype.kind not in "iu" or array.ndim != 1:
        return None
    return tuple(int(v) for v in array)


def _reshape_target(node: ir.Node) -> list[int] | None:
    """The shape a Reshape asks for, where it is a constant without zeros (a zero copies an
    input dimension, or means 0 with allowzero: either way not a plain target); else None."""
    shape = _ints(node.inputs[1]) if len(node.inputs) == 2 else None
    return None if shape is None or 0 in shape else list(shape)


class FuseReshapedGemmPass(_NodePass):
    """``Reshape(Gemm(Reshape(x, (-1, K)), W, bias), (*lead, N))`` for ``x`` of static shape
    (*lead, K): a Linear layer on a stack of rows as exporters write it (transformers'
    GPT-2 ``Conv1D``; torch.export's ``addmm`` of a flattened input).
    ``plugrt.cpu::FusedMatMul(x, W, bias)`` on ``x`` as it is: one step for three, which the
    GELU fusion after it then sees as any other Linear layer. ``W`` a constant 2-D weight
    (laid out transposed once where ``transB``), ``bias`` a constant (N,) or (1, N),
    alpha = beta = 1 and no ``transA``; the flattened rows read by the Gemm alone and the
    product by the second Reshape alone."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if not _is(node, "Gemm") or len(node.inputs) != 3 or any(v is None for v in node.inputs):
            return False
        attributes = node.attributes
        if attributes.get_int("transA", 0) or attributes.get_float("alpha", 1.0) != 1.0 or attributes.get_float("beta", 1.0) != 1.0:
            return False
        rows, weight_value, bias_value = node.inputs
        assert rows is not None and weight_value is not None and bias_value is not None  # checked above
        flatten = rows.producer()
        unflatten = _sole_reader(node.outputs[0])
        if not (_is(flatten, "Reshape") and _is(unflatten, "Reshape") and _ours(flatten)) or _sole_reader(rows) is not node:
            return False
        x = flatten.inputs[0]
        if x is None or x.shape is None or not x.shape.is_static() or len(x.shape) < 2:
            return False
        *lead, k = x.shape.numpy()
        weight, bias = constant_array(weight_value), constant_array(bias_value)
        if weight is None or weight.ndim != 2 or weight.dtype not in _FLOATS or bias is None or bias.dtype != weight.dtype:
            return False
        transposed = bool(attributes.get_int("transB", 0))
        if transposed:
            weight = weight.T
        n = weight.shape[1]
        if weight.shape[0] != k or bias.shape not in ((n,), (1, n)):
            return False
        if _reshape_target(flatten) not in ([-1, k], [math.prod(lead), k]) or _reshape_target(unflatten) != [*lead, n]:
            return False
        graph = model.graph
        if transposed:
            weight_value = _add_constant(graph, f"{weight_value.name or 'weight'}_t", weight)
        if bias.ndim == 2:
            bias_value = _add_constant(graph, f"{bias_value.name or 'bias'}_row", bias.reshape(n))
        old_constants = [v for v in node.inputs if v is not None]
        fused = _private_node(model, "FusedMatMul", [x, weight_value, bias_value], node.name or "matmul", [])
        _replace(graph, [flatten, node, unflatten], fused)
        _drop_unused_initializers(graph, old_constants)
        return True


class FuseMatMulBiasPass(_NodePass):
    """MatMul by a constant 2-D weight whose output only an Add of a constant bias of
    shape (N,) reads: ``plugrt.cpu::FusedMatMul(A, W, bias)``."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if not _is(node, "MatMul") or len(node.inputs) != 2 or node.inputs[1] is None:
            return False
        weight = constant_array(node.inputs[1])
        if weight is None or weight.ndim != 2 or weight.dtype not in _FLOATS:
            return False
        add = _sole_reader(node.outputs[0])
        if not _is(add, "Add"):
            return False
        bias_value = _other_input(add, node.outputs[0])
        bias = constant_array(bias_value) if bias_value is not None else None
        # Only (N,): a wider bias could broadcast the product to more axes.
        if bias is None or bias.dtype != weight.dtype or bias.shape != (weight.shape[1],):
            return False
        inputs = [node.inputs[0], node.inputs[1], bias_value]
        fused = _private_node(model, "FusedMatMul", inputs, node.name or "matmul", [])
        _replace(model.graph, [node, add], fused)
        return True


# ---------------------------------------------------------------------------------------
# (5a) LayerNorm written out as ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add


class FuseLayerNormPass(_NodePass):
    """The written-out LayerNorm the core's ``RewriteLayerNormPass`` left (below opset 17,
    where the standard opset has no LayerNormalization): ``plugrt.cpu::LayerNormalization``,
    the kernel of the standard op."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        found = rewrites.match_layer_norm(node, model.opset_imports.get("", 0), _ours)
        if found is None:
            return False
        inputs = [found.x, found.scale, *([found.bias] if found.bias is not None else [])]
        attributes = [ir.AttrInt64("axis", found.axis), ir.AttrFloat32("epsilon", found.epsilon)]
        fused = _private_node(model, "LayerNormalization", inputs, node.name or "layer_norm", attributes)
        _replace(model.graph, found.pattern, fused)
        return True


# ---------------------------------------------------------------------------------------
# (5b) Gelu: the contrib ops the core writes below opset 20, and written-out ones it left


class FuseGeluPass(_NodePass):
    """``plugrt.cpu::Gelu`` (approximate "none" or "tanh", the standard Gelu's kernel) for
    ``com.microsoft::FastGelu`` without a bias (what the core's ``RewriteGeluPass`` writes
    for the tanh form below opset 20; the contrib kernel computes it in another order) and
    for a written-out GELU the core left."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if node.domain == rewrites.CONTRIB_DOMAIN and node.op_type == "FastGelu" and len(node.inputs) == 1:
            pattern, x, approximate = [node], node.inputs[0], "tanh"
        else:
            found = rewrites.match_gelu(node, _ours)
            if found is None:
                return False
            pattern, x, approximate = found.pattern, found.x, found.approximate
        if x is None:
            return False
        fused = _private_node(model, "Gelu", [x], node.name or "gelu", [ir.AttrString("approximate", approximate)])
        _replace(model.graph, pattern, fused)
        return True


def _silu_of(node: ir.Node) -> tuple[ir.Value, ir.Node] | None:
    """(g, the Mul) when ``node`` is ``Sigmoid(g)`` read only by ``Mul(g, Sigmoid(g))``."""
    if not _is(node, "Sigmoid") or node.inputs[0] is None:
        return None
    gate = node.inputs[0]
    product = _sole_reader(node.outputs[0])
    if not _is(product, "Mul") or {id(v) for v in product.inputs} != {id(gate), id(node.outputs[0])}:
        return None
    return gate, product


class FuseSiluMulPass(_NodePass):
    """``plugrt.cpu::SiluMul(g, u)`` for ``Mul(Mul(g, Sigmoid(g)), u)``: a decoder MLP's
    gate (SwiGLU, as onnxruntime-genai's model builder and exporters write Llama, Qwen and
    SmolLM), three steps a layer as one. ``g`` and ``u`` of one float type; the inner
    results read by nothing else."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        found = _silu_of(node)
        if found is None:
            return False
        gate, product = found
        outer = _sole_reader(product.outputs[0])
        if not _is(outer, "Mul"):
            return False
        up = _other_input(outer, product.outputs[0])
        if up is None or up is product.outputs[0] or gate.dtype not in _SILU_TYPES or up.dtype != gate.dtype:
            return False
        fused = _private_node(model, "SiluMul", [gate, up], outer.name or "silu_mul", [])
        _replace(model.graph, [node, product, outer], fused)
        return True


class FuseSiluPass(_NodePass):
    """``plugrt.cpu::Silu(g)`` for ``Mul(g, Sigmoid(g))`` that no SwiGLU took (after
    :class:`FuseSiluMulPass`): a transformer MLP's SiLU after its first Linear (MobileViT's),
    two steps as one compiled pass. The Sigmoid read by nothing else."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        found = _silu_of(node)
        if found is None or found[0].dtype not in _SILU_TYPES:
            return False
        gate, product = found
        fused = _private_node(model, "Silu", [gate], product.name or "silu", [])
        _replace(model.graph, [node, product], fused)
        return True


_SILU_TYPES = (ir.DataType.FLOAT, ir.DataType.DOUBLE)


# ---------------------------------------------------------------------------------------
# (3c) 1x1 Conv + the depthwise Conv that alone reads it: one ExpandDepthwise step


def _conv_step(node: ir.Node | None) -> TypeIs[ir.Node]:
    """A Conv, or a FusedConv with an activation and no residual input."""
    if node is None or len(node.outputs) != 1 or len(node.inputs) > 3:
        return False
    if _is(node, "Conv"):
        return True
    return node.op_type == "FusedConv" and node.domain == DOMAIN and "activation" in node.attributes


def _float32_weight(node: ir.Node) -> np.ndarray | None:
    """The 4-D weight of a Conv step when it and the bias (if any) are float32 constants."""
    weight = constant_array(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    if weight is None or weight.dtype != np.float32 or weight.ndim != 4:
        return None
    bias_value = node.inputs[2] if len(node.inputs) > 2 else None
    bias = None if bias_value is None else constant_array(bias_value)
    if bias_value is not None and (bias is None or bias.dtype != np.float32):
        return None
    return weight


class FuseExpandDepthwisePass(_NodePass):
    """A 1x1 Conv step (stride 1, no pads, one group; its activation fused or not) whose
    output only a 2-D depthwise Conv step reads, both with float32 constant weights:
    ``plugrt.cpu::ExpandDepthwise(x, w1, b1, w2, b2)``, the 1x1 Conv's activation as
    ``expand_activation`` (``kernels.expand_depthwise``: the wide tensor between them is
    never made)."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if not _conv_step(node) or node.attributes.get_int("group", 1) != 1 or node.attributes.get("auto_pad") not in (None,):
            return False
        expand = _float32_weight(node)
        if expand is None or expand.shape[2:] != (1, 1):
            return False
        ones = (*node.attributes.get_ints("strides", [1, 1]), *node.attributes.get_ints("dilations", [1, 1]))
        if any(v != 1 for v in ones) or any(node.attributes.get_ints("pads", [0] * 4)):
            return False
        depthwise = _sole_reader(node.outputs[0])
        if not _conv_step(depthwise) or depthwise.inputs[0] is not node.outputs[0] or depthwise.attributes.get("auto_pad") is not None:
            return False
        taps = _float32_weight(depthwise)
        m = expand.shape[0]
        if taps is None or taps.shape[:2] != (m, 1) or depthwise.attributes.get_int("group", 1) != m:
            return False
        kernel = list(taps.shape[2:])
        if list(depthwise.attributes.get_ints("kernel_shape", kernel)) != kernel:
            return False
        ints = depthwise.attributes.get_ints
        attributes = [
            ir.AttrInt64s("kernel_shape", kernel), ir.AttrInt64("group", m), ir.AttrInt64s("strides", list(ints("strides", [1, 1]))),
            ir.AttrInt64s("dilations", list(ints("dilations", [1, 1]))), ir.AttrInt64s("pads", list(ints("pads", [0] * 4))),
        ]
        for step, prefix in ((node, EXPAND_PREFIX), (depthwise, "")):
            activation, params = step.attributes.get("activation"), step.attributes.get("activation_params")
            if activation is not None:
                attributes.append(ir.AttrString(prefix + "activation", activation.as_string()))
            if params is not None:
                attributes.append(ir.AttrFloat32s(prefix + "activation_params", list(params.as_floats())))
        inputs = [node.inputs[0], node.inputs[1], node.inputs[2] if len(node.inputs) > 2 else None, depthwise.inputs[1],
                  depthwise.inputs[2] if len(depthwise.inputs) > 2 else None]
        fused = _private_node(model, "ExpandDepthwise", inputs, node.name or "conv", attributes)
        _replace(model.graph, [node, depthwise], fused)
        return True


# ---------------------------------------------------------------------------------------
# Kernels of the plugrt.cpu nodes


@kernel_builder("FusedConv", DOMAIN_VERSION, domain=DOMAIN, compiled=CONV_LOOPS)
def fused_conv(ctx: KernelContext) -> Callable[..., np.ndarray]:
    """Conv (x, w, b) with the Relu applied to each output block while it is in cache, or
    with activation="Clip" (activation_params=[min, max]), "HardSwish" or "SiLU" applied to
    its output in place; with a fourth input z, Conv + z (then the Relu when activation="Relu")."""
    attributes = dict(ctx.attributes)
    activation = attributes.pop("activation", None)
    params = [float(p) for p in attributes.pop("activation_params", [])]
    residual = ctx.num_inputs > 3
    if activation is not None and activation not in conv_activation.ACTIVATIONS:
        raise NotImplementedError(
            f"FusedConv: activation={activation!r} is not supported; use one of {sorted(conv_activation.ACTIVATIONS)}"
        )
    if residual and activation not in (None, "Relu"):
        raise NotImplementedError(f"FusedConv: activation={activation!r} after a residual sum is not supported (only 'Relu')")
    if activation is None and not residual:
        raise NotImplementedError("FusedConv: without a residual input it needs an activation")
    if activation is not None and len(params) != conv_activation.ACTIVATIONS[activation]:
        raise ValueError(
            f"FusedConv: activation={activation!r} takes {conv_activation.ACTIVATIONS[activation]} activation_params, got {params}"
        )
    conv_ctx = dataclasses.replace(ctx, op_type="Conv", domain="", attributes=attributes)
    if residual:
        return conv_residual.build_residual_conv(conv_ctx, relu=activation == "Relu")
    if activation == "Relu":
        return convolution.build_conv(conv_ctx, relu=True)
    return convolution.build_conv(conv_ctx, activation=conv_activation.activation_in_place(activation, params))


@kernel_builder("ChannelAffine", DOMAIN_VERSION, domain=DOMAIN, inplace_keeps_first=True)
def channel_affine(ctx: KernelContext) -> Callable[..., np.ndarray]:
    """x * multiplier + shift per channel (axis 1 of x; multiplier and shift are vectors,
    cast to x's dtype once when constant), then the Relu with activation="Relu": the
    inference BatchNormalization's ``channel_affine`` passes, with the Relu on each block
    while it is in cache. It writes over x where x dies at it (``inplace_keeps_first``: the
    output has x's shape whatever the vectors'): DenseNet's Concat outputs, one buffer less
    through the cache (DenseNet-121 4-8% faster a run, alternating in one process)."""
    activation = ctx.attributes.get("activation")
    if activation not in (None, "Relu"):
        raise NotImplementedError(f"ChannelAffine: activation={activation!r} is not supported (only 'Relu')")
    relu = activation == "Relu"
    affine = normalization.AffineCache(lambda multiplier, shift: (multiplier, shift), ctx.constant_inputs[1:3])

    def run(x: np.ndarray, multiplier: np.ndarray, shift: np.ndarray) -> np.ndarray:
        m, s = affine(x, multiplier, shift)
        return normalization.channel_affine(np.empty_like(x), x, m, s, relu)

    def run_into(out: np.ndarray, x: np.ndarray, multiplier: np.ndarray, shift: np.ndarray) -> None:
        m, s = affine(x, multiplier, shift, out=out)
        elementwise.with_small_buffers(normalization.channel_affine, out, x, m, s, relu)

    declare_into(run_into, run)
    return run


@kernel_builder("FusedMatMul", DOMAIN_VERSION, domain=DOMAIN, compiled=DENSE_LOOPS)
def fused_matmul(ctx: KernelContext) -> Callable[..., np.ndarray]:
    """a @ w + bias; a stack of rows is multiplied as one (rows, K) matrix, a constant
    float32 weight by the packed kernel where the host has it (``kernels.dense``)."""
    panels = dense.WeightPanels(ctx.constant_inputs[1] if len(ctx.constant_inputs) > 1 else None)

    def product(out: np.ndarray, a: np.ndarray, w: np.ndarray, bias: np.ndarray, allocate: dense.Allocate) -> None:
        rows = dense.matrix_rows(out, a, w, bias, allocate)
        if rows is not None:
            dense.dense_product(_as_rows(out), rows, w, bias, panels=panels, allocate=allocate)
            return
        np.matmul(a, w, out=out)
        out += bias

    def run(a: np.ndarray, w: np.ndarray, bias: np.ndarray) -> np.ndarray:
        out = np.empty((*a.shape[:-1], w.shape[-1]), np.result_type(a, w, bias))
        product(out, a, w, bias, dense.new_array)
        return out

    def run_into(out: np.ndarray, a: np.ndarray, w: np.ndarray, bias: np.ndarray) -> None:
        product(out, a, w, bias, lambda slot, shape, dtype: scratch(out, slot, shape, dtype))

    declare_into(run_into, run)
    return run


def _as_rows(x: np.ndarray) -> np.ndarray:
    """A C-contiguous x as a 2-D (rows, last axis) view."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


kernel_builder("ExpandDepthwise", DOMAIN_VERSION, domain=DOMAIN, compiled=CONV_LOOPS)(build_expand_depthwise)
kernel_builder("SqueezeExcite", DOMAIN_VERSION, domain=DOMAIN, compiled=CONV_LOOPS + ROW_LOOPS, inplace_keeps_first=True)(
    squeeze_excite.build_squeeze_excite
)
kernel_builder("LayerNormalization", DOMAIN_VERSION, domain=DOMAIN, multi_output=True, compiled=ROW_LOOPS)(
    normalization.layer_normalization
)
kernel_builder("Gelu", DOMAIN_VERSION, domain=DOMAIN, compiled=ROW_LOOPS)(elementwise.gelu)


def _silu_mul_flat(out: np.ndarray, g: np.ndarray, u: np.ndarray) -> tuple | None:
    """The compiled loop and the three arrays flat, when it takes them (float32, one shape,
    contiguous); else None."""
    if not (out.dtype == g.dtype == u.dtype == np.float32 and out.shape == g.shape == u.shape):
        return None
    if not (out.flags.c_contiguous and g.flags.c_contiguous and u.flags.c_contiguous):
        return None
    loops = epilogue_loops()
    return None if loops is None else (loops.silu_mul, g.reshape(-1), u.reshape(-1), out.reshape(-1))


def _silu_mul_into(out: np.ndarray, g: np.ndarray, u: np.ndarray) -> None:
    """out = g * sigmoid(g) * u, sigmoid as the Sigmoid kernel computes it (exp(-g)
    overflowing to inf gives 0): one compiled pass where numba is (its exp within 2 ulp of
    numpy's), else five numpy passes."""
    flat = _silu_mul_flat(out, g, u)
    if flat is not None:
        flat[0](*flat[1:])
        return
    with np.errstate(over="ignore"):
        np.negative(g, out=out)
        np.exp(out, out=out)
    out += 1
    np.divide(g, out, out=out)
    np.multiply(out, u, out=out)


def _silu_mul_bind(out: np.ndarray, g: np.ndarray, u: np.ndarray) -> Callable[[], None] | None:
    """For a capture: the compiled pass over these buffers as one call, or None."""
    flat = _silu_mul_flat(out, g, u)
    if flat is None:
        return None
    silu_mul, g_flat, u_flat, out_flat = flat

    def replay() -> None:
        silu_mul(g_flat, u_flat, out_flat)

    loops = epilogue_loops()
    words = np.array([0] * loops.SILU_MUL_WORDS, np.int64)
    words[loops.SILU_MUL_G], words[loops.SILU_MUL_U] = g_flat.ctypes.data, u_flat.ctypes.data
    words[loops.SILU_MUL_OUT], words[loops.SILU_MUL_LENGTH] = out_flat.ctypes.data, out_flat.shape[0]
    replay.program = (loops.silu_mul_step.address, 0, int(words.ctypes.data))  # type: ignore[attr-defined]  # a compiled program's step
    replay.words = words  # type: ignore[attr-defined]
    return replay


_silu_mul_into.bind = _silu_mul_bind  # type: ignore[attr-defined]


_SILU_IN_PLACE = conv_activation.activation_in_place("SiLU", [])


def _silu_into(out: np.ndarray, g: np.ndarray) -> None:
    """out = g * sigmoid(g): a copy of ``g``, then the fused Conv's in-place SiLU (one
    compiled pass where numba is, numpy passes through a work array kept with ``out``)."""
    assert _SILU_IN_PLACE is not None  # None only for the Relu
    if conv_activation.pooled(out, g, conv_activation.SILU):  # on the pool's threads, copied a unit at a time
        return
    if out is not g:
        np.copyto(out, g)
    _SILU_IN_PLACE(out, out)


@kernel("Silu", DOMAIN_VERSION, domain=DOMAIN, inplace=True, into=_silu_into, compiled=("_numba_epilogue",))
def silu(g: np.ndarray) -> np.ndarray:
    """SiLU(g) (FuseSiluPass)."""
    out = np.empty_like(g, order="C")
    _silu_into(out, g)
    return out


@kernel("SiluMul", DOMAIN_VERSION, domain=DOMAIN, into=_silu_mul_into, compiled=("_numba_epilogue",))
def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """SiLU(g) * u (FuseSiluMulPass)."""
    out = np.empty(np.broadcast_shapes(g.shape, u.shape), np.result_type(g, u))
    _silu_mul_into(out, g, u)
    return out
