"""The CPU provider's transformer fusions: self-attention, residual LayerNorm and MatMul + bias + GELU, each made one step.

``CPUProvider.passes`` runs them after :func:`plugrt_cpu.fusions.fusion_passes` (the
attention pattern starts from the MatMul + bias fusion's nodes). Like those, they write
``plugrt.cpu`` nodes, rewrite only nodes the CPU provider runs, and fuse only where every
intermediate value is read inside the pattern alone and is not a graph output.

- :class:`FuseSelfAttentionPass`: three projections of one input (MatMul + bias), each
  Reshape to (batch, seq, heads, size) and Transpose to heads-first, ``MatMul(q, k^T)``,
  an optional Mul/Div by a scalar, Softmax over the keys, ``MatMul(probs, v)``, Transpose
  and Reshape back to (batch, seq, hidden): ``plugrt.cpu::SelfAttention`` with the three
  weights side by side (one GEMM for q, k and v).
- :class:`FuseSkipLayerNormPass`: ``LayerNormalization(a + b)`` over the last axis whose
  statistics outputs nobody reads: ``plugrt.cpu::SkipLayerNormalization``.
- :class:`FuseBiasGeluPass`: a GELU (erf or tanh) of a MatMul + bias:
  ``plugrt.cpu::FusedMatMulGelu`` (bias and GELU in one pass over the product).
- :class:`FoldWindowMaskPass`: a shifted-window attention's mask added through a Reshape
  to (batch, windows, heads, rows, keys) and back (Swin's) as one Add of a constant on
  the scores, with the relative-position bias added before it folded in: what
  :class:`FuseAddSoftmaxPass` and the attention fusion then take.
- :class:`FuseAddSoftmaxPass`: ``Softmax(scores + mask)`` over the last axis, and the
  guard exporters put after it (``Where(IsNaN(p), 0, p)``, for rows every key of which is
  masked) where there is one: ``plugrt.cpu::AddSoftmax`` (the mask's row added, the
  softmax taken and the NaNs zeroed in one pass a row).
- :class:`FuseScaledDotProductAttentionPass`: ``softmax(q @ k^T * scale (+ mask)) @ v``
  on four-axis heads, the scale a scalar Mul or Div of q, of k^T or of the scores, and
  the Transpose of the heads after it where there is one:
  ``plugrt.cpu::ScaledDotProductAttention`` (each head's scores, softmax and product in
  cache; ``kernels.sdpa``).
- :class:`MergeSiblingMatMulsPass`: the ``FusedMatMul`` steps that read one input (an
  attention's q, k and v projections; a decoder MLP's gate and up) as one product by the
  weights side by side, and a ``Split`` of its columns (views).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import onnx_ir as ir

from plugrt.ir_utils import constant_array
from plugrt.passes import CLAIMED_BY
from plugrt.rewrites import CONTRIB_DOMAIN
from plugrt.threads import PARALLEL_MIN_WORK, blas_threads, parallel_for, threads_for

from ._registry import PROVIDER_NAME, KernelContext, capture_variant, declare_into, kernel_builder
from .fusions import DOMAIN, DOMAIN_VERSION, _add_constant, _drop_unused_initializers, _ints, _is, _NodePass, _other_input, _ours, _private_node, _replace, _scalar, _sole_reader
from .kernels import dense, elementwise, normalization, sdpa, softmax
from .kernels._compiled import DENSE_LOOPS, ROW_LOOPS
from .kernels._gemm import matmul
from .kernels.elementwise import compiled_loops, scratch, with_small_buffers

__all__ = [
    "transformer_passes", "FuseSelfAttentionPass", "FuseSkipLayerNormPass", "FuseBiasGeluPass", "FuseAddSoftmaxPass",
    "FuseScaledDotProductAttentionPass", "MergeSiblingMatMulsPass", "FoldWindowMaskPass",
]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def transformer_passes() -> list[_NodePass]:
    """The transformer fusions, in order (both after FuseMatMulBiasPass and FuseLayerNormPass)."""
    return [
        FuseSelfAttentionPass(), FuseSkipLayerNormPass(), FuseBiasGeluPass(), FoldWindowMaskPass(), FuseAddSoftmaxPass(),
        FuseScaledDotProductAttentionPass(), MergeSiblingMatMulsPass(),
    ]


def _is_ours(node: ir.Node | None, op_type: str) -> bool:
    """Whether ``node`` is the plugrt.cpu node ``op_type``."""
    return node is not None and node.domain == DOMAIN and node.op_type == op_type


# ---------------------------------------------------------------------------------------
# (1) Self-attention


@dataclasses.dataclass
class _Projection:
    """x @ weight + bias, reshaped to (batch, seq, heads, size) and transposed."""

    x: ir.Value
    weight: np.ndarray
    bias: np.ndarray
    heads: int
    nodes: list[ir.Node]
    constants: list[ir.Value]


def _projection(value: ir.Value | None, perm: tuple[int, ...], reader: ir.Node) -> _Projection | None:
    """The projection that ``value`` (read by ``reader`` alone) is, transposed by ``perm``."""
    transpose = value.producer() if value is not None else None
    if value is None or not _is(transpose, "Transpose") or _sole_reader(value) is not reader:
        return None
    if tuple(transpose.attributes.get_ints("perm", ())) != perm:
        return None
    split = transpose.inputs[0]
    reshape = split.producer() if split is not None else None
    if split is None or not _is(reshape, "Reshape") or _sole_reader(split) is not transpose:
        return None
    shape = _ints(reshape.inputs[1] if len(reshape.inputs) > 1 else None)
    if shape is None or len(shape) != 4 or shape[:2] != (0, 0) or min(shape[2:]) <= 0:
        return None
    if reshape.attributes.get_int("allowzero", 0):
        return None
    projected = reshape.inputs[0]
    product = projected.producer() if projected is not None else None
    if projected is None or product is None or _sole_reader(projected) is not reshape:
        return None
    if _is_ours(product, "FusedMatMul") and len(product.inputs) == 3:
        weight_value, bias_value = product.inputs[1], product.inputs[2]
    elif _is(product, "MatMul") and len(product.inputs) == 2:
        weight_value, bias_value = product.inputs[1], None
    else:
        return None
    weight = constant_array(weight_value) if weight_value is not None else None
    if weight is None or weight.ndim != 2 or weight.dtype not in _FLOATS:
        return None
    heads, size = shape[2:]
    if weight.shape[1] != heads * size:
        return None
    bias: np.ndarray | None
    if bias_value is None:
        bias = np.zeros(weight.shape[1], weight.dtype)
    else:
        bias = constant_array(bias_value)
        if bias is None or bias.dtype != weight.dtype or bias.shape != (weight.shape[1],):
            return None
    x = product.inputs[0]
    if x is None:
        return None
    constants = [v for v in (weight_value, bias_value, reshape.inputs[1]) if v is not None]
    return _Projection(x, weight, bias, heads, [product, reshape, transpose], constants)


def _scaling(scores: ir.Value, softmax: ir.Node) -> tuple[ir.Value, list[ir.Node], float, bool] | None:
    """(the MatMul's output, nodes, factor, divides) for Softmax's input: scores * factor,
    scores / factor, or scores itself (factor 1)."""
    node = scores.producer()
    if _sole_reader(scores) is not softmax:
        return None
    if (_is(node, "Mul") or _is(node, "Div")) and node is not None and len(node.inputs) == 2:
        a, b = node.inputs
        divides = node.op_type == "Div"
        factor = _scalar(b)
        if factor is not None and a is not None and _float32_exact(factor):
            return a, [node], factor, divides
        factor = None if divides else _scalar(a)
        if factor is not None and b is not None and _float32_exact(factor):
            return b, [node], factor, False
        return None
    return scores, [], 1.0, False


def _float32_exact(factor: float) -> bool:
    """Whether the float32 attribute that carries ``factor`` holds it exactly (a float64
    model's 1/sqrt(d) does not: such a model keeps its Mul)."""
    return float(np.float32(factor)) == factor


def _softmax_over_last_axis(node: ir.Node, opset: int) -> bool:
    """Softmax over axis 3 of a 4-D input (before opset 13, the coerced 2-D form with
    axis 3 is the same thing)."""
    axis = node.attributes.get_int("axis", -1 if opset >= 13 else 1)
    return axis in (-1, 3)


class FuseSelfAttentionPass(_NodePass):
    """Multi-head self-attention written out as exporters do (see the module docstring):
    ``plugrt.cpu::SelfAttention(x, [Wq|Wk|Wv], [bq|bk|bv], heads, scale, divide)``."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        opset = model.opset_imports.get("", 0)
        if not _is(node, "Softmax") or not _softmax_over_last_axis(node, opset) or node.inputs[0] is None:
            return False
        found = _scaling(node.inputs[0], node)
        if found is None:
            return False
        scores, scaling, factor, divides = found
        qk = scores.producer()
        if not _is(qk, "MatMul") or _sole_reader(scores) is not (scaling[0] if scaling else node):
            return False
        pv = _sole_reader(node.outputs[0])
        if not _is(pv, "MatMul") or pv.inputs[0] is not node.outputs[0]:
            return False
        merge_t = _sole_reader(pv.outputs[0])
        if not _is(merge_t, "Transpose") or tuple(merge_t.attributes.get_ints("perm", ())) != (0, 2, 1, 3):
            return False
        merge = _sole_reader(merge_t.outputs[0])
        if not _is(merge, "Reshape") or len(merge.inputs) < 2 or merge.attributes.get_int("allowzero", 0) != 0:
            return False
        merged_shape = _ints(merge.inputs[1])
        if merged_shape is None or len(merged_shape) != 3 or merged_shape[:2] != (0, 0):
            return False
        q = _projection(qk.inputs[0], (0, 2, 1, 3), qk)
        k = _projection(qk.inputs[1], (0, 2, 3, 1), qk)
        v = _projection(pv.inputs[1], (0, 2, 1, 3), pv)
        if q is None or k is None or v is None or not (q.x is k.x is v.x):
            return False
        x = q.x
        if x.shape is None or len(x.shape) != 3:
            return False
        weights = [q.weight, k.weight, v.weight]
        if len({(w.shape, w.dtype) for w in weights}) != 1 or len({q.heads, k.heads, v.heads}) != 1:
            return False
        if merged_shape[2] != q.weight.shape[1]:
            return False
        pattern = [*q.nodes, *k.nodes, *v.nodes, qk, *scaling, node, pv, merge_t, merge]
        graph, name = model.graph, node.name or "attention"
        inputs = [
            x,
            _add_constant(graph, f"{name}_qkv_weight", np.concatenate(weights, axis=1)),
            _add_constant(graph, f"{name}_qkv_bias", np.concatenate([q.bias, k.bias, v.bias])),
        ]
        attributes = [
            ir.AttrInt64("heads", q.heads),
            ir.AttrFloat32("scale", factor),
            ir.AttrInt64("divide", int(divides)),
        ]
        # The pattern's nodes are not in graph order; _replace wants its last output last.
        ordered = sorted(pattern, key=list(graph).index)
        fused = _private_node(model, "SelfAttention", inputs, name, attributes)
        _replace(graph, ordered, fused)
        _drop_unused_initializers(graph, [*q.constants, *k.constants, *v.constants])
        return True


# ---------------------------------------------------------------------------------------
# (2) LayerNormalization of a sum


def _layer_norm_parameters(node: ir.Node) -> tuple[ir.Value, ir.Value | None, float] | None:
    """(scale, bias, epsilon) of a LayerNormalization over the last axis with 1-D constant
    float parameters, whose mean and inverse-std outputs nobody reads."""
    if not (_is(node, "LayerNormalization") or _is_ours(node, "LayerNormalization")) or len(node.inputs) < 2:
        return None
    if node.attributes.get_int("axis", -1) != -1 or node.attributes.get_int("stash_type", 1) != 1:
        return None
    if any(v.uses() or v.is_graph_output() for v in node.outputs[1:]):
        return None
    scale = node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    for value in (scale, bias):
        array = constant_array(value) if value is not None else None
        if value is not None and (array is None or array.ndim != 1 or array.dtype not in _FLOATS):
            return None
    if scale is None:
        return None
    return scale, bias, node.attributes.get_float("epsilon", 1e-5)


class FuseSkipLayerNormPass(_NodePass):
    """``LayerNormalization(Add(a, b))`` (last axis, only Y read, the sum read by the
    LayerNorm alone): ``plugrt.cpu::SkipLayerNormalization(a, b, scale[, bias])``."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        found = _layer_norm_parameters(node)
        if found is None:
            return False
        total = node.inputs[0]
        add = total.producer() if total is not None else None
        if total is None or not _is(add, "Add") or _sole_reader(total) is not node:
            return False
        scale, bias, epsilon = found
        inputs = [add.inputs[0], add.inputs[1], scale, *([bias] if bias is not None else [])]
        attributes = [ir.AttrFloat32("epsilon", epsilon)]
        fused = _private_node(model, "SkipLayerNormalization", inputs, node.name or "skip_layer_norm", attributes)
        _replace(model.graph, [add, node], fused)
        return True


# ---------------------------------------------------------------------------------------
# (3) GELU of a MatMul + bias


def _gelu_approximation(node: ir.Node | None) -> str | None:
    """"none" where ``node`` is an erf GELU (plugrt.cpu::Gelu or ONNX Gelu with
    approximate="none", or com.microsoft::Gelu, the core's rewrite below opset 20), "tanh"
    where it is the tanh form (approximate="tanh": GPT-2's, which ``FuseGeluPass`` wrote
    for the written-out formula); else None."""
    if node is not None and node.domain == CONTRIB_DOMAIN and node.op_type == "Gelu":
        return "none"
    if not (_is(node, "Gelu") or _is_ours(node, "Gelu")) or node is None:
        return None
    approximate = node.attributes.get_string("approximate", "none")
    return approximate if approximate in ("none", "tanh") else None


class FuseBiasGeluPass(_NodePass):
    """``plugrt.cpu::FusedMatMul`` whose output only a GELU (erf or tanh) reads:
    ``plugrt.cpu::FusedMatMulGelu`` (the bias added inside the GELU's pass), with the
    GELU's ``approximate``."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if not _is_ours(node, "FusedMatMul") or len(node.inputs) != 3:
            return False
        gelu = _sole_reader(node.outputs[0])
        approximate = _gelu_approximation(gelu)
        if gelu is None or approximate is None:
            return False
        attributes = [ir.AttrString("approximate", approximate)] if approximate != "none" else []
        fused = _private_node(model, "FusedMatMulGelu", node.inputs, node.name or "matmul_gelu", attributes)
        _replace(model.graph, [node, gelu], fused)
        return True


# ---------------------------------------------------------------------------------------
# Kernels of the plugrt.cpu nodes


def _softmax_rows(scores: np.ndarray, row: np.ndarray) -> None:
    """Softmax over the last axis of the 2-D ``scores``, in place; ``row`` (rows, 1) holds
    the per-row statistics (every row finite or NaN: there is no mask here)."""
    np.max(scores, axis=-1, keepdims=True, out=row)
    np.subtract(scores, row, out=scores)
    np.exp(scores, out=scores)
    np.sum(scores, axis=-1, keepdims=True, out=row)
    np.divide(scores, row, out=scores)


@kernel_builder("SelfAttention", DOMAIN_VERSION, domain=DOMAIN, compiled=ROW_LOOPS)
def self_attention(ctx: KernelContext) -> Callable[..., np.ndarray]:
    """softmax(q k^T * scale) v per head, with q, k, v from one GEMM of x by the three
    weights side by side; the result in (batch, seq, hidden) order. The heads run as
    ``parallel_for`` chunks (each its two products and softmax, one BLAS thread)."""
    heads = int(ctx.attributes["heads"])
    scale = float(ctx.attributes.get("scale", 1.0))
    divide = bool(ctx.attributes.get("divide", 0))

    def attend(out: np.ndarray, x: np.ndarray, w: np.ndarray, b: np.ndarray, work, into: bool = False) -> None:
        batch, seq, width = x.shape
        hidden = w.shape[1] // 3
        size = hidden // heads
        rows = batch * seq
        qkv = work("qkv", (rows, 3 * hidden), np.result_type(x, w))
        blas_threads(rows * width * 3 * hidden)
        matmul(x.reshape(rows, width), w, out=qkv)
        qkv += b
        split = qkv.reshape(batch, seq, 3, heads, size)
        q = split[:, :, 0].transpose(0, 2, 1, 3)  # (batch, heads, seq, size), strided views
        k_t = split[:, :, 1].transpose(0, 2, 3, 1)
        v = split[:, :, 2].transpose(0, 2, 1, 3)
        context = out.reshape(batch, seq, heads, size).transpose(0, 2, 1, 3)
        scores = work("scores", (batch, heads, seq, seq), qkv.dtype)
        factor = scores.dtype.type(scale)
        scaling = None if scale == 1.0 else np.divide if divide else np.multiply
        loops = compiled_loops() if scores.dtype == np.float32 else None
        # the numpy softmax's per-row maxima and sums (the compiled loops keep theirs in registers)
        statistics: Any = work("statistics", (batch, heads, seq, 1), qkv.dtype) if loops is None else None
        multiplier = scores.dtype.type(1.0 / scale if divide else scale)

        def head_range(start: int, stop: int) -> None:
            for index in range(start, stop):
                n, h = divmod(index, heads)
                head_scores = scores[n, h]
                np.matmul(q[n, h], k_t[n, h], out=head_scores)
                if loops is not None:  # the scaling, max and sum passes compiled; numpy's exp
                    loops.scale_and_shift_rows(head_scores, multiplier)
                    np.exp(head_scores, out=head_scores)
                    loops.normalize_rows(head_scores)
                else:
                    if scaling is not None:
                        scaling(head_scores, factor, out=head_scores)
                    _softmax_rows(head_scores, statistics[n, h])
                np.matmul(head_scores, v[n, h], out=context[n, h])

        blas_threads(seq * size * seq)  # one product per head: too small to split
        cost = batch * heads * seq * seq * size * 2
        # Heads in parallel only while the cores are free: on a busy machine a helper that
        # loses its core holds up the whole step (measured: 1.1x slower at load 4 on 2 cores).
        if threads_for(cost) > 1:
            # numpy's ufunc buffer size is per thread: the into variant's small buffers
            # must be set on the pool workers too
            chunk = (lambda start, stop: with_small_buffers(head_range, start, stop)) if into else head_range
            parallel_for(batch * heads, chunk, cost)
        else:
            head_range(0, batch * heads)
        blas_threads(PARALLEL_MIN_WORK)  # back to what products no kernel sizes get

    def run(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
        _check_attention_input(x, w, heads)
        out = np.empty((*x.shape[:2], w.shape[1] // 3), np.result_type(x, w))
        attend(out, x, w, b, lambda slot, shape, dtype: np.empty(shape, dtype))
        return out

    def run_into(out: np.ndarray, x: np.ndarray, w: np.ndarray, b: np.ndarray) -> None:
        attend(out, x, w, b, lambda slot, shape, dtype: scratch(out, slot, shape, dtype), into=True)

    declare_into(run_into, run)
    return run


def _check_attention_input(x: np.ndarray, w: np.ndarray, heads: int) -> None:
    """The Reshape of the unfused graph would fail on these: so does the fused node."""
    if x.ndim != 3 or x.shape[2] != w.shape[0]:
        raise ValueError(f"SelfAttention: input of shape {x.shape} does not fit weights of shape {w.shape}")


@kernel_builder("SkipLayerNormalization", DOMAIN_VERSION, domain=DOMAIN, compiled=ROW_LOOPS)
def skip_layer_normalization(ctx: KernelContext) -> Callable[..., np.ndarray]:
    """LayerNorm(a + b) over the last axis: one compiled pass for float32 where numba is
    installed, else the Add and the LayerNormalization kernel."""
    epsilon = float(ctx.attributes.get("epsilon", 1e-5))
    layer_norm = normalization.layer_normalization(
        dataclasses.replace(ctx, op_type="LayerNormalization", domain="", attributes={"axis": -1, "epsilon": epsilon})
    )
    layer_norm_into = capture_variant(layer_norm)

    def compiled(out: np.ndarray, a: np.ndarray, b: np.ndarray, scale: np.ndarray, bias: np.ndarray | None) -> bool:
        """Run the compiled loop into ``out`` when it applies (float32, contiguous, b the
        shape of a trailing part of a); False when it does not."""
        if out.dtype != np.float32 or out.shape != a.shape or out.ndim < 2 or out.size < 1024:
            return False
        if b.ndim < 1 or a.shape[-b.ndim:] != b.shape or scale.shape != a.shape[-1:]:
            return False
        if bias is not None and bias.shape != scale.shape:
            return False
        if not all(t.dtype == np.float32 and t.flags.c_contiguous for t in (a, b, scale, out)):
            return False
        loops = compiled_loops()
        if loops is None:
            return False
        width = a.shape[-1]
        shift = bias if bias is not None else normalization.zero_vector(width)
        if shift.dtype != np.float32 or not shift.flags.c_contiguous:
            return False
        loops.skip_layer_norm(
            a.reshape(-1, width), b.reshape(-1, width), scale, shift, epsilon, out.reshape(-1, width)
        )
        return True

    def run(a: np.ndarray, b: np.ndarray, scale: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        if a.shape != np.broadcast_shapes(a.shape, b.shape):
            a, b = b, a  # the sum commutes: a is the operand of the result's shape
        if a.dtype == np.float32 and b.dtype == np.float32:
            out = np.empty(a.shape, np.float32)
            if compiled(out, a, b, scale, bias):
                return out
        return layer_norm(np.add(a, b), scale, bias)[0]

    def run_into(out: np.ndarray, a: np.ndarray, b: np.ndarray, scale: np.ndarray, bias: np.ndarray | None = None) -> None:
        if a.shape != out.shape:
            a, b = b, a
        if compiled(out, a, b, scale, bias):
            return
        total = scratch(out, "sum", out.shape, out.dtype)
        np.add(a, b, out=total)
        if layer_norm_into is None:
            np.copyto(out, layer_norm(total, scale, bias)[0])
        else:
            layer_norm_into((out,), total, scale, bias)

    declare_into(run_into, run)
    return run


@kernel_builder("FusedMatMulGelu", DOMAIN_VERSION, domain=DOMAIN, compiled=DENSE_LOOPS)
def fused_matmul_gelu(ctx: KernelContext) -> Callable[..., np.ndarray]:
    """GELU(a @ w + bias), erf or tanh (``approximate``, as the Gelu op's): the product as
    one GEMM over a's rows (``kernels.dense``), the bias and GELU on each panel of columns
    while it is in cache (float32, numba, AVX-512); else BLAS, the bias, and the GELU in
    one compiled pass (float32 with numba) or numpy's."""
    approximate = ctx.attributes.get("approximate", "none")
    gelu = elementwise.gelu(dataclasses.replace(ctx, op_type="Gelu", attributes={"approximate": approximate}))
    gelu_into = capture_variant(gelu)
    code = dense.GELU_TANH if approximate == "tanh" else dense.GELU_ERF
    panels = dense.WeightPanels(ctx.constant_inputs[1] if len(ctx.constant_inputs) > 1 else None)

    def product(out: np.ndarray, a: np.ndarray, w: np.ndarray, bias: np.ndarray, allocate: dense.Allocate) -> bool:
        """out = a @ w + bias, and the GELU where the product took it: whether it did."""
        rows = dense.matrix_rows(out, a, w, bias, allocate)
        if rows is not None:
            target = out.reshape(-1, w.shape[1])
            return dense.dense_product(
                target, rows, w, bias, panels=panels, gelu=code, allocate=allocate, gelu_pass=compiled
            )
        np.matmul(a, w, out=out)
        out += bias
        return False

    def compiled(out: np.ndarray) -> bool:
        if out.dtype != np.float32 or not out.flags.c_contiguous:
            return False
        loops = compiled_loops()
        if loops is None:
            return False
        flat = out.reshape(-1)
        (loops.gelu_tanh if code == dense.GELU_TANH else loops.gelu_erf)(flat, flat)
        return True

    def run(a: np.ndarray, w: np.ndarray, bias: np.ndarray) -> np.ndarray:
        out = np.empty((*a.shape[:-1], w.shape[1]), np.result_type(a, w))
        if product(out, a, w, bias, dense.new_array) or compiled(out):
            return out
        return gelu(out)

    def run_into(out: np.ndarray, a: np.ndarray, w: np.ndarray, bias: np.ndarray) -> None:
        if product(out, a, w, bias, lambda slot, shape, dtype: scratch(out, slot, shape, dtype)) or compiled(out):
            return
        if gelu_into is None:
            np.copyto(out, gelu(out))
        else:
            biased = scratch(out, "biased", out.shape, out.dtype)
            np.copyto(biased, out)
            gelu_into(out, biased)

    declare_into(run_into, run)
    return run


# ---------------------------------------------------------------------------------------
# (4) Softmax of a sum, and its NaN guard


def _nan_guard(probabilities: ir.Value) -> list[ir.Node] | None:
    """[IsNaN, Where] where ``probabilities`` is read by ``Where(IsNaN(p), 0, p)`` and
    nothing else (the IsNaN read by that Where alone); else None."""
    uses = [use.node for use in probabilities.uses()]
    if probabilities.is_graph_output() or len(uses) != 2:
        return None
    isnan = next((n for n in uses if _is(n, "IsNaN")), None)
    where = next((n for n in uses if _is(n, "Where")), None)
    if isnan is None or where is None or len(where.inputs) != 3 or _sole_reader(isnan.outputs[0]) is not where:
        return None
    condition, zero, value = where.inputs
    if condition is not isnan.outputs[0] or value is not probabilities or _scalar(zero) != 0.0:
        return None
    return [isnan, where]


class FuseAddSoftmaxPass(_NodePass):
    """``Softmax(Add(x, mask))`` over the last axis (opset 13 and later), float32 or
    float64, the mask broadcast onto x with x's last axis, the sum read by the Softmax
    alone: ``plugrt.cpu::AddSoftmax(x, mask)``, taking the NaN guard after it along
    (``zero_nan``)."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if not _is(node, "Softmax") or model.opset_imports.get("", 0) < 13 or node.inputs[0] is None:
            return False
        summed = node.inputs[0]
        add = summed.producer()
        shape = summed.shape
        if not _is(add, "Add") or len(add.inputs) != 2 or _sole_reader(summed) is not node or shape is None:
            return False
        if summed.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE) or node.attributes.get_int("axis", -1) not in (-1, len(shape) - 1):
            return False
        for x, mask in (add.inputs, add.inputs[::-1]):
            if x is None or mask is None or x.shape is None or mask.shape is None or x.dtype != mask.dtype:
                continue
            if tuple(x.shape) != tuple(shape) or len(mask.shape) > len(shape) or not mask.shape or mask.shape[-1] != shape[-1]:
                continue
            if not isinstance(shape[-1], int):
                continue
            guard = _nan_guard(node.outputs[0])
            attributes = [ir.AttrInt64("zero_nan", int(guard is not None))]
            fused = _private_node(model, "AddSoftmax", [x, mask], node.name or "add_softmax", attributes)
            _replace(model.graph, [add, node, *(guard or [])], fused)
            return True
        return False


@kernel_builder("AddSoftmax", DOMAIN_VERSION, domain=DOMAIN, compiled=ROW_LOOPS)
def add_softmax(ctx: KernelContext) -> Callable[..., np.ndarray]:
    """``softmax(x + mask)`` over the last axis, NaN -> 0 where ``zero_nan``
    (``kernels.softmax.add_softmax``)."""
    zero_nan = bool(ctx.attributes.get("zero_nan", 0))

    def run(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return softmax.add_softmax(x, mask, zero_nan)

    def run_into(out: np.ndarray, x: np.ndarray, mask: np.ndarray) -> None:
        softmax.add_softmax(x, mask, zero_nan, out)

    declare_into(run_into, run)
    return run


# ---------------------------------------------------------------------------------------
# (5) Scaled dot-product attention


def _scaled(value: ir.Value, reader: ir.Node) -> tuple[ir.Value, float, list[ir.Node]]:
    """(source, factor, [node]) where ``value`` is ``Mul(source, c)``, ``Mul(c, source)`` or
    ``Div(source, c)`` for a one-element float constant ``c`` of no more axes than
    ``source``, read by ``reader`` alone; else (value, 1.0, [])."""
    node = value.producer()
    if node is None or not _ours(node) or _sole_reader(value) is not reader or len(node.inputs) != 2:
        return value, 1.0, []
    if not (_is(node, "Mul") or _is(node, "Div")):
        return value, 1.0, []
    pairs = [tuple(node.inputs)] if _is(node, "Div") else [tuple(node.inputs), tuple(node.inputs[::-1])]
    for source, constant in pairs:
        factor = _scalar(constant)
        if source is None or constant is None or factor is None or factor == 0.0:
            continue
        if source.shape is None or constant.shape is None or len(constant.shape) > len(source.shape):
            continue
        return source, (1.0 / factor if _is(node, "Div") else factor), [node]
    return value, 1.0, []


def _heads(value: ir.Value | None) -> bool:
    """Whether ``value`` is a float32/float64 tensor of four axes (batch, heads, rows, width)."""
    return value is not None and value.shape is not None and len(value.shape) == 4 and value.dtype in (
        ir.DataType.FLOAT, ir.DataType.DOUBLE
    )


class FuseScaledDotProductAttentionPass(_NodePass):
    """``MatMul(softmax(scale * MatMul(q, kt) (+ mask)), v)`` on four-axis operands (batch,
    heads, rows, width), the softmax a Softmax over the last axis or an ``AddSoftmax``
    (with its NaN guard), the scale any scalar Mul or Div of q, of kt or of the scores
    (SDPA exports scale q and k^T by its root each), every intermediate read by the next
    node alone; and the Transpose of the result, where it is its only reader and keeps the
    last axis last: ``plugrt.cpu::ScaledDotProductAttention(q, kt, v[, mask])`` with
    ``scale``, ``zero_nan`` and ``perm``."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if not _is(node, "MatMul") or len(node.inputs) != 2 or None in node.inputs:
            return False
        probabilities, v = node.inputs
        assert probabilities is not None and v is not None
        norm = probabilities.producer()
        if norm is None or not _ours(norm) or _sole_reader(probabilities) is not node or not _heads(v):
            return False
        mask: ir.Value | None = None
        zero_nan = 0
        if _is_ours(norm, "AddSoftmax") and len(norm.inputs) == 2:
            scores, mask = norm.inputs
            zero_nan = norm.attributes.get_int("zero_nan", 0)
        elif _is(norm, "Softmax") and model.opset_imports.get("", 0) >= 13 and norm.attributes.get_int("axis", -1) in (-1, 3):
            scores = norm.inputs[0]
        else:
            return False
        if scores is None or (mask is not None and (mask.shape is None or len(mask.shape) > 4)):
            return False
        raw, after, scaling = _scaled(scores, norm)
        product = raw.producer()
        if not _is(product, "MatMul") or not _ours(product) or len(product.inputs) != 2:
            return False
        if _sole_reader(raw) is not (scaling[0] if scaling else norm):
            return False
        q, q_factor, q_scaling = _scaled(product.inputs[0], product)  # type: ignore[arg-type]
        kt, k_factor, k_scaling = _scaled(product.inputs[1], product)  # type: ignore[arg-type]
        if not (_heads(q) and _heads(kt)) or len({q.dtype, kt.dtype, v.dtype}) != 1:
            return False
        scale = float(np.float64(q_factor) * k_factor * after)
        if q.dtype == ir.DataType.DOUBLE and float(np.float32(scale)) != scale:
            return False  # the attribute is a float32: a float64 model keeps its own scaling
        pattern = [*q_scaling, *k_scaling, product, *scaling, norm, node]
        perm = [0, 1, 2, 3]
        transpose = _sole_reader(node.outputs[0])
        if _is(transpose, "Transpose"):
            asked = [int(a) for a in transpose.attributes.get_ints("perm", [])]
            if sorted(asked) == perm and asked[3] == 3:
                perm = asked
                pattern.append(transpose)
        attributes = [
            ir.AttrFloat32("scale", scale),
            ir.AttrInt64("zero_nan", zero_nan),
            ir.AttrInt64s("perm", perm),
        ]
        inputs = [q, kt, v, *([mask] if mask is not None else [])]
        fused = _private_node(model, "ScaledDotProductAttention", inputs, node.name or "attention", attributes)
        _replace(model.graph, pattern, fused)
        return True


@kernel_builder("ScaledDotProductAttention", DOMAIN_VERSION, domain=DOMAIN, compiled=DENSE_LOOPS + ROW_LOOPS)
def scaled_dot_product_attention(ctx: KernelContext) -> Callable[..., np.ndarray]:
    """``softmax(scale * q @ kt + mask) @ v`` per head, NaN -> 0 where ``zero_nan``, the
    result transposed by ``perm`` (``kernels.sdpa``)."""
    scale = float(ctx.attributes.get("scale", 1.0))
    zero_nan = bool(ctx.attributes.get("zero_nan", 0))
    perm = tuple(int(a) for a in ctx.attributes.get("perm", (0, 1, 2, 3)))

    def run(q: np.ndarray, kt: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        return sdpa.attend(q, kt, v, mask, scale, zero_nan, perm)

    def run_into(out: np.ndarray, q: np.ndarray, kt: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None) -> None:
        sdpa.attend(q, kt, v, mask, scale, zero_nan, perm, out)

    declare_into(run_into, run)
    return run


# ---------------------------------------------------------------------------------------
# (6) Sibling products of one input


#: Values of the weights side by side past which siblings stay apart: products that big
#: gain nothing from one call (their arithmetic dominates), and the build would hold both
#: copies while it concatenates (a 7B decoder's q, k and v: 50 M values).
_MERGED_WEIGHT_LIMIT = 1 << 22


class MergeSiblingMatMulsPass(_NodePass):
    """The ``plugrt.cpu::FusedMatMul`` steps reading one input, each by a constant 2-D
    weight of the same depth and dtype and a constant bias, none of their outputs a graph
    output: one ``FusedMatMul`` by the weights side by side (their biases likewise), then a
    ``Split`` of its last axis into the products (views of its columns: their readers, an
    attention's Reshape and Transpose, read them where they lie). BERT's and DistilBERT's
    q, k and v projections: three products of N = 256 become one of 768 (the activation
    read once, one call); at opset 11 and later (Split's sizes by attribute below 13, by
    input from 13), up to ``_MERGED_WEIGHT_LIMIT`` values of weights."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if not _is_ours(node, "FusedMatMul") or len(node.inputs) != 3 or node.inputs[0] is None:
            return False
        opset = model.opset_imports.get("", 0)
        if opset < 11:
            return False
        x = node.inputs[0]
        siblings: list[tuple[ir.Node, np.ndarray, np.ndarray]] = []
        for use in x.uses():
            reader = use.node
            if use.idx != 0 or not _is_ours(reader, "FusedMatMul") or len(reader.inputs) != 3 or reader.outputs[0].is_graph_output():
                continue
            if any(s[0] is reader for s in siblings):
                continue
            if reader.inputs[1] is None or reader.inputs[2] is None:
                continue
            weight, bias = constant_array(reader.inputs[1]), constant_array(reader.inputs[2])
            if weight is None or bias is None or weight.ndim != 2 or bias.shape != (weight.shape[1],):
                continue
            if siblings and (weight.shape[0] != siblings[0][1].shape[0] or weight.dtype != siblings[0][1].dtype):
                continue
            siblings.append((reader, weight, bias))
        if len(siblings) < 2 or siblings[0][1].dtype not in _FLOATS or not any(s[0] is node for s in siblings):
            return False
        if sum(w.size for _, w, _ in siblings) > _MERGED_WEIGHT_LIMIT:
            return False
        graph = model.graph
        members = {id(s[0]) for s in siblings}
        first = next(n for n in graph if id(n) in members)  # the earliest: the merged product goes before it
        order = {id(n): i for i, n in enumerate(n for n in graph if id(n) in members)}
        siblings.sort(key=lambda s: order[id(s[0])])
        weight = np.concatenate([w for _, w, _ in siblings], axis=1)
        bias = np.concatenate([b for _, _, b in siblings])
        widths = [w.shape[1] for _, w, _ in siblings]
        name = node.name or "matmul"
        merged = _private_node(
            model, "FusedMatMul",
            [x, _add_constant(graph, f"{name}_merged_weight", weight), _add_constant(graph, f"{name}_merged_bias", bias)],
            f"{name}_merged", [],
        )
        if opset >= 13:
            split = ir.Node("", "Split", [merged.outputs[0], _add_constant(graph, f"{name}_merged_split", np.array(widths, np.int64))],
                            [ir.AttrInt64("axis", -1)], num_outputs=len(siblings), name=f"{name}_merged_split")
        else:
            split = ir.Node("", "Split", [merged.outputs[0]], [ir.AttrInt64("axis", -1), ir.AttrInt64s("split", widths)],
                            num_outputs=len(siblings), name=f"{name}_merged_split")
        merged.meta[CLAIMED_BY] = PROVIDER_NAME
        split.meta[CLAIMED_BY] = PROVIDER_NAME
        graph.insert_before(first, [merged, split])
        constants = []
        for (reader, _, _), part in zip(siblings, split.outputs):
            old = reader.outputs[0]
            part.name, part.shape, part.type = old.name, old.shape, old.type
            old.name = None
            old.replace_all_uses_with(part)
            constants += [v for v in reader.inputs[1:] if v is not None]
            graph.remove(reader, safe=True)
        _drop_unused_initializers(graph, constants)
        return True


# ---------------------------------------------------------------------------------------
# (7) A shifted window's mask, added through a Reshape to windows and back


def _constant_addend(add: ir.Node, value: ir.Value) -> tuple[ir.Value, np.ndarray] | None:
    """(the constant input, its array) of ``Add(value, constant)`` or ``Add(constant, value)``."""
    other = _other_input(add, value) if _is(add, "Add") else None
    array = constant_array(other) if other is not None else None
    return None if other is None or array is None else (other, array)


def _static(value: ir.Value | None) -> tuple[int, ...] | None:
    shape = value.shape if value is not None else None
    return tuple(shape.numpy()) if shape is not None and shape.is_static() else None


class FoldWindowMaskPass(_NodePass):
    """``Reshape(Add(Reshape(x, (b, w, h, n, t)), mask), shape of x)`` for ``x`` of static
    shape (b * w, h, n, t) and a constant ``mask`` that broadcasts onto (b, w, h, n, t):
    ``Add(x, mask')``, ``mask'`` the mask laid out on x's axes; and where ``x`` is itself
    ``Add(scores, bias)`` of a constant read there alone, one ``Add(scores, bias + mask')``.
    Swin's shifted windows add their mask so (64 windows of 3 heads at its first stage),
    between the relative-position bias and the Softmax: three passes over the scores and
    two Reshapes become one Add, which ``AddSoftmax`` and the attention step then take."""

    def rewrite(self, model: ir.Model, node: ir.Node) -> bool:
        if model.opset_imports.get("", 0) < 7:  # an Add that broadcasts
            return False
        summed = node.inputs[0] if _is(node, "Reshape") else None
        add = summed.producer() if summed is not None else None
        if summed is None or add is None or not _is(add, "Add") or not _ours(add) or _sole_reader(summed) is not node:
            return False
        windows = next((v for v in add.inputs if v is not None and _is(v.producer(), "Reshape")), None)
        found = _constant_addend(add, windows) if windows is not None else None
        split = windows.producer() if windows is not None else None
        if windows is None or found is None or split is None or not _ours(split) or _sole_reader(windows) is not add:
            return False
        x = split.inputs[0]
        shape, split_shape = _static(x), _static(windows)
        if x is None or shape is None or split_shape is None or _static(node.outputs[0]) != shape:
            return False
        if len(shape) != 4 or len(split_shape) != 5 or x.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
            return False
        b, w, h, n, t = split_shape
        mask = found[1]
        if b * w != shape[0] or (h, n, t) != shape[1:] or mask.ndim > 5 or mask.dtype != np.dtype(x.dtype.numpy()):
            return False
        padded: tuple[int, ...] = (1,) * (5 - mask.ndim) + tuple(mask.shape)
        mask = mask.reshape(padded)
        heads = 1 if padded[2] == 1 else h
        try:
            laid = np.broadcast_to(mask, (b, w, heads, n, t)).reshape(b * w, heads, n, t)
        except ValueError:
            return False
        pattern = [split, add, node]
        scores = x
        bias_add = x.producer()
        if bias_add is not None and _is(bias_add, "Add") and _ours(bias_add) and _sole_reader(x) is split:
            variable = [v for v in bias_add.inputs if v is not None and constant_array(v) is None]
            bias = _constant_addend(bias_add, variable[0]) if len(variable) == 1 else None
            try:
                size = int(np.prod(np.broadcast_shapes(bias[1].shape, laid.shape))) if bias is not None and bias[1].ndim <= 4 else 0
            except ValueError:  # a bias that does not broadcast onto the windows' mask: left as it is
                size = 0
            if bias is not None and bias[1].dtype == laid.dtype and 0 < size <= _MERGED_WEIGHT_LIMIT:  # the sum is a new constant
                combined = bias[1] + laid  # broadcast: (1, h, n, t) + (b * w, 1, n, t)
                if combined.shape == tuple(np.broadcast_shapes(combined.shape, shape)) and len(combined.shape) == 4:
                    laid, scores = combined, variable[0]
                    pattern.insert(0, bias_add)
        graph = model.graph
        constant = _add_constant(graph, f"{node.name or 'window'}_mask", np.ascontiguousarray(laid))
        fused = ir.Node("", "Add", [scores, constant], name=f"{node.name or 'window'}_masked")
        _replace(graph, pattern, fused)
        return True
