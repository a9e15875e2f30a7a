"""Matrix kernels: MatMul, Gemm, Einsum, Det and the integer matmul family."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .._registry import KernelContext, kernel, kernel_builder

# numpy has no BLAS path for half types (and bfloat16 products would round at every
# step): they are multiplied in float32 and the result cast back.
_HALF_TYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))

# Above this many terms, a sum of (255 * 255)-sized integer products may not be exact
# in float32 (24-bit mantissa), so MatMulInteger falls back to float64.
_FLOAT32_EXACT_TERMS = (1 << 24) // (255 * 255)


def _widen(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) if x.dtype in _HALF_TYPES else x


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype in _HALF_TYPES:
        return np.matmul(_widen(a), _widen(b)).astype(a.dtype)
    return np.matmul(a, b)


@kernel("MatMul", 1)
def matmul(a, b):
    return _matmul(a, b)


def _scaled(x: np.ndarray, factor: float) -> np.ndarray:
    """x * factor in x's dtype (integer tensors are scaled exactly, then truncated)."""
    if x.dtype.kind in "iu":
        return (x * factor).astype(x.dtype)
    return x * x.dtype.type(factor)


@kernel_builder("Gemm", 1, 7)
def gemm(ctx: KernelContext):
    """Y = alpha * A' @ B' + beta * C. What depends on constant B and C is folded once:
    a transposed B is made contiguous, and alpha and beta are multiplied in."""
    attributes = ctx.attributes
    alpha = float(attributes.get("alpha", 1.0))
    beta = float(attributes.get("beta", 1.0))
    trans_a = bool(attributes.get("transA", 0))
    trans_b = bool(attributes.get("transB", 0))
    # Before opset 7, C is broadcast only when asked; otherwise it must match Y's shape.
    strict_c_shape = ctx.opset < 7 and not attributes.get("broadcast", 0)

    b_const = ctx.constant_inputs[1] if len(ctx.constant_inputs) > 1 else None
    c_const = ctx.constant_inputs[2] if len(ctx.constant_inputs) > 2 else None
    scale_y = alpha != 1.0
    if b_const is not None and b_const.ndim == 2:
        prepared_b = np.ascontiguousarray(b_const.T if trans_b else b_const)
        if scale_y and prepared_b.dtype.kind not in "iu":
            prepared_b = _scaled(prepared_b, alpha)
            scale_y = False
        prepared_b = _widen(prepared_b)
    else:
        prepared_b = None
    prepared_c = None
    if c_const is not None and beta != 0.0:
        prepared_c = _scaled(c_const, beta) if beta != 1.0 else c_const

    def run(a, b, c=None):
        if trans_a:
            a = a.T
        if prepared_b is not None:
            out_dtype = a.dtype
            y = np.matmul(_widen(a), prepared_b)
            if y.dtype != out_dtype:
                y = y.astype(out_dtype)
        else:
            y = _matmul(a, b.T if trans_b else b)
        if scale_y:
            y = _scaled(y, alpha)
        if c is not None and beta != 0.0:
            if strict_c_shape and c.shape != y.shape:
                raise ValueError(
                    f"Gemm (opset {ctx.opset}, broadcast=0): C has shape {c.shape}, "
                    f"expected {y.shape}; set broadcast=1 to broadcast it"
                )
            if prepared_c is not None:
                c = prepared_c
            elif beta != 1.0:
                c = _scaled(c, beta)
            y += c
        return y

    return run


@kernel_builder("Einsum", 12)
def einsum(ctx: KernelContext):
    """np.einsum along a contraction path (pairwise tensordot/BLAS), planned once per
    combination of input shapes."""
    equation = str(ctx.attributes["equation"]).replace(" ", "")
    plans: dict[tuple[tuple[int, ...], ...], Any] = {}

    def run(*inputs):
        out_dtype = inputs[0].dtype
        operands = [_widen(x) for x in inputs]
        shapes = tuple(x.shape for x in operands)
        path = plans.get(shapes)
        if path is None:
            path = np.einsum_path(equation, *operands, optimize="greedy")[0] if len(operands) > 1 else False
            plans[shapes] = path
        result = np.asarray(np.einsum(equation, *operands, optimize=path))
        return result if result.dtype == out_dtype else result.astype(out_dtype)

    return run


@kernel("Det", 11)
def det(x):
    result = np.linalg.det(_widen(x))
    return np.asarray(result, dtype=x.dtype)


@kernel("MatMulInteger", 10)
def matmul_integer(a, b, a_zero_point=None, b_zero_point=None):
    """int32 (A - a_zero_point) @ (B - b_zero_point), through float BLAS, which is exact
    for 8-bit operands (float64 where float32's mantissa could round)."""
    depth = a.shape[-1]
    work = np.float32 if depth <= _FLOAT32_EXACT_TERMS else np.float64
    a_work = a.astype(work)
    if a_zero_point is not None:
        a_zero = np.asarray(a_zero_point)
        # A per-row zero point of a 2-D A is an M-vector: one value per row.
        if a_zero.ndim == 1 and a_zero.size > 1:
            a_zero = a_zero.reshape(-1, 1)
        a_work -= a_zero.astype(work)
    b_work = b.astype(work)
    if b_zero_point is not None:
        b_work -= np.asarray(b_zero_point).astype(work)
    return np.matmul(a_work, b_work).astype(np.int32)
