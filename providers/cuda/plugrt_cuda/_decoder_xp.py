"""The LLM decoder's kernel math over an array namespace ``xp`` (numpy here, cupy on a GPU):
RMS normalisation, rotary embedding, grouped-query attention over a fixed-capacity cache,
and the block-quantized MatMulNBits.

Everything a decode step reads from device memory (``seqlens_k``, position ids) stays an
array: nothing is copied to the host, so a step can be recorded in a CUDA graph and
replayed while those values change. Shapes come from the arrays' shapes only.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = [
    "rms_normalization",
    "skip_rms_normalization",
    "rotate",
    "rotary_embedding",
    "group_query_attention",
    "unpack_nbits",
    "dequantize_nbits",
    "int8_blocks",
]

MatMul = Callable[[Any, Any], Any]
Softmax = Callable[[Any], Any]


def rms_normalization(xp: Any, x: Any, scale: Any, *, epsilon: float) -> tuple[Any, Any]:
    """SimplifiedLayerNormalization over the last axis, statistics in float32 whatever x's
    dtype: (y in x's dtype, inv_std_var in float32)."""
    x32 = x.astype(xp.float32)
    inv_std = 1.0 / xp.sqrt((x32 * x32).mean(axis=-1, keepdims=True) + xp.float32(epsilon))
    y = x32 * inv_std * scale.astype(xp.float32)
    return y.astype(x.dtype), inv_std.astype(xp.float32)


def skip_rms_normalization(
    xp: Any, x: Any, skip: Any, gamma: Any, bias: Any = None, *, epsilon: float
) -> tuple[Any, Any, Any, Any]:
    """SkipSimplifiedLayerNormalization: (y, mean, inv_std_var, x + skip (+ bias)); the sum is
    formed in float32 and normalised before it is rounded to x's dtype (the residual stream)."""
    total = x.astype(xp.float32) + skip.astype(xp.float32)
    if bias is not None:
        total = total + bias.astype(xp.float32)
    inv_std = 1.0 / xp.sqrt((total * total).mean(axis=-1, keepdims=True) + xp.float32(epsilon))
    y = total * inv_std * gamma.astype(xp.float32)
    mean = total.mean(axis=-1, keepdims=True)
    return y.astype(x.dtype), mean, inv_std, total.astype(x.dtype)


def rotate(xp: Any, x: Any, cos: Any, sin: Any, interleaved: bool) -> Any:
    """Rotary embedding of ``x`` (..., D) by ``cos``/``sin`` (..., R/2) broadcast against it:
    the first R channels rotate in pairs (adjacent when ``interleaved``, the two halves
    otherwise), the rest pass through. Computed in float32, returned in x's dtype."""
    half = cos.shape[-1]
    rotary = 2 * half
    x32 = x.astype(xp.float32)
    cos, sin = cos.astype(xp.float32), sin.astype(xp.float32)
    if interleaved:
        first, second = x32[..., 0:rotary:2], x32[..., 1:rotary:2]
        pairs = xp.stack([first * cos - second * sin, first * sin + second * cos], axis=-1)
        rotated = pairs.reshape(pairs.shape[:-2] + (rotary,))
    else:
        first, second = x32[..., :half], x32[..., half:rotary]
        rotated = xp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
    if rotary < x.shape[-1]:
        rotated = xp.concatenate([rotated, x32[..., rotary:]], axis=-1)
    return rotated.astype(x.dtype)


def _cache_rows(xp: Any, cache: Any, positions: Any) -> Any:
    """Rows of a (max positions, R/2) cos/sin cache for integer ``positions`` (any shape);
    positions past the cache read its last row (a device kernel cannot raise)."""
    index = xp.clip(positions.astype(xp.int64), 0, cache.shape[0] - 1)
    return xp.take(cache, index, axis=0)


def rotary_embedding(
    xp: Any, x: Any, position_ids: Any, cos_cache: Any, sin_cache: Any, *, interleaved: bool, num_heads: int,
    rotary_embedding_dim: int,
) -> Any:
    """com.microsoft RotaryEmbedding of x (B, S, hidden) or (B, N, S, D)."""
    if x.ndim == 4:
        batch, _, seq, size = x.shape
        heads = x.transpose(0, 2, 1, 3)  # (B, S, N, D)
    else:
        batch, seq, hidden = x.shape
        size = hidden // num_heads if num_heads else (rotary_embedding_dim or 2 * cos_cache.shape[-1])
        heads = x.reshape(batch, seq, hidden // size, size)
    if position_ids.size == 1:  # one offset: token s sits at offset + s
        positions = position_ids.reshape(1, 1) + xp.arange(seq, dtype=xp.int64)[None, :]
    else:
        positions = position_ids.reshape(batch, seq)
    half = (rotary_embedding_dim or size) // 2
    cos = _cache_rows(xp, cos_cache[:, :half], positions)[:, :, None]  # (B or 1, S, 1, R/2)
    sin = _cache_rows(xp, sin_cache[:, :half], positions)[:, :, None]
    out = rotate(xp, heads, cos, sin, interleaved)
    if x.ndim == 4:
        return xp.ascontiguousarray(out.transpose(0, 2, 1, 3))
    return out.reshape(x.shape)


def group_query_attention(
    xp: Any,
    query: Any,
    key: Any,
    value: Any,
    past_key: Any,
    past_value: Any,
    seqlens_k: Any,
    cos_cache: Any,
    sin_cache: Any,
    position_ids: Any,
    *,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
    do_rotary: bool,
    interleaved: bool,
    window: int,
    softcap: float,
    matmul: MatMul,
    softmax: Softmax,
    in_place: bool = False,
) -> tuple[Any, Any, Any]:
    """Causal grouped-query attention with the cache in one fixed-capacity buffer per K/V:
    (output (B, S, N*D), present_key, present_value (B, Nkv, C, D)).

    The valid length of batch entry b after the step is ``seqlens_k[b] + 1``; the step's S
    tokens go at positions ``[seqlens_k[b] + 1 - S, seqlens_k[b] + 1)`` (a first prompt
    starts at 0), the past below them is kept, the rest of the buffer is zero. C is the
    past buffer's length (S without a past). Attention runs over all C positions with the
    invalid ones masked, so the work is the same every step and the step can be captured.
    ``in_place``: the presents are the past buffers themselves, updated where they are (a
    binding that carries the cache in and out; only the new rows and the stale tail are written).
    """
    batch, seq, hidden = query.shape
    if key is None:  # packed QKV
        size = hidden // (num_heads + 2 * kv_num_heads)
        packed = query.reshape(batch, seq, num_heads + 2 * kv_num_heads, size)
        q = packed[:, :, :num_heads]
        k = packed[:, :, num_heads:num_heads + kv_num_heads]
        v = packed[:, :, num_heads + kv_num_heads:]
    else:
        size = hidden // num_heads
        q = query.reshape(batch, seq, num_heads, size)
        k = key.reshape(batch, seq, kv_num_heads, size)
        v = value.reshape(batch, seq, kv_num_heads, value.shape[-1] // kv_num_heads)
    dtype = query.dtype
    lengths = seqlens_k.reshape(-1).astype(xp.int64) + 1  # (B,) valid after this step
    starts = xp.maximum(lengths - seq, 0)  # where this step's tokens go
    steps = xp.arange(seq, dtype=xp.int64)
    positions = starts[:, None] + steps[None, :]  # (B, S)
    if do_rotary:
        rows = positions if position_ids is None else position_ids.reshape(batch, seq)
        cos = _cache_rows(xp, cos_cache, rows)[:, :, None]  # (B, S, 1, R/2)
        sin = _cache_rows(xp, sin_cache, rows)[:, :, None]
        q = rotate(xp, q, cos, sin, interleaved)
        k = rotate(xp, k, cos, sin, interleaved)
    present_k = _write_cache(xp, past_key, k, starts, positions, kv_num_heads, dtype, in_place)
    present_v = _write_cache(xp, past_value, v, starts, positions, kv_num_heads, dtype, in_place)
    capacity = present_k.shape[2]
    group = num_heads // kv_num_heads
    # (B, Nkv, G*S, D): head n = kv * G + g, as the cache's heads are shared
    queries = (q.astype(xp.float32) * xp.float32(scale)).astype(dtype)
    queries = xp.ascontiguousarray(queries.reshape(batch, seq, kv_num_heads, group, size).transpose(0, 2, 3, 1, 4))
    queries = queries.reshape(batch, kv_num_heads, group * seq, size)
    scores = matmul(queries, xp.ascontiguousarray(present_k.transpose(0, 1, 3, 2))).astype(xp.float32)
    scores = scores.reshape(batch, kv_num_heads, group, seq, capacity)
    if softcap > 0:
        scores = xp.tanh(scores / xp.float32(softcap)) * xp.float32(softcap)
    keys = xp.arange(capacity, dtype=xp.int64)
    allowed = (keys[None, None, :] <= positions[:, :, None]) & (keys[None, None, :] < lengths[:, None, None])
    if window > 0:
        allowed = allowed & (keys[None, None, :] > positions[:, :, None] - window)
    scores = xp.where(allowed[:, None, None], scores, xp.float32(-xp.inf))
    probs = softmax(xp.ascontiguousarray(scores)).reshape(batch, kv_num_heads, group * seq, capacity)
    context = matmul(probs.astype(dtype), present_v)  # (B, Nkv, G*S, D)
    context = context.reshape(batch, kv_num_heads, group, seq, size).transpose(0, 3, 1, 2, 4)
    return xp.ascontiguousarray(context).reshape(batch, seq, num_heads * size).astype(dtype), present_k, present_v


def _write_cache(
    xp: Any, past: Any, new: Any, starts: Any, positions: Any, heads: int, dtype: Any, in_place: bool
) -> Any:
    """present: the past's first ``starts[b]`` positions, the new tokens (B, S, Nkv, D) at
    ``positions``, zeros after; a new buffer unless ``in_place`` (then the past buffer
    itself, which must hold ``dtype``; otherwise the past, possibly the caller's, is not written)."""
    batch, seq, _, size = new.shape
    if past is None:
        present = xp.zeros((batch, heads, seq, size), dtype)
    else:
        keep = xp.arange(past.shape[2], dtype=xp.int64)[None, :] < starts[:, None]  # (B, C)
        if in_place and past.dtype == dtype:
            present = past
            xp.copyto(present, xp.zeros((), dtype), where=~keep[:, None, :, None])  # NaN-safe, unlike a product
        else:
            present = xp.where(keep[:, None, :, None], past.astype(dtype), xp.zeros((), dtype))
    rows = xp.broadcast_to(xp.arange(batch, dtype=xp.int64)[:, None], (batch, seq))
    at = xp.clip(positions, 0, present.shape[2] - 1)  # a device kernel cannot raise: never write outside
    present[rows, :, at] = new.astype(dtype)
    return present


def unpack_nbits(xp: Any, packed: Any, bits: int) -> Any:
    """uint8 (..., n) holding 8/bits values per byte, low-order bits first -> uint8 (..., n * 8/bits)."""
    if bits == 8:
        return packed
    per_byte = 8 // bits
    values = [(packed >> (i * bits)) & ((1 << bits) - 1) for i in range(per_byte)]
    stacked = xp.stack(values, axis=-1).astype(xp.uint8)
    return stacked.reshape(packed.shape[:-1] + (packed.shape[-1] * per_byte,))


def dequantize_nbits(
    xp: Any, b: Any, scales: Any, zero_points: Any, *, n: int, k: int, bits: int, block_size: int
) -> Any:
    """The (K, N) float32 weight of MatMulNBits' packed ``b`` (N, blocks, blob). Only the
    numpy backend calls this (per run, for testing); on a GPU the kernel dequantizes tiles."""
    blocks = -(-k // block_size)
    q = unpack_nbits(xp, b.reshape(n, blocks, block_size * bits // 8), bits).reshape(n, blocks, block_size)
    scale = scales.reshape(n, blocks).astype(xp.float32)
    if zero_points is None:
        zero = xp.full((n, blocks), float(1 << (bits - 1)), xp.float32)
    elif zero_points.dtype == xp.uint8:
        zero = unpack_nbits(xp, zero_points.reshape(n, -1), bits)[:, :blocks].astype(xp.float32)
    else:
        zero = zero_points.reshape(n, blocks).astype(xp.float32)
    weight = (q.astype(xp.float32) - zero[..., None]) * scale[..., None]
    return xp.ascontiguousarray(weight.reshape(n, blocks * block_size)[:, :k].T)


def int8_blocks(xp: Any, a: Any, block_size: int) -> Any:
    """A (float32) quantized to int8 and back symmetrically per block of ``block_size`` along
    K (scale = max |a| / 127 over the block): the activations onnxruntime multiplies with
    at MatMulNBits' accuracy_level 4, so greedy decoding picks the tokens it picks."""
    k = a.shape[-1]
    blocks = -(-k // block_size)
    if k != blocks * block_size:  # zeros change neither a block's peak nor its products
        widths = [(0, 0)] * (a.ndim - 1) + [(0, blocks * block_size - k)]
        a = xp.pad(a, widths, mode="constant")
    grouped = a.reshape(a.shape[:-1] + (blocks, block_size))
    peak = xp.abs(grouped).max(axis=-1, keepdims=True)
    scale = peak / xp.float32(127)
    inverse = xp.where(peak != 0, xp.float32(127) / xp.where(peak != 0, peak, xp.float32(1)), xp.float32(0))
    quantized = xp.clip(xp.rint(grouped * inverse), -128, 127) * scale
    return quantized.reshape(a.shape)[..., :k].astype(xp.float32)
