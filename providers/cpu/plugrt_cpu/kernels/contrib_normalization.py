"""com.microsoft fused normalization and activation kernels (SkipLayerNormalization, FastGelu, ...)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._registry import declare_into, kernel, kernel_builder
from ._compiled import ROW_LOOPS, compiled_module
from .elementwise import _sigmoid_into, erf, gelu, scratch, sigmoid

_MS = "com.microsoft"
_SQRT_2_OVER_PI = 0.7978845608028654
_SQRT_HALF = 0.7071067811865476


def _work(x: np.ndarray) -> np.ndarray:
    """x in a type the statistics are computed in: float32 and float64 as they are, half types in float32."""
    return x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)


def _normalize(
    x: np.ndarray, gamma: np.ndarray, beta: np.ndarray | None, epsilon: float, simplified: bool, axis: int = -1
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(Layer or RMS) normalization of x over the axes from ``axis`` on: (y, mean, inv_std).

    y has x's type; the statistics keep their reduced axes (size 1) in the work type.
    """
    work = _work(x)
    axis = axis + x.ndim if axis < 0 else axis
    if not 0 <= axis < x.ndim:
        raise ValueError(f"normalization axis {axis} is out of range for rank {x.ndim}")
    axes = tuple(range(axis, x.ndim))
    if simplified:
        mean = np.zeros(x.shape[:axis] + (1,) * len(axes), work.dtype)
        centred = work
    else:
        mean = np.mean(work, axis=axes, keepdims=True)
        centred = work - mean
    variance = np.mean(np.square(centred), axis=axes, keepdims=True)
    inv_std = 1 / np.sqrt(variance + work.dtype.type(epsilon))
    y = centred * inv_std
    y = y * _work(gamma)
    if beta is not None:
        y += _work(beta)
    return y.astype(x.dtype, copy=False), mean, inv_std


def _skip_sum(x: np.ndarray, skip: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    hidden = x.shape[-1]
    if skip.shape[-1] != hidden:
        raise ValueError(f"skip's last dimension {skip.shape[-1]} differs from the input's hidden size {hidden}")
    total = x + skip
    if bias is not None:
        total += bias
    return total


def _check_hidden(name: str, value: np.ndarray | None, hidden: int) -> None:
    if value is not None and value.shape[-1:] != (hidden,):
        raise ValueError(f"{name} must have shape ({hidden},) to match the hidden size, got {value.shape}")


@kernel("SkipLayerNormalization", 1, domain=_MS, multi_output=True)
def skip_layer_normalization(x, skip, gamma, beta=None, bias=None, *, epsilon=1e-12):
    hidden = x.shape[-1]
    for name, value in (("gamma", gamma), ("beta", beta), ("bias", bias)):
        _check_hidden(name, value, hidden)
    total = _skip_sum(x, skip, bias)
    y, mean, inv_std = _normalize(total, gamma, beta, epsilon, simplified=False)
    return y, mean, inv_std, total


def decode_loops() -> Any:
    """The numba-compiled decode loops (``kernels._numba_decode``), or None when numba is
    not installed, the environment sets ``PLUGRT_NUMBA=0`` or they are still being built
    (see ``compiled_module``)."""
    return compiled_module("_numba_decode")


_F32 = np.dtype(np.float32)
_NO_BIAS = np.zeros(1, np.float32)  # the compiled loop's "no bias" (a length other than the width)


def _compiled_rms(x: np.ndarray, gamma: np.ndarray, *others: np.ndarray | None) -> Any:
    """The compiled loops when they apply: float32 throughout, normalization over the last
    axis with a gamma (and bias) of its width; else None (the numpy path)."""
    if x.dtype != _F32 or gamma.dtype != _F32 or x.ndim < 1 or x.shape[-1] < 2 or gamma.shape != x.shape[-1:]:
        return None
    if any(o is not None and (o.dtype != _F32 or o.shape != x.shape[-1:]) for o in others):
        return None
    if not all(v is None or v.flags.c_contiguous for v in (gamma, *others)):  # the loops' types
        return None
    return decode_loops()


def _rows(array: np.ndarray) -> np.ndarray | None:
    """A C-contiguous array as 2-D rows (a view), or None."""
    return array.reshape(-1, array.shape[-1]) if array.flags.c_contiguous else None


def _skip_rms_compiled(loops: Any, x, skip, gamma, bias, epsilon, y, mean, inv_std, total) -> bool:
    """The compiled skip + RMS loop into the four outputs; False when their layout does not fit."""
    rows = [_rows(a) for a in (y, total)]
    if rows[0] is None or rows[1] is None or not inv_std.flags.c_contiguous:
        return False
    a = _rows(np.ascontiguousarray(x))
    b = _rows(np.ascontiguousarray(skip))
    loops.skip_rms_rows(
        a, b, _NO_BIAS if bias is None else bias, float(epsilon), gamma, rows[0], inv_std.reshape(-1), rows[1]
    )
    mean.fill(0)
    return True


@kernel("SkipSimplifiedLayerNormalization", 1, domain=_MS, multi_output=True, compiled=("_numba_decode",))
def skip_simplified_layer_normalization(x, skip, gamma, bias=None, *, epsilon=1e-12):
    hidden = x.shape[-1]
    for name, value in (("gamma", gamma), ("bias", bias)):
        _check_hidden(name, value, hidden)
    loops = _compiled_rms(x, gamma, bias) if skip.shape == x.shape and skip.dtype == x.dtype else None
    if loops is not None:
        statistics = x.shape[:-1] + (1,)
        y, total = np.empty(x.shape, _F32), np.empty(x.shape, _F32)
        mean, inv_std = np.empty(statistics, _F32), np.empty(statistics, _F32)
        _skip_rms_compiled(loops, x, skip, gamma, bias, epsilon, y, mean, inv_std, total)
        return y, mean, inv_std, total
    total = _skip_sum(x, skip, bias)
    y, mean, inv_std = _normalize(total, gamma, None, epsilon, simplified=True)
    return y, mean, inv_std, total


# onnxruntime registers SimplifiedLayerNormalization in the default (ai.onnx) domain.
@kernel("SimplifiedLayerNormalization", 1, multi_output=True, compiled=("_numba_decode",))
def simplified_layer_normalization(x, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    loops = _compiled_rms(x, scale) if axis in (-1, x.ndim - 1) else None
    if loops is not None:
        y, inv_std = np.empty(x.shape, _F32), np.empty(x.shape[:-1] + (1,), _F32)
        loops.rms_rows(_rows(np.ascontiguousarray(x)), scale, float(epsilon), _rows(y), inv_std.reshape(-1))
        return y, inv_std
    y, _, inv_std = _normalize(x, scale, None, epsilon, simplified=True, axis=axis)
    return y, inv_std.astype(np.float32, copy=False)


def _rms_into(y: np.ndarray, inv_std: np.ndarray, x: np.ndarray, gamma: np.ndarray, epsilon: float, axis: int) -> None:
    """_normalize(x, gamma, None, epsilon, simplified=True, axis) written into y and inv_std
    (float32 or float64 x): the same operations in the same order, so the same bits."""
    axes = tuple(range(axis % x.ndim, x.ndim))
    squares = scratch(y, "squares", x.shape, x.dtype)
    np.square(x, out=squares)
    # np.mean's own steps, a sum then a division by the count, without its Python-level
    # bookkeeping. np.mean divides in float64 and rounds to x's type; dividing in x's type
    # by the exactly representable count gives the same bits (a quotient rounded through
    # float64 is rounded correctly for float32).
    np.add.reduce(squares, axis=axes, keepdims=True, out=inv_std)
    count = math.prod(x.shape[a] for a in axes)
    if count < 2**24:
        np.divide(inv_std, x.dtype.type(count), out=inv_std)
    else:
        np.true_divide(inv_std, np.intp(count), out=inv_std, casting="unsafe")
    np.add(inv_std, x.dtype.type(epsilon), out=inv_std)
    np.sqrt(inv_std, out=inv_std)
    np.divide(x.dtype.type(1), inv_std, out=inv_std)
    np.multiply(x, inv_std, out=y)
    np.multiply(y, gamma, out=y)


def _statistics_shape(x: np.ndarray, axis: int) -> tuple[int, ...]:
    axis = axis % x.ndim
    return x.shape[:axis] + (1,) * (x.ndim - axis)


def _filled(out, defaults: list[tuple[tuple[int, ...], np.dtype]]) -> tuple[np.ndarray, ...]:
    """The capture's output buffers (the node's outputs, a leading part of the kernel's),
    then work arrays for the outputs the node does not use."""
    out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if len(out) >= len(defaults):
        return out
    extra = [scratch(out[0], ("unused", i), shape, dtype) for i, (shape, dtype) in enumerate(defaults) if i >= len(out)]
    return out + tuple(extra)


def _simplified_layer_normalization_into(out, x, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    statistics = _statistics_shape(x, axis)
    y, inv_std = _filled(out, [(x.shape, x.dtype), (statistics, np.dtype(np.float32))])
    loops = _compiled_rms(x, scale) if axis in (-1, x.ndim - 1) else None
    if loops is not None and y.flags.c_contiguous and inv_std.flags.c_contiguous:
        loops.rms_rows(_rows(np.ascontiguousarray(x)), scale, float(epsilon), _rows(y), inv_std.reshape(-1))
        return
    if x.dtype != np.float32 or scale.dtype != np.float32:
        for buffer, value in zip((y, inv_std), simplified_layer_normalization(x, scale, axis=axis, epsilon=epsilon)):
            np.copyto(buffer, value)
        return
    _rms_into(y, inv_std, x, scale, epsilon, axis)


declare_into(_simplified_layer_normalization_into, simplified_layer_normalization)


def _simplified_layer_normalization_bind(out, x, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    """For a capture: the compiled RMS loop over these buffers as one call (a step of a
    compiled program too), or None where ``into`` is needed."""
    if axis not in (-1, x.ndim - 1) or x.ndim < 1:
        return None
    y, inv_std = _filled(out, [(x.shape, x.dtype), (_statistics_shape(x, -1), np.dtype(np.float32))])
    loops = _compiled_rms(x, scale)
    arrays = (x, y, inv_std)
    if loops is None or not all(isinstance(v, np.ndarray) and v.flags.c_contiguous for v in arrays):
        return None
    if y.shape != x.shape or inv_std.shape != _statistics_shape(x, -1) or y.dtype != _F32 or inv_std.dtype != _F32:
        return None
    arguments = (_rows(x), scale, float(epsilon), _rows(y), inv_std.reshape(-1))
    rms_rows = loops.rms_rows

    def replay() -> None:
        rms_rows(*arguments)

    words = np.zeros(loops.RMS_WORDS, np.int64)
    for word, array in ((loops.RMS_X, x), (loops.RMS_GAMMA, scale), (loops.RMS_Y, y), (loops.RMS_INV, inv_std)):
        words[word] = array.ctypes.data
    words[loops.RMS_ROWS], words[loops.RMS_WIDTH] = arguments[0].shape
    words.view(np.float64)[loops.RMS_EPSILON] = float(epsilon)
    replay.program = (loops.rms_step.address, 0, int(words.ctypes.data))  # type: ignore[attr-defined]
    replay.words = words  # type: ignore[attr-defined]
    return replay


_simplified_layer_normalization_into.bind = _simplified_layer_normalization_bind  # type: ignore[attr-defined]


def _skip_simplified_layer_normalization_into(out, x, skip, gamma, bias=None, *, epsilon=1e-12):
    statistics = _statistics_shape(x, -1)
    y, mean, inv_std, total = _filled(
        out, [(x.shape, x.dtype), (statistics, x.dtype), (statistics, x.dtype), (x.shape, x.dtype)]
    )
    loops = _compiled_rms(x, gamma, bias) if skip.shape == x.shape and skip.dtype == x.dtype else None
    if loops is not None and _skip_rms_compiled(loops, x, skip, gamma, bias, epsilon, y, mean, inv_std, total):
        return
    same = x.dtype == skip.dtype == gamma.dtype and (bias is None or bias.dtype == x.dtype)
    if x.dtype not in (np.float32, np.float64) or not same or skip.shape != x.shape:
        results = skip_simplified_layer_normalization(x, skip, gamma, bias, epsilon=epsilon)
        for buffer, value in zip((y, mean, inv_std, total), results):
            np.copyto(buffer, value)
        return
    np.add(x, skip, out=total)
    if bias is not None:
        np.add(total, bias, out=total)
    mean.fill(0)
    _rms_into(y, inv_std, total, gamma, epsilon, -1)


def _skip_simplified_layer_normalization_bind(out, x, skip, gamma, bias=None, *, epsilon=1e-12):
    """For a capture: the compiled skip + RMS loop over these buffers as one call with no
    arguments (``into`` checks its arguments on every call), or None where it does not apply."""
    if len(out) != 4 or skip.shape != x.shape or skip.dtype != x.dtype:
        return None
    y, mean, inv_std, total = out
    loops = _compiled_rms(x, gamma, bias)
    arrays = (x, skip, y, mean, inv_std, total)
    if loops is None or not all(isinstance(v, np.ndarray) and v.flags.c_contiguous for v in arrays):
        return None
    statistics = _statistics_shape(x, -1)
    if y.shape != x.shape or total.shape != x.shape or mean.shape != statistics or inv_std.shape != statistics:
        return None
    if any(v.dtype != _F32 for v in (y, mean, inv_std, total)):
        return None
    rows = (_rows(x), _rows(skip), _NO_BIAS if bias is None else bias, float(epsilon), gamma)
    outputs = (_rows(y), inv_std.reshape(-1), _rows(total))
    skip_rms_rows = loops.skip_rms_rows

    def replay() -> None:
        skip_rms_rows(*rows, *outputs)
        mean.fill(0)  # its buffer may serve another value between replays

    if mean.flags.c_contiguous:  # the same loop as a step of a compiled program (``_capture``)
        words = np.zeros(loops.SKIP_WORDS, np.int64)
        for word, array in (
            (loops.SKIP_A, x), (loops.SKIP_B, skip), (loops.SKIP_GAMMA, gamma), (loops.SKIP_Y, y),
            (loops.SKIP_INV, inv_std), (loops.SKIP_TOTAL, total), (loops.SKIP_MEAN, mean),
        ):
            words[word] = array.ctypes.data
        words[loops.SKIP_BIAS] = 0 if bias is None else bias.ctypes.data
        words[loops.SKIP_ROWS], words[loops.SKIP_WIDTH] = outputs[0].shape
        words.view(np.float64)[loops.SKIP_EPSILON] = float(epsilon)
        replay.program = (loops.skip_rms_step.address, 0, int(words.ctypes.data))  # type: ignore[attr-defined]
        replay.words = words  # type: ignore[attr-defined]  # alive as long as the replay
    return replay


declare_into(_skip_simplified_layer_normalization_into, skip_simplified_layer_normalization)
_skip_simplified_layer_normalization_into.bind = _skip_simplified_layer_normalization_bind  # type: ignore[attr-defined]


@kernel("FastGelu", 1, domain=_MS)
def fast_gelu(x, bias=None):
    work = _work(x if bias is None else x + bias)
    cube = work * work * work
    inner = work.dtype.type(_SQRT_2_OVER_PI) * (work + work.dtype.type(0.044715) * cube)
    y = work * (np.tanh(inner) + 1) * work.dtype.type(0.5)
    return y.astype(x.dtype, copy=False)


def _fast_gelu_into(out, x, bias=None):
    """fast_gelu written into ``out``: the same operations in the same order."""
    if x.dtype not in (np.float32, np.float64) or out.shape != x.shape:
        np.copyto(out, fast_gelu(x, bias))
        return
    work = x if bias is None else np.add(x, bias, out=scratch(out, "sum", x.shape, x.dtype))
    term = scratch(out, "term", x.shape, x.dtype)
    np.multiply(work, work, out=term)
    np.multiply(term, work, out=term)
    np.multiply(x.dtype.type(0.044715), term, out=term)
    np.add(work, term, out=term)
    np.multiply(x.dtype.type(_SQRT_2_OVER_PI), term, out=term)
    np.tanh(term, out=term)
    term += 1
    np.multiply(work, term, out=out)
    out *= x.dtype.type(0.5)


declare_into(_fast_gelu_into, fast_gelu)


# the erf Gelu of the standard opset 20 (its one attribute absent: approximate="none"),
# which the core's rewrite writes below opset 20
kernel_builder("Gelu", 1, domain=_MS, compiled=ROW_LOOPS)(gelu)


@kernel("BiasGelu", 1, domain=_MS)
def bias_gelu(a, b):
    work = _work(a + b)
    y = work * (erf(work * work.dtype.type(_SQRT_HALF)) + 1) * work.dtype.type(0.5)
    return y.astype(a.dtype, copy=False)


@kernel("QuickGelu", 1, domain=_MS)
def quick_gelu(x, *, alpha=1.702):
    work = _work(x)
    return (work * sigmoid(work * work.dtype.type(alpha))).astype(x.dtype, copy=False)


def _quick_gelu_into(out, x, *, alpha=1.702):
    if x.dtype not in (np.float32, np.float64):
        np.copyto(out, quick_gelu(x, alpha=alpha))
        return
    np.multiply(x, x.dtype.type(alpha), out=out)
    _sigmoid_into(out, out)
    np.multiply(x, out, out=out)


declare_into(_quick_gelu_into, quick_gelu)


@kernel("BiasAdd", 1, domain=_MS)
def bias_add(x, bias, skip):
    if x.ndim != 3 or bias.shape != (x.shape[2],) or skip.shape != x.shape:
        raise ValueError(
            f"BiasAdd needs X (N, S, C), bias (C,) and skip (N, S, C); got {x.shape}, {bias.shape}, {skip.shape}"
        )
    return x + bias + skip


def _bias_add_into(out, x, bias, skip):
    np.add(x, bias, out=out)
    out += skip


declare_into(_bias_add_into, bias_add)


def _lookup(table: np.ndarray, ids: np.ndarray, name: str) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise ValueError(f"{name} ids range over [{ids.min()}, {ids.max()}] but the table has {table.shape[0]} rows")
    return table[ids]


@kernel("EmbedLayerNormalization", 1, domain=_MS, multi_output=True)
def embed_layer_normalization(
    input_ids,
    segment_ids,
    word_embedding,
    position_embedding,
    segment_embedding=None,
    gamma=None,
    beta=None,
    mask=None,
    position_ids=None,
    *,
    epsilon=1e-12,
    mask_index_type=1,
):
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (batch, sequence), got shape {input_ids.shape}")
    if gamma is None or beta is None:
        raise ValueError("EmbedLayerNormalization needs gamma and beta")
    batch, seq = input_ids.shape
    if position_ids is None:
        position_ids = np.arange(seq)[None, :]
    position_ids = np.broadcast_to(np.asarray(position_ids, dtype=np.int64), (batch, seq))
    total = _lookup(word_embedding, input_ids, "input") + _lookup(position_embedding, position_ids, "position")
    if segment_ids is not None:
        if segment_embedding is None:
            raise ValueError("segment_ids need a segment_embedding")
        total += _lookup(segment_embedding, segment_ids, "segment")
    y, _, _ = _normalize(total, gamma, beta, epsilon, simplified=False)
    if mask is None:
        mask_index = np.zeros(batch, np.int32)
    else:
        # the count of attended words per sequence
        mask_index = np.count_nonzero(np.asarray(mask), axis=1).astype(np.int32)
    return y, mask_index, total
