"""The LLM decoder's ops on the CUDA provider: GroupQueryAttention, MatMulNBits,
(Skip)SimplifiedLayerNormalization, RotaryEmbedding, and the int64 shape arithmetic
(Shape resolved once per input shape, integer Add/Sub/Mul/ReduceSum on the device), so
that a builder-made decoder's step places on the provider whole and is captured whole."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import numpy as np

from . import _decoder_xp
from ._backend import CupyBackend
from ._decoder_sources import NBITS_COLUMNS_PER_BLOCK
from ._ops import OPS, OpInfo, _op

__all__ = ["MS_DOMAIN", "INTEGER_DTYPES"]

MS_DOMAIN = "com.microsoft"
#: integer element types the shape arithmetic runs on
INTEGER_DTYPES = ("int32", "int64")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- normalisation -------------------------------------------------------------------------

def _check_simplified(info: OpInfo) -> str | None:
    axis = int(info.attributes.get("axis", -1))
    if axis != -1:
        return f"SimplifiedLayerNormalization over axis={axis}: the CUDA provider normalises the last axis (-1) only"
    stash = int(info.attributes.get("stash_type", 1))
    return None if stash == 1 else f"SimplifiedLayerNormalization stash_type={stash} (only 1, float32 statistics)"


def _check_hidden(name: str, value: Any, hidden: int) -> None:
    if value is not None and value.shape[-1:] != (hidden,):
        raise ValueError(f"{name} must have shape ({hidden},) to match the hidden size, got {tuple(value.shape)}")


@_op("SimplifiedLayerNormalization", check=_check_simplified)  # onnxruntime's: the default domain
def _simplified_layer_normalization(info: OpInfo) -> Callable[..., Any]:
    xp, epsilon, outputs = info.backend.xp, float(info.attributes.get("epsilon", 1e-5)), info.num_outputs

    def run(x: Any, scale: Any) -> Any:
        _check_hidden("scale", scale, x.shape[-1])
        y, inv_std = _decoder_xp.rms_normalization(xp, x, scale, epsilon=epsilon)
        return (y, inv_std) if outputs > 1 else y

    run.multi_output = outputs > 1  # type: ignore[attr-defined]
    return run


@_op("SkipSimplifiedLayerNormalization", domain=MS_DOMAIN, multi_output=True)
def _skip_simplified_layer_normalization(info: OpInfo) -> Callable[..., Any]:
    xp, epsilon = info.backend.xp, float(info.attributes.get("epsilon", 1e-12))

    def run(x: Any, skip: Any, gamma: Any, bias: Any = None) -> tuple:
        hidden = x.shape[-1]
        _check_hidden("gamma", gamma, hidden)
        _check_hidden("bias", bias, hidden)
        if skip.shape[-1:] != (hidden,):
            raise ValueError(f"skip must end in the hidden size {hidden}, got shape {tuple(skip.shape)}")
        return _decoder_xp.skip_rms_normalization(xp, x, skip, gamma, bias, epsilon=epsilon)

    return run


# -- rotary embedding and attention ----------------------------------------------------------

def _check_rotary(info: OpInfo) -> str | None:
    if int(info.attributes.get("is_packed_batching", 0)):
        return "RotaryEmbedding with is_packed_batching=1 is not implemented on CUDA"
    return None


@_op("RotaryEmbedding", domain=MS_DOMAIN, check=_check_rotary)
def _rotary_embedding(info: OpInfo) -> Callable[..., Any]:
    xp, a = info.backend.xp, info.attributes
    interleaved, heads, dim = bool(a.get("interleaved", 0)), int(a.get("num_heads", 0)), int(a.get("rotary_embedding_dim", 0))

    def run(x: Any, position_ids: Any, cos_cache: Any, sin_cache: Any) -> Any:
        if x.ndim not in (3, 4):
            raise ValueError(f"RotaryEmbedding expects a 3-D or 4-D input, got shape {tuple(x.shape)}")
        if x.ndim == 3 and not heads and not dim and x.shape[-1] % (2 * cos_cache.shape[-1]):
            raise ValueError(f"hidden size {x.shape[-1]} is not a multiple of the head size; set num_heads")
        return _decoder_xp.rotary_embedding(
            xp, x, position_ids, cos_cache, sin_cache, interleaved=interleaved, num_heads=heads,
            rotary_embedding_dim=dim,
        )

    return run


def _check_group_query_attention(info: OpInfo) -> str | None:
    a = info.attributes
    heads, kv_heads = int(a.get("num_heads", 0)), int(a.get("kv_num_heads", 0))
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        return f"GroupQueryAttention needs num_heads ({heads}) a positive multiple of kv_num_heads ({kv_heads})"
    for name in ("k_quant_type", "v_quant_type"):
        if _text(a.get(name, "NONE")) != "NONE":
            return f"GroupQueryAttention with a quantized KV cache ({name}) is not implemented on CUDA"
    for name in ("sliding_window_cache", "qk_output"):
        if int(a.get(name, 0)):
            return f"GroupQueryAttention with {name}=1 is not implemented on CUDA"
    if int(a.get("smooth_softmax", -1)) == 1:
        return "GroupQueryAttention with smooth_softmax=1 is not implemented on CUDA"
    if int(a.get("causal", 1)) != 1:
        return "GroupQueryAttention with causal=0 is not implemented on CUDA"
    if info.num_inputs > 10:
        return "GroupQueryAttention's attention_bias, head_sink, scale and norm inputs are not implemented on CUDA"
    return None


@_op("GroupQueryAttention", domain=MS_DOMAIN, multi_output=True, check=_check_group_query_attention)
def _group_query_attention(info: OpInfo) -> Callable[..., Any]:
    backend, a = info.backend, info.attributes
    xp = backend.xp
    heads, kv_heads = int(a["num_heads"]), int(a["kv_num_heads"])
    options: dict[str, Any] = {
        "num_heads": heads,
        "kv_num_heads": kv_heads,
        "do_rotary": bool(a.get("do_rotary", 0)),
        "interleaved": bool(a.get("rotary_interleaved", 0)),
        "window": int(a.get("local_window_size", -1)),
        "softcap": float(a.get("softcap", 0.0) or 0.0),
    }
    scale_attr = float(a.get("scale", 0.0) or 0.0)

    def softmax(scores: Any) -> Any:
        return backend.softmax(scores, -1, False, False)

    def run(
        query: Any, key: Any = None, value: Any = None, past_key: Any = None, past_value: Any = None,
        seqlens_k: Any = None, total_sequence_length: Any = None, cos_cache: Any = None, sin_cache: Any = None,
        position_ids: Any = None, *, in_place: bool = False,
    ) -> tuple:
        # total_sequence_length is not read: the buffer's capacity is the past's length, and
        # reading a device value on the host would stall the stream and break capture
        if seqlens_k is None:
            raise ValueError("GroupQueryAttention needs the seqlens_k input")
        if (past_key is None) != (past_value is None):
            raise ValueError("past_key and past_value must be given together")
        if query.ndim != 3:
            raise ValueError(f"query must be 3-D (B, S, hidden), got shape {tuple(query.shape)}")
        batch, seq, hidden = query.shape
        if key is None:
            if value is not None:
                raise ValueError("packed QKV (no key input) takes no value input")
            if hidden % (heads + 2 * kv_heads):
                raise ValueError(f"packed QKV width {hidden} is not a multiple of num_heads + 2 * kv_num_heads")
            size = hidden // (heads + 2 * kv_heads)
        else:
            if value is None:
                raise ValueError("GroupQueryAttention needs a value input with a key input")
            if key.shape[:2] != (batch, seq):
                raise ValueError(f"key {tuple(key.shape)} must have the query's batch and length {(batch, seq)}")
            size = hidden // heads
        if seqlens_k.size != batch:
            raise ValueError(f"seqlens_k has {seqlens_k.size} entries for batch {batch}")
        if past_key is not None and (past_key.ndim != 4 or past_key.shape[1] != kv_heads or past_key.shape[3] != size):
            raise ValueError(f"past_key must be (B, {kv_heads}, capacity, {size}), got {tuple(past_key.shape)}")
        if options["do_rotary"] and (cos_cache is None or sin_cache is None):
            raise ValueError("do_rotary=1 needs the cos_cache and sin_cache inputs")
        if options["do_rotary"] and 2 * cos_cache.shape[-1] > size:
            raise ValueError(f"rotary dimension {2 * cos_cache.shape[-1]} (2 x cos_cache's last) exceeds head size {size}")
        return _decoder_xp.group_query_attention(
            xp, query, key, value, past_key, past_value, seqlens_k, cos_cache, sin_cache, position_ids,
            scale=scale_attr or 1 / math.sqrt(size), matmul=backend.matmul, softmax=softmax, in_place=in_place,
            **options,
        )

    # A capture whose binding carries a cache in and out (past_present_share_buffer) runs
    # this variant: the presents are the past buffers, updated in place, so a decode step
    # writes its new rows instead of copying the whole cache twice (once here, once into
    # the binding). {output index: input index}, as the CPU provider declares it.
    run.in_place = functools.partial(run, in_place=True)  # type: ignore[attr-defined]
    run.writes_over_inputs = {1: 3, 2: 4}  # type: ignore[attr-defined]
    return run


# -- MatMulNBits -----------------------------------------------------------------------------

def _check_matmul_nbits(info: OpInfo) -> str | None:
    a = info.attributes
    missing = [name for name in ("N", "K", "block_size") if name not in a]
    if missing:
        return f"MatMulNBits needs the {', '.join(missing)} attribute(s)"
    bits, block_size = int(a.get("bits", 4)), int(a["block_size"])
    if bits != 4:
        return f"MatMulNBits with bits={bits}: the CUDA provider's kernel reads 4-bit weights only"
    if block_size < 16 or block_size & (block_size - 1):
        return f"MatMulNBits' block_size must be a power of 2 of at least 16, got {block_size}"
    if int(a.get("weight_prepacked", 0)):
        return "MatMulNBits with weight_prepacked=1 is another provider's layout"
    return None


@_op("MatMulNBits", domain=MS_DOMAIN, check=_check_matmul_nbits)
def _matmul_nbits(info: OpInfo) -> Callable[..., Any]:
    backend, a = info.backend, info.attributes
    xp = backend.xp
    n, k, block_size = int(a["N"]), int(a["K"]), int(a["block_size"])
    blocks = -(-k // block_size)
    int8_activations = int(a.get("accuracy_level", 0)) == 4
    device = backend if isinstance(backend, CupyBackend) else None

    def run(x: Any, b: Any, scales: Any, zero_points: Any = None, g_idx: Any = None, bias: Any = None) -> Any:
        if g_idx is not None and g_idx.size:
            raise ValueError("MatMulNBits' g_idx input (act-order blocks) is not implemented on CUDA; requantize without it")
        if x.shape[-1:] != (k,):
            raise ValueError(f"A's last dimension must be K={k}, got shape {tuple(x.shape)}")
        if b.dtype != xp.uint8 or b.size != n * blocks * block_size // 2:
            raise ValueError(f"B must be uint8 of shape ({n}, {blocks}, {block_size // 2}), got {b.dtype} {tuple(b.shape)}")
        if scales.size != n * blocks:
            raise ValueError(f"scales must hold N x k_blocks = {n} x {blocks} values, got shape {tuple(scales.shape)}")
        rows = x.reshape(-1, k)
        # onnxruntime keeps float activations when the zero points are floats
        if int8_activations and (zero_points is None or zero_points.dtype == xp.uint8):
            rows = _decoder_xp.int8_blocks(xp, rows.astype(xp.float32), block_size).astype(x.dtype)
        if device is not None:
            y = _nbits_kernel(device, rows, b, scales, zero_points, bias, n, k, block_size, blocks)
        else:  # the numpy test double: the same arithmetic with the weight dequantized per call
            w = _decoder_xp.dequantize_nbits(xp, b, scales, zero_points, n=n, k=k, bits=4, block_size=block_size)
            y = xp.matmul(rows.astype(xp.float32), w)
            if bias is not None:
                y = y + bias.astype(xp.float32)
        return y.astype(x.dtype).reshape(x.shape[:-1] + (n,))

    return run


def _nbits_kernel(
    backend: CupyBackend, rows: Any, b: Any, scales: Any, zero_points: Any, bias: Any, n: int, k: int,
    block_size: int, blocks: int,
) -> Any:
    """MatMulNBits on the GPU: the kernel reads the packed weight and dequantizes in registers."""
    cp = backend.xp
    dtype = rows.dtype
    m = rows.shape[0]
    out = cp.empty((m, n), dtype)
    if m == 0:
        return out
    rows = cp.ascontiguousarray(rows)
    kind = 0 if zero_points is None else (1 if zero_points.dtype == cp.uint8 else 2)
    packed_zero = cp.ascontiguousarray(zero_points) if kind == 1 else b
    float_zero = cp.ascontiguousarray(zero_points, dtype=dtype) if kind == 2 else out
    bias_arg = cp.ascontiguousarray(bias, dtype=dtype) if bias is not None else out
    fn = backend.kernel("matmul_nbits", dtype, "matmul_nbits4")
    grid = (-(-n // NBITS_COLUMNS_PER_BLOCK), m)
    fn(grid, (32 * NBITS_COLUMNS_PER_BLOCK,), (
        rows, cp.ascontiguousarray(b), cp.ascontiguousarray(scales, dtype=dtype), packed_zero, float_zero, bias_arg,
        out, cp.int32(m), cp.int32(n), cp.int32(k), cp.int32(block_size), cp.int32(blocks), cp.int32(kind),
        cp.int32(bias is not None),
    ))
    return out


# -- int64 shape arithmetic ------------------------------------------------------------------

#: distinct input shapes a Shape node keeps device arrays for (a session sees a handful)
_SHAPES_KEPT = 64


@_op("Shape", math=False)
def _shape(info: OpInfo) -> Callable[..., Any]:
    """The shape as a device array made once per input shape: the first run (a capture's
    warm-up) copies it up, later runs and the recording return that array, so the op
    needs no host-to-device copy under capture. Consumers only read it."""
    xp = info.backend.xp
    start, end = info.attributes.get("start", 0), info.attributes.get("end")
    made: dict[tuple[int, ...], Any] = {}

    def run(x: Any) -> Any:
        dims = tuple(int(d) for d in x.shape[slice(start, end)])
        found = made.get(dims)
        if found is None:
            if len(made) >= _SHAPES_KEPT:
                made.clear()  # a graph that still reads an older array keeps it alive itself
            found = made[dims] = xp.asarray(np.asarray(dims, dtype=np.int64))
        return found

    return run


def _register_integer_arithmetic() -> None:
    """Add, Sub, Mul and ReduceSum also on int32/int64: the decoder's valid lengths
    (ReduceSum of the attention mask, minus one) are computed where the mask lives."""
    for op in ("Add", "Sub", "Mul", "ReduceSum"):
        OPS[("", op)] = dataclasses.replace(OPS[("", op)], integers=True)


_register_integer_arithmetic()
