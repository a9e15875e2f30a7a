"""Kernel math written once over an array namespace ``xp`` (numpy here, cupy on a GPU).

Every function takes ``xp`` first and uses only what numpy and cupy share, so the numpy
binding is the oracle-checked copy of exactly what runs on the device. Loops run over
kernel taps or window offsets (a handful), never over elements.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

__all__ = [
    "conv_pads",
    "conv",
    "pool",
    "global_pool",
    "batch_normalization",
    "lrn",
    "softmax",
    "log_softmax",
    "layer_normalization",
    "erf",
    "gelu",
    "silu",
    "resize",
    "gemm",
]

MatMul = Callable[[Any, Any], Any]


def conv_pads(
    in_shape: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    pads: Sequence[int] | None,
    auto_pad: str,
    ceil_mode: bool = False,
) -> tuple[list[int], list[int], list[int]]:
    """(pads begin, pads end, output spatial shape) as the ONNX Conv/Pool specs define them."""
    rank = len(in_shape)
    begin, end, out = [0] * rank, [0] * rank, [0] * rank
    for i in range(rank):
        effective = (kernel[i] - 1) * dilations[i] + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out[i] = -(-in_shape[i] // strides[i])
            total = max(0, (out[i] - 1) * strides[i] + effective - in_shape[i])
            small, large = total // 2, total - total // 2
            begin[i], end[i] = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
            continue
        if auto_pad == "VALID":
            begin[i] = end[i] = 0
        else:
            begin[i], end[i] = (pads[i], pads[i + rank]) if pads else (0, 0)
        span = in_shape[i] + begin[i] + end[i] - effective
        out[i] = (-(-span // strides[i]) if ceil_mode else span // strides[i]) + 1
        if ceil_mode and (out[i] - 1) * strides[i] >= in_shape[i] + begin[i]:
            out[i] -= 1  # the last window must start inside the input or its begin pad
    return begin, end, out


def _windows(xp: Any, x: Any, kernel, strides, dilations, begin, end, out, fill: float) -> list:
    """One strided view per kernel tap of the padded ``x``: each is (N, C, *out)."""
    rank = len(kernel)
    extra = [max(0, (out[i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - (x.shape[2 + i] + begin[i] + end[i])) for i in range(rank)]
    if any(begin) or any(end) or any(extra):
        widths = [(0, 0), (0, 0)] + [(begin[i], end[i] + extra[i]) for i in range(rank)]
        x = xp.pad(x, widths, mode="constant", constant_values=fill)
    taps = []
    for offsets in _product([range(k) for k in kernel]):
        index = [slice(None), slice(None)]
        for i, o in enumerate(offsets):
            start = o * dilations[i]
            index.append(slice(start, start + (out[i] - 1) * strides[i] + 1, strides[i]))
        taps.append(x[tuple(index)])
    return taps


def _product(ranges: list) -> list[tuple[int, ...]]:
    result: list[tuple[int, ...]] = [()]
    for r in ranges:
        result = [prefix + (v,) for prefix in result for v in r]
    return result


def conv(
    xp: Any,
    x: Any,
    w: Any,
    b: Any = None,
    *,
    auto_pad: str = "NOTSET",
    dilations: Sequence[int] | None = None,
    group: int = 1,
    kernel_shape: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
    matmul: MatMul | None = None,
) -> Any:
    """ONNX Conv (any spatial rank, grouped and depthwise) as im2col + one batched GEMM."""
    matmul = matmul or xp.matmul
    spatial = x.ndim - 2
    kernel = list(kernel_shape or w.shape[2:])
    strides = list(strides or [1] * spatial)
    dilations = list(dilations or [1] * spatial)
    begin, end, out = conv_pads(x.shape[2:], kernel, strides, dilations, pads, auto_pad)
    n, c = x.shape[:2]
    m = w.shape[0]
    taps = _windows(xp, x, kernel, strides, dilations, begin, end, out, 0.0)
    positions = math.prod(out)
    # columns: (N, G, C/G * taps, positions), channel-major to match W's (M, C/G, *kernel)
    cols = xp.stack(taps, axis=2).reshape(n, group, (c // group) * len(taps), positions)
    weights = w.reshape(group, m // group, (c // group) * len(taps))
    y = matmul(weights, cols).reshape(n, m, *out)
    if b is not None:
        y = y + b.reshape((1, m) + (1,) * spatial)
    return y


def pool(
    xp: Any,
    x: Any,
    mode: str,
    *,
    kernel_shape: Sequence[int],
    auto_pad: str = "NOTSET",
    ceil_mode: int = 0,
    count_include_pad: int = 0,
    dilations: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> Any:
    """MaxPool / AveragePool ("max" / "average") by reducing over the kernel's taps."""
    spatial = x.ndim - 2
    kernel = list(kernel_shape)
    strides = list(strides or [1] * spatial)
    dilations = list(dilations or [1] * spatial)
    begin, end, out = conv_pads(x.shape[2:], kernel, strides, dilations, pads, auto_pad, bool(ceil_mode))
    if mode == "max":
        taps = _windows(xp, x, kernel, strides, dilations, begin, end, out, -math.inf)
        y = taps[0].copy()
        for tap in taps[1:]:
            xp.maximum(y, tap, out=y)
        return y
    taps = _windows(xp, x, kernel, strides, dilations, begin, end, out, 0.0)
    y = taps[0].astype(x.dtype, copy=True)
    for tap in taps[1:]:
        y += tap
    if count_include_pad:
        # pads count as positions; the area past the end that ceil_mode adds does not
        padded = tuple(s + b + e for s, b, e in zip(x.shape[2:], begin, end))
        ones = xp.ones((1, 1) + padded, x.dtype)
        zeros = [0] * spatial
        count = sum(_windows(xp, ones, kernel, strides, dilations, zeros, zeros, out, 0.0))
    else:
        ones = xp.ones((1, 1) + tuple(x.shape[2:]), x.dtype)
        count = sum(_windows(xp, ones, kernel, strides, dilations, begin, end, out, 0.0))
    return y / xp.maximum(count, 1)


def global_pool(xp: Any, x: Any, mode: str) -> Any:
    axes = tuple(range(2, x.ndim))
    return x.max(axis=axes, keepdims=True) if mode == "max" else x.mean(axis=axes, keepdims=True)


def batch_normalization(xp: Any, x: Any, scale: Any, bias: Any, mean: Any, var: Any, *, epsilon: float = 1e-5) -> Any:
    """Inference BatchNormalization: one multiply-add per element with per-channel factors."""
    shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    factor = (scale / xp.sqrt(var + epsilon)).astype(x.dtype)
    shift = (bias - mean * factor).astype(x.dtype)
    return x * factor.reshape(shape) + shift.reshape(shape)


def lrn(xp: Any, x: Any, *, size: int, alpha: float = 1e-4, beta: float = 0.75, bias: float = 1.0) -> Any:
    """LRN across channels: the window sum of squares from a cumulative sum over channels."""
    squares = (x.astype(xp.float32) ** 2)
    before, after = (size - 1) // 2, size // 2  # the spec's floor/ceil split of the window
    widths = [(0, 0), (before + 1, after)] + [(0, 0)] * (x.ndim - 2)
    cumulative = xp.cumsum(xp.pad(squares, widths, mode="constant"), axis=1)
    c = x.shape[1]
    window = cumulative[:, size : size + c] - cumulative[:, 0:c]
    return (x / (bias + (alpha / size) * window) ** beta).astype(x.dtype)


def _along(x: Any, axis: int, coerce_2d: bool) -> tuple[Any, int]:
    """``x`` and the axis to normalise over: opset < 13 flattens the axes from ``axis`` on."""
    if not coerce_2d:
        return x, axis
    axis = axis % x.ndim
    return x.reshape(math.prod(x.shape[:axis]), -1), 1


def softmax(xp: Any, x: Any, *, axis: int = -1, coerce_2d: bool = False) -> Any:
    """Softmax over ``axis`` (opset 13), or over the flattened axes from ``axis`` on (opset < 13)."""
    rows, axis = _along(x, axis, coerce_2d)
    e = xp.exp(rows - rows.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).reshape(x.shape)


def log_softmax(xp: Any, x: Any, *, axis: int = -1, coerce_2d: bool = False) -> Any:
    rows, axis = _along(x, axis, coerce_2d)
    shifted = rows - rows.max(axis=axis, keepdims=True)
    return (shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))).reshape(x.shape)


def layer_normalization(xp: Any, x: Any, scale: Any, bias: Any = None, *, axis: int = -1, epsilon: float = 1e-5) -> tuple:
    """LayerNormalization in float32 (stash_type 1) whatever x's dtype: (y, mean, inv_std_dev)."""
    axes = tuple(range(axis % x.ndim, x.ndim))
    x32 = x.astype(xp.float32)
    mean = x32.mean(axis=axes, keepdims=True)
    centered = x32 - mean
    inv_std = 1.0 / xp.sqrt((centered * centered).mean(axis=axes, keepdims=True) + epsilon)
    y = centered * inv_std * scale.astype(xp.float32)
    if bias is not None:
        y = y + bias.astype(xp.float32)
    return y.astype(x.dtype), mean, inv_std


def erf(xp: Any, x: Any) -> Any:
    """erf to ~1.2e-7 (Numerical Recipes' erfc Chebyshev fit), in float32 or wider; numpy has no erf."""
    z = xp.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    value = 1.0 - t * xp.exp(poly)
    return xp.where(x >= 0, value, -value)


def gelu(xp: Any, x: Any, *, approximate: str = "none") -> Any:
    x32 = x.astype(xp.float32)
    if approximate == "tanh":
        inner = math.sqrt(2.0 / math.pi) * (x32 + 0.044715 * x32 * x32 * x32)
        y = 0.5 * x32 * (1.0 + xp.tanh(inner))
    else:
        y = 0.5 * x32 * (1.0 + erf(xp, x32 * (1.0 / math.sqrt(2.0))))
    return y.astype(x.dtype)


def silu(xp: Any, x: Any) -> Any:
    """x * sigmoid(x) (SiLU, swish) in float32."""
    x32 = x.astype(xp.float32)
    return (x32 / (1.0 + xp.exp(-x32))).astype(x.dtype)


def _source_coordinates(xp: Any, out_size: int, in_size: int, scale: float, mode: str) -> Any:
    i = xp.arange(out_size, dtype=xp.float64)
    if mode == "half_pixel":
        return (i + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (i + 0.5) / scale - 0.5 if out_size > 1 else xp.zeros(out_size, xp.float64)
    if mode == "align_corners":
        return i * (in_size - 1) / (out_size - 1) if out_size > 1 else xp.zeros(out_size, xp.float64)
    if mode == "asymmetric":
        return i / scale
    raise ValueError(f"coordinate_transformation_mode {mode!r}")


def resize(
    xp: Any,
    x: Any,
    out_shape: Sequence[int],
    scales: Sequence[float],
    *,
    mode: str = "nearest",
    coordinate_transformation_mode: str = "half_pixel",
    nearest_mode: str = "round_prefer_floor",
) -> Any:
    """Resize (nearest or linear), separably: one gather (and blend, for linear) per resized axis."""
    y = x
    for axis, (size, scale) in enumerate(zip(out_shape, scales)):
        in_size = x.shape[axis]
        if size == in_size and scale == 1.0:
            continue
        coords = _source_coordinates(xp, size, in_size, scale, coordinate_transformation_mode)
        if mode == "nearest":
            if nearest_mode == "round_prefer_floor":
                index = xp.ceil(coords - 0.5)
            elif nearest_mode == "round_prefer_ceil":
                index = xp.floor(coords + 0.5)
            elif nearest_mode == "floor":
                index = xp.floor(coords)
            else:
                index = xp.ceil(coords)
            index = xp.clip(index, 0, in_size - 1).astype(xp.int64)
            y = xp.take(y, index, axis=axis)
            continue
        coords = xp.clip(coords, 0, in_size - 1)
        low = xp.floor(coords).astype(xp.int64)
        high = xp.minimum(low + 1, in_size - 1)
        weight = (coords - low).astype(xp.float32)
        shape = [1] * x.ndim
        shape[axis] = size
        weight = weight.reshape(shape)
        a, b = xp.take(y, low, axis=axis), xp.take(y, high, axis=axis)
        y = (a + (b - a) * weight).astype(x.dtype)
    return y


def gemm(
    xp: Any, a: Any, b: Any, c: Any = None, *, alpha: float = 1.0, beta: float = 1.0, transA: int = 0, transB: int = 0,
    matmul: MatMul | None = None,
) -> Any:
    matmul = matmul or xp.matmul
    y = matmul(a.T if transA else a, b.T if transB else b)
    # Python scalars, never xp.asarray: a host-to-device copy cannot be captured
    if alpha != 1.0:
        y = (y * alpha).astype(y.dtype, copy=False)
    if c is not None and beta != 0.0:
        y = (y + (c if beta == 1.0 else c * beta)).astype(y.dtype, copy=False)
    return y
