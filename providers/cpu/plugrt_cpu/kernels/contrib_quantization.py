"""com.microsoft block-quantized kernels: MatMulNBits, GatherBlockQuantized, QuantizeLinear, DequantizeLinear."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from plugrt.provider import shared_transform

from .._registry import KernelContext, declare_into, kernel, kernel_builder
from .quantization import _dequantize, _quantize

_MS = "com.microsoft"
_PACKABLE_BITS = (2, 4, 8)  # widths that tile a byte exactly (low-order bits first)
_FLOAT_DATA = frozenset(
    np.dtype(t)
    for t in (
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e4m3fnuz,
        ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e5m2fnuz,
        ml_dtypes.float4_e2m1fn,
    )
)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 (..., n) holding 8/bits values per byte, low-order bits first -> uint8 (..., n * 8 / bits)."""
    if bits == 8:
        return packed
    per_byte = 8 // bits
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8)
    values = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return values.reshape(packed.shape[:-1] + (packed.shape[-1] * per_byte,))


def _work_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(dtype) if dtype in (np.float32, np.float64) else np.dtype(np.float32)


# ----------------------------------------------------------------------------- MatMulNBits


def _nbits_weight(
    b: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    g_idx: np.ndarray | None,
    n: int,
    k: int,
    bits: int,
    block_size: int,
    work: np.dtype,
) -> np.ndarray:
    """The dequantized weight as a (K, N) array of ``work`` type, one vectorised pass."""
    blocks = -(-k // block_size)
    blob = block_size * bits // 8
    if b.dtype != np.uint8 or b.size != n * blocks * blob:
        raise ValueError(f"B must be uint8 of shape ({n}, {blocks}, {blob}) for N={n}, K={k}, got {b.dtype} {b.shape}")
    if scales.size != n * blocks:
        raise ValueError(f"scales must hold N x k_blocks = {n} x {blocks} values, got shape {scales.shape}")
    q = _unpack(b.reshape(n, blocks, blob), bits).reshape(n, blocks * block_size)[:, :k]
    scale = scales.reshape(n, blocks).astype(work, copy=False)
    if zero_points is None:
        zero = np.full((n, blocks), 1 << (bits - 1), dtype=work)
    elif zero_points.dtype == np.uint8:
        per_row = -(-blocks * bits // 8)
        if zero_points.size != n * per_row:
            raise ValueError(f"packed zero_points must have shape ({n}, {per_row}), got {zero_points.shape}")
        zero = _unpack(zero_points.reshape(n, per_row), bits)[:, :blocks].astype(work)
    else:
        if zero_points.size != n * blocks:
            raise ValueError(f"float zero_points must have shape ({n}, {blocks}), got {zero_points.shape}")
        zero = zero_points.reshape(n, blocks).astype(work, copy=False)
    if g_idx is not None:
        # deprecated act-order layout: column k belongs to block g_idx[k]
        groups = np.asarray(g_idx, dtype=np.int64).reshape(-1)
        if groups.shape != (k,) or groups.min(initial=0) < 0 or groups.max(initial=0) >= blocks:
            raise ValueError(f"g_idx must hold {k} block indices in [0, {blocks}), got shape {groups.shape}")
        weight = (q.astype(work) - zero[:, groups]) * scale[:, groups]
    else:
        padded = blocks * block_size
        full = np.empty((n, padded), work)
        full[:, :k] = q
        full[:, k:] = 0
        full = full.reshape(n, blocks, block_size)
        full -= zero[..., None]
        full *= scale[..., None]
        weight = full.reshape(n, padded)[:, :k]
    return np.ascontiguousarray(weight.T)


def _int8_blocks(a: np.ndarray, block_size: int) -> np.ndarray:
    """A quantized to int8 and back, symmetrically per block of ``block_size`` along K
    (scale = max |a| / 127 over the block), the activations of an int8 matmul."""
    k = a.shape[-1]
    blocks = -(-k // block_size)
    if k == blocks * block_size:
        padded = a
    else:  # a partial last block: zeros change neither its peak nor the products
        padded = np.zeros(a.shape[:-1] + (blocks * block_size,), a.dtype)
        padded[..., :k] = a
    grouped = padded.reshape(a.shape[:-1] + (blocks, block_size))
    peak = np.max(np.abs(grouped), axis=-1, keepdims=True)
    scale = peak / a.dtype.type(127)
    inverse = np.divide(a.dtype.type(127), peak, out=np.zeros_like(peak), where=peak != 0)
    quantized = np.multiply(grouped, inverse)
    np.rint(quantized, out=quantized)
    np.clip(quantized, -128, 127, out=quantized)
    quantized *= scale
    return quantized.reshape(padded.shape)[..., :k]


@kernel_builder("MatMulNBits", 1, domain=_MS)
def matmul_nbits(ctx: KernelContext):
    attrs = ctx.attributes
    try:
        n, k, block_size = int(attrs["N"]), int(attrs["K"]), int(attrs["block_size"])
    except KeyError as e:
        raise NotImplementedError(f"MatMulNBits needs the {e.args[0]} attribute") from e
    bits = int(attrs.get("bits", 4))
    if bits not in _PACKABLE_BITS:
        raise NotImplementedError(f"MatMulNBits with bits={bits} is not supported on the CPU provider (2, 4 or 8)")
    if block_size < 16 or block_size & (block_size - 1):
        raise NotImplementedError(f"MatMulNBits' block_size must be a power of 2 of at least 16, got {block_size}")
    if int(attrs.get("weight_prepacked", 0)):
        raise NotImplementedError("MatMulNBits with weight_prepacked=1 is specific to another provider's layout")
    # accuracy_level 4 asks for int8 activations: A is quantized symmetrically per block
    # of K as onnxruntime does, so greedy decoding picks the same tokens as it. Lower
    # levels multiply in float32 (float64 for float64 A).
    int8_activations = int(attrs.get("accuracy_level", 0)) == 4
    a_dtype = ctx.input_dtypes[0] if ctx.input_dtypes else None
    work = _work_dtype(np.dtype(a_dtype)) if a_dtype is not None else np.dtype(np.float32)
    constants = list(ctx.constant_inputs) + [None] * (5 - len(ctx.constant_inputs))

    def fixed(i: int) -> bool:  # absent, or an initializer
        if i >= ctx.num_inputs or constants[i] is not None:
            return True
        return ctx.node is not None and ctx.node.inputs[i] is None

    cached = None
    if all(fixed(i) for i in range(1, 5)) and constants[1] is not None and constants[1].size:
        # the weight is an initializer: dequantize it once, here
        # one dequantized weight for every session of a WeightStore (a prefill and a decode graph)
        cached = shared_transform(
            tuple(constants[1:5]),
            ("MatMulNBits", n, k, bits, block_size, work.str),
            lambda: _nbits_weight(constants[1], constants[2], constants[3], constants[4], n, k, bits, block_size, work),
        )

    def run(a, b, scales, zero_points=None, g_idx=None, bias=None):
        if a.shape[-1:] != (k,):
            raise ValueError(f"A's last dimension must be K={k}, got shape {a.shape}")
        if b.size == 0:  # an omitted projection: zeros, or the bias
            out = np.zeros(a.shape[:-1] + (n,), a.dtype)
            return out + bias.astype(a.dtype, copy=False) if bias is not None else out
        w = cached
        if w is None:
            w = _nbits_weight(b, scales, zero_points, g_idx, n, k, bits, block_size, _work_dtype(a.dtype))
        y = product(a.astype(w.dtype, copy=False), w, zero_points, bias)
        return y.astype(a.dtype, copy=False)

    def product(a, w, zero_points, bias, out=None):
        """A (in w's type) @ w + bias, into ``out`` when given."""
        # onnxruntime keeps float activations when the zero points are floats
        if int8_activations and (zero_points is None or zero_points.dtype == np.uint8):
            a = _int8_blocks(a, block_size)
        y = np.matmul(a, w, out=out)
        if bias is not None:
            y += bias.astype(w.dtype, copy=False)
        return y

    def into(out, a, b, scales, zero_points=None, g_idx=None, bias=None):
        """run written into ``out``: the product straight into it when the weight was
        dequantized at build and A, the weight and out share a type (int8 activations
        are still made per call, activation-sized)."""
        w = cached
        if w is None or b.size == 0 or a.dtype != w.dtype or out.dtype != w.dtype or a.shape[-1:] != (k,):
            np.copyto(out, run(a, b, scales, zero_points, g_idx, bias))
            return
        product(a, w, zero_points, bias, out)

    declare_into(into, run)
    return run


# ----------------------------------------------------------------------------- GatherBlockQuantized


def _expand_blocks(value: np.ndarray, axis: int, block_size: int, length: int) -> np.ndarray:
    """Repeat a per-block parameter ``block_size`` times along ``axis`` and trim it to ``length``."""
    if value.shape[axis] == 1 and length != 1:
        return value  # one block (or a broadcast scale) covers the axis
    expanded = np.repeat(value, block_size, axis=axis)
    return expanded.take(np.arange(length), axis=axis) if expanded.shape[axis] != length else expanded


@kernel_builder("GatherBlockQuantized", 1, domain=_MS)
def gather_block_quantized(ctx: KernelContext):
    attrs = ctx.attributes
    bits = int(attrs.get("bits", 4))
    block_size = int(attrs.get("block_size", 128))
    quantize_axis = int(attrs.get("quantize_axis", 1))
    gather_axis = int(attrs.get("gather_axis", 0))

    def run(data, indices, scales, zero_points=None):
        rank = data.ndim
        q_axis = quantize_axis + rank if quantize_axis < 0 else quantize_axis
        g_axis = gather_axis + rank if gather_axis < 0 else gather_axis
        if not (0 <= q_axis < rank and 0 <= g_axis < rank):
            raise ValueError(f"gather_axis {gather_axis} / quantize_axis {quantize_axis} out of range for rank {rank}")
        if scales.ndim != rank:
            raise ValueError(f"scales must have the data's rank {rank}, got shape {scales.shape}")
        dtype = data.dtype
        packed = dtype == np.uint8 and bits < 8  # values packed along the last axis
        if dtype == np.uint8:
            if bits not in _PACKABLE_BITS:
                raise ValueError(f"uint8 data supports bits 2, 4 or 8, got {bits}")
            if g_axis != 0 or (bits < 8 and q_axis == rank - 1 and g_axis == rank - 1):
                raise ValueError("uint8 data needs gather_axis 0, different from the packed last axis")
            default_zero = float(1 << (bits - 1))
        elif dtype in _FLOAT_DATA:
            if zero_points is not None:
                raise ValueError("float8/float4 data is symmetric: it takes no zero_points")
            default_zero = 0.0
        else:
            default_zero = 0.0
        length = data.shape[q_axis] * (8 // bits if packed and q_axis == rank - 1 else 1)
        if block_size <= 0:
            if dtype not in _FLOAT_DATA:
                raise ValueError(f"block_size must be positive for {dtype} data, got {block_size}")
            size = length
        else:
            size = block_size
        extent = data.shape[g_axis]  # the gather axis is never the packed one
        index = np.asarray(indices, dtype=np.int64)
        valid = (index >= -extent) & (index < extent)
        index = np.where(index < 0, index + extent, index)
        index = np.where(valid, index, 0)  # out of range: zeros, set below
        # Only the rows asked are unpacked and dequantized (a decoder's embedding table is
        # ~100 MB: expanding all of it per token cost seconds). Along the gather axis a
        # parameter holds one entry per row, or per block when it is also the quantize axis.
        out_q = q_axis if q_axis < g_axis else q_axis + index.ndim - 1  # q_axis in the result

        def take(array: np.ndarray, blocked: bool = False) -> np.ndarray:
            if array.shape[g_axis] == 1:
                shape = list(array.shape)
                shape[g_axis : g_axis + 1] = [1] * index.ndim
                return array.reshape(shape)
            return np.take(array, index // size if blocked else index, axis=g_axis)

        values = take(data)
        if packed:
            values = _unpack(values, bits)
        work = _work_dtype(scales.dtype)
        gathered = values.astype(work)
        zeros = zero_points
        if zeros is not None:
            zeros = take(zeros, blocked=q_axis == g_axis)
            if packed:
                zeros = _unpack(zeros, bits)
            if q_axis != g_axis:
                zeros = _expand_blocks(zeros, out_q, size, gathered.shape[out_q])
            gathered -= zeros.astype(work)
        elif default_zero:
            gathered -= work.type(default_zero)
        scale = take(scales.astype(work, copy=False), blocked=q_axis == g_axis)
        if q_axis != g_axis:
            scale = _expand_blocks(scale, out_q, size, gathered.shape[out_q])
        gathered *= scale
        if not valid.all():
            shape = (1,) * g_axis + index.shape + (1,) * (rank - g_axis - 1)
            gathered *= valid.reshape(shape)
        return gathered.astype(scales.dtype, copy=False)

    return run


# ----------------------------------------------------------------------------- QuantizeLinear / DequantizeLinear


@kernel("QuantizeLinear", 1, domain=_MS)
def quantize_linear(x, y_scale, y_zero_point=None, *, axis=1):
    """Per-tensor or per-axis quantization (the blocked form is the ai.onnx op's, opset 21)."""
    return _quantize(x, y_scale, y_zero_point, axis, 1, 0, 0, 0)


@kernel("DequantizeLinear", 1, domain=_MS)
def dequantize_linear(x, x_scale, x_zero_point=None, *, axis=1):
    return _dequantize(x, x_scale, x_zero_point, axis, 0, 0)
