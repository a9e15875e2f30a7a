"""Kernels that make tensors: Constant, ConstantOfShape, Range, EyeLike, and the random ops."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from .._dtypes import numpy_dtype
from .._registry import KernelContext, kernel, kernel_builder

_FLOAT = 1  # TensorProto.FLOAT
_INT32 = 6  # TensorProto.INT32
_LOW_PRECISION_FLOATS = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def _constant_value(attributes: dict) -> np.ndarray:
    if attributes.get("sparse_value") is not None:
        raise NotImplementedError("Constant with a sparse_value attribute is not supported; use a dense 'value'")
    value = attributes.get("value")
    if value is not None:
        return np.asarray(value)
    for name, dtype in (
        ("value_float", np.float32),
        ("value_floats", np.float32),
        ("value_int", np.int64),
        ("value_ints", np.int64),
        ("value_string", object),  # strings are object arrays of str
        ("value_strings", object),
    ):
        if attributes.get(name) is not None:
            return np.array(attributes[name], dtype=dtype)
    raise ValueError("Constant has none of value, value_float(s), value_int(s), value_string(s)")


@kernel_builder("Constant", 1, 11, 12)
def constant(ctx: KernelContext):
    value = _constant_value(ctx.attributes)
    # Every run hands out the same array, so it must not be written through.
    value.flags.writeable = False

    def run():
        return value

    return run


@kernel("ConstantOfShape", 9)
def constant_of_shape(shape, *, value=None):
    dims = tuple(shape.tolist())
    if value is None:
        return np.zeros(dims, dtype=np.float32)
    value = np.asarray(value)
    if value.size != 1:
        raise ValueError(f"ConstantOfShape value must hold one element, got {value.size}")
    return np.full(dims, value.reshape(-1)[0], dtype=value.dtype)


@kernel("Range", 11, 27)
def range_(start, limit, delta, *, stash_type=_FLOAT):
    dtype = start.dtype
    if dtype.kind in "iu":
        first, stop, step = (int(np.asarray(v).reshape(-1)[0]) for v in (start, limit, delta))
        if step == 0:
            raise ValueError("Range delta cannot be 0")
        count = max(-((first - stop) // step), 0)  # ceil((stop - first) / step)
        return (first + np.arange(count, dtype=np.int64) * step).astype(dtype, copy=False)
    # float16 / bfloat16 are computed in float32 (Range-27's default stash_type), or
    # float64 when asked: accumulating in 16 bits loses whole steps on long ranges.
    compute = dtype
    if dtype in _LOW_PRECISION_FLOATS:
        compute = np.dtype(np.float64) if stash_type == 11 else np.dtype(np.float32)
    first, stop, step = (np.asarray(v).astype(compute).reshape(-1)[0] for v in (start, limit, delta))
    if step == 0:
        raise ValueError("Range delta cannot be 0")
    count = max(math.ceil(float(stop - first) / float(step)), 0)
    return (first + np.arange(count, dtype=compute) * step).astype(dtype, copy=False)


@kernel("EyeLike", 9)
def eye_like(x, *, dtype=None, k=0):
    if x.ndim != 2:
        raise ValueError(f"EyeLike expects a rank-2 input, got rank {x.ndim}")
    out_dtype = x.dtype if dtype is None else numpy_dtype(dtype)
    return np.eye(x.shape[0], x.shape[1], k=k, dtype=out_dtype)


# ---------------------------------------------------------------------------
# random ops: a fresh numpy Generator per run, seeded from the ``seed`` attribute when
# there is one, so a seeded node gives the same output in every run and session.
# ---------------------------------------------------------------------------


def _generator(seed: float | None) -> np.random.Generator:
    if seed is None:
        return np.random.default_rng()
    # The float32 bit pattern keys the stream: distinct seeds (1.0, 1.5, -1.0) give distinct streams.
    return np.random.default_rng(int(np.float32(seed).view(np.uint32)))


def _float_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype numpy's Generator draws in for ``dtype``: float32 or float64."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _sample(method, shape, dtype: np.dtype, scale: float, shift: float, seed: float | None) -> np.ndarray:
    """``method`` (a standard Generator draw) times ``scale`` plus ``shift``, as ``dtype``."""
    draw = _float_dtype(dtype)
    sample = method(_generator(seed), tuple(shape), dtype=draw)
    sample *= draw.type(scale)
    sample += draw.type(shift)
    return sample.astype(dtype, copy=False)


_NORMAL = np.random.Generator.standard_normal
_UNIFORM = np.random.Generator.random


@kernel("RandomNormal", 1, data_dependent=True)
def random_normal(*, shape, dtype=_FLOAT, mean=0.0, scale=1.0, seed=None):
    return _sample(_NORMAL, shape, numpy_dtype(dtype), scale, mean, seed)


@kernel("RandomNormalLike", 1, data_dependent=True)
def random_normal_like(x, *, dtype=None, mean=0.0, scale=1.0, seed=None):
    return _sample(_NORMAL, x.shape, x.dtype if dtype is None else numpy_dtype(dtype), scale, mean, seed)


@kernel("RandomUniform", 1, data_dependent=True)
def random_uniform(*, shape, dtype=_FLOAT, low=0.0, high=1.0, seed=None):
    return _sample(_UNIFORM, shape, numpy_dtype(dtype), high - low, low, seed)


@kernel("RandomUniformLike", 1, data_dependent=True)
def random_uniform_like(x, *, dtype=None, low=0.0, high=1.0, seed=None):
    return _sample(_UNIFORM, x.shape, x.dtype if dtype is None else numpy_dtype(dtype), high - low, low, seed)


@kernel("Bernoulli", 15, data_dependent=True)
def bernoulli(x, *, dtype=None, seed=None):
    out_dtype = x.dtype if dtype is None else numpy_dtype(dtype)
    draw = _float_dtype(x.dtype)
    return (_generator(seed).random(x.shape, dtype=draw) < x).astype(out_dtype)


@kernel("Multinomial", 7, data_dependent=True)
def multinomial(x, *, dtype=_INT32, sample_size=1, seed=None):
    """Draw ``sample_size`` class indices per row of unnormalised log-probabilities."""
    if x.ndim != 2:
        raise ValueError(f"Multinomial expects a [batch, classes] input, got rank {x.ndim}")
    out_dtype = numpy_dtype(dtype)
    if out_dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise NotImplementedError(f"Multinomial dtype must be int32 or int64, got {out_dtype}")
    batch, classes = x.shape
    logits = x.astype(np.float64)
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    cdf = np.cumsum(weights, axis=1)
    cdf /= cdf[:, -1:]
    # One searchsorted for every row: row b's cdf is shifted into [b, b + 1].
    rows = np.arange(batch, dtype=np.float64)[:, None]
    draws = _generator(seed).random((batch, sample_size)) + rows
    flat = np.searchsorted((cdf + rows).reshape(-1), draws.reshape(-1), side="right")
    samples = flat.reshape(batch, sample_size) - np.arange(batch)[:, None] * classes
    return np.minimum(samples, classes - 1).astype(out_dtype)
