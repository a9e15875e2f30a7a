"""com.microsoft attention kernels: GroupQueryAttention, MultiHeadAttention, Attention, RotaryEmbedding."""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np
from plugrt.threads import PARALLEL_MIN_WORK, threads_for

from .._registry import KernelContext, declare_into, kernel, kernel_builder
from ._compiled_parallel import compiled_pool
from .attention import _grouped_matmul, _merge_heads, _split_heads
from .contrib_normalization import decode_loops
from .elementwise import scratch

_MS = "com.microsoft"
_DEFAULT_MASK_FILTER = -10000.0


def _rotary_factors(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> tuple[int, int, np.ndarray, np.ndarray]:
    """Half the rotary dimension, the rotary dimension (2 x cos's last axis, checked against
    x's head size) and cos/sin in x's dtype."""
    half = cos.shape[-1]
    rotary = 2 * half
    if rotary > x.shape[-1]:
        raise ValueError(f"rotary dimension {rotary} (2 x cos_cache's last dimension) exceeds head size {x.shape[-1]}")
    return half, rotary, cos.astype(x.dtype, copy=False), sin.astype(x.dtype, copy=False)


def _rotate(
    x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool
) -> np.ndarray:
    """Rotary embedding of x (..., seq, size) with cos/sin (..., seq, rotary/2) broadcast over heads.

    The first ``rotary`` channels of each head rotate in pairs (adjacent pairs when
    ``interleaved``, the two halves otherwise); the rest pass through.
    """
    half, rotary, cos, sin = _rotary_factors(x, cos, sin)
    out = x.copy()
    if interleaved:
        first, second = x[..., 0:rotary:2], x[..., 1:rotary:2]
        out[..., 0:rotary:2] = first * cos - second * sin
        out[..., 1:rotary:2] = first * sin + second * cos
    else:
        first, second = x[..., :half], x[..., half:rotary]
        out[..., :half] = first * cos - second * sin
        out[..., half:rotary] = first * sin + second * cos
    return out


def _check_positions(positions: np.ndarray, rows: int, name: str) -> None:
    """A clear error when integer ``positions`` fall outside a cos/sin cache of ``rows`` rows."""
    if positions.size and (positions.min() < 0 or positions.max() >= rows):
        raise ValueError(
            f"position ids range over [{positions.min()}, {positions.max()}] but {name} has "
            f"{rows} rows; build the cache for the longest sequence the model will see"
        )


def _cache_rows(cache: np.ndarray, positions: np.ndarray, name: str) -> np.ndarray:
    """cos/sin cache rows for integer ``positions``, with a clear error when out of range."""
    positions = np.asarray(positions, dtype=np.int64)
    _check_positions(positions, cache.shape[0], name)
    return cache[positions]


# ----------------------------------------------------------------------------- RotaryEmbedding


@kernel("RotaryEmbedding", 1, domain=_MS)
def rotary_embedding(
    x,
    position_ids,
    cos_cache,
    sin_cache,
    *,
    interleaved=0,
    num_heads=0,
    rotary_embedding_dim=0,
    is_packed_batching=0,
    scale=1.0,
):
    if is_packed_batching:
        raise ValueError("RotaryEmbedding with is_packed_batching=1 is not supported on the CPU provider")
    if x.ndim == 4:  # (batch, heads, seq, size)
        batch, _, seq, size = x.shape
        heads = x
    elif x.ndim == 3:
        batch, seq, hidden = x.shape
        if num_heads:
            size = hidden // num_heads
        else:
            # without num_heads the head size follows from a full-width cos cache
            size = rotary_embedding_dim or 2 * cos_cache.shape[-1]
        if not size or hidden % size:
            raise ValueError(f"hidden size {hidden} is not a multiple of the head size {size}; set num_heads")
        heads = x.reshape(batch, seq, hidden // size, size).transpose(0, 2, 1, 3)
    else:
        raise ValueError(f"RotaryEmbedding expects a 3-D or 4-D input, got rank {x.ndim}")
    position_ids = np.asarray(position_ids, dtype=np.int64)
    if position_ids.size == 1 and position_ids.ndim <= 1:
        # one offset: token s of every sequence sits at offset + s
        positions = position_ids.reshape(()) + np.arange(seq)[None, :]
        positions = np.broadcast_to(positions, (batch, seq))
    elif position_ids.shape == (batch, seq):
        positions = position_ids
    else:
        raise ValueError(f"position_ids must have shape (1,) or ({batch}, {seq}), got {position_ids.shape}")
    half = (rotary_embedding_dim or size) // 2
    if cos_cache.shape[-1] < half:
        raise ValueError(f"cos_cache's last dimension {cos_cache.shape[-1]} is below rotary_embedding_dim/2 = {half}")
    cos = _cache_rows(cos_cache[:, :half], positions, "cos_cache")[:, None]  # (batch, 1, seq, half)
    sin = _cache_rows(sin_cache[:, :half], positions, "sin_cache")[:, None]
    out = _rotate(heads, cos, sin, bool(interleaved))
    if x.ndim == 3:
        out = out.transpose(0, 2, 1, 3).reshape(x.shape)
    return out


# ----------------------------------------------------------------------------- shared attention core


def _softmax_rows(scores: np.ndarray, sink: np.ndarray | None = None) -> np.ndarray:
    """Softmax over the last axis, in place; ``sink`` (broadcastable to the row max) adds
    exp(sink) to each denominator (smooth softmax / attention sinks)."""
    # the ufuncs' own reductions: np.max and np.sum without their Python-level wrappers
    row_max = np.maximum.reduce(scores, axis=-1, keepdims=True)
    if sink is not None:
        row_max = np.maximum(row_max, sink)
    np.subtract(scores, row_max, out=scores)
    np.exp(scores, out=scores)
    total = np.add.reduce(scores, axis=-1, keepdims=True)
    if sink is not None:
        total += np.exp(sink - row_max)
    scores /= total
    return scores


def _masked_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    additive: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """softmax(scale * q k^T + additive) v for (B, H, S, D) inputs; returns (output, raw scores, probs)."""
    scores = _grouped_matmul(q * q.dtype.type(scale), np.swapaxes(k, -1, -2))
    raw = scores
    if additive is not None:
        scores = scores + additive
    else:
        scores = scores.copy()
    probs = _softmax_rows(scores)
    return _grouped_matmul(probs, v), raw, probs


def _attend(q, k, v, padding_mask, past_length, unidirectional, attention_bias, filter_value, scale_attr):
    """Attention over (B, N, S, D) heads with the padding mask, the causal mask when
    ``unidirectional`` and an additive bias; returns what _masked_attention returns."""
    batch, _, seq, head_size = q.shape
    total = k.shape[2]
    dtype = q.dtype
    additive = _padding_mask_additive(padding_mask, batch, seq, past_length, total, filter_value, dtype)
    if unidirectional:
        additive = _add(additive, _causal_additive(seq, past_length, total, filter_value, dtype))
    if attention_bias is not None:
        additive = _add(additive, attention_bias.astype(dtype, copy=False))
    scale = scale_attr or 1 / np.sqrt(head_size)
    return _masked_attention(q, k, v, scale, additive)


def _padding_mask_additive(
    mask: np.ndarray | None,
    batch: int,
    seq: int,
    past: int,
    total: int,
    filter_value: float,
    dtype: np.dtype,
) -> np.ndarray | None:
    """An additive (B, 1, S, T) term for an Attention mask_index / MultiHeadAttention key
    padding mask, in every layout onnxruntime accepts (see ContribOperators.md)."""
    if mask is None:
        return None
    keys = np.arange(total)
    if mask.ndim == 1 and mask.shape[0] == batch:  # right padding: valid lengths
        allowed = keys[None, :] < mask.astype(np.int64)[:, None]
        allowed = allowed[:, None, None, :]
    elif mask.ndim == 1 and mask.shape[0] == 2 * batch:  # left padding: exclusive ends, then starts
        ends = mask[:batch].astype(np.int64)[:, None]
        starts = mask[batch:].astype(np.int64)[:, None]
        allowed = ((keys[None, :] < ends) & (keys[None, :] >= starts))[:, None, None, :]
    elif mask.ndim == 2 and mask.shape[0] == batch and mask.shape[1] in (total, total - past):
        if mask.shape[1] != total:  # a mask over the new keys only: the past is always attended
            mask = np.concatenate([np.ones((batch, past), mask.dtype), mask], axis=1)
        allowed = (mask != 0)[:, None, None, :]
    elif mask.ndim == 3 and mask.shape == (batch, seq, total):
        allowed = (mask != 0)[:, None]
    elif mask.ndim == 4 and mask.shape[0] == batch and mask.shape[1] == 1:
        # (B, 1, max, max) with the max-length causal layout: take our window of it
        if mask.shape[2] < past + seq or mask.shape[3] < total:
            raise ValueError(f"4-D mask of shape {mask.shape} is too small for {past + seq} queries over {total} keys")
        allowed = mask[:, :, past:past + seq, :total] != 0
    else:
        raise ValueError(
            f"mask of shape {mask.shape} is not one of (B,), (2B,), (B, T), (B, S, T), (B, 1, M, M) "
            f"for batch {batch}, sequence {seq}, total length {total}"
        )
    return np.where(allowed, dtype.type(0), dtype.type(filter_value))


def _causal_additive(seq: int, past: int, total: int, filter_value: float, dtype: np.dtype) -> np.ndarray:
    """(S, T) additive term masking keys after each query's own position (query i sits at past + i)."""
    future = np.arange(total)[None, :] > (past + np.arange(seq))[:, None]
    return np.where(future, dtype.type(filter_value), dtype.type(0))


def _add(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    if a is None:
        return b
    if b is None:
        return a
    return a + b


# ----------------------------------------------------------------------------- Attention


@kernel_builder("Attention", 1, domain=_MS, multi_output=True)
def attention(ctx: KernelContext):
    attrs = ctx.attributes
    num_heads = int(attrs["num_heads"]) if "num_heads" in attrs else 0
    if num_heads <= 0:
        raise NotImplementedError("Attention needs a positive num_heads attribute")
    if attrs.get("do_rotary", 0):
        raise NotImplementedError("Attention with do_rotary=1 is not supported on the CPU provider")
    if attrs.get("past_present_share_buffer", 0):
        raise NotImplementedError("Attention with past_present_share_buffer=1 is not supported on the CPU provider")
    unidirectional = bool(attrs.get("unidirectional", 0))
    scale_attr = float(attrs.get("scale", 0.0) or 0.0)
    filter_value = float(attrs.get("mask_filter_value", _DEFAULT_MASK_FILTER))
    sizes = attrs.get("qkv_hidden_sizes")

    def run(x, weights, bias=None, mask_index=None, past=None, attention_bias=None, past_sequence_length=None):
        if x.ndim != 3 or weights.ndim != 2 or weights.shape[0] != x.shape[2]:
            raise ValueError(f"input {x.shape} and weights {weights.shape} must be (B, S, In) and (In, Hq + Hk + Hv)")
        hidden = weights.shape[1]
        if sizes:
            q_size, k_size, v_size = (int(s) for s in sizes)
        else:
            if hidden % 3:
                raise ValueError(f"weights' second dimension {hidden} is not divisible by 3; set qkv_hidden_sizes")
            q_size = k_size = v_size = hidden // 3
        if q_size + k_size + v_size != hidden or q_size != k_size:
            raise ValueError(f"qkv_hidden_sizes {(q_size, k_size, v_size)} do not fit weights of width {hidden}")
        for size in (q_size, v_size):
            if size % num_heads:
                raise ValueError(f"hidden size {size} is not a multiple of num_heads={num_heads}")
        projected = np.matmul(x, weights)  # one BLAS call for Q, K and V
        if bias is not None:
            projected += bias
        q = _split_heads(projected[..., :q_size], num_heads, "Q")
        k = _split_heads(projected[..., q_size:q_size + k_size], num_heads, "K")
        v = _split_heads(projected[..., q_size + k_size:], num_heads, "V")
        past_length = 0
        if past is not None:
            if past.ndim != 5 or past.shape[0] != 2:
                raise ValueError(f"past must be (2, B, N, P, D), got {past.shape}")
            past_length = past.shape[3]
            k = np.concatenate([past[0].astype(k.dtype, copy=False), k], axis=2)
            v = np.concatenate([past[1].astype(v.dtype, copy=False), v], axis=2)
        out, _, _ = _attend(
            q, k, v, mask_index, past_length, unidirectional, attention_bias, filter_value, scale_attr
        )
        present = np.stack([k, v]) if ctx.num_outputs > 1 else None
        return _merge_heads(out), present

    return run


# ----------------------------------------------------------------------------- MultiHeadAttention


def _mha_inputs(
    query: np.ndarray, key: np.ndarray | None, value: np.ndarray | None, bias: np.ndarray | None, num_heads: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """q (B, N, S, D), k and v (B, N, L, D) from MultiHeadAttention's input layouts; the
    flag says whether k/v were given already in BNSH (cross-attention cache) form."""
    if query.ndim == 5:  # packed QKV (B, S, N, 3, D)
        if key is not None or value is not None:
            raise ValueError("packed QKV query (5-D) takes no key or value inputs")
        if bias is not None:
            query = query + bias.reshape(3, num_heads, -1).transpose(1, 0, 2)
        parts = query.transpose(3, 0, 2, 1, 4)  # (3, B, N, S, D)
        return parts[0], parts[1], parts[2], False
    if query.ndim != 3:
        raise ValueError(f"query must be 3-D (B, S, hidden) or 5-D packed QKV, got rank {query.ndim}")
    q_hidden = query.shape[2]
    if key is None:
        raise ValueError("MultiHeadAttention needs key and value unless query is packed QKV")
    if key.ndim == 5:  # packed KV (B, L, N, 2, D)
        if value is not None:
            raise ValueError("packed KV key (5-D) takes no value input")
        if bias is not None:
            query = query + bias[:q_hidden]
            key = key + bias[q_hidden:].reshape(2, num_heads, -1).transpose(1, 0, 2)
        parts = key.transpose(3, 0, 2, 1, 4)
        return _split_heads(query, num_heads, "query"), parts[0], parts[1], False
    if value is None:
        raise ValueError("MultiHeadAttention needs a value input with a 3-D or 4-D key")
    if key.ndim == 4:  # BNSH keys and values, used as they are
        if bias is not None:
            query = query + bias[:q_hidden]
        return _split_heads(query, num_heads, "query"), key, value, True
    if key.ndim != 3 or value.ndim != 3:
        raise ValueError(f"key and value must both be 3-D or 4-D, got ranks {key.ndim}, {value.ndim}")
    if bias is not None:
        k_hidden = key.shape[2]
        query = query + bias[:q_hidden]
        key = key + bias[q_hidden:q_hidden + k_hidden]
        value = value + bias[q_hidden + k_hidden:]
    return (
        _split_heads(query, num_heads, "query"),
        _split_heads(key, num_heads, "key"),
        _split_heads(value, num_heads, "value"),
        False,
    )


@kernel_builder("MultiHeadAttention", 1, domain=_MS, multi_output=True)
def multi_head_attention(ctx: KernelContext):
    attrs = ctx.attributes
    num_heads = int(attrs.get("num_heads", 0))
    if num_heads <= 0:
        raise NotImplementedError("MultiHeadAttention needs a positive num_heads attribute")
    unidirectional = bool(attrs.get("unidirectional", 0))
    scale_attr = float(attrs.get("scale", 0.0) or 0.0)
    filter_value = float(attrs.get("mask_filter_value", _DEFAULT_MASK_FILTER))

    def run(
        query,
        key=None,
        value=None,
        bias=None,
        key_padding_mask=None,
        attention_bias=None,
        past_key=None,
        past_value=None,
        past_sequence_length=None,
        cache_indirection=None,
    ):
        if past_sequence_length is not None or cache_indirection is not None:
            raise ValueError(
                "MultiHeadAttention's past_sequence_length / cache_indirection (beam search) are not supported"
            )
        if (past_key is None) != (past_value is None):
            raise ValueError("past_key and past_value must be given together")
        q, k, v, bnsh = _mha_inputs(query, key, value, bias, num_heads)
        past_length = 0
        if past_key is not None:
            if bnsh:
                raise ValueError("past_key/past_value cannot be combined with 4-D (BNSH) key and value")
            past_length = past_key.shape[2]
            k = np.concatenate([past_key, k], axis=2)
            v = np.concatenate([past_value, v], axis=2)
        out, raw, probs = _attend(
            q, k, v, key_padding_mask, past_length, unidirectional, attention_bias, filter_value, scale_attr
        )
        present_key = k if ctx.num_outputs > 1 else None
        present_value = v if ctx.num_outputs > 2 else None
        qk = raw if ctx.num_outputs > 3 else None
        return _merge_heads(out), present_key, present_value, qk

    return run


# ----------------------------------------------------------------------------- GroupQueryAttention


def _gqa_unsupported(attrs: dict[str, Any]) -> str | None:
    """Why the CPU provider cannot run this GroupQueryAttention node, or None."""
    for name in ("k_quant_type", "v_quant_type"):
        value = attrs.get(name, "NONE")
        value = value.decode() if isinstance(value, bytes) else value
        if value != "NONE":
            return f"GroupQueryAttention with a quantized KV cache ({name}={value}) is not supported"
    if attrs.get("sliding_window_cache", 0):
        return "GroupQueryAttention with sliding_window_cache=1 is not supported"
    if attrs.get("qk_output", 0):
        return "GroupQueryAttention's qk_output is not supported"
    return None


class _GqaWork:
    """GroupQueryAttention's work arrays: the rotated query and key heads (B, S, N + Hkv, D),
    a rotation term (B, S, N + Hkv, D / 2 at most), the scaled queries (B, N, S, D), the
    scores over the whole cache (B, Hkv, G * S, capacity) and the attended values
    (B, Hkv, G * S, D), query heads folded into groups of G per kv head. Scores are
    computed in their leading valid columns only; the capture variant keeps one set per
    output buffer, so a replay allocates none."""

    __slots__ = ("rotated", "term", "queries", "scores", "context")
    _NAMES = ("gqa-rotated", "gqa-term", "gqa-queries", "gqa-scores", "gqa-context")

    def __init__(self, *arrays: np.ndarray):
        self.rotated, self.term, self.queries, self.scores, self.context = arrays

    @staticmethod
    def _shapes(batch: int, num_heads: int, kv_heads: int, seq: int, capacity: int, head_size: int) -> list:
        groups = num_heads // kv_heads
        return [
            (batch, seq, num_heads + kv_heads, head_size),
            (batch, seq, num_heads + kv_heads, head_size // 2),
            (batch, num_heads, seq, head_size),
            (batch, kv_heads, groups * seq, capacity),
            (batch, kv_heads, groups * seq, head_size),
        ]

    @classmethod
    def allocate(cls, dtype: np.dtype, *geometry: int) -> "_GqaWork":
        return cls(*(np.empty(shape, dtype) for shape in cls._shapes(*geometry)))

    @classmethod
    def scratch(cls, out: np.ndarray, *geometry: int) -> "_GqaWork":
        return cls(*(scratch(out, name, shape, out.dtype) for name, shape in zip(cls._NAMES, cls._shapes(*geometry))))


class _WorkByOutput:
    """The capture variant's work arrays, found again in one look-up per call: keyed on
    the output buffer (held weakly) and the geometry, which a capture keeps fixed."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Any, tuple[int, ...], _GqaWork]] = {}

    def get(self, out: np.ndarray, geometry: tuple[int, ...]) -> _GqaWork:
        entry = self._entries.get(id(out))
        if entry is not None and entry[0]() is out and entry[1] == geometry:
            return entry[2]
        work = _GqaWork.scratch(out, *geometry)
        self._entries[id(out)] = (weakref.ref(out), geometry, work)
        weakref.finalize(out, self._entries.pop, id(out), None)
        return work


def _heads(x: np.ndarray, heads: int, name: str) -> np.ndarray:
    """(batch, seq, heads * size) -> (batch, seq, heads, size), a view."""
    batch, seq, hidden = x.shape
    if hidden % heads:
        raise ValueError(f"{name}'s hidden size {hidden} is not a multiple of {heads} heads")
    return x.reshape(batch, seq, heads, hidden // heads)


def _rotate_into(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool, out: np.ndarray, term: np.ndarray):
    """_rotate written into ``out`` with ``term`` (x's shape, half its last axis or more)
    as work array; cos/sin broadcast against x's rotated pairs."""
    half, rotary, cos, sin = _rotary_factors(x, cos, sin)
    if interleaved:
        first, second = x[..., 0:rotary:2], x[..., 1:rotary:2]
        out_first, out_second = out[..., 0:rotary:2], out[..., 1:rotary:2]
    else:
        first, second = x[..., :half], x[..., half:rotary]
        out_first, out_second = out[..., :half], out[..., half:rotary]
    term = term[..., : x.shape[-2], :half]  # x's heads
    np.multiply(first, cos, out=out_first)
    np.multiply(second, sin, out=term)
    np.subtract(out_first, term, out=out_first)
    np.multiply(first, sin, out=out_second)
    np.multiply(second, cos, out=term)
    np.add(out_second, term, out=out_second)
    if rotary < x.shape[-1]:
        np.copyto(out[..., rotary:], x[..., rotary:])


def _rotary_rows(
    cos_cache: np.ndarray,
    sin_cache: np.ndarray,
    position_ids: np.ndarray | None,
    past_lengths: list[int],
    first_prompt: bool,
    batch: int,
    seq: int,
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin rows (B or 1, S, 1, rotary / 2) for the new tokens' positions."""
    if position_ids is None and min(past_lengths) == max(past_lengths):
        # every sequence continues at one position: a slice of the caches, no gather
        start = past_lengths[0]
        if start + seq > cos_cache.shape[0]:
            raise ValueError(
                f"position ids range over [{start}, {start + seq - 1}] but cos_cache has "
                f"{cos_cache.shape[0]} rows; build the cache for the longest sequence the model will see"
            )
        return cos_cache[None, start:start + seq, None], sin_cache[None, start:start + seq, None]
    positions = _rotary_positions(position_ids, past_lengths, first_prompt, batch, seq, cos_cache.shape[0])
    return cos_cache[positions][:, :, None], sin_cache[positions][:, :, None]


# Query-key products (heads x queries x keys x head size) from which a bound decode step's
# attention shares its heads over the compiled pool's threads (a job costs a few us).
_POOL_ATTENTION_MIN = 1 << 14

_NO_ROTATION = np.zeros((1, 0), np.float32)  # cos/sin of width 0: the compiled loop rotates nothing


def _rotary_positions(
    position_ids: np.ndarray | None, past_lengths: list[int], first_prompt: bool, batch: int, seq: int, rows: int
) -> np.ndarray:
    """The cos/sin cache row of each new token (B, S), checked against the cache's rows."""
    if position_ids is None:
        # each sequence continues from its past: the range is known without reading the array
        if min(past_lengths) < 0 or max(past_lengths) + seq > rows:
            raise ValueError(
                f"position ids range over [{min(past_lengths)}, {max(past_lengths) + seq - 1}] but cos_cache has "
                f"{rows} rows; build the cache for the longest sequence the model will see"
            )
        if seq == 1:  # a decode step: one position per sequence
            return np.array(past_lengths, np.int64).reshape(batch, 1)
        return np.asarray(past_lengths, np.int64)[:, None] + np.arange(seq)[None, :]
    elif first_prompt:
        # a first prompt reads only the first position id (as onnxruntime does)
        first = int(np.asarray(position_ids).reshape(-1)[0])
        positions = np.broadcast_to(first + np.arange(seq)[None, :], (batch, seq))
    else:
        positions = np.asarray(position_ids, dtype=np.int64).reshape(batch, seq)
    _check_positions(positions, rows, "cos_cache")
    return np.ascontiguousarray(positions, np.int64)


def _write_cache(
    present: np.ndarray, past: np.ndarray | None, new: np.ndarray | None, past_lengths: list[int], seq: int
) -> None:
    """present[b] = past[b][:past_lengths[b]], then the ``seq`` new tokens (B, Hkv, S, D;
    None: written already), then zeros. Reads only the valid part of the past; when
    present is the past's own buffer (a shared, fixed-capacity cache) the valid part is
    already in place, and the zeros after it are written when its sequence starts
    (``_numba_decode.finish_caches`` says why)."""
    capacity = present.shape[2]
    shared = past is not None and np.may_share_memory(past, present)
    if min(past_lengths) == max(past_lengths):  # the common case: one slice for the whole batch
        spans = [(slice(None), past_lengths[0])]
    else:  # ragged batch: a loop over the (small) batch dimension
        spans = [(slice(b, b + 1), start) for b, start in enumerate(past_lengths)]
    for rows, start in spans:
        end = min(start + seq, capacity)
        if past is not None and start and not shared:
            np.copyto(present[rows, :, :start], past[rows, :, :start])
        if new is not None:
            np.copyto(present[rows, :, start:end], new[rows, :, : end - start])
        if not shared or start == 0:
            present[rows, :, end:] = 0


def _gqa_attend(
    queries: np.ndarray,
    present_k: np.ndarray,
    present_v: np.ndarray,
    lengths: list[int],
    past_lengths: list[int],
    work: _GqaWork,
    output: np.ndarray,
    *,
    softcap: float,
    window: int,
    attention_bias: np.ndarray | None,
    sink: np.ndarray | None,
    loops: Any = None,
) -> None:
    """Causal attention of the scaled queries (B, N, S, D) over the first max(lengths)
    cache positions, written into output (B, S, N * D). Only the valid part of the cache
    is read, so a fixed-capacity cache costs what its filled part costs. ``loops``: the
    compiled decode loops when the caller has them (else asked for here)."""
    batch, num_heads, seq, head_size = queries.shape
    kv_heads = present_k.shape[1]
    total = max(lengths)
    dtype = queries.dtype
    if softcap <= 0 and attention_bias is None and sink is None and dtype == np.float32:
        loops = loops if loops is not None else decode_loops()
        contiguous = all(a.flags.c_contiguous for a in (output, queries, present_k, present_v))  # the loop's types
        if loops is not None and contiguous and present_k.dtype == present_v.dtype == np.float32:
            # one compiled loop for scores, softmax and the weighted sum
            loops.causal_attention(
                queries, present_k, present_v, np.asarray(lengths, np.int64), np.asarray(past_lengths, np.int64),
                window, work.scores.reshape(-1), output,
            )
            return
    grouped = queries.reshape(batch, kv_heads, (num_heads // kv_heads) * seq, head_size)
    scores = work.scores[..., :total]
    np.matmul(grouped, np.swapaxes(present_k[:, :, :total], -1, -2), out=scores)
    by_head = scores.reshape(batch, num_heads, seq, total)  # a view: the group axis splits
    if softcap > 0:
        np.divide(scores, dtype.type(softcap), out=scores)
        np.tanh(scores, out=scores)
        np.multiply(scores, dtype.type(softcap), out=scores)
    if attention_bias is not None:
        width = min(attention_bias.shape[-1], total)  # missing bias columns add 0
        by_head[..., :width] += attention_bias[..., :width].astype(dtype, copy=False)
    # A single new token of every sequence sees its whole valid cache: no mask needed.
    if seq > 1 or min(lengths) != total or (window > 0 and total > window):
        query_positions = np.asarray(past_lengths, np.int64)[:, None] + np.arange(seq)[None, :]  # (B, S)
        keys = np.arange(total)
        allowed = (keys[None, None, :] <= query_positions[:, :, None]) & (
            keys[None, None, :] < np.asarray(lengths, np.int64)[:, None, None]
        )
        if window > 0:
            allowed &= keys[None, None, :] > query_positions[:, :, None] - window
        np.copyto(by_head, dtype.type(-np.inf), where=~allowed[:, None])
    _softmax_rows(by_head, sink)
    np.matmul(scores, present_v[:, :, :total], out=work.context)
    attended = work.context.reshape(batch, num_heads, seq, head_size)
    np.copyto(output.reshape(batch, seq, num_heads, head_size), attended.transpose(0, 2, 1, 3))


@kernel_builder("GroupQueryAttention", 1, domain=_MS, multi_output=True, compiled=("_numba_decode",))
def group_query_attention(ctx: KernelContext):
    attrs = ctx.attributes
    num_heads = int(attrs.get("num_heads", 0))
    kv_num_heads = int(attrs.get("kv_num_heads", 0))
    if num_heads <= 0 or kv_num_heads <= 0 or num_heads % kv_num_heads:
        raise NotImplementedError(
            f"GroupQueryAttention needs num_heads ({num_heads}) a positive multiple of kv_num_heads ({kv_num_heads})"
        )
    reason = _gqa_unsupported(attrs)
    if reason:
        raise NotImplementedError(reason)
    if int(attrs.get("causal", 1)) != 1:
        raise NotImplementedError("GroupQueryAttention with causal=0 is not supported")
    scale_attr = float(attrs.get("scale", 0.0) or 0.0)
    softcap = float(attrs.get("softcap", 0.0) or 0.0)
    do_rotary = bool(attrs.get("do_rotary", 0))
    interleaved = bool(attrs.get("rotary_interleaved", 0))
    window = int(attrs.get("local_window_size", -1))
    smooth = int(attrs.get("smooth_softmax", -1)) == 1
    works = _WorkByOutput()

    def run(
        query,
        key=None,
        value=None,
        past_key=None,
        past_value=None,
        seqlens_k=None,
        total_sequence_length=None,
        cos_cache=None,
        sin_cache=None,
        position_ids=None,
        attention_bias=None,
        head_sink=None,
        k_scale=None,
        v_scale=None,
        q_norm_weight=None,
        k_norm_weight=None,
        query_seqlens=None,
        out=None,
    ):
        if seqlens_k is None or total_sequence_length is None:
            raise ValueError("GroupQueryAttention needs the seqlens_k and total_sequence_length inputs")
        if q_norm_weight is not None or k_norm_weight is not None or query_seqlens is not None:
            raise ValueError("GroupQueryAttention's q/k_norm_weight and query_seqlens inputs are not supported")
        if (past_key is None) != (past_value is None):
            raise ValueError("past_key and past_value must be given together")
        if query.ndim != 3:
            raise ValueError(f"query must be 3-D (B, S, hidden), got shape {query.shape}")
        batch, seq, hidden = query.shape
        if key is None:  # packed QKV: query and key heads side by side, rotated together
            if value is not None:
                raise ValueError("packed QKV (no key input) takes no value input")
            if hidden % (num_heads + 2 * kv_num_heads):
                raise ValueError(f"packed QKV width {hidden} is not a multiple of num_heads + 2 * kv_num_heads")
            packed = _heads(query, num_heads + 2 * kv_num_heads, "packed QKV")
            qk_heads = packed[:, :, : num_heads + kv_num_heads]
            v_heads = packed[:, :, num_heads + kv_num_heads:]
        elif value is None:
            raise ValueError("GroupQueryAttention needs a value input with a key input")
        else:
            qk_heads = None
            q_heads = _heads(query, num_heads, "query")
            k_heads = _heads(key, kv_num_heads, "key")
            v_heads = _heads(value, kv_num_heads, "value")
            if k_heads.shape[1] != seq:
                raise ValueError(
                    f"key has {k_heads.shape[1]} tokens but query has {seq}; GroupQueryAttention needs equal lengths"
                )
            if k_heads.shape[-1] != q_heads.shape[-1]:
                raise ValueError(f"query and key head sizes differ ({q_heads.shape[-1]}, {k_heads.shape[-1]})")
        head_size = v_heads.shape[-1]
        dtype = query.dtype
        lengths = [int(n) + 1 for n in np.asarray(seqlens_k).reshape(-1).tolist()]  # cached after this step
        if len(lengths) != batch:
            raise ValueError(f"seqlens_k has {len(lengths)} entries for batch {batch}")
        max_total = int(np.asarray(total_sequence_length).reshape(-1)[0])
        buffer = 0 if past_key is None else past_key.shape[2]
        capacity = max(max_total, buffer)
        # A first prompt fills the cache from position 0; otherwise the new tokens follow
        # the cached ones of each batch entry (a past buffer longer than its valid part,
        # as with a fixed-capacity cache, is read only up to seqlens_k).
        first_prompt = seq == max_total
        past_lengths = [0] * batch if first_prompt else [n - seq for n in lengths]
        if min(past_lengths) < 0 or max(past_lengths) > buffer or max(lengths) > capacity:
            raise ValueError(
                f"seqlens_k {[n - 1 for n in lengths]} do not fit a step of {seq} tokens with a past of {buffer} "
                f"and total_sequence_length {max_total}"
            )
        shapes = ((batch, seq, num_heads * head_size), *[(batch, kv_num_heads, capacity, head_size)] * 2)
        geometry = (batch, num_heads, kv_num_heads, seq, capacity, head_size)
        if out is None:
            out = tuple(np.empty(shape, dtype) for shape in shapes)
            work = _GqaWork.allocate(dtype, *geometry)
        else:  # the capture variant: the node's outputs, then work arrays for the unused presents
            out = out + tuple(scratch(out[0], ("gqa-present", i), shapes[i], dtype) for i in range(len(out), 3))
            work = works.get(out[0], geometry)
        output, present_k, present_v = out
        if do_rotary and (cos_cache is None or sin_cache is None):
            raise ValueError("do_rotary=1 needs the cos_cache and sin_cache inputs")
        scale = dtype.type(scale_attr or 1 / math.sqrt(head_size))
        if qk_heads is not None:
            q_heads, k_heads = qk_heads[:, :, :num_heads], qk_heads[:, :, num_heads:]
        loops = decode_loops() if dtype == np.float32 else None
        compiled = loops is not None and all(a.dtype == dtype for a in (k_heads, v_heads, present_k, present_v))
        compiled = compiled and all(a.flags.c_contiguous for a in (present_k, present_v, work.queries))  # the loop's types
        if compiled and do_rotary:  # the compiled loop takes the caches as they are; odd ones go the numpy way
            compiled = (
                cos_cache.dtype == sin_cache.dtype == dtype
                and cos_cache.ndim == 2
                and cos_cache.shape == sin_cache.shape
                and 2 * cos_cache.shape[-1] <= head_size
            )
        if compiled:
            # one compiled loop rotates, scales the queries and writes the new cache rows
            if do_rotary:
                cos, sin = cos_cache, sin_cache
                positions = _rotary_positions(position_ids, past_lengths, first_prompt, batch, seq, cos_cache.shape[0])
            else:
                cos = sin = _NO_ROTATION
                positions = np.zeros((batch, seq), np.int64)
            starts = np.asarray(past_lengths, np.int64)
            loops.rotate_into_cache(
                q_heads, k_heads, v_heads, cos, sin, positions, interleaved, scale, work.queries, present_k,
                present_v, starts,
            )
            shared = past_key is None or (np.may_share_memory(past_key, present_k) and past_key.shape == present_k.shape)
            if shared or past_key.dtype == dtype == past_value.dtype:
                loops.finish_caches(
                    present_k, present_v, present_k if shared else past_key, present_v if shared else past_value,
                    not shared, starts, seq,
                )
            else:
                _write_cache(present_k, past_key, None, past_lengths, seq)
                _write_cache(present_v, past_value, None, past_lengths, seq)
        elif do_rotary:
            cos, sin = _rotary_rows(cos_cache, sin_cache, position_ids, past_lengths, first_prompt, batch, seq)
            if qk_heads is not None:
                _rotate_into(qk_heads, cos, sin, interleaved, work.rotated, work.term)
            else:
                _rotate_into(q_heads, cos, sin, interleaved, work.rotated[:, :, :num_heads], work.term)
                _rotate_into(k_heads, cos, sin, interleaved, work.rotated[:, :, num_heads:], work.term)
            q_heads, k_heads = work.rotated[:, :, :num_heads], work.rotated[:, :, num_heads:]
        if not compiled:
            _write_cache(present_k, past_key, k_heads.transpose(0, 2, 1, 3), past_lengths, seq)
            _write_cache(present_v, past_value, v_heads.transpose(0, 2, 1, 3), past_lengths, seq)
            np.multiply(q_heads.transpose(0, 2, 1, 3), scale, out=work.queries)
        sink = None
        if head_sink is not None:
            sink = head_sink.astype(dtype, copy=False).reshape(1, num_heads, 1, 1)
        elif smooth:
            sink = np.zeros((1, 1, 1, 1), dtype)
        _gqa_attend(
            work.queries, present_k, present_v, lengths, past_lengths, work, output,
            softcap=softcap, window=window, attention_bias=attention_bias, sink=sink, loops=loops,
        )
        return output, present_k, present_v

    def kernel(*inputs):
        return run(*inputs)

    def into(out, *inputs):
        run(*inputs, out=tuple(out) if isinstance(out, (tuple, list)) else (out,))

    def bind(
        out, query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
        total_sequence_length=None, cos_cache=None, sin_cache=None, position_ids=None, *rest,
    ):
        """For a capture: a decode step's attention over a cache its presents share with
        their pasts (one binding each), as one call with no arguments: the compiled
        rotation into the cache, the cache's tail and the attention, with the heads' views
        and work arrays found once. Each call reads seqlens_k, total_sequence_length (and
        position_ids) as they are then, and checks them against the cache. None where a
        feature or layout asks for ``into`` (biases, sinks, softcap, a separate past, ...)."""
        loops = decode_loops()
        outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if loops is None or softcap > 0 or smooth or any(r is not None for r in rest) or len(outputs) != 3:
            return None
        arrays = [query, key, value, past_key, past_value, *outputs]
        if any(a is not None and not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous) for a in arrays):
            return None
        if past_key is None or past_value is None or query.ndim != 3 or (key is None) != (value is None):
            return None
        if not isinstance(seqlens_k, np.ndarray) or not isinstance(total_sequence_length, np.ndarray):
            return None
        output, present_k, present_v = outputs
        shared = all(
            past.shape == present.shape and np.may_share_memory(past, present)
            for past, present in ((past_key, present_k), (past_value, present_v))
        )
        if not shared:
            return None
        batch, seq, hidden = query.shape
        if key is None:
            if hidden % (num_heads + 2 * kv_num_heads):
                return None
            packed = _heads(query, num_heads + 2 * kv_num_heads, "packed QKV")
            q_heads, k_heads = packed[:, :, :num_heads], packed[:, :, num_heads : num_heads + kv_num_heads]
            v_heads = packed[:, :, num_heads + kv_num_heads :]
        else:
            if hidden % num_heads or key.shape[-1] % kv_num_heads or value.shape[-1] % kv_num_heads:
                return None
            q_heads, k_heads = _heads(query, num_heads, "query"), _heads(key, kv_num_heads, "key")
            v_heads = _heads(value, kv_num_heads, "value")
            if k_heads.shape[:2] != (batch, seq) or k_heads.shape[-1] != q_heads.shape[-1] or v_heads.shape[:2] != (batch, seq):
                return None
        head_size = v_heads.shape[-1]
        capacity = past_key.shape[2]
        if (
            seqlens_k.size != batch
            or present_k.shape != (batch, kv_num_heads, capacity, head_size)
            or output.shape != (batch, seq, num_heads * head_size)
        ):
            return None
        if do_rotary:
            if cos_cache is None or sin_cache is None or not all(
                isinstance(c, np.ndarray) and c.dtype == np.float32 and c.ndim == 2 for c in (cos_cache, sin_cache)
            ):
                return None
            if cos_cache.shape != sin_cache.shape or 2 * cos_cache.shape[-1] > head_size:
                return None
            cos, sin, rows = cos_cache, sin_cache, cos_cache.shape[0]
        else:
            cos = sin = _NO_ROTATION
            rows = 0
        work = works.get(output, (batch, num_heads, kv_num_heads, seq, capacity, head_size))
        if not work.queries.flags.c_contiguous:
            return None
        scale = np.float32(scale_attr or 1 / math.sqrt(head_size))
        lengths, starts = np.empty(batch, np.int64), np.empty(batch, np.int64)
        positions = np.zeros((batch, seq), np.int64)
        steps = np.arange(seq, dtype=np.int64)
        scores = work.scores.reshape(-1)
        seqlens, totals = seqlens_k.reshape(-1), total_sequence_length.reshape(-1)
        # the heads over the compiled pool's threads: one (sequence, head) a unit, each
        # slot its own capacity of scores (the work array holds one per query row)
        units = batch * num_heads
        job = np.zeros(loops.ATT_STEP_WORDS, np.int64)  # attention_job's words, then attention_step's
        for index, value in (
            (loops.ATT_QUERIES, work.queries.ctypes.data), (loops.ATT_KEYS, present_k.ctypes.data),
            (loops.ATT_VALUES, present_v.ctypes.data), (loops.ATT_LENGTHS, lengths.ctypes.data),
            (loops.ATT_STARTS, starts.ctypes.data), (loops.ATT_WORK, scores.ctypes.data),
            (loops.ATT_OUT, output.ctypes.data), (loops.ATT_WINDOW, window), (loops.ATT_BATCH, batch),
            (loops.ATT_HEADS, num_heads), (loops.ATT_SEQ, seq), (loops.ATT_SIZE, head_size),
            (loops.ATT_KV_HEADS, kv_num_heads), (loops.ATT_CAPACITY, capacity),
        ):
            job[index] = value
        job_address, job_body = int(job.ctypes.data), loops.attention_job.address

        def replay() -> None:
            np.add(seqlens, 1, out=lengths)  # cached after this step
            first_prompt = seq == int(totals[0])
            if first_prompt:
                starts.fill(0)
            else:
                np.subtract(lengths, seq, out=starts)
            if int(starts.min()) < 0 or int(lengths.max()) > capacity:
                raise ValueError(
                    f"seqlens_k {(lengths - 1).tolist()} do not fit a step of {seq} tokens in a cache of {capacity}"
                )
            if do_rotary:
                if position_ids is None:
                    if int(starts.max()) + seq > rows:
                        raise ValueError(
                            f"position ids reach {int(starts.max()) + seq - 1} but cos_cache has {rows} rows; build the "
                            "cache for the longest sequence the model will see"
                        )
                    np.add(starts[:, None], steps, out=positions)
                else:
                    positions[...] = _rotary_positions(position_ids, starts.tolist(), first_prompt, batch, seq, rows)
            loops.rotate_into_cache(
                q_heads, k_heads, v_heads, cos, sin, positions, interleaved, scale, work.queries, present_k, present_v, starts
            )
            loops.finish_caches(present_k, present_v, present_k, present_v, False, starts, seq)
            spans = units * seq * int(lengths.max()) * head_size  # query-key products, about
            count = min(units, threads_for(PARALLEL_MIN_WORK)) if spans >= _POOL_ATTENTION_MIN else 1
            pool = compiled_pool() if count > 1 else None
            if pool is None:
                loops.causal_attention(work.queries, present_k, present_v, lengths, starts, window, scores, output)
            else:
                pool.run(job_body, job_address, units, count)

        # as a step of a compiled program (``_capture``): the same steps in one compiled call,
        # where the lengths come as onnxruntime-genai gives them (int32) and the positions follow
        if position_ids is None and all(
            a.dtype == np.int32 and a.flags.c_contiguous for a in (seqlens_k, total_sequence_length)
        ):
            for index, value in (
                (loops.ATT_SEQLENS, seqlens_k.ctypes.data), (loops.ATT_TOTALS, total_sequence_length.ctypes.data),
                (loops.ATT_POSITIONS, positions.ctypes.data), (loops.ATT_COS, cos.ctypes.data),
                (loops.ATT_SIN, sin.ctypes.data), (loops.ATT_ROWS, cos.shape[0]), (loops.ATT_HALF, cos.shape[1]),
                (loops.ATT_ROTARY, int(do_rotary)), (loops.ATT_INTERLEAVED, int(interleaved)),
                (loops.ATT_POOL_MIN, _POOL_ATTENTION_MIN),
            ):
                job[index] = value
            job.view(np.float64)[loops.ATT_SCALE] = float(scale)
            for at, view in ((loops.ATT_Q, q_heads), (loops.ATT_K, k_heads), (loops.ATT_V, v_heads)):
                job[at] = view.ctypes.data
                job[at + 1 : at + loops.ATT_VIEW_WORDS] = view.strides
            replay.program = (loops.attention_step.address, job_body, job_address)  # type: ignore[attr-defined]
        replay.job = job  # type: ignore[attr-defined]  # the context lives as long as the replay
        return replay

    into.bind = bind  # type: ignore[attr-defined]

    # A capture may give the presents the past buffers themselves when one binding carries
    # both (onnxruntime's past_present_share_buffer): only the new tokens are written then.
    into.writes_over_inputs = {1: 3, 2: 4}  # type: ignore[attr-defined]
    declare_into(into, kernel)
    return kernel

