"""ReLU linear attention (EfficientViT's LiteMLA) written out as exporters do, made one step.

EfficientViT (timm's ``efficientvit_b*``, EfficientViT-SAM, SANA) computes its global
context as linear attention: the query/key/value channels of a heads-first tensor
``(N, heads * 3 * d, H, W)`` are reshaped to ``(N, heads, 3d, H*W)`` and transposed to
positions-first, sliced into q, k and v, q and k go through a Relu, v is padded with a
column of ones, and ``q @ (k^T @ [v | 1])`` gives the numerators and, in its last column,
the denominators; their quotient is transposed and reshaped back to ``(N, heads * d, H,
W)``. Exported, that is some twenty nodes (Reshape, Transpose, three Slices, two Relus,
Pad, a Transpose, two MatMuls, two Slices, Add, Div, Transpose, Reshape, and Casts to the
same type), each a pass over a strided view or a small product: 0.4 ms a block on a
2-core Zen 4 where the products themselves are microseconds.

:class:`FuseReluLinearAttentionPass` writes ``plugrt.cpu::ReluLinearAttention(x)``
(attributes ``head_size`` = d and ``epsilon``), computed channels-first where every slice
is contiguous: ``A = v @ relu(k)^T`` and ``s = sum(relu(k))`` stacked as one (d + 1, d)
matrix a head, ``[num; den] = [A; s] @ relu(q)``, ``y = num / (den + epsilon)``: the same
sums as the graph's (the ones column gives ``s``), in two batched products.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import onnx_ir as ir

from ._registry import KernelContext, declare_into, kernel_builder
from .fusions import DOMAIN, DOMAIN_VERSION, _NodePass, _is, _private_node, _replace, _scalar, _sole_reader
from .fusions import _ints
from .kernels._relu import relu_into
from .kernels.elementwise import scratch

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = ["FuseReluLinearAttentionPass", "relu_linear_attention"]

_TYPES = (ir.DataType.FLOAT, ir.DataType.DOUBLE)


def _through_casts(value: ir.Value | None) -> tuple[ir.Value | None, list[ir.Node]]:
    """``value`` traced back through Casts that keep its type (an exporter's autocast
    guards), each read by the next node alone: (the value before them, the Casts)."""
    casts: list[ir.Node] = []
    while value is not None:
        node = value.producer()
        if not _is(node, "Cast") or node.inputs[0] is None or value.dtype is None:
            break
        source = node.inputs[0]
        if source.dtype != value.dtype or (casts and _sole_reader(value) is not casts[-1]):
            break
        if not casts and len(list(value.uses())) != 1:
            break
        casts.append(node)
        value = source
    return value, casts


def _forward_casts(value: ir.Value) -> tuple[ir.Value, list[ir.Node]]:
    """``value`` followed forward through same-type Casts, each its input's only reader."""
    casts: list[ir.Node] = []
    while True:
        reader = _sole_reader(value)
        if not _is(reader, "Cast") or reader.outputs[0].dtype != value.dtype or value.dtype is None:
            return value, casts
        casts.append(reader)
        value = reader.outputs[0]


def _last_axis_range(node: ir.Node, size: int) -> tuple[int, int] | None:
    """[start, stop) of a Slice of step 1 along the last axis (of ``size`` values) of a
    4-D input, its bounds constants; else None."""
    if not _is(node, "Slice") or len(node.inputs) < 4 or node.inputs[3] is None:
        return None
    starts, ends, axes = (_ints(node.inputs[i]) for i in (1, 2, 3))
    steps = _ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else (1,)
    if starts is None or ends is None or axes not in ((3,), (-1,)) or steps != (1,) or len(starts) != 1 or len(ends) != 1:
        return None
    start, stop, _ = slice(starts[0], ends[0]).indices(size)
    return (start, stop) if start < stop else None


def _static(value: ir.Value | None, rank: int) -> tuple[int, ...] | None:
    shape = value.shape if value is not None else None
    if shape is None or len(shape) != rank or not all(isinstance(d, int) for d in shape):
        return None
    return tuple(int(d) for d in shape)  # type: ignore[arg-type]


def _transposes_last_two(node: ir.Node | None) -> TypeIs[ir.Node]:
    return _is(node, "Transpose") and tuple(node.attributes.get_ints("perm", ())) == (0, 1, 3, 2)


def _producer(value: ir.Value | None) -> ir.Node | None:
    return value.producer() if value is not None else None


def _read_by(value: ir.Value, readers: list[ir.Node]) -> bool:
    """Whether exactly ``readers`` read ``value``, once each, and it is not a graph output."""
    uses = [use.node for use in value.uses()]
    return not value.is_graph_output() and len(uses) == len(readers) and {id(u) for u in uses} == {id(r) for r in readers}


def _first(casts: list[ir.Node], reader: ir.Node) -> ir.Node:
    """The node that reads a value traced back through ``casts``: the last Cast, else ``reader``."""
    return casts[-1] if casts else reader


class FuseReluLinearAttentionPass(_NodePass):
    """The pattern of the module docstring, found from its Div, every intermediate read
    inside the pattern alone, shapes static: ``plugrt.cpu::ReluLinearAttention(x)``."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        found = self._pattern(node) if _is(node, "Div") else None
        if found is None:
            return False
        nodes, x, head_size, epsilon = found
        attributes = [ir.AttrInt64("head_size", head_size), ir.AttrFloat32("epsilon", epsilon)]
        fused = _private_node(model, "ReluLinearAttention", [x], node.name or "relu_linear_attention", attributes)
        _replace(model.graph, nodes, fused)
        return True

    @staticmethod
    def _pattern(div: ir.Node) -> tuple[list[ir.Node], ir.Value, int, float] | None:  # noqa: C901 - one pattern, read top to bottom
        if len(div.inputs) != 2:
            return None
        numerators, denominators = div.inputs
        if numerators is None or denominators is None or numerators.dtype not in _TYPES:
            return None
        # the denominators: the product's last column plus epsilon
        add = _producer(denominators)
        if not _is(add, "Add") or len(add.inputs) != 2 or _sole_reader(denominators) is not div:
            return None
        epsilon, last = _scalar(add.inputs[1]), add.inputs[0]
        if epsilon is None:
            epsilon, last = _scalar(add.inputs[0]), add.inputs[1]
        if epsilon is None or last is None or _sole_reader(last) is not add or _sole_reader(numerators) is not div:
            return None
        slice_num, slice_den = _producer(numerators), _producer(last)
        if slice_num is None or slice_den is None or not slice_num.inputs:
            return None
        product = slice_num.inputs[0]
        shape = _static(product, 4)
        if product is None or shape is None or slice_den.inputs[0] is not product or not _read_by(product, [slice_num, slice_den]):
            return None
        d = shape[3] - 1
        if _last_axis_range(slice_num, d + 1) != (0, d) or _last_axis_range(slice_den, d + 1) != (d, d + 1):
            return None
        # product = q @ kv;  kv = k^T @ [v | 1]
        qkv_product = _producer(product)
        if not _is(qkv_product, "MatMul") or len(qkv_product.inputs) != 2:
            return None
        q_relu_out, q_casts = _through_casts(qkv_product.inputs[0])
        kv, kv_casts = _through_casts(qkv_product.inputs[1])
        kv_product = _producer(kv)
        if kv is None or not _is(kv_product, "MatMul") or _sole_reader(kv) is not _first(kv_casts, qkv_product):
            return None
        k_t, k_t_casts = _through_casts(kv_product.inputs[0])
        padded, v_casts = _through_casts(kv_product.inputs[1])
        transpose_k, pad = _producer(k_t), _producer(padded)
        if k_t is None or not _transposes_last_two(transpose_k) or _sole_reader(k_t) is not _first(k_t_casts, kv_product):
            return None
        if padded is None or not _is(pad, "Pad") or _sole_reader(padded) is not _first(v_casts, kv_product):
            return None
        if pad.attributes.get_string("mode", "constant") != "constant" or len(pad.inputs) != 3:
            return None
        if _ints(pad.inputs[1]) != (0, 0, 0, 0, 0, 0, 0, 1) or _scalar(pad.inputs[2]) != 1.0:
            return None
        k_relu_out, k_casts = _through_casts(transpose_k.inputs[0])
        relus: list[ir.Node] = []
        for relu_out, casts, reader in ((q_relu_out, q_casts, qkv_product), (k_relu_out, k_casts, transpose_k)):
            relu = _producer(relu_out)
            if relu_out is None or not _is(relu, "Relu") or _sole_reader(relu_out) is not _first(casts, reader):
                return None
            relus.append(relu)
        slices: list[ir.Node] = []
        for sliced, reader in ((relus[0].inputs[0], relus[0]), (relus[1].inputs[0], relus[1]), (pad.inputs[0], pad)):
            producer = _producer(sliced)
            if producer is None or _sole_reader(sliced) is not reader:
                return None
            slices.append(producer)
        heads_first = slices[0].inputs[0]
        split_shape = _static(heads_first, 4)
        if heads_first is None or split_shape is None or split_shape[3] != 3 * d or not _read_by(heads_first, slices):
            return None
        if any(s.inputs[0] is not heads_first for s in slices):
            return None
        if [_last_axis_range(s, 3 * d) for s in slices] != [(0, d), (d, 2 * d), (2 * d, 3 * d)]:
            return None
        # heads_first = Transpose(Reshape(x, (N, heads, 3d, H*W)))
        transpose_in = _producer(heads_first)
        if not _transposes_last_two(transpose_in) or transpose_in.inputs[0] is None:
            return None
        grouped = transpose_in.inputs[0]
        reshape_in = _producer(grouped)
        if not _is(reshape_in, "Reshape") or _sole_reader(grouped) is not transpose_in or reshape_in.inputs[0] is None:
            return None
        x = reshape_in.inputs[0]
        x_shape = _static(x, 4)
        n, heads, size = split_shape[:3]
        if x_shape is None or x_shape[:2] != (n, heads * 3 * d) or x_shape[2] * x_shape[3] != size:
            return None
        if _static(grouped, 4) != (n, heads, 3 * d, size) or x.dtype != numerators.dtype:
            return None
        # forward from the Div: Casts, Transpose to channels-first, Reshape to (N, heads * d, H, W)
        quotient, out_casts = _forward_casts(div.outputs[0])
        transpose_out = _sole_reader(quotient)
        if not _transposes_last_two(transpose_out):
            return None
        channels_first = transpose_out.outputs[0]
        reshape_out = _sole_reader(channels_first)
        if not _is(reshape_out, "Reshape") or reshape_out.inputs[0] is not channels_first:
            return None
        y = reshape_out.outputs[0]
        if _static(y, 4) != (n, heads * d, *x_shape[2:]) or y.dtype != x.dtype:
            return None
        nodes = [
            reshape_in, transpose_in, *slices, *relus, *q_casts, *k_casts, transpose_k, *k_t_casts, pad, *v_casts,
            kv_product, *kv_casts, qkv_product, slice_num, slice_den, add, div, *out_casts, transpose_out, reshape_out,
        ]
        return nodes, x, d, float(epsilon)


def relu_linear_attention(
    x: np.ndarray, head_size: int, epsilon: float, out: np.ndarray | None = None
) -> np.ndarray:
    """``y`` (N, heads * d, H, W) from ``x`` (N, heads * 3d, H, W), d = ``head_size``:
    per head, with q, k, v its three d-channel groups, ``relu(k) ...`` as the module
    docstring says. Work arrays from ``out``'s scratch when given (a replay allocates
    nothing), else new ones."""
    if x.ndim != 4 or x.shape[1] % (3 * head_size):
        raise ValueError(
            f"ReluLinearAttention: input of shape {x.shape} does not split into heads of 3 x {head_size} channels"
        )
    n, channels, height, width = x.shape
    d, size = head_size, height * width
    heads = n * channels // (3 * d)  # over the whole batch
    y = np.empty((n, channels // 3, height, width), x.dtype) if out is None else out

    def work(slot: str, shape: tuple[int, ...]) -> np.ndarray:
        return np.empty(shape, x.dtype) if out is None else scratch(out, slot, shape, x.dtype)

    if not x.flags.c_contiguous:
        contiguous = work("input", x.shape)
        np.copyto(contiguous, x)
        x = contiguous
    groups = x.reshape(heads, 3 * d, size)
    q, k = work("q", (heads, d, size)), work("k", (heads, d, size))
    relu_into(q, groups[:, :d])
    relu_into(k, groups[:, d : 2 * d])
    stacked = work("stacked", (heads, d + 1, d))
    np.matmul(groups[:, 2 * d :], k.transpose(0, 2, 1), out=stacked[:, :d])
    np.sum(k, axis=2, out=stacked[:, d])
    sums = work("sums", (heads, d + 1, size))
    np.matmul(stacked, q, out=sums)
    denominators = sums[:, d:]
    denominators += x.dtype.type(epsilon)
    np.divide(sums[:, :d], denominators, out=y.reshape(heads, d, size))
    return y


@kernel_builder("ReluLinearAttention", DOMAIN_VERSION, domain=DOMAIN)
def relu_linear_attention_kernel(ctx: KernelContext) -> Callable[..., np.ndarray]:
    """The kernel of ``plugrt.cpu::ReluLinearAttention(x)``: see :func:`relu_linear_attention`."""
    head_size = int(ctx.attributes["head_size"])
    epsilon = float(ctx.attributes.get("epsilon", 1e-15))

    def run(x: np.ndarray) -> np.ndarray:
        return relu_linear_attention(x, head_size, epsilon)

    def run_into(out: np.ndarray, x: np.ndarray) -> None:
        relu_linear_attention(x, head_size, epsilon, out)

    declare_into(run_into, run)
    return run
