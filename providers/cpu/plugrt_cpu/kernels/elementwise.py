"""Elementwise kernels: unary math, binary arithmetic, comparison, logic, bitwise, activations."""

from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Callable

import numpy as np

from .._registry import KernelContext, capture_variant, declare_into, kernel, kernel_builder
from ._compiled import ROW_LOOPS, compiled_module
from ._relu import relu_into

__all__ = ["compiled_loops", "erf", "sigmoid", "scratch", "with_small_buffers"]


def compiled_loops() -> Any:
    """The numba-compiled loops module (``kernels._numba_loops``), or None when numba is
    not installed, the environment sets ``PLUGRT_NUMBA=0`` or they are still being built (see
    ``compiled_module``)."""
    return compiled_module("_numba_loops")


# ---------------------------------------------------------------------------------------
# Work arrays for `into` variants (capture): allocated on a variant's first call, reused on
# every later one. They are kept per output buffer, so steps and captures never share one
# (two sessions replaying in two threads stay apart), and freed with that buffer.

_SCRATCH: dict[int, dict[Any, np.ndarray]] = {}


def scratch(
    out: Any, slot: Any, shape: tuple[int, ...], dtype: Any, init: Callable[[np.ndarray], Any] | None = None
) -> np.ndarray:
    """The work array ``slot`` of shape ``shape`` for the ``into`` call writing ``out``
    (an array, or the tuple of a multi-output kernel's arrays; a view counts as the
    array it views, so that a reshaped ``out`` finds the same work arrays every call).
    ``init`` fills a new one (for values that depend only on the slot, kept after)."""
    anchor = out[0] if isinstance(out, tuple) else out
    while isinstance(anchor.base, np.ndarray):
        anchor = anchor.base
    arrays = _SCRATCH.get(id(anchor))
    if arrays is None:
        arrays = _SCRATCH[id(anchor)] = {}
        weakref.finalize(anchor, _SCRATCH.pop, id(anchor), None)
    key = (slot, shape, dtype)
    array = arrays.get(key)
    if array is None:
        array = arrays[key] = np.empty(shape, dtype)
        if init is not None:
            init(array)
    return array


# numpy's ufuncs allocate iteration buffers (np.getbufsize() elements per operand, 32 KiB
# and more) on every call that broadcasts or strides unevenly, such as a per-channel bias.
# ``into`` variants run such elementwise steps with smaller buffers (a few KiB: smaller
# still slows strided loops). Elementwise results do not depend on the buffer size;
# reductions can (the blocks of pairwise summation), so no reduction may run under it.
_INTO_BUFSIZE = 1024


def with_small_buffers(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) with numpy's ufunc buffer size at most _INTO_BUFSIZE elements."""
    if np.getbufsize() <= _INTO_BUFSIZE:
        return fn(*args)
    size = np.setbufsize(_INTO_BUFSIZE)
    try:
        return fn(*args)
    finally:
        np.setbufsize(size)


def _call_into(fn: Callable[..., Any], out: np.ndarray, *args: Any) -> None:
    """Runs kernel ``fn`` into ``out``: a ufunc takes ``out=``, anything else its ``into``."""
    if isinstance(fn, np.ufunc):
        fn(*args, out=out)
    else:
        into = capture_variant(fn)
        if into is None:
            raise TypeError(f"{fn!r} declares no capture variant")
        into(out, *args)

# The ops whose kernel is the numpy function itself.
_UFUNCS: dict[str, tuple[int, Callable[..., Any]]] = {
    # op: (first since_version, ufunc); later versions only add types, except for the
    # binary ops at 7, which replaced `broadcast`/`axis` with numpy-style broadcasting.
    "Abs": (1, np.absolute),
    "Neg": (1, np.negative),
    "Ceil": (1, np.ceil),
    "Floor": (1, np.floor),
    "Exp": (1, np.exp),
    "Log": (1, np.log),
    "Sqrt": (1, np.sqrt),
    "Reciprocal": (1, np.reciprocal),
    "Tanh": (1, np.tanh),
    "Not": (1, np.logical_not),
    "Sin": (7, np.sin),
    "Cos": (7, np.cos),
    "Tan": (7, np.tan),
    "Asin": (7, np.arcsin),
    "Acos": (7, np.arccos),
    "Atan": (7, np.arctan),
    "Sinh": (9, np.sinh),
    "Cosh": (9, np.cosh),
    "Asinh": (9, np.arcsinh),
    "Acosh": (9, np.arccosh),
    "Atanh": (9, np.arctanh),
    "Sign": (9, np.sign),
    "IsNaN": (9, np.isnan),
    "Round": (11, np.rint),  # round half to even
    "BitwiseNot": (18, np.invert),
    "Add": (7, np.add),
    "Sub": (7, np.subtract),
    "Mul": (7, np.multiply),
    "And": (7, np.logical_and),
    "Or": (7, np.logical_or),
    "Xor": (7, np.logical_xor),
    "Equal": (7, np.equal),
    "Greater": (7, np.greater),
    "Less": (7, np.less),
    "GreaterOrEqual": (12, np.greater_equal),
    "LessOrEqual": (12, np.less_equal),
    "BitwiseAnd": (18, np.bitwise_and),
    "BitwiseOr": (18, np.bitwise_or),
    "BitwiseXor": (18, np.bitwise_xor),
}

# Predicates answer in bool whatever their inputs, so their output never fits the first
# input's buffer; every other ufunc here keeps its inputs' dtype.
_PREDICATES = frozenset({"Not", "And", "Or", "Xor", "Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "IsNaN"})

for _op, (_version, _ufunc) in _UFUNCS.items():
    kernel(_op, _version, inplace=_op not in _PREDICATES)(_ufunc)


@kernel("Where", 9)
def where(condition, x, y):
    return np.where(condition, x, y)


def _where_into(out, condition, x, y):
    np.copyto(out, y)
    np.copyto(out, x, where=condition)


declare_into(_where_into, where)


def _is_integer(dtype: np.dtype) -> bool:
    return dtype.kind in "iub"


# ---------------------------------------------------------------------------------------
# Opset 1-6 broadcasting


def _legacy_broadcast(a: np.ndarray, b: np.ndarray, broadcast: int, axis: int | None) -> np.ndarray:
    """Aligns B to A the opset-1 way: B's dimensions match A's starting at `axis`."""
    if not broadcast or axis is None:
        return b  # without an axis B matches A's trailing dimensions: numpy broadcasting
    if axis < 0:
        axis += np.ndim(a)
    trailing = np.ndim(a) - axis - np.ndim(b)
    if trailing < 0:
        raise ValueError(f"broadcast axis {axis} leaves no room for B of shape {np.shape(b)} in A of shape {np.shape(a)}")
    return np.reshape(b, np.shape(b) + (1,) * trailing)


def _legacy_binary(op: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    def run(a, b, *, broadcast=0, axis=None):
        return op(a, _legacy_broadcast(a, b, broadcast, axis))

    def run_into(out, a, b, *, broadcast=0, axis=None):
        _call_into(op, out, a, _legacy_broadcast(a, b, broadcast, axis))

    run.__name__ = f"legacy_{getattr(op, '__name__', 'binary')}"
    declare_into(run_into, run)
    return run


for _op in ("Add", "Sub", "Mul", "And", "Or", "Xor", "Equal", "Greater", "Less"):
    kernel(_op, 1)(_legacy_binary(_UFUNCS[_op][1]))


# ---------------------------------------------------------------------------------------
# Div: integer division truncates toward zero (C semantics, as onnxruntime and onnx.reference)


def _divide_signed(a, b):
    # a - fmod(a, b) is an exact multiple of b, so floor division there truncates.
    return np.floor_divide(np.subtract(a, np.fmod(a, b)), b)


def _divide_signed_into(out, a, b):
    np.fmod(a, b, out=out)
    np.subtract(a, out, out=out)
    np.floor_divide(out, b, out=out)


declare_into(_divide_signed_into, _divide_signed)


def _divide_for(dtype: np.dtype | None) -> Callable[..., Any]:
    if dtype is None:
        return _divide_any
    if dtype.kind == "i":
        return _divide_signed
    if dtype.kind in "ub":
        return np.floor_divide
    return np.true_divide


def _divide_any(a, b):
    return _divide_for(a.dtype)(a, b)


def _divide_any_into(out, a, b):
    _call_into(_divide_for(a.dtype), out, a, b)


declare_into(_divide_any_into, _divide_any)


@kernel_builder("Div", 7)
def div(ctx: KernelContext):
    return _divide_for(ctx.input_dtypes[0] if ctx.input_dtypes else None)


kernel("Div", 1)(_legacy_binary(_divide_any))


# ---------------------------------------------------------------------------------------
# Pow: the output has the base's dtype, whatever the exponent's


def _power_integer(a, b):
    try:
        result = np.power(a, b)
    except ValueError:  # numpy refuses negative integer exponents; C's pow truncates
        result = np.power(a.astype(np.float64), b)
    return result.astype(a.dtype, copy=False)


def _power_integer_into(out, a, b):
    if np.result_type(a, b) == out.dtype:
        try:
            np.power(a, b, out=out)
            return
        except ValueError:
            pass
    # Mixed integer types, or negative exponents (rare): as the kernel, through a temporary.
    np.copyto(out, _power_integer(a, b), casting="unsafe")


declare_into(_power_integer_into, _power_integer)


#: The largest integer each float type holds exactly, with every integer below it: an
#: integer exponent within it keeps its value, so its parity, cast to the base's type.
_EXACT_INTEGERS = {np.dtype(np.float16): 2**11, np.dtype(np.float32): 2**24, np.dtype(np.float64): 2**53}


def _exponent_exact_in(dtype: np.dtype, b: np.ndarray) -> bool:
    limit = _EXACT_INTEGERS.get(np.dtype(dtype))
    if limit is None:
        return False  # bfloat16, float8: the careful path
    return b.size == 0 or (-limit <= int(b.min()) and int(b.max()) <= limit)


def _power_integer_exponent(a, b):
    """A float base to integer exponents too large for the base's type to hold exactly
    (int32 -16777217 is -16777216 in float32: even, so (-0.0) ** it would be +inf, not
    -inf). The magnitude in float64, as onnx.reference computes it; the sign from the
    exponent's parity, exact on the integers whatever their size."""
    wide = a.astype(np.float64)
    magnitude = np.power(np.abs(wide), b.astype(np.float64))
    negative = np.signbit(wide) & (b % 2 != 0)
    return np.where(negative, -magnitude, magnitude).astype(a.dtype)


def _power_any(a, b):
    if _is_integer(a.dtype):
        return _power_integer(a, b)
    if a.dtype == b.dtype:
        return np.power(a, b)
    if _is_integer(b.dtype):
        if not _exponent_exact_in(a.dtype, b):
            return _power_integer_exponent(a, b)
        return np.power(a, b.astype(a.dtype))
    return np.power(a, b).astype(a.dtype, copy=False)


def _power_any_into(out, a, b):
    if _is_integer(a.dtype):
        _power_integer_into(out, a, b)
    elif a.dtype == b.dtype:
        np.power(a, b, out=out)
    elif _is_integer(b.dtype) and not _exponent_exact_in(a.dtype, b):
        np.copyto(out, _power_integer_exponent(a, b), casting="unsafe")
    elif _is_integer(b.dtype):
        exponent = scratch(out, "exponent", b.shape, a.dtype)
        np.copyto(exponent, b, casting="unsafe")
        np.power(a, exponent, out=out)
    else:
        wide = scratch(out, "power", out.shape, np.result_type(a, b))
        np.power(a, b, out=wide)
        np.copyto(out, wide, casting="unsafe")


declare_into(_power_any_into, _power_any)


def _square_base(a, b):
    return np.square(a)


def _square_base_into(out, a, b):
    np.square(a, out=out)


declare_into(_square_base_into, _square_base)


@kernel_builder("Pow", 7)
def pow_(ctx: KernelContext):
    base, exponent = (list(ctx.input_dtypes or ()) + [None, None])[:2]
    constant = (list(ctx.constant_inputs or ()) + [None, None])[1]
    if (
        constant is not None
        and np.ndim(constant) == 0
        and float(constant) == 2.0
        and base is not None
        and (not _is_integer(base) or _is_integer(constant.dtype))
    ):
        return _square_base  # x ** 2 is common (variance, norms) and square is much faster
    if base is not None and _is_integer(base):
        return _power_integer
    if base is not None and base == exponent:
        return np.power
    return _power_any


kernel("Pow", 1)(_legacy_binary(_power_any))


# ---------------------------------------------------------------------------------------
# Binary ops with attributes


@kernel_builder("Mod", 10)
def mod(ctx: KernelContext):
    # fmod=0: sign of the divisor (Python %), fmod=1: sign of the dividend (C fmod).
    fmod = ctx.attributes.get("fmod", 0)
    if fmod not in (0, 1):
        raise ValueError(f"Mod: fmod must be 0 or 1, got {fmod!r}")
    return np.fmod if fmod else np.mod


@kernel_builder("BitShift", 11)
def bit_shift(ctx: KernelContext):
    # numpy gives what opset 28 specifies for shifts outside [0, bits): 0, or -1 for a
    # right shift of a negative value.
    direction = ctx.attributes.get("direction")
    if direction == "LEFT":
        return np.left_shift
    if direction == "RIGHT":
        return np.right_shift
    raise ValueError(f"BitShift: direction must be 'LEFT' or 'RIGHT', got {direction!r}")


# ---------------------------------------------------------------------------------------
# Variadic ops (numpy broadcasting; opset < 8 required equal shapes, a subset)


def _fold_into(ufunc: np.ufunc, out: np.ndarray, inputs: tuple) -> None:
    """functools.reduce(ufunc, inputs) into ``out``: the same pairwise steps, in order."""
    if len(inputs) == 1:
        np.copyto(out, inputs[0])
        return
    ufunc(inputs[0], inputs[1], out=out)
    for x in inputs[2:]:
        ufunc(out, x, out=out)


@kernel("Max", 1)
def max_(*inputs):
    return functools.reduce(np.maximum, inputs)


declare_into(lambda out, *inputs: _fold_into(np.maximum, out, inputs), max_)


@kernel("Min", 1)
def min_(*inputs):
    return functools.reduce(np.minimum, inputs)


declare_into(lambda out, *inputs: _fold_into(np.minimum, out, inputs), min_)


@kernel("Sum", 1, inplace=True)
def sum_(*inputs):
    return functools.reduce(np.add, inputs)


declare_into(lambda out, *inputs: _fold_into(np.add, out, inputs), sum_)


@kernel("Mean", 1)
def mean(*inputs):
    return np.true_divide(functools.reduce(np.add, inputs), len(inputs))


def _mean_into(out, *inputs):
    _fold_into(np.add, out, inputs)
    np.true_divide(out, len(inputs), out=out)


declare_into(_mean_into, mean)


# ---------------------------------------------------------------------------------------
# Clip


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _within_range(bound: float, dtype: np.dtype) -> float | None:
    """The bound, or None when it lies beyond what the dtype holds (it would clip nothing)."""
    if dtype == np.float32 or dtype == np.float64:
        return bound
    limit = float(np.finfo(dtype).max) if dtype.kind == "f" else math.inf
    return bound if abs(bound) <= limit else None


@kernel("Clip", 1)
def clip_with_attributes(x, *, min=-_FLOAT32_MAX, max=_FLOAT32_MAX):  # noqa: A002 (ONNX names)
    low, high = _within_range(min, x.dtype), _within_range(max, x.dtype)
    if low is None and high is None:
        return x
    return np.clip(x, low, high)


def _clip_with_attributes_into(out, x, *, min=-_FLOAT32_MAX, max=_FLOAT32_MAX):  # noqa: A002
    low, high = _within_range(min, x.dtype), _within_range(max, x.dtype)
    if low is None and high is None:
        np.copyto(out, x)
    else:
        np.clip(x, low, high, out=out)


declare_into(_clip_with_attributes_into, clip_with_attributes)


@kernel("Clip", 11)
def clip(x, min=None, max=None):  # noqa: A002 (ONNX names)
    # When min > max every value becomes max, as np.clip (maximum, then minimum) gives.
    if min is None and max is None:
        return x
    return np.clip(x, min, max)


def _clip_into(out, x, min=None, max=None):  # noqa: A002 (ONNX names)
    if min is None and max is None:
        np.copyto(out, x)
    else:
        np.clip(x, min, max, out=out)


declare_into(_clip_into, clip)


# ---------------------------------------------------------------------------------------
# erf: numpy has none (and scipy is no dependency), so rational approximations fitted for
# this module: iterated linearised least squares with Lawson reweighting (near-minimax
# relative error), in 60-digit mpmath arithmetic against mpmath's erf.

# float32: erf(x) = x * P(x^2) / Q(x^2) on [-4, 4]; erf(x) rounds to +-1 beyond.
# Relative error of the fit 2.5e-8; at most 7 ulp (4.2e-7 absolute) after float32 rounding.
_ERF32_P = (1.9864886927765341e-6, 2.8449755476522498e-4, 3.8820289464572449e-3,
            5.3097641382377289e-2, 1.9351990776871800e-1, 1.1283791397845179)
_ERF32_Q = (3.7413503706159646e-5, 1.1851778678227299e-3, 1.5204678532240398e-2,
            1.1533889148043141e-1, 5.0483511927805172e-1, 1.0)
# float64, |x| < 0.5: erf(x) = x * P(x^2) / Q(x^2), relative error 3e-20.
_ERF64_SMALL_P = (6.5317312986348867e-5, 1.1113986116946291e-3, 4.0033241006256857e-2,
                  1.3271881910746778e-1, 1.1283791670955126)
_ERF64_SMALL_Q = (3.5158599313875980e-4, 8.2979019298830070e-3, 8.5795977539774948e-2,
                  4.5095232434066523e-1, 1.0)
# float64, 0.5 <= z <= 6: erfc(z) = exp(-z^2) * P(z) / Q(z), relative error 4e-17;
# erfc(6) < 2.2e-17, so erf rounds to 1 beyond.
_ERF64_LARGE_P = (7.5545186133100641e-4, 1.0746545462025205e-2, 7.3722405969122530e-2,
                  3.1042083851313525e-1, 8.6110122630965570e-1, 1.5767447479236023,
                  1.7848826176341561, 9.9999999981522931e-1)
_ERF64_LARGE_Q = (1.3390036045657288e-3, 1.9047753397069456e-2, 1.3133913140581295e-1,
                  5.5972933990534306e-1, 1.5909413977109405, 3.0601590203576961,
                  3.8640086707078618, 2.9132617819397814, 1.0)


# Every step of erf is a pass over memory; blocks this size stay in L2 across the ~25 steps,
# which makes large tensors about three times faster than whole-array passes.
_ERF_BLOCK = 1 << 15


def _polynomial(t: np.ndarray, coefficients: tuple[float, ...], out: np.ndarray) -> np.ndarray:
    """Horner's rule, highest degree first, into ``out``."""
    np.multiply(t, coefficients[0], out=out)
    for c in coefficients[1:-1]:
        out += c
        out *= t
    out += coefficients[-1]
    return out


def _erf_float32(x: np.ndarray, out: np.ndarray, work: list[np.ndarray]) -> np.ndarray:
    """erf(x) into ``out``; ``work`` holds three float32 arrays shaped like x."""
    z = np.clip(x, -4.0, 4.0, out=work[0])
    t = np.multiply(z, z, out=work[1])
    numerator = _polynomial(t, _ERF32_P, work[2])
    numerator *= z
    np.divide(numerator, _polynomial(t, _ERF32_Q, out=z), out=out)
    return np.clip(out, -1.0, 1.0, out=out)  # the fit overshoots 1 by an ulp at 4


def _erf_float64(x: np.ndarray, out: np.ndarray, work: list[np.ndarray]) -> np.ndarray:
    """erf(x) into ``out``; ``work`` holds three float64 arrays and a bool one shaped like x."""
    small = np.clip(x, -0.5, 0.5, out=work[0])
    t = np.multiply(small, small, out=work[1])
    near_zero = _polynomial(t, _ERF64_SMALL_P, work[2])
    near_zero *= small
    near_zero /= _polynomial(t, _ERF64_SMALL_Q, out=small)

    z = np.abs(x, out=t)
    np.minimum(z, 6.0, out=z)  # keeps NaN
    tail = _polynomial(z, _ERF64_LARGE_P, out)
    tail /= _polynomial(z, _ERF64_LARGE_Q, out=small)
    np.square(z, out=z)
    np.negative(z, out=z)
    np.exp(z, out=z)
    tail *= z
    np.subtract(1.0, tail, out=tail)  # erf(|x|) = 1 - erfc(|x|)
    np.copysign(tail, x, out=tail)
    # Both branches are finite, so blending with 0/1 weights is exact (and, unlike a masked
    # copy, fast on randomly mixed masks).
    np.abs(x, out=z)
    mask = work[3]
    np.less(z, 0.5, out=mask)
    near_zero *= mask
    np.greater_equal(z, 0.5, out=mask)
    tail *= mask
    tail += near_zero
    return tail


def _erf_work(x: np.ndarray, shape: tuple[int, ...], allocate) -> tuple[Callable[..., Any], list[np.ndarray]]:
    """The float32 or float64 erf and the work arrays it needs for blocks of ``shape``."""
    if x.dtype == np.float64:
        return _erf_float64, [allocate(i, shape, x.dtype) for i in range(3)] + [allocate(3, shape, np.bool_)]
    return _erf_float32, [allocate(i, shape, x.dtype) for i in range(3)]


def _fresh(slot, shape, dtype) -> np.ndarray:
    return np.empty(shape, dtype)


def _erf_blocks(x: np.ndarray, out: np.ndarray, allocate) -> None:
    """erf of the contiguous float32/float64 ``x`` into ``out``, in L2-sized blocks."""
    if x.size <= _ERF_BLOCK:
        compute, work = _erf_work(x, x.shape, allocate)
        compute(x, out, work)
        return
    flat, flat_out = x.reshape(-1), out.reshape(-1)
    compute, work = _erf_work(x, (_ERF_BLOCK,), allocate)
    for start in range(0, flat.size, _ERF_BLOCK):
        block = slice(start, start + _ERF_BLOCK)
        part = flat[block]
        compute(part, flat_out[block], work if part.size == _ERF_BLOCK else [w[: part.size] for w in work])


def erf(x: np.ndarray) -> np.ndarray:
    """The error function, elementwise, in the input's dtype (absolute error about 1e-16 for
    float64, 4e-7 for float32; float16, bfloat16 and integers go through float32)."""
    x = np.asarray(x)
    if x.dtype != np.float64 and x.dtype != np.float32:
        return erf(x.astype(np.float32)).astype(x.dtype)
    if x.size > _ERF_BLOCK:
        x = np.ascontiguousarray(x)
    out = np.empty(x.shape, x.dtype)
    _erf_blocks(x, out, _fresh)
    return out


def _erf_into(out: np.ndarray, x: np.ndarray) -> None:
    if x.dtype != np.float64 and x.dtype != np.float32:
        wide = scratch(out, "erf-in", x.shape, np.float32)
        np.copyto(wide, x, casting="unsafe")
        result = scratch(out, "erf-out", x.shape, np.float32)
        _erf_into(result, wide)
        np.copyto(out, result, casting="unsafe")
    elif x.size > _ERF_BLOCK and not (x.flags.c_contiguous and out.flags.c_contiguous):
        np.copyto(out, erf(x))  # blocks need flat views (never so for a captured buffer)
    else:
        _erf_blocks(x, out, lambda slot, shape, dtype: scratch(out, ("erf", slot), shape, dtype))


declare_into(_erf_into, erf)
kernel("Erf", 9)(erf)


# ---------------------------------------------------------------------------------------
# Activations


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)), exact in both tails: exp(-x) overflowing to inf gives 0."""
    if x.dtype.itemsize < 4:  # float16's exp(-x) overflows long before sigmoid(x) underflows
        return sigmoid(x.astype(np.float32)).astype(x.dtype)
    with np.errstate(over="ignore"):
        y = np.negative(x, out=np.empty_like(x))
        np.exp(y, out=y)
    y += 1
    return np.reciprocal(y, out=y)


def _sigmoid_into(out: np.ndarray, x: np.ndarray) -> None:
    if x.dtype.itemsize < 4:
        wide = scratch(out, "sigmoid", x.shape, np.float32)
        np.copyto(wide, x, casting="unsafe")
        _sigmoid_into(wide, wide)
        np.copyto(out, wide, casting="unsafe")
        return
    with np.errstate(over="ignore"):
        np.negative(x, out=out)
        np.exp(out, out=out)
    out += 1
    np.reciprocal(out, out=out)


declare_into(_sigmoid_into, sigmoid)
kernel("Sigmoid", 1)(sigmoid)


@kernel("Relu", 1, inplace=True)
def relu(x):
    return relu_into(np.empty_like(x), x)


def _relu_into(out, x):
    relu_into(out, x)


declare_into(_relu_into, relu)


@kernel("LeakyRelu", 1)
def leaky_relu(x, *, alpha=0.01):
    # x for x >= 0 and alpha * x below is the larger of the two when alpha <= 1.
    y = (np.maximum if alpha <= 1 else np.minimum)(x, np.multiply(x, alpha))
    if alpha == 0:
        # alpha * inf is NaN and the maximum propagates it, yet LeakyRelu(inf) is inf
        y = np.where(np.isposinf(x), x, y)
    return y


def _leaky_relu_into(out, x, *, alpha=0.01):
    np.multiply(x, alpha, out=out)
    (np.maximum if alpha <= 1 else np.minimum)(x, out, out=out)
    if alpha == 0:
        np.copyto(out, x, where=np.isposinf(x))


declare_into(_leaky_relu_into, leaky_relu)


# Where a mask would pick between two values (Elu, PRelu), the kernels add the negative and
# positive parts instead: np.where and masked copies mispredict on mixed signs and run
# ten times slower than a few plain passes.


def _positive_part(out: np.ndarray, x: np.ndarray) -> np.ndarray:
    """max(x, 0) in a work array of ``out``'s ``into`` call."""
    return np.maximum(x, 0, out=scratch(out, "positive", x.shape, x.dtype))


def _scaled_negative_part(x, slope, out=None) -> np.ndarray:
    """min(x, 0) * slope + max(x, 0) (into ``out`` when given)."""
    y = np.minimum(x, 0, out=np.empty_like(x) if out is None else out)
    y *= slope
    y += np.maximum(x, 0) if out is None else _positive_part(out, x)
    if not np.isfinite(slope).all():
        # 0 * inf is NaN, yet where x >= 0 the result is x whatever the slope
        np.copyto(y, x, where=x >= 0)
    return y


@kernel("PRelu", 7)
def prelu(x, slope):
    return _scaled_negative_part(x, slope)  # slope broadcasts to x, one way only


declare_into(lambda out, x, slope: _scaled_negative_part(x, slope, out), prelu)


def _per_channel(x, slope):
    # Before opset 7 a 1-D slope holds one value per channel (axis 1), not per last axis.
    if np.ndim(slope) == 1 and np.size(slope) > 1 and np.ndim(x) > 2:
        slope = np.reshape(slope, (-1,) + (1,) * (np.ndim(x) - 2))
    return slope


@kernel("PRelu", 1)
def prelu_per_channel(x, slope):
    return prelu(x, _per_channel(x, slope))


declare_into(lambda out, x, slope: _scaled_negative_part(x, _per_channel(x, slope), out), prelu_per_channel)


def _exponential_below_zero(x, alpha: float, divisor: float = 1.0, out=None) -> np.ndarray:
    """alpha * (exp(x / divisor) - 1) where x <= 0 and x where x > 0 (into ``out`` when given)."""
    # exp of the positive side could overflow
    y = np.minimum(x, 0, out=np.empty_like(x) if out is None else out)
    if divisor != 1.0:
        y /= divisor
    np.expm1(y, out=y)
    y *= alpha
    y += np.maximum(x, 0) if out is None else _positive_part(out, x)
    return y


@kernel("Elu", 1)
def elu(x, *, alpha=1.0):
    return _exponential_below_zero(x, alpha)


def _elu_into(out, x, *, alpha=1.0):
    _exponential_below_zero(x, alpha, out=out)


declare_into(_elu_into, elu)


@kernel("Selu", 1)
def selu(x, *, alpha=1.67326319217681884765625, gamma=1.05070102214813232421875):
    y = _exponential_below_zero(x, alpha)
    y *= gamma
    return y


def _selu_into(out, x, *, alpha=1.67326319217681884765625, gamma=1.05070102214813232421875):
    _exponential_below_zero(x, alpha, out=out)
    out *= gamma


declare_into(_selu_into, selu)


@kernel("Celu", 12)
def celu(x, *, alpha=1.0):
    return _exponential_below_zero(x, alpha, divisor=alpha)


def _celu_into(out, x, *, alpha=1.0):
    _exponential_below_zero(x, alpha, divisor=alpha, out=out)


declare_into(_celu_into, celu)


@kernel("ThresholdedRelu", 10)
def thresholded_relu(x, *, alpha=1.0):
    return np.where(x > alpha, x, 0)


def _thresholded_relu_into(out, x, *, alpha=1.0):
    above = np.greater(x, alpha, out=scratch(out, "mask", x.shape, np.bool_))
    out.fill(0)
    np.copyto(out, x, where=above)


declare_into(_thresholded_relu_into, thresholded_relu)


def _hard_sigmoid_into(out, x, *, alpha=0.2, beta=0.5):
    np.multiply(x, alpha, out=out)
    out += beta
    np.clip(out, 0, 1, out=out)


@kernel("HardSigmoid", 1)
def hard_sigmoid(x, *, alpha=0.2, beta=0.5):
    y = np.empty_like(x)
    _hard_sigmoid_into(y, x, alpha=alpha, beta=beta)
    return y


declare_into(_hard_sigmoid_into, hard_sigmoid)


def _hard_swish_into(out, x):
    _hard_sigmoid_into(out, x, alpha=1 / 6, beta=0.5)
    out *= x


@kernel("HardSwish", 14)
def hard_swish(x):
    y = np.empty_like(x)
    _hard_swish_into(y, x)
    return y


declare_into(_hard_swish_into, hard_swish)


def _softsign_into(out, x):
    np.abs(x, out=out)
    out += 1
    np.divide(x, out, out=out)


@kernel("Softsign", 1)
def softsign(x):
    y = np.empty_like(x)
    _softsign_into(y, x)
    return y


declare_into(_softsign_into, softsign)


def _softplus(x, out=None):
    # log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)): nothing overflows, and numpy's
    # vectorised exp and log1p make it several times faster than np.logaddexp.
    y = np.abs(x, out=np.empty_like(x) if out is None else out)
    np.negative(y, out=y)
    np.exp(y, out=y)
    np.log1p(y, out=y)
    y += np.maximum(x, 0) if out is None else _positive_part(out, x)
    return y


@kernel("Softplus", 1)
def softplus(x):
    return _softplus(x)


declare_into(lambda out, x: _softplus(x, out), softplus)


@kernel("Mish", 18)
def mish(x):
    y = softplus(x)
    np.tanh(y, out=y)
    y *= x
    return y


def _mish_into(out, x):
    _softplus(x, out)
    np.tanh(out, out=out)
    out *= x


declare_into(_mish_into, mish)


@kernel("Swish", 24)
def swish(x, *, alpha=1.0):
    y = sigmoid(np.multiply(x, alpha) if alpha != 1.0 else x)
    y *= x
    return y


def _swish_into(out, x, *, alpha=1.0):
    if alpha != 1.0:
        scaled = np.multiply(x, alpha, out=scratch(out, "swish", x.shape, np.result_type(x, alpha)))
        _sigmoid_into(out, scaled)
    else:
        _sigmoid_into(out, x)
    out *= x


declare_into(_swish_into, swish)


@kernel("Shrink", 9)
def shrink(x, *, bias=0.0, lambd=0.5):
    y = np.where(x < -lambd, x + bias, np.where(x > lambd, x - bias, 0))
    return y.astype(x.dtype, copy=False)


def _shrink_into(out, x, *, bias=0.0, lambd=0.5):
    dtype = np.result_type(x, bias)  # of x + bias, as the kernel's np.where
    y = out if out.dtype == dtype else scratch(out, "y", out.shape, dtype)
    shifted = scratch(out, "shifted", x.shape, dtype)
    mask = scratch(out, "mask", x.shape, np.bool_)
    y.fill(0)
    np.greater(x, lambd, out=mask)
    np.copyto(y, np.subtract(x, bias, out=shifted), where=mask)
    np.less(x, -lambd, out=mask)  # the outer np.where: wins where both hold
    np.copyto(y, np.add(x, bias, out=shifted), where=mask)
    if y is not out:
        np.copyto(out, y, casting="unsafe")


declare_into(_shrink_into, shrink)


_SQRT_HALF = math.sqrt(0.5)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# Below this many elements the compiled GELU loop gains less than its call costs.
_COMPILED_GELU_MIN = 1 << 10


def _compiled_gelu(x: np.ndarray, out: np.ndarray, tanh: bool = False) -> bool:
    """GELU of float32 ``x`` (the erf form, or with ``tanh`` the tanh approximation) into
    ``out`` in one compiled pass, when numba is there and both are contiguous; False
    (nothing written) otherwise."""
    if x.dtype != np.float32 or out.dtype != np.float32 or x.size < _COMPILED_GELU_MIN:
        return False
    if not (x.flags.c_contiguous and out.flags.c_contiguous):
        return False
    loops = compiled_loops()
    if loops is None:
        return False
    (loops.gelu_tanh if tanh else loops.gelu_erf)(x.reshape(-1), out.reshape(-1))
    return True


def _gelu_exact(x):
    y = np.empty_like(x)
    if _compiled_gelu(x, y):
        return y
    y = erf(np.multiply(x, _SQRT_HALF, out=y))  # the buffer the compiled loop did not take
    y += 1
    y *= x
    y *= 0.5
    return y


def _gelu_exact_into(out, x):
    if _compiled_gelu(x, out):
        return
    _erf_into(out, np.multiply(x, _SQRT_HALF, out=scratch(out, "gelu", x.shape, x.dtype)))
    out += 1
    out *= x
    out *= 0.5


declare_into(_gelu_exact_into, _gelu_exact)


def _gelu_tanh_into(out, x):
    # one compiled pass where numba is there (GPT-2's 64 x 1024: 110 us in the nine numpy
    # passes below)
    if _compiled_gelu(x, out, tanh=True):
        return
    np.multiply(x, x, out=out)
    out *= 0.044715
    out += 1
    out *= x
    out *= _SQRT_2_OVER_PI
    np.tanh(out, out=out)
    out += 1
    out *= x
    out *= 0.5


def _gelu_tanh(x):
    y = np.empty_like(x)
    _gelu_tanh_into(y, x)
    return y


declare_into(_gelu_tanh_into, _gelu_tanh)


@kernel_builder("Gelu", 20, compiled=ROW_LOOPS)
def gelu(ctx: KernelContext):
    approximate = ctx.attributes.get("approximate", "none")
    if approximate == "none":
        return _gelu_exact
    if approximate == "tanh":
        return _gelu_tanh
    raise NotImplementedError(f"Gelu: approximate={approximate!r} is not supported (use 'none' or 'tanh')")


def _is_negative_infinity(x):
    return np.isneginf(x)


def _is_positive_infinity(x):
    return np.isposinf(x)


def _no_infinity(x):
    return np.zeros(np.shape(x), dtype=np.bool_)


def _signed_infinity_into(out, x, negative: bool) -> None:
    """np.isneginf / np.isposinf (isinf and the sign bit), their temporaries in a work array."""
    np.isinf(x, out=out)
    sign = np.signbit(x, out=scratch(out, "sign", x.shape, np.bool_))
    if not negative:
        np.logical_not(sign, out=sign)
    np.logical_and(out, sign, out=out)


declare_into(lambda out, x: _signed_infinity_into(out, x, True), _is_negative_infinity)
declare_into(lambda out, x: _signed_infinity_into(out, x, False), _is_positive_infinity)
declare_into(lambda out, x: out.fill(False), _no_infinity)


@kernel_builder("IsInf", 10)
def is_inf(ctx: KernelContext):
    negative = ctx.attributes.get("detect_negative", 1)
    positive = ctx.attributes.get("detect_positive", 1)
    if negative and positive:
        return np.isinf
    if negative:
        return _is_negative_infinity
    if positive:
        return _is_positive_infinity
    return _no_infinity
