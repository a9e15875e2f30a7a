"""Provider-independent graph rewrites, run once before placement for every provider.

At optimisation level "all", after constant folding, :func:`rewrite_passes` turn node
patterns into ops any provider may claim, so every provider sees the same graph:

- :class:`FoldChannelAffinePass`: BatchNormalization (inference, constant statistics) and
  Mul/Add/Sub/Div by per-channel constants folded, in float64, into the Conv or Gemm with
  constant weights before them, or into the BatchNormalization before them.
- :class:`RewriteLayerNormPass`: ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul(/Add) over
  the trailing axes: ``LayerNormalization`` (opset 17 and later; below it the standard
  opset has no such op and the pattern is left to the providers' own fusions).
- :class:`RewriteGeluPass`: 0.5 * x * (1 + erf(x / sqrt(2))) and its tanh approximation:
  ``Gelu`` (opset 20 and later, approximate "none" or "tanh"), below opset 20 the
  ``com.microsoft`` contrib ops ``Gelu`` (erf form) and ``FastGelu`` (tanh form, no bias).

Each pattern is rewritten only where every intermediate value is read inside the pattern
alone and is not a graph output, and only where the result cannot depend on placement:
every provider of the session that supports all the pattern's nodes must support the
node it becomes (otherwise the pattern stays, and a provider that could run it whole
still gets it whole). The matchers are public so a provider's own passes can look for
the same patterns on the nodes placed on it.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np
import onnx_ir as ir
from onnx_ir.convenience import replace_nodes_and_values
from onnx_ir.passes import InPlacePass, PassResult, PostconditionError

from .ir_utils import constant_array
from .provider import ExecutionProvider, SupportContext

__all__ = [
    "CONTRIB_DOMAIN",
    "rewrite_passes",
    "FoldChannelAffinePass",
    "RewriteLayerNormPass",
    "RewriteGeluPass",
    "LayerNormMatch",
    "GeluMatch",
    "batch_norm_affine",
    "batch_norm_constants",
    "match_layer_norm",
    "match_gelu",
    "sole_reader",
    "other_input",
    "scalar_constant",
    "add_constant",
    "PlacedNodePass",
]

#: onnxruntime's contrib-op domain: Gelu and FastGelu below opset 20.
CONTRIB_DOMAIN = "com.microsoft"
#: First standard opsets with the ops the rewrites write.
LAYER_NORMALIZATION_OPSET = 17
GELU_OPSET = 20

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_SQRT_2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)

#: Which nodes a matcher may take in (a provider's passes: only those placed on it).
Accept = Callable[[ir.Node], bool]


def _anything(node: ir.Node) -> bool:
    return True


def rewrite_passes(providers: Sequence[ExecutionProvider]) -> list[InPlacePass]:
    """The core's rewrites in the order they run (the BatchNormalization fold first: it
    leaves the Conv, Gemm and BatchNormalization nodes the providers' fusions look for)."""
    guard = _PlacementGuard(providers)
    return [FoldChannelAffinePass(guard), RewriteLayerNormPass(guard), RewriteGeluPass(guard)]


# ---------------------------------------------------------------------------------------
# Graph helpers


def sole_reader(value: ir.Value | None, accept: Accept = _anything) -> ir.Node | None:
    """The node reading ``value``, when exactly one input of one node does, it is not a
    graph output, and ``accept`` takes the node."""
    if value is None or value.is_graph_output():
        return None
    uses = list(value.uses())
    if len(uses) != 1 or not accept(uses[0].node):
        return None
    return uses[0].node


def _read_only_by(value: ir.Value, nodes: Iterable[ir.Node]) -> bool:
    """True when every reader of ``value`` is among ``nodes`` and it is not a graph output."""
    allowed = set(map(id, nodes))
    return not value.is_graph_output() and all(id(use.node) in allowed for use in value.uses())


def _is(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def other_input(node: ir.Node | None, value: ir.Value) -> ir.Value | None:
    """For a binary node reading ``value``, its other input."""
    if node is None or len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if a is value:
        return b
    if b is value:
        return a
    return None


def scalar_constant(value: ir.Value | None) -> float | None:
    """The float of a one-element constant, else None."""
    array = constant_array(value) if value is not None else None
    if array is None or array.size != 1 or array.dtype.kind != "f":
        return None
    return float(array.reshape(-1)[0])


def _close(actual: float | None, wanted: float, rtol: float = 1e-4) -> bool:
    return actual is not None and abs(actual - wanted) <= rtol * abs(wanted)


def add_constant(graph: ir.Graph, hint: str, array: np.ndarray) -> ir.Value:
    """A new initializer holding ``array``, named ``hint`` (with a suffix when taken)."""
    name, suffix = hint, 0
    while name in graph.initializers:
        suffix += 1
        name = f"{hint}_{suffix}"
    tensor = ir.tensor(np.ascontiguousarray(array), name=name)
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


def _detach(node: ir.Node) -> None:
    """Undo a node that was built and not inserted: its inputs forget it as a reader."""
    for index in range(len(node.inputs)):
        node.replace_input_with(index, None)


class _PlacementGuard:
    """Says whether a rewrite keeps placement out of the result: every provider that
    supports all the pattern's nodes supports the node that replaces them, and at least
    one provider supports that node."""

    def __init__(self, providers: Sequence[ExecutionProvider]) -> None:
        self.providers = list(providers)

    def allows(self, model: ir.Model, pattern: Sequence[ir.Node], node: ir.Node) -> bool:
        opsets = {("" if d == "ai.onnx" else d): v for d, v in model.opset_imports.items()}
        ctx = SupportContext(opsets, model.graph)
        runs_it = False
        for provider in self.providers:
            supported = _supports(provider, node, ctx)
            if not supported and all(_supports(provider, n, ctx) for n in pattern):
                return False
            runs_it = runs_it or supported
        return runs_it  # and someone must run it: the pattern may be split between providers


def _supports(provider: ExecutionProvider, node: ir.Node, ctx: SupportContext) -> bool:
    try:
        return bool(provider.supports_op(node, ctx))
    except Exception:  # a provider that cannot answer does not claim the node
        return False


class PlacedNodePass(InPlacePass):
    """Base of a provider's own fusions: visit every main-graph node ``placed`` takes (the
    nodes placed on the provider) once, in order; ``rewrite`` returns whether it changed
    the graph at that node."""

    def placed(self, node: ir.Node) -> bool:
        raise NotImplementedError

    def call(self, model: ir.Model) -> PassResult:
        modified = False
        for node in list(model.graph):
            if node.graph is model.graph and self.placed(node):  # not removed by an earlier rewrite
                modified |= self.rewrite(model, node)
        return PassResult(model, modified)

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        raise NotImplementedError


class _RewritePass(InPlacePass):
    """Visit every node of the main graph once, in order; ``rewrite`` returns whether it
    changed the graph at that node (a model importing no default opset, ai.onnx.ml or
    training ops alone, has no pattern to rewrite).
    Post-condition: the graph's outputs are the values they were (a rewrite hands its
    last value's name, type and readers to the node replacing the pattern)."""

    def __init__(self, guard: _PlacementGuard | None = None) -> None:
        super().__init__()
        self.guard = guard  # None: rewrite wherever the pattern is (no providers to ask)
        self._outputs: list[str | None] = []

    def requires(self, model: ir.Model) -> None:
        self._outputs = [v.name for v in model.graph.outputs]  # for ensures

    def ensures(self, model: ir.Model) -> None:
        if [v.name for v in model.graph.outputs] != self._outputs:
            raise PostconditionError(f"{type(self).__name__} changed the graph's outputs")

    def call(self, model: ir.Model) -> PassResult:
        modified = False
        for node in list(model.graph):
            if node.graph is model.graph:  # not removed by an earlier rewrite
                modified |= self.rewrite(model, node)
        return PassResult(model, modified)

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        raise NotImplementedError

    def replace(self, model: ir.Model, pattern: Sequence[ir.Node], node: ir.Node) -> bool:
        """Put ``node`` where ``pattern`` was, if the guard allows it; its one output takes
        over the pattern's last output (name, type, shape and readers, graph outputs
        included). False, and the graph as it was, when the guard refuses."""
        last = pattern[-1].outputs[0]
        node.outputs[0].type, node.outputs[0].shape = last.type, last.shape
        if self.guard is not None and not self.guard.allows(model, pattern, node):
            _detach(node)
            return False
        replace_nodes_and_values(model.graph, pattern[-1], pattern, [node], [last], [node.outputs[0]])
        return True


# ---------------------------------------------------------------------------------------
# (1) Per-channel affine nodes folded into the Conv, Gemm or BatchNormalization before them


def batch_norm_affine(
    scale: np.ndarray, bias: np.ndarray, mean: np.ndarray, var: np.ndarray, epsilon: float
) -> tuple[np.ndarray, np.ndarray]:
    """(multiplier, shift) such that BatchNormalization's y = x * multiplier + shift,
    computed in float64 (the CPU provider's kernel folds its statistics the same way, so a
    folded node gives the values the unfolded one does)."""
    multiplier = np.asarray(scale, np.float64) / np.sqrt(np.asarray(var, np.float64) + epsilon)
    shift = np.asarray(bias, np.float64) - np.asarray(mean, np.float64) * multiplier
    return multiplier, shift


def batch_norm_constants(node: ir.Node, opset: int) -> list[np.ndarray] | None:
    """[scale, bias, mean, var] of a BatchNormalization that normalises with its stored,
    constant statistics and whose first output alone is read; None otherwise."""
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
        arrays = batch_norm_constants(node, opset)
        if arrays is None or arrays[0].shape != (channels,):
            return None
        scale, bias, mean, var = arrays
        return batch_norm_affine(scale, bias, mean, var, node.attributes.get_float("epsilon", 1e-5))
    if node.op_type not in ("Add", "Sub", "Mul", "Div") or "broadcast" in node.attributes:
        return None
    other = other_input(node, value)
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
    while (reader := sole_reader(value)) is not None:
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


def _default_opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))


class FoldChannelAffinePass(_RewritePass):
    """BatchNormalization (inference) and Mul, Add, Sub, Div by per-channel constants fold
    into the node before them, in float64: into a Conv's or a Gemm's constant weight and
    bias, or into a BatchNormalization's scale and bias. The Gemm takes in only chains
    holding a BatchNormalization (a bias Add after it stays the provider's to fuse)."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if _is(node, "Conv") and len(node.outputs) == 1:
            return self._into_conv(model, node)
        if _is(node, "Gemm") and len(node.outputs) == 1:
            return self._into_gemm(model, node)
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
        chain, scale, shift = _affine_chain(node.outputs[0], weight.shape[0], rank, _default_opset(model))
        if not chain:
            return False
        graph, name = model.graph, node.name or "conv"
        new_weight = np.asarray(weight, np.float64) * scale.reshape((-1,) + (1,) * (rank - 1))
        new_bias = shift + (np.asarray(bias, np.float64) * scale if bias is not None else 0.0)
        inputs = [
            node.inputs[0],
            add_constant(graph, f"{name}_folded_weight", new_weight.astype(weight.dtype)),
            add_constant(graph, f"{name}_folded_bias", new_bias.astype(weight.dtype)),
        ]
        conv = ir.Node("", "Conv", inputs, list(node.attributes.values()), num_outputs=1, name=node.name)
        return self.replace(model, [node, *chain], conv)

    def _into_gemm(self, model: ir.Model, node: ir.Node) -> bool:
        # y = alpha * A' @ B' + beta * C; the output's axis 1 is B's column (row when transB)
        if len(node.inputs) < 2 or node.inputs[1] is None or node.attributes.get_int("transA", 0) not in (0, 1):
            return False
        weight = constant_array(node.inputs[1])
        if weight is None or weight.dtype not in _FLOATS or weight.ndim != 2:
            return False
        trans_b = bool(node.attributes.get_int("transB", 0))
        channels = weight.shape[0] if trans_b else weight.shape[1]
        c_value = node.inputs[2] if len(node.inputs) > 2 else None
        c = constant_array(c_value) if c_value is not None else None
        if c_value is not None and (c is None or c.dtype != weight.dtype or c.ndim > 2):
            return False
        chain, scale, shift = _affine_chain(node.outputs[0], channels, 2, _default_opset(model))
        if not any(_is(n, "BatchNormalization") for n in chain):
            return False
        beta = node.attributes.get_float("beta", 1.0)
        new_weight = np.asarray(weight, np.float64) * (scale[:, None] if trans_b else scale[None, :])
        new_c = shift + (beta * np.asarray(c, np.float64) * scale if c is not None else 0.0)
        graph, name = model.graph, node.name or "gemm"
        inputs = [
            node.inputs[0],
            add_constant(graph, f"{name}_folded_weight", new_weight.astype(weight.dtype)),
            add_constant(graph, f"{name}_folded_bias", np.asarray(new_c).astype(weight.dtype)),
        ]
        attributes = [a for a in node.attributes.values() if a.name != "beta"]
        gemm = ir.Node("", "Gemm", inputs, attributes, num_outputs=1, name=node.name)
        return self.replace(model, [node, *chain], gemm)

    def _into_batch_norm(self, model: ir.Model, node: ir.Node) -> bool:
        opset = _default_opset(model)
        arrays = batch_norm_constants(node, opset)
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
            add_constant(graph, f"{name}_folded_scale", new_scale.astype(scale.dtype)),
            add_constant(graph, f"{name}_folded_bias", new_bias.astype(bias.dtype)),
            *node.inputs[3:5],
        ]
        attributes = list(node.attributes.values())
        batch_norm = ir.Node("", "BatchNormalization", inputs, attributes, num_outputs=1, name=node.name)
        return self.replace(model, [node, *chain], batch_norm)


# ---------------------------------------------------------------------------------------
# (2) LayerNorm written out as ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add


class LayerNormMatch(NamedTuple):
    """A LayerNorm pattern: its nodes (the last yields the result) and what they compute."""

    pattern: list[ir.Node]
    x: ir.Value
    scale: ir.Value
    bias: ir.Value | None
    axis: int
    epsilon: float


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
    if node is not None and _is(node, "Pow"):
        return node.inputs[0] is value and _close(scalar_constant(node.inputs[1]), 2.0, 0.0)
    return node is not None and _is(node, "Mul") and node.inputs[0] is value and node.inputs[1] is value


def _normalized_shape_constant(value: ir.Value, axis: int) -> bool:
    """A float constant that broadcasts over the normalised axes only (at most -axis axes)."""
    array = constant_array(value)
    return array is not None and array.dtype.kind == "f" and array.ndim <= -axis


def match_layer_norm(node: ir.Node, opset: int, accept: Accept = _anything) -> LayerNormMatch | None:
    """mean = ReduceMean(x); d = x - mean; var = ReduceMean(d ** 2); y = d / Sqrt(var + eps)
    * scale (+ bias), over the trailing axes, with constant scale and bias, starting at
    the first ReduceMean ``node``; every node of it taken by ``accept``."""
    if not _is(node, "ReduceMean") or not accept(node):
        return None
    x = node.inputs[0]
    axes = _reduce_axes(node, opset)
    axis = _trailing_axis(axes) if axes is not None else None
    sub = sole_reader(node.outputs[0], accept)
    if x is None or axis is None or sub is None or not _is(sub, "Sub"):
        return None
    if sub.inputs[0] is not x or sub.inputs[1] is not node.outputs[0]:
        return None
    centered = sub.outputs[0]
    readers = [use.node for use in centered.uses()]
    square = next((n for n in readers if _squares(n, centered)), None)
    div = next((n for n in readers if _is(n, "Div") and n.inputs[0] is centered), None)
    if square is None or div is None or not _read_only_by(centered, [square, div]):
        return None
    mean_of_squares = sole_reader(square.outputs[0], accept)
    if mean_of_squares is None or not _is(mean_of_squares, "ReduceMean"):
        return None
    if _reduce_axes(mean_of_squares, opset) != axes:
        return None
    add_eps = sole_reader(mean_of_squares.outputs[0], accept)
    if add_eps is None or not _is(add_eps, "Add"):
        return None
    epsilon = scalar_constant(other_input(add_eps, mean_of_squares.outputs[0]))
    sqrt = sole_reader(add_eps.outputs[0], accept)
    if epsilon is None or sqrt is None or not _is(sqrt, "Sqrt") or sole_reader(sqrt.outputs[0], accept) is not div:
        return None
    mul = sole_reader(div.outputs[0], accept)
    scale = other_input(mul, div.outputs[0]) if mul is not None and _is(mul, "Mul") else None
    if scale is None or mul is None or not _normalized_shape_constant(scale, axis):
        return None
    pattern = [node, sub, square, mean_of_squares, add_eps, sqrt, div, mul]
    if not all(map(accept, pattern)):
        return None
    add = sole_reader(mul.outputs[0], accept)
    bias = other_input(add, mul.outputs[0]) if add is not None and _is(add, "Add") else None
    if bias is not None and add is not None and _normalized_shape_constant(bias, axis):
        pattern.append(add)
    else:
        bias = None
    return LayerNormMatch(pattern, x, scale, bias, axis, epsilon)


class RewriteLayerNormPass(_RewritePass):
    """The written-out LayerNorm (:func:`match_layer_norm`): ``LayerNormalization`` at
    opset 17 and later."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        opset = _default_opset(model)
        if opset < LAYER_NORMALIZATION_OPSET:
            return False
        found = match_layer_norm(node, opset)
        if found is None:
            return False
        inputs = [found.x, found.scale, *([found.bias] if found.bias is not None else [])]
        attributes = [ir.AttrInt64("axis", found.axis), ir.AttrFloat32("epsilon", found.epsilon)]
        layer_norm = ir.Node("", "LayerNormalization", inputs, attributes, num_outputs=1, name=node.name)
        return self.replace(model, found.pattern, layer_norm)


# ---------------------------------------------------------------------------------------
# (3) Gelu written out with Erf or Tanh


class GeluMatch(NamedTuple):
    """A GELU pattern: its nodes (the last yields the result), its input, "none" or "tanh"."""

    pattern: list[ir.Node]
    x: ir.Value
    approximate: str


def _scaled_by(node: ir.Node | None, value: ir.Value, factor: float) -> bool:
    """Whether ``node`` computes value * factor (as Mul by factor or Div by 1 / factor)."""
    if node is not None and _is(node, "Mul"):
        return _close(scalar_constant(other_input(node, value)), factor)
    if node is not None and _is(node, "Div"):
        return node.inputs[0] is value and _close(scalar_constant(node.inputs[1]), 1.0 / factor)
    return False


def _half_x_times(one_plus: ir.Node, x: ir.Value, accept: Accept) -> list[ir.Node] | None:
    """The nodes computing 0.5 * x * one_plus.outputs[0], in any of the three orders
    exporters write, the one yielding the result last; None when they are not there."""
    value = one_plus.outputs[0]
    first = sole_reader(value, accept)
    if first is None or not _is(first, "Mul"):
        return None
    other = other_input(first, value)
    half = other.producer() if other is not None else None
    if (
        half is not None and _is(half, "Mul") and sole_reader(other, accept) is first
        and _close(scalar_constant(other_input(half, x)), 0.5)
    ):
        return [half, first]  # (x * 0.5) * (1 + f)
    second = sole_reader(first.outputs[0], accept)
    if second is None or not _is(second, "Mul"):
        return None
    if other is x and _close(scalar_constant(other_input(second, first.outputs[0])), 0.5):
        return [first, second]  # (x * (1 + f)) * 0.5
    if _close(scalar_constant(other), 0.5) and other_input(second, first.outputs[0]) is x:
        return [first, second]  # x * ((1 + f) * 0.5)
    return None


def _erf_argument(erf: ir.Node, accept: Accept) -> tuple[ir.Value, list[ir.Node]] | None:
    """(x, [scaling node]) when Erf reads x / sqrt(2)."""
    scaled = erf.inputs[0]
    producer = scaled.producer() if scaled is not None else None
    if producer is None or sole_reader(scaled, accept) is not erf or producer.op_type not in ("Div", "Mul"):
        return None
    for x in producer.inputs:
        if x is not None and constant_array(x) is None and _scaled_by(producer, x, 1.0 / _SQRT_2):
            return x, [producer]
    return None


def _tanh_argument(tanh: ir.Node, accept: Accept) -> tuple[ir.Value, list[ir.Node]] | None:
    """(x, nodes) when Tanh reads sqrt(2/pi) * (x + 0.044715 * x ** 3)."""
    scaled = tanh.inputs[0]
    times_c = scaled.producer() if scaled is not None else None
    if times_c is None or sole_reader(scaled, accept) is not tanh or not _is(times_c, "Mul"):
        return None
    inner = next((v for v in times_c.inputs if v is not None and constant_array(v) is None), None)
    add = inner.producer() if inner is not None else None
    if inner is None or add is None or not _is(add, "Add") or sole_reader(inner, accept) is not times_c:
        return None
    if not _scaled_by(times_c, inner, _SQRT_2_OVER_PI):
        return None
    for x in add.inputs:
        if x is None:
            continue
        cubic = other_input(add, x)
        times_k = cubic.producer() if cubic is not None else None
        if cubic is None or times_k is None or not _is(times_k, "Mul") or sole_reader(cubic, accept) is not add:
            continue
        cube = next((v for v in times_k.inputs if v is not None and constant_array(v) is None), None)
        power = cube.producer() if cube is not None else None
        if (
            cube is not None and power is not None and _is(power, "Pow") and power.inputs[0] is x
            and _close(scalar_constant(power.inputs[1]), 3.0)
            and sole_reader(cube, accept) is times_k and _scaled_by(times_k, cube, 0.044715)
        ):
            return x, [power, times_k, add, times_c]
    return None


def match_gelu(node: ir.Node, accept: Accept = _anything) -> GeluMatch | None:
    """0.5 * x * (1 + erf(x / sqrt(2))) or 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715
    * x ** 3))) around the Erf or Tanh ``node``; every node of it taken by ``accept``."""
    if _is(node, "Erf"):
        found, approximate = _erf_argument(node, accept), "none"
    elif _is(node, "Tanh"):
        found, approximate = _tanh_argument(node, accept), "tanh"
    else:
        return None
    if found is None:
        return None
    x, head = found
    one_plus = sole_reader(node.outputs[0], accept)
    if one_plus is None or not _is(one_plus, "Add"):
        return None
    if not _close(scalar_constant(other_input(one_plus, node.outputs[0])), 1.0):
        return None
    tail = _half_x_times(one_plus, x, accept)
    if tail is None:
        return None
    pattern = [*head, node, one_plus, *tail]  # the last node yields the Gelu's value
    if not all(map(accept, pattern)):
        return None
    return GeluMatch(pattern, x, approximate)


class RewriteGeluPass(_RewritePass):
    """The written-out GELU (:func:`match_gelu`): ``Gelu`` at opset 20 and later, below it
    ``com.microsoft::Gelu`` (erf) or ``com.microsoft::FastGelu`` (tanh, no bias input),
    onnxruntime's contrib ops, the model importing ``com.microsoft`` version 1 for them."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        found = match_gelu(node)
        if found is None:
            return False
        name = node.name or "gelu"
        if _default_opset(model) >= GELU_OPSET:
            attributes = [ir.AttrString("approximate", found.approximate)]
            gelu = ir.Node("", "Gelu", [found.x], attributes, num_outputs=1, name=name)
            return self.replace(model, found.pattern, gelu)
        op_type = "Gelu" if found.approximate == "none" else "FastGelu"
        imported = CONTRIB_DOMAIN in model.opset_imports
        model.opset_imports.setdefault(CONTRIB_DOMAIN, 1)
        gelu = ir.Node(CONTRIB_DOMAIN, op_type, [found.x], [], num_outputs=1, name=name)
        if self.replace(model, found.pattern, gelu):
            return True
        if not imported:
            model.opset_imports.pop(CONTRIB_DOMAIN)
        return False
