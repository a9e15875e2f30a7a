"""The CPU provider's fusions: onnx_ir passes that merge node patterns into one step each.

``CPUProvider.passes`` returns :func:`fusion_passes`; ``plugrt.build`` runs them at
optimisation level "all", after placement, on the nodes placed on the CPU provider, so no
other provider is ever asked about a fused node, and a session built at "none" or
"basic" never sees one. The nodes they write live in the
private domain ``plugrt.cpu`` (version 1, added to the model's opset imports by the pass
that writes one); their kernels are registered at the end of this module and reuse the
standard kernels (Conv from kernels/conv.py, BatchNormalization's per-channel affine pass,
LayerNormalization, Gelu).

Every pass fuses only where each intermediate value is read by the next node of the
pattern alone and is not a graph output, so no value anyone else can see disappears, and
only nodes placed on the CPU provider (``node.meta[plugrt.passes.CLAIMED_BY]``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np
import onnx_ir as ir
from onnx_ir.convenience import replace_nodes_and_values
from onnx_ir.passes import InPlacePass, PassResult

from plugrt.ir_utils import constant_array
from plugrt.passes import CLAIMED_BY

from ._registry import PROVIDER_NAME, KernelContext, kernel_builder, declare_into
from .kernels import conv as convolution
from .kernels import conv_residual
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
    "FuseMatMulBiasPass",
    "FuseLayerNormPass",
    "FuseGeluPass",
]

DOMAIN = "plugrt.cpu"
DOMAIN_VERSION = 1

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def fusion_passes() -> list[InPlacePass]:
    """The CPU fusions in the order they must run (folding before the Add and Relu fusions
    that look for a Conv or a BatchNormalization right before them; Conv + Add + Relu
    before Conv + Relu)."""
    return [
        FoldChannelAffinePass(), FuseBatchNormReluPass(), FuseConvAddPass(), FuseConvReluPass(), FuseMatMulBiasPass(),
        FuseLayerNormPass(), FuseGeluPass(),
    ]


# ---------------------------------------------------------------------------------------
# Graph helpers


def _ours(node: ir.Node) -> bool:
    """Whether ``node`` is placed on the CPU provider (unmarked: nothing else to run it)."""
    return node.meta.get(CLAIMED_BY, PROVIDER_NAME) == PROVIDER_NAME


def _sole_reader(value: ir.Value | None) -> ir.Node | None:
    """The node reading ``value``, when exactly one input of one node does, it is not a
    graph output, and the node is ours to rewrite."""
    if value is None or value.is_graph_output():
        return None
    uses = list(value.uses())
    if len(uses) != 1 or not _ours(uses[0].node):
        return None
    return uses[0].node


def _read_only_by(value: ir.Value, nodes: Iterable[ir.Node]) -> bool:
    """True when every reader of ``value`` is among ``nodes`` and it is not a graph output."""
    allowed = set(map(id, nodes))
    return not value.is_graph_output() and all(id(use.node) in allowed for use in value.uses())


def _is(node: ir.Node | None, op_type: str) -> TypeIs[ir.Node]:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _other_input(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """For a binary node reading ``value``, its other input."""
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if a is value:
        return b
    if b is value:
        return a
    return None


def _scalar(value: ir.Value | None) -> float | None:
    """The float of a one-element constant, else None."""
    array = constant_array(value) if value is not None else None
    if array is None or array.size != 1 or array.dtype.kind != "f":
        return None
    return float(array.reshape(-1)[0])


def _close(actual: float | None, wanted: float, rtol: float = 1e-4) -> bool:
    return actual is not None and abs(actual - wanted) <= rtol * abs(wanted)


def _add_constant(graph: ir.Graph, hint: str, array: np.ndarray) -> ir.Value:
    name, suffix = hint, 0
    while name in graph.initializers:
        suffix += 1
        name = f"{hint}_{suffix}"
    tensor = ir.tensor(np.ascontiguousarray(array), name=name)
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


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


class _NodePass(InPlacePass):
    """Visit every node of the main graph once, in order; ``rewrite`` returns whether it
    changed the graph at that node."""

    def call(self, model: ir.Model) -> PassResult:
        modified = False
        for node in list(model.graph):
            if node.graph is model.graph and _ours(node):  # not removed by an earlier rewrite
                modified |= self.rewrite(model, node)
        return PassResult(model, modified)

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------
# (1) Per-channel affine nodes folded into the Conv or BatchNormalization before them


def _batch_norm_constants(node: ir.Node, opset: int) -> list[np.ndarray] | None:
    """[scale, bias, mean, var] of a BatchNormalization that normalises with its stored,
    constant statistics (as its kernel decides) and whose first output alone is read."""
    found = [constant_array(v) if v is not None else None for v in node.inputs[1:5]]
    arrays = [a for a in found if a is not None]
    if len(arrays) != 4 or any(a.ndim != 1 or a.shape != arrays[0].shape for a in arrays):
        return None
    attributes = node.attributes
    if opset < 7:
        training = not attributes.get_int("is_test", 0)
    elif opset < 14:
        training = len(node.outputs) > 1
    else:
        training = bool(attributes.get_int("training_mode", 0))
    if opset < 9 and not attributes.get_int("spatial", 1):
        return None  # statistics per activation, not per channel
    if training or any(v.uses() or v.is_graph_output() for v in node.outputs[1:]):
        return None
    return arrays


def _channel_affine(
    node: ir.Node, value: ir.Value, channels: int, rank: int | None, opset: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """(scale, shift) per channel, in float64, with ``node(value) == value * scale + shift``
    where ``value`` is an (N, channels, ...) tensor of ``rank`` axes (None: unknown); None
    when ``node`` is not such a map of ``value``."""
    if node.domain not in ("", "ai.onnx") or not node.inputs:
        return None
    if node.op_type in ("BatchNormalization", "Sub", "Div") and node.inputs[0] is not value:
        return None  # not an affine map of value (c - value, c / value)
    if node.op_type == "BatchNormalization":
        arrays = _batch_norm_constants(node, opset)
        if arrays is None or arrays[0].shape != (channels,):
            return None
        scale, bias, mean, var = arrays
        return normalization.batch_norm_affine(scale, bias, mean, var, node.attributes.get_float("epsilon", 1e-5))
    if node.op_type not in ("Add", "Sub", "Mul", "Div"):
        return None
    other = _other_input(node, value)
    array = constant_array(other) if other is not None else None
    if array is None or array.dtype.kind != "f":
        return None
    if array.size != 1:
        if rank is None or array.ndim > rank:
            return None
        # Right-aligned against (N, channels, *spatial): a size-1 axis everywhere except
        # the channel axis.
        shape = (1,) * (rank - array.ndim) + array.shape
        if any(size != 1 for axis, size in enumerate(shape) if axis != 1) or shape[1] not in (1, channels):
            return None
    per_channel = np.broadcast_to(np.asarray(array, np.float64).reshape(-1), (channels,))
    ones, zeros = np.ones(channels), np.zeros(channels)
    return {
        "Add": (ones, per_channel),
        "Sub": (ones, -per_channel),
        "Mul": (per_channel, zeros),
        "Div": (1.0 / per_channel, zeros),
    }[node.op_type]


def _affine_chain(
    value: ir.Value, channels: int, rank: int | None, opset: int
) -> tuple[list[ir.Node], np.ndarray, np.ndarray]:
    """The per-channel affine nodes applied to ``value`` one after the other (each the sole
    reader of the one before), and the (scale, shift) they make together."""
    scale, shift = np.ones(channels), np.zeros(channels)
    chain: list[ir.Node] = []
    while (reader := _sole_reader(value)) is not None:
        affine = _channel_affine(reader, value, channels, rank, opset)
        if affine is None:
            break
        scale, shift = scale * affine[0], shift * affine[0] + affine[1]
        chain.append(reader)
        value = reader.outputs[0]
    return chain, scale, shift


# Ops whose first input has the rank of their output (Concat: all inputs do).
_SAME_RANK = frozenset(
    {"BatchNormalization", "Relu", "LeakyRelu", "Sigmoid", "Clip", "Dropout", "Identity", "LRN",
     "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Concat"}
)


def _rank(value: ir.Value | None) -> int | None:
    """The number of axes of ``value``: from its shape, or through the producers that keep
    it up to a Conv with a constant weight; None when that does not tell."""
    while value is not None:
        if value.shape is not None:
            return len(value.shape)
        node = value.producer()
        if node is None:
            return None
        if node.op_type in ("Conv", "FusedConv") and len(node.inputs) > 1 and node.inputs[1] is not None:
            weight = constant_array(node.inputs[1])
            return None if weight is None else weight.ndim
        if node.op_type not in _SAME_RANK or node.domain not in ("", "ai.onnx"):
            return None
        value = node.inputs[0] if node.inputs else None
    return None


class FoldChannelAffinePass(_NodePass):
    """BatchNormalization (inference) and Mul, Add, Sub, Div by per-channel constants fold
    into the node before them, in float64: into a Conv's constant weight and bias, or into
    a BatchNormalization's scale and bias."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if _is(node, "Conv") and len(node.outputs) == 1:
            return self._into_conv(model, node)
        if _is(node, "BatchNormalization"):
            return self._into_batch_norm(model, node)
        return False

    def _into_conv(self, model: ir.Model, node: ir.Node) -> bool:
        w_value = node.inputs[1] if len(node.inputs) > 1 else None
        weight = constant_array(w_value) if w_value is not None else None
        if weight is None or weight.dtype not in _FLOATS or weight.ndim < 3:
            return False
        bias_value = node.inputs[2] if len(node.inputs) > 2 else None
        bias = constant_array(bias_value) if bias_value is not None else None
        if bias_value is not None and bias is None:
            return False
        rank = weight.ndim
        chain, scale, shift = _affine_chain(node.outputs[0], weight.shape[0], rank, model.opset_imports.get("", 0))
        if not chain:
            return False
        graph, name = model.graph, node.name or "conv"
        new_weight = np.asarray(weight, np.float64) * scale.reshape((-1,) + (1,) * (rank - 1))
        new_bias = shift + (np.asarray(bias, np.float64) * scale if bias is not None else 0.0)
        inputs = [
            node.inputs[0],
            _add_constant(graph, f"{name}_folded_weight", new_weight.astype(weight.dtype)),
            _add_constant(graph, f"{name}_folded_bias", new_bias.astype(weight.dtype)),
        ]
        conv = ir.Node("", "Conv", inputs, list(node.attributes.values()), num_outputs=1, name=node.name)
        _replace(graph, [node, *chain], conv)
        return True

    def _into_batch_norm(self, model: ir.Model, node: ir.Node) -> bool:
        opset = model.opset_imports.get("", 0)
        arrays = _batch_norm_constants(node, opset)
        if arrays is None or arrays[0].dtype not in _FLOATS:
            return False
        scale, bias, mean, var = arrays
        chain, gain, shift = _affine_chain(node.outputs[0], scale.shape[0], _rank(node.inputs[0]), opset)
        if not chain:
            return False
        # ((x - mean) / sqrt(var + eps) * scale + bias) * gain + shift
        graph, name = model.graph, node.name or "batch_norm"
        new_scale = np.asarray(scale, np.float64) * gain
        new_bias = np.asarray(bias, np.float64) * gain + shift
        inputs = [
            node.inputs[0],
            _add_constant(graph, f"{name}_folded_scale", new_scale.astype(scale.dtype)),
            _add_constant(graph, f"{name}_folded_bias", new_bias.astype(bias.dtype)),
            *node.inputs[3:5],
        ]
        attributes = list(node.attributes.values())
        batch_norm = ir.Node("", "BatchNormalization", inputs, attributes, num_outputs=1, name=node.name)
        _replace(graph, [node, *chain], batch_norm)
        return True


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
        arrays = _batch_norm_constants(node, model.opset_imports.get("", 0))
        if arrays is None or any(a.dtype.kind != "f" for a in arrays):
            return False
        relu = _sole_reader(node.outputs[0])
        if not _is(relu, "Relu"):
            return False
        scale, bias, mean, var = arrays
        epsilon = node.attributes.get_float("epsilon", 1e-5)
        multiplier, shift = normalization.batch_norm_affine(scale, bias, mean, var, epsilon)
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
# (4) MatMul + Add of a constant bias: one FusedMatMul step


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


def _reduce_axes(node: ir.Node, opset: int) -> tuple[int, ...] | None:
    """The axes of a ReduceMean with keepdims=1, as written (None when not constant)."""
    if node.attributes.get_int("keepdims", 1) != 1:
        return None
    if opset >= 18:
        if len(node.inputs) < 2 or node.inputs[1] is None:
            return None
        array = constant_array(node.inputs[1])
        return None if array is None else tuple(int(a) for a in array.reshape(-1))
    axes = node.attributes.get_ints("axes")
    return None if axes is None else tuple(axes)


def _trailing_axis(axes: tuple[int, ...]) -> int | None:
    """The LayerNormalization axis for reducing over ``axes`` given as the last k axes
    with negative indices (-k, ..., -1); None for anything else."""
    if not axes or sorted(axes) != list(range(-len(axes), 0)):
        return None
    return -len(axes)


def _squares(node: ir.Node | None, value: ir.Value) -> bool:
    """Whether ``node`` computes value ** 2 (Pow by a constant 2 or Mul(value, value))."""
    if _is(node, "Pow"):
        return node.inputs[0] is value and _close(_scalar(node.inputs[1]), 2.0, 0.0)
    return _is(node, "Mul") and node.inputs[0] is value and node.inputs[1] is value


class FuseLayerNormPass(_NodePass):
    """mean = ReduceMean(x); d = x - mean; var = ReduceMean(d ** 2); y = d / Sqrt(var + eps)
    * scale (+ bias), over the trailing axes, with constant scale and bias:
    ``plugrt.cpu::LayerNormalization``."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if not _is(node, "ReduceMean"):
            return False
        opset = model.opset_imports.get("", 0)
        x = node.inputs[0]
        axes = _reduce_axes(node, opset)
        axis = _trailing_axis(axes) if axes is not None else None
        sub = _sole_reader(node.outputs[0])
        if axis is None or not _is(sub, "Sub") or sub.inputs[0] is not x or sub.inputs[1] is not node.outputs[0]:
            return False
        centered = sub.outputs[0]
        readers = [use.node for use in centered.uses()]
        square = next((n for n in readers if _squares(n, centered)), None)
        div = next((n for n in readers if _is(n, "Div") and n.inputs[0] is centered), None)
        if square is None or div is None or not _read_only_by(centered, [square, div]):
            return False
        mean_of_squares = _sole_reader(square.outputs[0])
        if not _is(mean_of_squares, "ReduceMean") or _reduce_axes(mean_of_squares, opset) != axes:
            return False
        add_eps = _sole_reader(mean_of_squares.outputs[0])
        if not _is(add_eps, "Add"):
            return False
        epsilon = _scalar(_other_input(add_eps, mean_of_squares.outputs[0]))
        sqrt = _sole_reader(add_eps.outputs[0])
        if epsilon is None or not _is(sqrt, "Sqrt") or _sole_reader(sqrt.outputs[0]) is not div:
            return False
        mul = _sole_reader(div.outputs[0])
        scale = _other_input(mul, div.outputs[0]) if _is(mul, "Mul") else None
        if scale is None or mul is None or not _normalized_shape_constant(scale, axis):
            return False
        pattern = [node, sub, square, mean_of_squares, add_eps, sqrt, div, mul]
        if not all(map(_ours, pattern)):
            return False
        inputs = [x, scale]
        add = _sole_reader(mul.outputs[0])
        bias = _other_input(add, mul.outputs[0]) if _is(add, "Add") else None
        if bias is not None and add is not None and _normalized_shape_constant(bias, axis):
            pattern.append(add)
            inputs.append(bias)
        attributes = [ir.AttrInt64("axis", axis), ir.AttrFloat32("epsilon", epsilon)]
        fused = _private_node(model, "LayerNormalization", inputs, node.name or "layer_norm", attributes)
        _replace(model.graph, pattern, fused)
        return True


def _normalized_shape_constant(value: ir.Value, axis: int) -> bool:
    """A float constant that broadcasts over the normalised axes only (at most -axis axes)."""
    array = constant_array(value)
    return array is not None and array.dtype.kind == "f" and array.ndim <= -axis


# ---------------------------------------------------------------------------------------
# (5b) Gelu written out with Erf or Tanh

_SQRT_2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _scaled_by(node: ir.Node | None, value: ir.Value, factor: float) -> bool:
    """Whether ``node`` computes value * factor (as Mul by factor or Div by 1 / factor)."""
    if _is(node, "Mul"):
        return _close(_scalar(_other_input(node, value)), factor)
    if _is(node, "Div"):
        return node.inputs[0] is value and _close(_scalar(node.inputs[1]), 1.0 / factor)
    return False


def _half_x_times(one_plus: ir.Node, x: ir.Value) -> list[ir.Node] | None:
    """The nodes computing 0.5 * x * one_plus.outputs[0], in any of the three orders
    exporters write, the one yielding the result last; None when they are not there."""
    value = one_plus.outputs[0]
    first = _sole_reader(value)
    if first is None or not _is(first, "Mul"):
        return None
    other = _other_input(first, value)
    half = other.producer() if other is not None else None
    if _is(half, "Mul") and _sole_reader(other) is first and _close(_scalar(_other_input(half, x)), 0.5):
        return [half, first]  # (x * 0.5) * (1 + f)
    second = _sole_reader(first.outputs[0])
    if not _is(second, "Mul"):
        return None
    if other is x and _close(_scalar(_other_input(second, first.outputs[0])), 0.5):
        return [first, second]  # (x * (1 + f)) * 0.5
    if _close(_scalar(other), 0.5) and _other_input(second, first.outputs[0]) is x:
        return [first, second]  # x * ((1 + f) * 0.5)
    return None


def _erf_argument(erf: ir.Node) -> tuple[ir.Value, list[ir.Node]] | None:
    """(x, [scaling node]) when Erf reads x / sqrt(2)."""
    scaled = erf.inputs[0]
    producer = scaled.producer() if scaled is not None else None
    if producer is None or _sole_reader(scaled) is not erf or producer.op_type not in ("Div", "Mul"):
        return None
    for x in producer.inputs:
        if x is not None and constant_array(x) is None and _scaled_by(producer, x, 1.0 / _SQRT_2):
            return x, [producer]
    return None


def _tanh_argument(tanh: ir.Node) -> tuple[ir.Value, list[ir.Node]] | None:
    """(x, nodes) when Tanh reads sqrt(2/pi) * (x + 0.044715 * x ** 3)."""
    scaled = tanh.inputs[0]
    times_c = scaled.producer() if scaled is not None else None
    if times_c is None or _sole_reader(scaled) is not tanh or not _is(times_c, "Mul"):
        return None
    inner = next((v for v in times_c.inputs if v is not None and constant_array(v) is None), None)
    add = inner.producer() if inner is not None else None
    if inner is None or not _is(add, "Add") or _sole_reader(inner) is not times_c:
        return None
    if not _scaled_by(times_c, inner, _SQRT_2_OVER_PI):
        return None
    for x in add.inputs:
        if x is None:
            continue
        cubic = _other_input(add, x)
        times_k = cubic.producer() if cubic is not None else None
        if cubic is None or not _is(times_k, "Mul") or _sole_reader(cubic) is not add:
            continue
        cube = next((v for v in times_k.inputs if v is not None and constant_array(v) is None), None)
        power = cube.producer() if cube is not None else None
        if (
            cube is not None and _is(power, "Pow") and power.inputs[0] is x and _close(_scalar(power.inputs[1]), 3.0)
            and _sole_reader(cube) is times_k and _scaled_by(times_k, cube, 0.044715)
        ):
            return x, [power, times_k, add, times_c]
    return None


class FuseGeluPass(_NodePass):
    """0.5 * x * (1 + erf(x / sqrt(2))) and its tanh approximation:
    ``plugrt.cpu::Gelu`` (approximate "none" or "tanh")."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if _is(node, "Erf"):
            found, approximate = _erf_argument(node), "none"
        elif _is(node, "Tanh"):
            found, approximate = _tanh_argument(node), "tanh"
        else:
            return False
        if found is None:
            return False
        x, head = found
        one_plus = _sole_reader(node.outputs[0])
        if not _is(one_plus, "Add") or not _close(_scalar(_other_input(one_plus, node.outputs[0])), 1.0):
            return False
        tail = _half_x_times(one_plus, x)
        if tail is None:
            return False
        pattern = [*head, node, one_plus, *tail]  # the last node yields the Gelu's value
        if not all(map(_ours, pattern)):
            return False
        fused = _private_node(model, "Gelu", [x], node.name or "gelu", [ir.AttrString("approximate", approximate)])
        _replace(model.graph, pattern, fused)
        return True


# ---------------------------------------------------------------------------------------
# Kernels of the plugrt.cpu nodes


@kernel_builder("FusedConv", DOMAIN_VERSION, domain=DOMAIN)
def fused_conv(ctx: KernelContext) -> Callable[..., np.ndarray]:
    """Conv (x, w, b) with the Relu applied to each output block while it is in cache; with a
    fourth input z, Conv + z (then the Relu when activation="Relu")."""
    attributes = dict(ctx.attributes)
    activation = attributes.pop("activation", None)
    residual = ctx.num_inputs > 3
    if activation != "Relu" and not (residual and activation is None):
        raise NotImplementedError(f"FusedConv: activation={activation!r} is not supported (only 'Relu')")
    conv_ctx = dataclasses.replace(ctx, op_type="Conv", domain="", attributes=attributes)
    if residual:
        return conv_residual.build_residual_conv(conv_ctx, relu=activation == "Relu")
    return convolution.build_conv(conv_ctx, relu=True)


@kernel_builder("ChannelAffine", DOMAIN_VERSION, domain=DOMAIN)
def channel_affine(ctx: KernelContext) -> Callable[..., np.ndarray]:
    """x * multiplier + shift per channel (axis 1 of x; multiplier and shift are vectors,
    cast to x's dtype once when constant), then the Relu with activation="Relu": the
    inference BatchNormalization's ``channel_affine`` passes, with the Relu on each block
    while it is in cache."""
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


@kernel_builder("FusedMatMul", DOMAIN_VERSION, domain=DOMAIN)
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


kernel_builder("LayerNormalization", DOMAIN_VERSION, domain=DOMAIN, multi_output=True)(
    normalization.layer_normalization
)
kernel_builder("Gelu", DOMAIN_VERSION, domain=DOMAIN)(elementwise.gelu)
