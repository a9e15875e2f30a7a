"""Attention kernels: Attention, RotaryEmbedding, SwiGLU and related."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._dtypes import numpy_dtype
from .._registry import KernelContext, kernel, kernel_builder
from ._gemm import matmul


def _work_dtype(dtype: np.dtype) -> np.dtype:
    """float32/float64 compute natively; half types (float16, bfloat16) go through float32."""
    return np.dtype(dtype) if dtype in (np.float32, np.float64) else np.dtype(np.float32)


def _split_heads(x: np.ndarray, num_heads: int | None, name: str) -> np.ndarray:
    """(batch, seq, heads * size) -> (batch, heads, seq, size)."""
    if not num_heads:
        raise ValueError(f"3-D {name} needs the q_num_heads and kv_num_heads attributes")
    batch, seq, hidden = x.shape
    if hidden % num_heads:
        raise ValueError(f"{name}'s hidden size {hidden} is not a multiple of {num_heads} heads")
    return x.reshape(batch, seq, num_heads, hidden // num_heads).transpose(0, 2, 1, 3)


def _merge_heads(x: np.ndarray) -> np.ndarray:
    """(batch, heads, seq, size) -> (batch, seq, heads * size)."""
    batch, heads, seq, size = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch, seq, heads * size)


def _grouped_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (B, Hq, M, K) @ b (B, Hkv, K, N) where query head h uses kv head h // (Hq / Hkv).

    The query heads are folded into groups so each kv head is read once, without
    materialising repeated keys/values.
    """
    batch, q_heads, m, _ = a.shape
    kv_heads = b.shape[1]
    if q_heads == kv_heads:
        return matmul(a, b)
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} key/value heads")
    grouped = a.reshape(batch, kv_heads, q_heads // kv_heads, m, a.shape[-1])
    return matmul(grouped, b[:, :, None]).reshape(batch, q_heads, m, b.shape[-1])


def _rounded_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """_grouped_matmul in the inputs' type; half types accumulate in float32, rounded once."""
    if a.dtype in (np.float32, np.float64):
        return _grouped_matmul(a, b)
    return _grouped_matmul(a.astype(np.float32), b.astype(np.float32)).astype(a.dtype)


def _softmax(scores: np.ndarray, overwrite: bool = False) -> np.ndarray:
    """Softmax over the last axis; a row that is entirely -inf gives zeros, not NaN.

    With ``overwrite`` the result reuses ``scores``' memory.
    """
    zero, one = scores.dtype.type(0), scores.dtype.type(1)
    row_max = np.max(scores, axis=-1, keepdims=True)
    row_max = np.where(np.isneginf(row_max), zero, row_max)
    exp = np.subtract(scores, row_max, out=scores if overwrite else None)
    np.exp(exp, out=exp)
    total = np.sum(exp, axis=-1, keepdims=True)
    exp /= np.where(total == zero, one, total)
    return exp


def _sqrt_scale(scale: float | None, head_size: int, dtype: np.dtype) -> float:
    """sqrt(scale), rounded to the input type as the spec's Cast(ScaleFactorSqrt, to=T1) does."""
    value = 1 / np.sqrt(head_size) if scale is None else scale
    return float(np.asarray(np.sqrt(value)).astype(dtype))


def _attention_bias(
    attn_mask: np.ndarray | None,
    is_causal: bool,
    offset: int | np.ndarray,
    nonpad_kv_seqlen: np.ndarray | None,
    left_window: int,
    right_window: int,
    q_length: int,
    total_length: int,
    dtype: np.dtype,
) -> np.ndarray | None:
    """The additive bias (0 / -inf / float mask), broadcastable to (B, Hq, Sq, T), or None.

    ``offset`` is the count of valid keys before the query block: an int, or per batch
    entry an array of shape (B,). Query i attends key j causally iff j <= i + offset.
    """
    allowed = None  # bool, broadcastable
    additive = None
    if attn_mask is not None:
        missing = total_length - attn_mask.shape[-1]
        if missing < 0:
            raise ValueError(f"attn_mask covers {attn_mask.shape[-1]} keys but there are only {total_length}")
        if missing:
            pad = [(0, 0)] * (attn_mask.ndim - 1) + [(0, missing)]
            attn_mask = np.pad(attn_mask, pad, constant_values=False if attn_mask.dtype == np.bool_ else -np.inf)
        if attn_mask.dtype == np.bool_:
            allowed = attn_mask
        else:
            additive = attn_mask.astype(dtype, copy=False)
    if is_causal or left_window >= 0 or right_window >= 0:
        queries = np.arange(q_length)[:, None]
        if np.ndim(offset):
            queries = queries + np.asarray(offset).reshape(-1, 1, 1, 1)  # (B, 1, Sq, 1)
        else:
            queries = queries + offset
        distance = queries - np.arange(total_length)  # query position - key position
        window = np.ones(distance.shape, dtype=np.bool_)
        if is_causal:
            window &= distance >= 0
        if left_window >= 0:
            window &= distance <= left_window
        if right_window >= 0:
            window &= -distance <= right_window
        allowed = window if allowed is None else allowed & window
    if nonpad_kv_seqlen is not None:
        lengths = np.asarray(nonpad_kv_seqlen).reshape(-1, 1, 1, 1)
        valid = np.arange(total_length) < lengths  # (B, 1, 1, T)
        allowed = valid if allowed is None else allowed & valid
    if allowed is None:
        return additive
    masked = np.asarray(-np.inf, dtype=dtype)
    return np.where(allowed, np.zeros((), dtype) if additive is None else additive, masked)


@kernel_builder("Attention", 23, 24, 25, multi_output=True)
def attention(ctx: KernelContext):
    attrs = ctx.attributes
    is_causal = bool(attrs.get("is_causal", 0))
    q_num_heads = attrs.get("q_num_heads")
    kv_num_heads = attrs.get("kv_num_heads")
    scale = attrs.get("scale")
    softcap = float(attrs.get("softcap", 0.0))
    mode = int(attrs.get("qk_matmul_output_mode", 0))
    softmax_precision = attrs.get("softmax_precision")
    left_window = int(attrs.get("left_window_size", -1))
    right_window = int(attrs.get("right_window_size", -1))
    if mode not in (0, 1, 2, 3):
        raise ValueError(f"qk_matmul_output_mode must be 0, 1, 2 or 3, got {mode}")
    if left_window < -1 or right_window < -1:
        raise ValueError("left_window_size and right_window_size must be -1 or non-negative")
    softmax_dtype = None if softmax_precision is None else numpy_dtype(softmax_precision)
    want_qk = ctx.num_outputs >= 4

    def run(q, k, v, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None):
        if not q.ndim == k.ndim == v.ndim or q.ndim not in (3, 4):
            raise ValueError(f"Q, K and V must all be 3-D or all 4-D, got ranks {q.ndim}, {k.ndim}, {v.ndim}")
        if (past_key is None) != (past_value is None):
            raise ValueError("past_key and past_value must be given together")
        if nonpad_kv_seqlen is not None and past_key is not None:
            raise ValueError("nonpad_kv_seqlen cannot be combined with past_key/past_value")
        three_d = q.ndim == 3
        if three_d:
            q = _split_heads(q, q_num_heads, "Q")
            k = _split_heads(k, kv_num_heads, "K")
            v = _split_heads(v, kv_num_heads, "V")
        elif ctx.opset >= 25 and (q_num_heads is not None or kv_num_heads is not None):
            raise ValueError("q_num_heads and kv_num_heads must not be set for 4-D inputs")
        # Every step runs in the input type, as the spec's function body does; matmuls of
        # half types accumulate in float32 and round once.
        dtype = q.dtype
        if past_key is not None:
            k = np.concatenate([past_key, k], axis=2)
            v = np.concatenate([past_value, v], axis=2)
        present_key, present_value = k, v
        q_length, total_length = q.shape[2], k.shape[2]

        root = dtype.type(_sqrt_scale(scale, q.shape[-1], dtype))
        scores = _rounded_matmul(q * root, np.swapaxes(k * root, -1, -2))
        raw = scores
        if softcap > 0:
            scores = np.tanh(scores / dtype.type(softcap)) * dtype.type(softcap)
        capped = scores
        if nonpad_kv_seqlen is not None:
            offset = np.asarray(nonpad_kv_seqlen, dtype=np.int64).reshape(-1) - q_length
        else:
            offset = 0 if past_key is None else past_key.shape[2]
        bias = _attention_bias(
            attn_mask, is_causal, offset, nonpad_kv_seqlen, left_window, right_window, q_length, total_length, dtype
        )
        if bias is not None:
            scores = scores + bias
        qk = {0: raw, 1: capped, 2: scores}.get(mode)

        if softmax_dtype is not None and softmax_dtype != scores.dtype:
            scores = scores.astype(softmax_dtype)
        # The softmax may overwrite the scores unless they are the qk_matmul_output.
        probs = _softmax(scores, overwrite=scores is not qk or not want_qk)
        if bias is not None:
            # A query row with no attendable key gives a zero row (decided on the bias,
            # so NaN/inf logits in masked positions cannot leak through).
            fully_masked = np.isneginf(np.max(bias, axis=-1, keepdims=True))
            if fully_masked.any():
                probs = np.where(fully_masked, probs.dtype.type(0), probs)
        probs = probs.astype(dtype, copy=False)
        if mode == 3:
            qk = probs
        y = _rounded_matmul(probs, v)
        if three_d:
            y = _merge_heads(y)
        qk_output = np.broadcast_to(qk, raw.shape).astype(dtype, copy=False) if want_qk else None
        return y, present_key, present_value, qk_output

    return run


@kernel("RotaryEmbedding", 23)
def rotary_embedding(x, cos_cache, sin_cache, position_ids=None, *, interleaved=0, num_heads=0, rotary_embedding_dim=0):
    if x.ndim == 4:
        heads = x  # (batch, heads, seq, size)
        cache_axis = -3  # caches (batch, seq, half) gain a heads axis before seq
    elif x.ndim == 3:
        if not num_heads:
            raise ValueError("RotaryEmbedding on a 3-D input needs the num_heads attribute")
        batch, seq, hidden = x.shape
        if hidden % num_heads:
            raise ValueError(f"hidden size {hidden} is not a multiple of num_heads={num_heads}")
        heads = x.reshape(batch, seq, num_heads, hidden // num_heads)  # (batch, seq, heads, size)
        cache_axis = -2
    else:
        raise ValueError(f"RotaryEmbedding expects a 3-D or 4-D input, got rank {x.ndim}")
    rotary = rotary_embedding_dim or heads.shape[-1]
    if rotary % 2 or rotary > heads.shape[-1]:
        raise ValueError(f"rotary_embedding_dim {rotary} must be even and at most the head size {heads.shape[-1]}")
    half = rotary // 2
    if position_ids is not None:
        cos_cache, sin_cache = cos_cache[position_ids], sin_cache[position_ids]
    for name, cache in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if cache.shape[-1] != half:
            raise ValueError(f"{name}'s last dimension is {cache.shape[-1]}, expected rotary_embedding_dim/2 = {half}")
    if cos_cache.ndim == 3:
        cos_cache = np.expand_dims(cos_cache, cache_axis)
        sin_cache = np.expand_dims(sin_cache, cache_axis)
    cos = cos_cache.astype(x.dtype, copy=False)
    sin = sin_cache.astype(x.dtype, copy=False)
    if interleaved:
        first, second = heads[..., 0:rotary:2], heads[..., 1:rotary:2]
    else:
        first, second = heads[..., :half], heads[..., half:rotary]
    out = heads.copy()
    if interleaved:
        out[..., 0:rotary:2] = cos * first - sin * second
        out[..., 1:rotary:2] = sin * first + cos * second
    else:
        out[..., :half] = cos * first - sin * second
        out[..., half:rotary] = sin * first + cos * second
    return out.reshape(x.shape)


@kernel("SwiGLU", 28)
def swiglu(a, b, *, alpha=1.0):
    """Y = A * Sigmoid(alpha * A) * B, with A and B of identical shape."""
    if a.shape != b.shape:
        raise ValueError(f"SwiGLU needs A and B of identical shapes (no broadcasting), got {a.shape} and {b.shape}")
    work = _work_dtype(a.dtype)
    gate = a.astype(work, copy=False)
    scaled = gate * work.type(alpha)
    # sigmoid through exp of a non-positive argument, so large |x| never overflows
    e = np.exp(-np.abs(scaled))
    sigmoid = np.where(scaled >= 0, 1 / (1 + e), e / (1 + e))
    return (gate * sigmoid * b.astype(work, copy=False)).astype(a.dtype, copy=False)


_LINEAR_ATTENTION_RULES = ("linear", "gated", "delta", "gated_delta")


@kernel("LinearAttention", 27, multi_output=True)
def linear_attention(
    query,
    key,
    value,
    past_state=None,
    decay=None,
    beta=None,
    *,
    chunk_size=64,
    kv_num_heads=None,
    q_num_heads=None,
    scale=0.0,
    update_rule="gated_delta",
):
    """Recurrent linear attention: a state (B, Hkv, dk, dv) updated per token, read by q.

    Accumulates in float32 (float64 for float64 inputs) like onnx.reference; the loop is
    over time steps, each step batched over batch and heads.
    """
    if update_rule not in _LINEAR_ATTENTION_RULES:
        raise ValueError(f"update_rule must be one of {_LINEAR_ATTENTION_RULES}, got {update_rule!r}")
    if not q_num_heads or not kv_num_heads or q_num_heads % kv_num_heads:
        raise ValueError(f"q_num_heads ({q_num_heads}) must be a positive multiple of kv_num_heads ({kv_num_heads})")
    gated = update_rule in ("gated", "gated_delta")
    delta = update_rule in ("delta", "gated_delta")
    if gated != (decay is not None):
        raise ValueError(f"update_rule {update_rule!r} {'requires' if gated else 'forbids'} the decay input")
    if delta != (beta is not None):
        raise ValueError(f"update_rule {update_rule!r} {'requires' if delta else 'forbids'} the beta input")
    for name, array in (("query", query), ("key", key), ("value", value)):
        if array.ndim != 3:
            raise ValueError(f"{name} must be 3-D (B, T, H*D), got shape {array.shape}")
    work = np.dtype(np.float64) if query.dtype == np.float64 else np.dtype(np.float32)
    batch, steps, _ = query.shape
    group = q_num_heads // kv_num_heads
    q = _split_heads(query.astype(work, copy=False), q_num_heads, "query")
    k = _split_heads(key.astype(work, copy=False), kv_num_heads, "key")
    v = _split_heads(value.astype(work, copy=False), kv_num_heads, "value")
    key_size, value_size = k.shape[-1], v.shape[-1]
    if q.shape[-1] != key_size:
        raise ValueError(f"query head size {q.shape[-1]} differs from key head size {key_size}")
    # Grouped query heads: (B, Hkv, group, T, dk), read against the shared kv state.
    q = q.reshape(batch, kv_num_heads, group, steps, key_size)
    if gated:
        if decay.ndim != 3 or decay.shape[-1] not in (kv_num_heads, kv_num_heads * key_size):
            raise ValueError(f"decay must be (B, T, {kv_num_heads}) or (B, T, {kv_num_heads * key_size}), got {decay.shape}")
        gates = np.exp(_split_heads(decay.astype(work, copy=False), kv_num_heads, "decay"))  # (B, Hkv, T, 1|dk)
    if delta:
        if beta.ndim != 3 or beta.shape[-1] not in (kv_num_heads, 1):
            raise ValueError(f"beta must be (B, T, {kv_num_heads}) or (B, T, 1), got {beta.shape}")
        rates = beta.astype(work, copy=False).transpose(0, 2, 1)[..., None]  # (B, Hkv|1, T, 1)
    if past_state is not None:
        if past_state.shape != (batch, kv_num_heads, key_size, value_size):
            raise ValueError(
                f"past_state shape {past_state.shape} is not {(batch, kv_num_heads, key_size, value_size)}"
            )
        state_dtype = past_state.dtype
        state = past_state.astype(work)
    else:
        state_dtype = query.dtype
        state = np.zeros((batch, kv_num_heads, key_size, value_size), dtype=work)
    factor = work.type(1 / np.sqrt(key_size) if not scale else scale)

    out = np.empty((batch, kv_num_heads, group, steps, value_size), dtype=work)
    for t in range(steps):
        if gated:
            # a per-head decay scales the whole state, a per-key-dimension one its rows
            state = state * gates[:, :, t, :, None]
        k_t = k[:, :, t]  # (B, Hkv, dk)
        v_t = v[:, :, t]  # (B, Hkv, dv)
        if delta:
            retrieved = np.matmul(k_t[:, :, None, :], state)[:, :, 0]  # S^T k: (B, Hkv, dv)
            v_t = rates[:, :, t] * (v_t - retrieved)
        state = state + k_t[..., :, None] * v_t[..., None, :]
        out[:, :, :, t] = np.matmul(q[:, :, :, t], state)  # (B, Hkv, group, dv)
    out *= factor
    output = out.reshape(batch, q_num_heads, steps, value_size).transpose(0, 2, 1, 3)
    output = output.reshape(batch, steps, q_num_heads * value_size).astype(query.dtype, copy=False)
    return output, state.astype(state_dtype, copy=False)


def _flex_softmax_dtype(dtype: np.dtype, softmax_precision: int | None) -> np.dtype:
    if softmax_precision is not None:
        return numpy_dtype(softmax_precision)
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


@kernel_builder("FlexAttention", 1, domain="ai.onnx.preview")
def flex_attention(ctx: KernelContext):
    attrs = ctx.attributes
    scale = attrs.get("scale")
    softmax_precision = attrs.get("softmax_precision")
    modifiers: dict[str, Any] = {}
    for name in ("score_mod", "prob_mod"):
        graph = attrs.get(name)
        if graph is not None:
            if ctx.compile_subgraph is None:
                raise NotImplementedError(f"FlexAttention's {name} needs a provider that compiles subgraphs")
            modifiers[name] = ctx.compile_subgraph(graph)
    implicit_names = tuple(ctx.implicit_inputs)

    def apply(name: str, values: np.ndarray, outer: dict[str, Any]) -> np.ndarray:
        modifier = modifiers.get(name)
        if modifier is None:
            return values
        results = modifier.run([values], outer)
        if len(results) != 1:
            raise ValueError(f"FlexAttention's {name} must produce exactly one output, got {len(results)}")
        result = np.asarray(results[0], dtype=values.dtype)
        if result.shape != values.shape:
            raise ValueError(f"FlexAttention's {name} changed the shape {values.shape} to {result.shape}")
        return result

    def run(q, k, v, *implicit):
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
            raise ValueError(f"FlexAttention needs 4-D Q, K, V, got shapes {q.shape}, {k.shape}, {v.shape}")
        if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
            raise ValueError("K and V must share their head count and sequence length")
        if q.shape[-1] != k.shape[-1]:
            raise ValueError("Q and K must share their head size")
        outer = dict(zip(implicit_names, implicit))
        compute = _flex_softmax_dtype(q.dtype, softmax_precision)
        work = _work_dtype(compute)
        value = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
        root = float(np.asarray(np.sqrt(np.float32(value))).astype(q.dtype))
        qs = q.astype(work) * work.type(root)
        ks = k.astype(work) * work.type(root)
        scores = _grouped_matmul(qs, np.swapaxes(ks, -1, -2)).astype(compute, copy=False)
        scores = apply("score_mod", scores, outer).astype(work, copy=False)
        row_max = np.max(scores, axis=-1, keepdims=True)
        exp = np.exp(scores - row_max)
        probs = (exp / np.sum(exp, axis=-1, keepdims=True)).astype(compute, copy=False)
        probs = apply("prob_mod", probs, outer).astype(work, copy=False)
        return _grouped_matmul(probs, v.astype(work, copy=False)).astype(v.dtype, copy=False)

    return run
