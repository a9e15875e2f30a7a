"""Quantisation and casting kernels: Cast, CastLike, BitCast, QuantizeLinear, DequantizeLinear, QLinear*."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import onnx_ir as ir
from numpy.lib.stride_tricks import sliding_window_view

from .._dtypes import numpy_dtype
from .._registry import kernel

_OBJECT = np.dtype(object)

# float8 formats with a saturating cast (Cast's `saturate` attribute applies to them).
_FLOAT8 = frozenset(
    np.dtype(t)
    for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz)
)
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
# Small floats without inf/nan encodings: ml_dtypes' cast already saturates them.
_SMALL_FLOATS = frozenset(
    np.dtype(t) for t in (ml_dtypes.float4_e2m1fn, ml_dtypes.float6_e2m3fn, ml_dtypes.float6_e3m2fn)
)
_SUB_BYTE_INTS = frozenset(np.dtype(t) for t in (ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.int2, ml_dtypes.uint2))
_ML_FLOATS = _FLOAT8 | _SMALL_FLOATS | {_E8M0, np.dtype(ml_dtypes.bfloat16)}

# Integer ranges of the quantised types (QuantizeLinear saturates to these).
_INTEGER_RANGES: dict[np.dtype, tuple[int, int]] = {
    np.dtype(np.uint8): (0, 255),
    np.dtype(np.int8): (-128, 127),
    np.dtype(np.uint16): (0, 65535),
    np.dtype(np.int16): (-32768, 32767),
    np.dtype(ml_dtypes.uint4): (0, 15),
    np.dtype(ml_dtypes.int4): (-8, 7),
    np.dtype(ml_dtypes.uint2): (0, 3),
    np.dtype(ml_dtypes.int2): (-2, 1),
}


def _target_dtype(to: int | str) -> np.dtype:
    """The numpy dtype for Cast's `to` (an enum value, or a type name before opset 6)."""
    if isinstance(to, (str, bytes)):
        name = to.decode() if isinstance(to, bytes) else to
        try:
            to = int(ir.DataType[name.upper()])
        except KeyError:
            raise ValueError(f"Cast: unknown type name {name!r} for attribute 'to'") from None
    return numpy_dtype(to)


def _as_str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else value


# ----------------------------------------------------------------------------- Cast


def _to_float8e8m0(x: np.ndarray, saturate: bool, round_mode: str) -> np.ndarray:
    """float -> float8e8m0 by exponent extraction, as onnx.numpy_helper.to_float8e8m0."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.uint16)
    special = exponent == 0xFF
    if round_mode == "up":
        round_up = ((bits & 0x7FFFFF) > 0) & ~special
    elif round_mode == "nearest":
        guard = (bits & 0x400000) > 0
        rest = (bits & 0x3FFFFF) > 0
        round_up = guard & (rest | (exponent > 0)) & ~special
    elif round_mode == "down":
        round_up = np.zeros(exponent.shape, dtype=bool)
    else:
        raise ValueError(f"Cast: unsupported round_mode {round_mode!r}; expected 'up', 'down' or 'nearest'")
    if saturate:
        round_up &= exponent != 0xFE
    exponent += round_up
    out = np.where(special, np.uint16(0xFF), exponent).astype(np.uint8)
    return out.view(ml_dtypes.float8_e8m0fnu)


def _saturate(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Cast to a float8 type, clamping out-of-range values (and infinities) to its largest finite value."""
    info = ml_dtypes.finfo(dtype)
    low, high = float(info.min), float(info.max)
    return np.clip(x, x.dtype.type(low), x.dtype.type(high)).astype(dtype)


def _parse_strings(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Numbers from strings: plain or scientific notation, 'INF'/'+INF'/'-INF'/'NaN' in any case."""
    text = np.asarray(x, dtype=np.str_)
    if dtype.kind in "iu":
        try:
            return text.astype(dtype)
        except (ValueError, OverflowError):
            # "100.5" -> 100, as the spec allows: parse as a float then truncate.
            with np.errstate(invalid="ignore", over="ignore"):
                return text.astype(np.float64).astype(dtype)
    values = text.astype(np.float64)
    if dtype == np.bool_:
        return values != 0
    with np.errstate(invalid="ignore", over="ignore"):
        return _cast(values, dtype, True, "up")


def _format_strings(x: np.ndarray) -> np.ndarray:
    """Strings from numbers, formatted as numpy formats them (onnx.reference does the same)."""
    if x.dtype in _ML_FLOATS or x.dtype in _SUB_BYTE_INTS:
        x = x.astype(np.float32)
    return x.astype(np.str_).astype(object)


def _cast(x: np.ndarray, dtype: np.dtype, saturate: int, round_mode: str) -> np.ndarray:
    if x.dtype == dtype:
        return x
    if dtype == _OBJECT:
        return _format_strings(x)
    if x.dtype == _OBJECT or x.dtype.kind in "US":
        return _parse_strings(x, dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        if dtype in _FLOAT8 and saturate:
            if x.dtype not in (np.float16, np.float32, np.float64):
                x = x.astype(np.float32 if x.dtype in _ML_FLOATS else np.float64)
            return _saturate(x, dtype)
        if dtype == _E8M0:
            return _to_float8e8m0(x, bool(saturate), round_mode)
        return x.astype(dtype)


# types numpy's own conversion does not cast as ONNX does (saturation, sub-byte packing)
_NOT_NUMPY_CAST = _ML_FLOATS | _SUB_BYTE_INTS


def _cast_into(out, x, *, to, saturate=1, round_mode="up"):
    """Cast into ``out``: numpy's own conversion between plain numeric types, the kernel otherwise."""
    numeric = x.dtype.kind in "biuf" and out.dtype.kind in "biuf"
    if numeric and x.dtype not in _NOT_NUMPY_CAST and out.dtype not in _NOT_NUMPY_CAST:
        with np.errstate(invalid="ignore", over="ignore"):
            np.copyto(out, x, casting="unsafe")
        return
    np.copyto(out, _cast(x, _target_dtype(to), saturate, _as_str(round_mode)))


# later versions only add types
@kernel("Cast", 1, 6, 19, 24, into=_cast_into)
def cast(x, *, to, saturate=1, round_mode="up"):
    return _cast(x, _target_dtype(to), saturate, _as_str(round_mode))


@kernel("CastLike", 15, 19, 24)
def cast_like(x, like, *, saturate=1, round_mode="up"):
    return _cast(x, like.dtype, saturate, _as_str(round_mode))


@kernel("BitCast", 26)
def bit_cast(x, *, to):
    dtype = _target_dtype(to)
    if dtype == _OBJECT or x.dtype == _OBJECT:
        raise NotImplementedError("BitCast from or to STRING is not defined")
    if dtype in _SUB_BYTE_INTS or x.dtype in _SUB_BYTE_INTS or dtype in _SMALL_FLOATS or x.dtype in _SMALL_FLOATS:
        raise NotImplementedError(f"BitCast between sub-byte types is not supported ({x.dtype} -> {dtype})")
    if dtype.itemsize != x.dtype.itemsize:
        raise ValueError(
            f"BitCast needs types of the same width: {x.dtype} is {x.dtype.itemsize * 8} bits, "
            f"{dtype} is {dtype.itemsize * 8} bits"
        )
    return x.view(dtype)


# ----------------------------------------------------------------------------- Quantize / Dequantize


def _expand_parameter(value: np.ndarray, shape: tuple[int, ...], axis: int, block_size: int) -> np.ndarray:
    """Reshape (per-axis) or repeat (blocked) a scale or zero point so it broadcasts to `shape`."""
    if value.ndim == 0:
        return value
    if value.size == 1:
        return value.reshape(())
    axis = axis + len(shape) if axis < 0 else axis
    if not 0 <= axis < len(shape):
        raise ValueError(f"quantization axis {axis} is out of range for input rank {len(shape)}")
    if not block_size:
        if value.ndim != 1 or value.shape[0] != shape[axis]:
            raise ValueError(
                f"per-axis scale/zero point must be 1-D of length {shape[axis]} (axis {axis}); got shape {value.shape}"
            )
        dims = [1] * len(shape)
        dims[axis] = value.size
        return value.reshape(dims)
    if block_size < 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if value.ndim != len(shape) or -(-shape[axis] // block_size) != value.shape[axis]:
        raise ValueError(
            f"blocked scale/zero point of shape {value.shape} does not match input shape {shape} "
            f"with block_size {block_size} on axis {axis}"
        )
    value = np.repeat(value, block_size, axis=axis)
    if value.shape[axis] != shape[axis]:
        value = value.take(np.arange(shape[axis]), axis=axis)
    if value.shape != tuple(shape):
        raise ValueError(f"blocked scale/zero point of shape {value.shape} does not match input shape {shape}")
    return value


def _quantize(x, y_scale, y_zero_point, axis, saturate, block_size, output_dtype, precision):
    out_dtype = numpy_dtype(output_dtype) if output_dtype else None
    if y_zero_point is not None:
        if out_dtype is not None and out_dtype != y_zero_point.dtype:
            raise ValueError(
                f"QuantizeLinear: output_dtype {out_dtype} does not match the zero point's type {y_zero_point.dtype}"
            )
        out_dtype = y_zero_point.dtype
    out_dtype = out_dtype or np.dtype(np.uint8)
    scale = _expand_parameter(y_scale, x.shape, axis, block_size)
    if scale.dtype == _E8M0:
        scale = scale.astype(np.float32)
    if precision:
        compute = numpy_dtype(precision)
        scaled = np.asarray(x.astype(compute) / scale.astype(compute))
    else:
        scaled = np.asarray(x / scale)

    if out_dtype in _INTEGER_RANGES:
        low, high = _INTEGER_RANGES[out_dtype]
        if scaled.dtype in (np.float32, np.float64):
            q = np.rint(scaled, out=scaled)
        else:
            q = np.rint(scaled).astype(np.float32)  # float16/bfloat16 cannot hold the zero-point sum exactly
        if y_zero_point is not None:
            zp = _expand_parameter(y_zero_point, x.shape, axis, block_size)
            q += zp.astype(q.dtype)
        np.clip(q, low, high, out=q)
        with np.errstate(invalid="ignore"):  # NaN has no integer value; numpy's cast decides
            return q.astype(out_dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        if out_dtype in _FLOAT8:
            return _saturate(scaled, out_dtype) if saturate else scaled.astype(out_dtype)
        if out_dtype in _SMALL_FLOATS:
            if y_zero_point is not None:
                zp = _expand_parameter(y_zero_point, x.shape, axis, block_size)
                scaled = scaled + zp.astype(np.float32)
            return scaled.astype(out_dtype)
    raise NotImplementedError(f"QuantizeLinear: {out_dtype} is not a quantized output type")


# 24, 25 and 28 only add types
@kernel("QuantizeLinear", 10, 13, 19, 21, 23)
def quantize_linear(
    x, y_scale, y_zero_point=None, *, axis=1, saturate=1, block_size=0, output_dtype=0, precision=0
):
    return _quantize(x, y_scale, y_zero_point, axis, saturate, block_size, output_dtype, precision)


def _dequantize(x, x_scale, x_zero_point, axis, block_size, output_dtype):
    if x.dtype == np.int32:
        # exact in float64 (float32 would round |x| > 2**24)
        dx = x.astype(np.float64)
    else:
        dx = x.astype(np.float32)
    if x_zero_point is not None and x.dtype not in _FLOAT8 and x.dtype not in _SMALL_FLOATS:
        if x_zero_point.dtype != x.dtype:
            raise ValueError(f"DequantizeLinear: zero point type {x_zero_point.dtype} differs from input type {x.dtype}")
        zp = _expand_parameter(x_zero_point, x.shape, axis, block_size)
        dx -= zp.astype(dx.dtype)
    elif x_zero_point is not None and x.dtype in _FLOAT8:
        if np.any(x_zero_point.astype(np.float32) != 0):
            raise NotImplementedError("DequantizeLinear: a non-zero zero point is not defined for float8 inputs")
    scale = _expand_parameter(x_scale, x.shape, axis, block_size)
    if scale.dtype in _ML_FLOATS:
        scale = scale.astype(np.float32)
    y = np.asarray(dx * scale)
    if output_dtype:
        out = numpy_dtype(output_dtype)
    else:
        out = x_scale.dtype
        if out == _E8M0:
            raise ValueError("DequantizeLinear: output_dtype is required when x_scale is float8e8m0")
    return y.astype(out, copy=False)


@kernel("DequantizeLinear", 10, 13, 19, 21, 23)
def dequantize_linear(x, x_scale, x_zero_point=None, *, axis=1, block_size=0, output_dtype=0):
    return _dequantize(x, x_scale, x_zero_point, axis, block_size, output_dtype)


@kernel("DynamicQuantizeLinear", 11, multi_output=True)
def dynamic_quantize_linear(x):
    qmax = np.float32(255)
    high = np.float32(max(0.0, float(np.max(x)))) if x.size else np.float32(0)
    low = np.float32(min(0.0, float(np.min(x)))) if x.size else np.float32(0)
    scale = np.float32(1.0 if high == low else high - low) / qmax
    zero_point = np.rint(np.clip(np.float32(0) - low / scale, 0, qmax))
    y = np.asarray(np.rint(x / scale))
    y += zero_point
    np.clip(y, 0, qmax, out=y)
    return y.astype(np.uint8), np.array(scale, dtype=x.dtype), np.array(zero_point, dtype=np.uint8)


# ----------------------------------------------------------------------------- integer matmul / conv


def _exact_float(k: int, *dtypes: np.dtype) -> np.dtype:
    """float32 when every dot product of length `k` of these integer operands is exact in it."""
    bound = float(k)
    for dtype in dtypes:
        info = np.iinfo(dtype) if dtype.kind in "iu" else ml_dtypes.iinfo(dtype)
        bound *= float(info.max) - float(info.min)
    return np.dtype(np.float32) if bound < 2.0**24 else np.dtype(np.float64)


def _centered(x: np.ndarray, zero_point, compute: np.dtype, shape=None) -> np.ndarray:
    """x - zero_point as an exact float array of dtype `compute`."""
    out = x.astype(compute)
    if zero_point is not None:
        zp = np.asarray(zero_point).astype(compute)
        if shape is not None and zp.ndim == 1 and zp.size > 1:
            zp = zp.reshape(shape)
        out -= zp
    return out


def _quant_multiplier(*scales) -> np.ndarray:
    a_scale, b_scale, y_scale = scales
    return np.asarray(a_scale * b_scale / y_scale)


def _requantize(acc: np.ndarray, multiplier: np.ndarray, y_zero_point, out_dtype: np.dtype, round_fn) -> np.ndarray:
    y = acc.astype(np.float64, copy=False) * multiplier.astype(np.float64)
    if y_zero_point is not None:
        y += np.asarray(y_zero_point).astype(np.float64)
    info = np.iinfo(out_dtype)
    np.clip(y, info.min, info.max, out=y)
    return round_fn(y).astype(out_dtype)


def _row_param(value, rank: int):
    """A per-row (size M) QLinearMatMul parameter of `a`, shaped to broadcast over (..., M, K)."""
    value = np.asarray(value)
    if value.size == 1:
        return value.reshape(())
    if value.ndim != 1:
        raise NotImplementedError(f"QLinearMatMul: a's scale/zero point must be a scalar or 1-D, got shape {value.shape}")
    return value.reshape(-1, 1)


def _col_param(value):
    value = np.asarray(value)
    if value.size == 1:
        return value.reshape(())
    if value.ndim != 1:
        raise NotImplementedError(f"QLinearMatMul: b's scale/zero point must be a scalar or 1-D, got shape {value.shape}")
    return value


@kernel("QLinearMatMul", 10, 21)
def qlinear_matmul(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point):
    a_scale, a_zero_point = _row_param(a_scale, a.ndim), _row_param(a_zero_point, a.ndim)
    b_scale, b_zero_point = _col_param(b_scale), _col_param(b_zero_point)
    k = a.shape[-1]
    compute = _exact_float(k, a.dtype, b.dtype)
    acc = np.matmul(_centered(a, a_zero_point, compute), _centered(b, b_zero_point, compute))
    multiplier = _quant_multiplier(a_scale, b_scale, y_scale)
    out_dtype = y_zero_point.dtype if y_zero_point is not None else a.dtype
    return _requantize(acc, multiplier, y_zero_point, out_dtype, np.rint)


def _conv_pads(in_shape, kernel_shape, strides, dilations, pads, auto_pad):
    nsp = len(in_shape)
    auto_pad = _as_str(auto_pad)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begins, ends = [], []
        for size, k, s, d in zip(in_shape, kernel_shape, strides, dilations):
            out = -(-size // s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
            small, large = total // 2, total - total // 2
            begins.append(small if auto_pad == "SAME_UPPER" else large)
            ends.append(large if auto_pad == "SAME_UPPER" else small)
        return begins, ends
    if auto_pad == "VALID":
        return [0] * nsp, [0] * nsp
    if auto_pad not in ("NOTSET", ""):
        raise NotImplementedError(f"auto_pad={auto_pad!r} is not supported")
    pads = list(pads) if pads else [0] * (2 * nsp)
    return pads[:nsp], pads[nsp:]


def _conv_accumulate(x, w, *, group, kernel_shape, strides, pads, dilations, auto_pad):
    """N-D grouped convolution of exact float arrays through im2col and one batched matmul.

    x: (N, C, *spatial), w: (M, C/group, *kernel) -> (N, M, *out)."""
    n, c = x.shape[:2]
    m = w.shape[0]
    nsp = x.ndim - 2
    kernel = list(kernel_shape) if kernel_shape else list(w.shape[2:])
    if tuple(kernel) != tuple(w.shape[2:]):
        raise ValueError(f"kernel_shape {kernel} does not match the weight shape {w.shape}")
    strides = list(strides) if strides else [1] * nsp
    dilations = list(dilations) if dilations else [1] * nsp
    if c % group or m % group or w.shape[1] != c // group:
        raise ValueError(f"input channels {c} / weight shape {w.shape} do not fit group={group}")
    begins, ends = _conv_pads(x.shape[2:], kernel, strides, dilations, pads, auto_pad)
    if any(begins) or any(ends):
        x = np.pad(x, [(0, 0), (0, 0)] + list(zip(begins, ends)))
    extents = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    spatial_axes = tuple(range(2, 2 + nsp))
    windows = sliding_window_view(x, extents, axis=spatial_axes)
    index = (slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides)
    index += tuple(slice(None, None, d) for d in dilations)
    windows = windows[index]  # (N, C, *out, *kernel)
    out_shape = windows.shape[2 : 2 + nsp]
    positions = int(np.prod(out_shape))
    kc = (c // group) * int(np.prod(kernel))
    # (N, C, *out, *k) -> (N, group, *out, C/group, *k) -> (N, group, positions, kc)
    windows = windows.reshape((n, group, c // group) + out_shape + tuple(kernel))
    order = (0, 1) + tuple(range(3, 3 + nsp)) + (2,) + tuple(range(3 + nsp, 3 + 2 * nsp))
    cols = windows.transpose(order).reshape(n, group, positions, kc)
    weights = w.reshape(group, m // group, kc).transpose(0, 2, 1)  # (group, kc, M/group)
    out = np.matmul(cols, weights)  # (N, group, positions, M/group)
    return out.transpose(0, 1, 3, 2).reshape((n, m) + out_shape)


def _integer_conv(x, x_zero_point, w, w_zero_point, **conv_attributes) -> np.ndarray:
    """Convolution of (x - x_zero_point) with (w - w_zero_point, per output channel or scalar),
    exact: integers in a float type wide enough for every accumulated sum."""
    compute = _exact_float(w.size // w.shape[0], x.dtype, w.dtype)
    xc = _centered(x, x_zero_point, compute)
    wc = _centered(w, w_zero_point, compute, shape=(-1,) + (1,) * (w.ndim - 1))
    return _conv_accumulate(xc, wc, **conv_attributes)


@kernel("ConvInteger", 10)
def conv_integer(
    x, w, x_zero_point=None, w_zero_point=None, *, auto_pad="NOTSET", dilations=None, group=1,
    kernel_shape=None, pads=None, strides=None,
):
    acc = _integer_conv(
        x, x_zero_point, w, w_zero_point, group=group, kernel_shape=kernel_shape, strides=strides, pads=pads,
        dilations=dilations, auto_pad=auto_pad,
    )
    return np.rint(acc).astype(np.int32)


@kernel("QLinearConv", 10)
def qlinear_conv(
    x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, B=None, *,
    auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None, strides=None,
):
    acc = _integer_conv(
        x, x_zero_point, w, w_zero_point, group=group, kernel_shape=kernel_shape, strides=strides, pads=pads,
        dilations=dilations, auto_pad=auto_pad,
    ).astype(np.float64, copy=False)
    channel_shape = (1, -1) + (1,) * (x.ndim - 2)
    if B is not None:
        acc += B.astype(np.float64).reshape(channel_shape)
    w_scale = np.asarray(w_scale)
    if w_scale.size > 1:
        if w_scale.ndim != 1 or w_scale.size != w.shape[0]:
            raise ValueError(f"QLinearConv: w_scale must be a scalar or have one value per output channel, got {w_scale.shape}")
        w_scale = w_scale.reshape(channel_shape)
    else:
        w_scale = w_scale.reshape(())
    multiplier = _quant_multiplier(np.asarray(x_scale).reshape(()), w_scale, np.asarray(y_scale).reshape(()))
    out_dtype = y_zero_point.dtype if y_zero_point is not None else x.dtype
    zp = None if y_zero_point is None else np.asarray(y_zero_point).reshape(())
    return _requantize(acc, multiplier, zp, out_dtype, np.round)
