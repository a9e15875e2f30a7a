"""numba-compiled float32 loops for a decoder step's kernels (RMS normalization with and without a residual sum; rotary embedding into a KV cache and causal grouped attention over it): one call where numpy needs eight to twenty.

Imported only through :func:`plugrt_cpu.kernels.contrib_normalization.decode_loops`,
which returns None when numba is missing or ``PLUGRT_NUMBA=0``; the callers' numpy path
then gives the same values to float32 rounding. Sums of squares accumulate in float64.
Compiled code is cached on disk (``cache=True``). No fastmath: NaN and infinity
propagate as in numpy.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

__all__ = [
    "attention_job", "attention_step", "causal_attention", "finish_caches", "rms_rows", "rms_step", "rotate_into_cache",
    "skip_rms_rows", "skip_rms_step",
]

_FLAGS: dict[str, Any] = dict(nogil=True, boundscheck=False, error_model="numpy", cache=True)
_compiled = numba.njit(**_FLAGS)


# After numba's first use above: a numba that cannot set up fails there, with its own
# error, before _numba_parallel's import of llvmlite could.
from ._numba_parallel import ALONE, float32_pointer, float64_pointer, int32_pointer, int64_pointer  # noqa: E402


def _entry(*signatures):  # type: ignore[no-untyped-def]
    """An entry point compiled for exactly ``signatures`` when the module is imported (by
    the background build), never again on a call: any shape of these types shares it."""
    return numba.njit(list(signatures), **_FLAGS)


_Array = numba.types.Array
# inputs are typed read-only, which takes writable arrays too
_IN1, _IN2, _IN4 = (_Array(numba.float32, ndim, "C", readonly=True) for ndim in (1, 2, 4))
# Inputs the callers pass as they come (views of a packed QKV, caches and tables as bound):
# any layout. The callers check that the other arrays are contiguous.
_STRIDED2, _STRIDED4 = (_Array(numba.float32, ndim, "A", readonly=True) for ndim in (2, 4))
_STRIDED_INDICES2 = _Array(numba.int64, 2, "A", readonly=True)
_OUT1, _OUT2, _OUT3, _OUT4 = (_Array(numba.float32, ndim, "C") for ndim in (1, 2, 3, 4))
_INDICES1, _INDICES2 = (_Array(numba.int64, ndim, "C", readonly=True) for ndim in (1, 2))


@_entry(numba.void(_IN2, _IN1, numba.float64, _OUT2, _OUT1))
def rms_rows(x, gamma, epsilon, y, inv_std):  # pragma: no cover  (compiled; covered through its callers)
    """y = x / sqrt(mean(x^2) + epsilon) * gamma per row of the 2-D float32 ``x``; the
    reciprocal root of each row into ``inv_std`` (one value per row)."""
    rows, width = x.shape
    for r in range(rows):
        total = 0.0
        for c in range(width):
            v = np.float64(x[r, c])
            total += v * v
        inv = np.float32(1.0 / math.sqrt(total / width + epsilon))
        inv_std[r] = inv
        for c in range(width):
            y[r, c] = x[r, c] * inv * gamma[c]


@_entry(numba.void(_IN2, _IN2, _IN1, numba.float64, _IN1, _OUT2, _OUT1, _OUT2))
def skip_rms_rows(a, b, bias, epsilon, gamma, y, inv_std, total):  # pragma: no cover  (compiled)
    """total = a + b (+ bias, a 1-element array meaning none), then rms_rows(total) into
    y and inv_std; 2-D float32 ``a`` and ``b`` of one shape."""
    rows, width = a.shape
    with_bias = bias.shape[0] == width
    for r in range(rows):
        squares = 0.0
        for c in range(width):
            v = a[r, c] + b[r, c]
            if with_bias:
                v += bias[c]
            total[r, c] = v
            squares += np.float64(v) * np.float64(v)
        inv = np.float32(1.0 / math.sqrt(squares / width + epsilon))
        inv_std[r] = inv
        for c in range(width):
            y[r, c] = total[r, c] * inv * gamma[c]


@numba.njit(**_FLAGS, fastmath={"reassoc"})
def _dot(a, b):  # pragma: no cover  (compiled)
    """The dot product of two float32 vectors, summed in whatever order vectorizes (a
    query by a key: one chain of dependent adds took most of a decode step's attention)."""
    total = np.float32(0.0)
    for i in range(a.shape[0]):
        total += a[i] * b[i]
    return total


@_compiled
def _attend_head(queries, keys, values, lengths, past_lengths, window, work, out, b, h):  # pragma: no cover  (compiled)
    """``causal_attention`` for sequence ``b``'s query head ``h``: its scores in ``work``
    (at least capacity floats), its result in its columns of ``out``."""
    seq, head_size = queries.shape[2], queries.shape[3]
    kv = h // (queries.shape[1] // keys.shape[1])
    valid = lengths[b]
    for s in range(seq):
        position = past_lengths[b] + s
        end = min(position + 1, valid)
        start = max(0, position - window + 1) if window > 0 else 0
        peak = -np.inf
        query = queries[b, h, s]
        for t in range(start, end):
            dot = _dot(query, keys[b, kv, t])
            work[t] = dot
            peak = max(peak, dot)
        total = np.float32(0.0)
        for t in range(start, end):
            e = np.float32(math.exp(work[t] - peak))
            work[t] = e
            total += e
        # the weighted values summed position by position, every channel at once (a
        # vector of channels: the sum over t for each channel keeps its order)
        row = out[b, s, h * head_size : (h + 1) * head_size]
        row[:] = 0.0
        for t in range(start, end):
            weight = work[t]
            value = values[b, kv, t]
            for d in range(head_size):
                row[d] += weight * value[d]
        for d in range(head_size):
            row[d] /= total


@_entry(numba.void(_IN4, _IN4, _IN4, _INDICES1, _INDICES1, numba.int64, _OUT1, _OUT3))
def causal_attention(queries, keys, values, lengths, past_lengths, window, work, out):  # pragma: no cover  (compiled)
    """Grouped causal attention of the scaled queries (B, N, S, D) over the first
    lengths[b] positions of the cache (B, Hkv, capacity, D): query s of sequence b sits at
    past_lengths[b] + s and sees the keys up to itself (and within ``window`` when
    positive). ``work`` holds at least capacity float32 scores; the result goes to
    ``out`` (B, S, N * D)."""
    for b in range(queries.shape[0]):
        for h in range(queries.shape[1]):
            _attend_head(queries, keys, values, lengths, past_lengths, window, work, out, b, h)


# The context of ``attention_job`` (int64 words): the arrays' addresses, then the sizes.
(
    ATT_QUERIES, ATT_KEYS, ATT_VALUES, ATT_LENGTHS, ATT_STARTS, ATT_WORK, ATT_OUT, ATT_WINDOW,
    ATT_BATCH, ATT_HEADS, ATT_SEQ, ATT_SIZE, ATT_KV_HEADS, ATT_CAPACITY,
) = range(14)
ATT_WORDS = 14


@numba.cfunc(numba.void(numba.int64, numba.int64, numba.int64, numba.int64), nogil=True, cache=True)
def attention_job(c, start, stop, slot):  # pragma: no cover  (compiled)
    """Units [start, stop) of ``causal_attention`` on the compiled pool, one (sequence,
    query head) a unit, slot ``slot``'s scores at ``slot * capacity`` in the work array:
    each head's result is the one-thread loop's, bitwise."""
    context = numba.carray(int64_pointer(c), ATT_WORDS)
    batch, heads, seq, size = context[ATT_BATCH], context[ATT_HEADS], context[ATT_SEQ], context[ATT_SIZE]
    kv_heads, capacity = context[ATT_KV_HEADS], context[ATT_CAPACITY]
    queries = numba.carray(float32_pointer(context[ATT_QUERIES]), (batch, heads, seq, size))
    keys = numba.carray(float32_pointer(context[ATT_KEYS]), (batch, kv_heads, capacity, size))
    values = numba.carray(float32_pointer(context[ATT_VALUES]), (batch, kv_heads, capacity, size))
    lengths = numba.carray(int64_pointer(context[ATT_LENGTHS]), (batch,))
    starts = numba.carray(int64_pointer(context[ATT_STARTS]), (batch,))
    work = numba.carray(float32_pointer(context[ATT_WORK] + slot * capacity * 4), (capacity,))
    out = numba.carray(float32_pointer(context[ATT_OUT]), (batch, seq, heads * size))
    for unit in range(start, stop):
        _attend_head(queries, keys, values, lengths, starts, context[ATT_WINDOW], work, out, unit // heads, unit % heads)


@_compiled
def _rotate_row(x, cos, sin, position, interleaved, scale, out):  # pragma: no cover  (compiled)
    """out = x with its first 2 * half channels rotated by cos/sin row ``position``
    (adjacent pairs when ``interleaved``, the two halves otherwise), times ``scale``."""
    half = cos.shape[1]
    for j in range(half):
        first = 2 * j if interleaved else j
        second = first + 1 if interleaved else j + half
        c, s = cos[position, j], sin[position, j]
        out[first] = (x[first] * c - x[second] * s) * scale
        out[second] = (x[first] * s + x[second] * c) * scale
    for d in range(2 * half, x.shape[0]):
        out[d] = x[d] * scale


# the heads as they come: contiguous, or strided views of a packed QKV (one signature: a
# contiguous and a strided one would both take a contiguous array, and numba refuses to choose)
@_entry(numba.void(_STRIDED4, _STRIDED4, _STRIDED4, _STRIDED2, _STRIDED2, _STRIDED_INDICES2, numba.boolean, numba.float32, _OUT4, _OUT4, _OUT4, _INDICES1))
def rotate_into_cache(
    q, k, v, cos, sin, positions, interleaved, scale, queries, present_k, present_v, past_lengths
):  # pragma: no cover  (compiled)
    """Queries (B, N, S, D) = q (B, S, N, D) rotated and times ``scale``; the rotated keys
    and the values (B, S, Hkv, D) written into cache rows past_lengths[b] + s of present
    (B, Hkv, capacity, D), those within its capacity. cos/sin rows are picked by
    positions (B, S); a cos of width 0 rotates nothing."""
    batch, seq, num_heads, _ = q.shape
    kv_heads = k.shape[2]
    capacity = present_k.shape[2]
    one = np.float32(1.0)
    for b in range(batch):
        for s in range(seq):
            position = positions[b, s]
            for h in range(num_heads):
                _rotate_row(q[b, s, h], cos, sin, position, interleaved, scale, queries[b, h, s])
            row = past_lengths[b] + s
            if row < capacity:
                for h in range(kv_heads):
                    _rotate_row(k[b, s, h], cos, sin, position, interleaved, one, present_k[b, h, row])
                    for d in range(v.shape[3]):
                        present_v[b, h, row, d] = v[b, s, h, d]


@_entry(numba.void(_OUT4, _OUT4, _STRIDED4, _STRIDED4, numba.boolean, _INDICES1, numba.int64))  # the past as it is bound
def finish_caches(present_k, present_v, past_k, past_v, copy_past, past_lengths, seq):  # pragma: no cover  (compiled)
    """Around the new rows of each sequence b in the caches (B, Hkv, capacity, D): the
    past's first past_lengths[b] rows before them (when ``copy_past``: the past is
    another buffer) and zeros after them. A cache that is its own past (one fixed-capacity
    buffer) gets its zeros when its sequence starts (past_lengths[b] 0): the rows after
    the new ones stay zero as later steps append, so a decode step writes only its own
    row, not the rest of the capacity (at max_length 4096 zeroing it every step made a
    135M decoder's steps 2.8x slower)."""
    batch, kv_heads, capacity, head_size = present_k.shape
    for b in range(batch):
        start = past_lengths[b]
        end = min(start + seq, capacity)
        for h in range(kv_heads):
            if copy_past:
                for t in range(start):
                    for d in range(head_size):
                        present_k[b, h, t, d] = past_k[b, h, t, d]
                        present_v[b, h, t, d] = past_v[b, h, t, d]
            if not copy_past and start > 0:
                continue
            for t in range(end, capacity):
                for d in range(head_size):
                    present_k[b, h, t, d] = 0.0
                    present_v[b, h, t, d] = 0.0


# -- the same loops as steps of a compiled program (``_numba_parallel.run_program``) --------
# Each reads its arrays from a context of int64 words (addresses and sizes; a float as the
# float64 a word holds) and calls the entry point above that a replay calls: the same code.

# rms_step: x, gamma, y, inv_std (addresses), rows, width, epsilon
RMS_X, RMS_GAMMA, RMS_Y, RMS_INV, RMS_ROWS, RMS_WIDTH, RMS_EPSILON = range(7)
RMS_WORDS = 7


@_compiled
def _floats(context, word, shape):  # pragma: no cover  (compiled)
    """The float32 array of ``shape`` at the address in ``context[word]``."""
    return numba.carray(float32_pointer(context[word]), shape)


@_compiled
def _word_float(c, word):  # pragma: no cover  (compiled)
    """The float64 that word ``word`` of the context at address ``c`` holds."""
    return numba.carray(float64_pointer(c + 8 * word), (1,))[0]


@numba.cfunc(numba.int64(numba.int64), nogil=True, cache=True)
def rms_step(c):  # pragma: no cover  (compiled)
    """``rms_rows`` as a program's step."""
    context = numba.carray(int64_pointer(c), RMS_WORDS)
    rows, width = context[RMS_ROWS], context[RMS_WIDTH]
    rms_rows(
        _floats(context, RMS_X, (rows, width)), _floats(context, RMS_GAMMA, (width,)), _word_float(c, RMS_EPSILON),
        _floats(context, RMS_Y, (rows, width)), _floats(context, RMS_INV, (rows,)),
    )
    return 0


# skip_rms_step: a, b, bias (0: none), gamma, y, inv_std, total, mean (zeroed), rows, width, epsilon
SKIP_A, SKIP_B, SKIP_BIAS, SKIP_GAMMA, SKIP_Y, SKIP_INV, SKIP_TOTAL, SKIP_MEAN, SKIP_ROWS, SKIP_WIDTH, SKIP_EPSILON = range(11)
SKIP_WORDS = 11


@numba.cfunc(numba.int64(numba.int64), nogil=True, cache=True)
def skip_rms_step(c):  # pragma: no cover  (compiled)
    """``skip_rms_rows`` as a program's step, its mean output zeroed (as the replay does)."""
    context = numba.carray(int64_pointer(c), SKIP_WORDS)
    rows, width = context[SKIP_ROWS], context[SKIP_WIDTH]
    gamma = _floats(context, SKIP_GAMMA, (width,))
    # no bias: a 1-element array (a length other than the width), as the replay passes
    bias = gamma[:1] if context[SKIP_BIAS] == 0 else _floats(context, SKIP_BIAS, (width,))
    skip_rms_rows(
        _floats(context, SKIP_A, (rows, width)), _floats(context, SKIP_B, (rows, width)), bias,
        _word_float(c, SKIP_EPSILON), gamma, _floats(context, SKIP_Y, (rows, width)),
        _floats(context, SKIP_INV, (rows,)), _floats(context, SKIP_TOTAL, (rows, width)),
    )
    mean = _floats(context, SKIP_MEAN, (rows,))
    for r in range(rows):
        mean[r] = 0.0
    return 0


# attention_step: the words of attention_job's context, then these
(
    ATT_SEQLENS, ATT_TOTALS, ATT_POSITIONS, ATT_COS, ATT_SIN, ATT_ROWS, ATT_HALF, ATT_ROTARY, ATT_INTERLEAVED,
    ATT_SCALE, ATT_POOL_MIN,
) = range(ATT_WORDS, ATT_WORDS + 11)
ATT_VIEW_WORDS = 5  # ATT_Q, ATT_K, ATT_V: each an address, then the view's four strides in bytes
ATT_Q = ATT_WORDS + 11
ATT_K = ATT_Q + ATT_VIEW_WORDS
ATT_V = ATT_K + ATT_VIEW_WORDS
ATT_STEP_WORDS = ATT_V + ATT_VIEW_WORDS


@_compiled
def _heads_view(context, at, batch, seq, heads, size):  # pragma: no cover  (compiled)
    """The (batch, seq, heads, size) float32 view whose address and byte strides are at ``at``."""
    first = numba.carray(float32_pointer(context[at]), (1,))
    strides = (context[at + 1], context[at + 2], context[at + 3], context[at + 4])
    return np.lib.stride_tricks.as_strided(first, shape=(batch, seq, heads, size), strides=strides)


@numba.cfunc(numba.int64(numba.int64), nogil=True, cache=True)
def attention_step(c):  # pragma: no cover  (compiled)
    """A decode step's attention over its cache as a program's step, as the capture's
    replay does it: the lengths and starts from seqlens_k and total_sequence_length (int32),
    the rotary positions, ``rotate_into_cache``, ``finish_caches``; answers the units of
    ``attention_job`` (alone below the context's pool threshold), or -1 where the replay
    raises (lengths outside the cache, positions past the cos/sin rows)."""
    context = numba.carray(int64_pointer(c), ATT_STEP_WORDS)
    batch, heads, seq, size = context[ATT_BATCH], context[ATT_HEADS], context[ATT_SEQ], context[ATT_SIZE]
    kv_heads, capacity = context[ATT_KV_HEADS], context[ATT_CAPACITY]
    lengths = numba.carray(int64_pointer(context[ATT_LENGTHS]), (batch,))
    starts = numba.carray(int64_pointer(context[ATT_STARTS]), (batch,))
    seqlens = numba.carray(int32_pointer(context[ATT_SEQLENS]), (batch,))
    first_prompt = seq == numba.carray(int32_pointer(context[ATT_TOTALS]), (1,))[0]
    lowest, longest, latest = 0, 0, 0
    for b in range(batch):
        lengths[b] = seqlens[b] + 1
        starts[b] = 0 if first_prompt else lengths[b] - seq
        if b == 0 or starts[b] < lowest:
            lowest = starts[b]
        if b == 0 or starts[b] > latest:
            latest = starts[b]
        if b == 0 or lengths[b] > longest:
            longest = lengths[b]
    if lowest < 0 or longest > capacity:
        return -1
    rows, rotary = context[ATT_ROWS], context[ATT_ROTARY] != 0
    positions = numba.carray(int64_pointer(context[ATT_POSITIONS]), (batch, seq))
    if rotary:
        if latest + seq > rows:
            return -1
        for b in range(batch):
            for s in range(seq):
                positions[b, s] = starts[b] + s
    cos = numba.carray(float32_pointer(context[ATT_COS]), (rows, context[ATT_HALF]))
    sin = numba.carray(float32_pointer(context[ATT_SIN]), (rows, context[ATT_HALF]))
    keys = numba.carray(float32_pointer(context[ATT_KEYS]), (batch, kv_heads, capacity, size))
    values = numba.carray(float32_pointer(context[ATT_VALUES]), (batch, kv_heads, capacity, size))
    rotate_into_cache(
        _heads_view(context, ATT_Q, batch, seq, heads, size),
        _heads_view(context, ATT_K, batch, seq, kv_heads, size),
        _heads_view(context, ATT_V, batch, seq, kv_heads, size),
        cos,
        sin,
        positions,
        context[ATT_INTERLEAVED] != 0,
        np.float32(numba.carray(float64_pointer(c + 8 * ATT_SCALE), (1,))[0]),
        numba.carray(float32_pointer(context[ATT_QUERIES]), (batch, heads, seq, size)),
        keys,
        values,
        starts,
    )
    finish_caches(keys, values, keys, values, False, starts, seq)
    units = batch * heads
    return units if units * seq * longest * size >= context[ATT_POOL_MIN] else units | ALONE
