"""Matrix kernels: MatMul, Gemm, Einsum, Det and the integer matmul family."""

from __future__ import annotations

import math
import string
from typing import Any

import ml_dtypes
import numpy as np
from plugrt.provider import shared_transform

from .._registry import KernelContext, kernel, kernel_builder, declare_into
from ._gemm import matmul as pooled, split_gemm
from .dense import Allocate, WeightPanels, dense_product, matrix_rows, new_array, packs
from .elementwise import scratch
from ._compiled import DENSE_LOOPS

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
    return pooled(a, b)


def _widen_into(out: np.ndarray, slot: str, x: np.ndarray) -> np.ndarray:
    """_widen(x), in a work array of ``out``'s ``into`` call when x is a half type."""
    if x.dtype not in _HALF_TYPES:
        return x
    wide = scratch(out, slot, x.shape, np.float32)
    np.copyto(wide, x, casting="unsafe")
    return wide


def _matmul_into(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    if a.dtype in _HALF_TYPES:
        product = scratch(out, "product", out.shape, np.float32)
        np.matmul(_widen_into(out, "a", a), _widen_into(out, "b", b), out=product)
        np.copyto(out, product, casting="unsafe")
    else:
        pooled(a, b, out=out)


@kernel_builder("MatMul", 1, compiled=DENSE_LOOPS)
def matmul(ctx: KernelContext):
    """a @ b; a constant float32 2-D b by the packed kernel of ``kernels.dense`` where the
    host has it (a stack of rows multiplied as one matrix), else numpy (BLAS)."""
    panels = WeightPanels(ctx.constant_inputs[1] if len(ctx.constant_inputs) > 1 else None)

    def packed(out: np.ndarray, a: np.ndarray, b: np.ndarray, allocate: Allocate) -> bool:
        if panels.weight is None or a.ndim < 2 or not packs(math.prod(a.shape[:-1])):
            return False
        rows = matrix_rows(out, a, b, None, allocate)
        if rows is None or panels.get(b) is None:
            return False
        dense_product(out.reshape(-1, b.shape[1]), rows, b, None, panels=panels, allocate=allocate)
        return True

    def run(a, b):
        if panels.weight is not None and a.dtype == np.float32 and a.ndim >= 2 and a.shape[-1] == b.shape[0] and packs(math.prod(a.shape[:-1])):
            out = np.empty((*a.shape[:-1], b.shape[1]), np.float32)
            if packed(out, a, b, new_array):
                return out
        return _matmul(a, b)

    def run_into(out, a, b):
        if not packed(out, a, b, lambda slot, shape, dtype: scratch(out, slot, shape, dtype)):
            _matmul_into(out, a, b)

    declare_into(run_into, run)
    return run


def _scaled(x: np.ndarray, factor: float) -> np.ndarray:
    """x * factor in x's dtype (integer tensors are scaled exactly, then truncated)."""
    if x.dtype.kind in "iu":
        return (x * factor).astype(x.dtype)
    return x * x.dtype.type(factor)


def _scaled_into(out: np.ndarray, slot: str, x: np.ndarray, factor: float) -> np.ndarray:
    """_scaled(x, factor), in a work array of ``out``'s ``into`` call (x itself when that
    array is ``x``, scaled in place)."""
    if x.dtype.kind in "iu":
        wide = scratch(out, slot + "-wide", x.shape, np.result_type(x, factor))
        np.multiply(x, factor, out=wide)
        target = x if slot == "y" else scratch(out, slot, x.shape, x.dtype)
        np.copyto(target, wide, casting="unsafe")
        return target
    target = x if slot == "y" else scratch(out, slot, x.shape, x.dtype)
    return np.multiply(x, x.dtype.type(factor), out=target)


def _check_c_shape(c: np.ndarray, y: np.ndarray, opset: int) -> None:
    """Gemm before opset 7 with broadcast=0 needs C of exactly the result's shape."""
    if c.shape != y.shape:
        raise ValueError(
            f"Gemm (opset {opset}, broadcast=0): C has shape {c.shape}, "
            f"expected {y.shape}; set broadcast=1 to broadcast it"
        )


def _prepared_b(b: np.ndarray, trans_b: bool, alpha: float | None) -> np.ndarray:
    """Gemm's constant B as the matmul reads it: contiguous, transposed, alpha folded in."""
    prepared = np.ascontiguousarray(b.T if trans_b else b)
    if alpha is not None:
        prepared = _scaled(prepared, alpha)
    return _widen(prepared)


def _splittable(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a @ b`` is a float32/float64 matrix product ``split_gemm`` computes
    (blocks over the threads, one-thread BLAS each) rather than numpy."""
    return a.ndim == 2 and b.ndim == 2 and a.dtype == b.dtype and a.dtype.char in "fd"


@kernel_builder("Gemm", 1, 7, compiled=DENSE_LOOPS)
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
        fold_alpha = scale_y and b_const.dtype.kind not in "iu"
        # the same weight prepared the same way is one array for every session of a WeightStore
        prepared_b = shared_transform(
            b_const, ("Gemm.B", trans_b, alpha if fold_alpha else 1.0),
            lambda: _prepared_b(b_const, trans_b, alpha if fold_alpha else None),
        )
        scale_y = scale_y and not fold_alpha
    else:
        prepared_b = None
    prepared_c = None
    if c_const is not None and beta != 0.0:
        prepared_c = _scaled(c_const, beta) if beta != 1.0 else c_const

    panels = WeightPanels(prepared_b if not scale_y else None)

    def packed(y: np.ndarray, a: np.ndarray, c: np.ndarray | None, allocate: Allocate) -> bool:
        """y = a @ B' (+ C) by the packed kernel (``kernels.dense``), C of one value per
        column as its bias; False where it does not run."""
        if panels.weight is None or prepared_b is None or a.ndim != 2 or not packs(a.shape[0]):
            return False
        n = prepared_b.shape[1]
        bias = rest = None
        if c is not None and beta != 0.0:
            if strict_c_shape:
                _check_c_shape(c, y, ctx.opset)
            c = prepared_c if prepared_c is not None else c if beta == 1.0 else None
            if c is None:
                return False
            if c.shape in ((n,), (1, n)) and c.dtype == y.dtype and c.flags.c_contiguous:
                bias = c.reshape(n)
            else:
                rest = c
        if matrix_rows(y, a, prepared_b, bias) is None:
            return False
        dense_product(y, a, prepared_b, bias, panels=panels, allocate=allocate)
        if rest is not None:
            y += rest
        return True

    def run(a, b, c=None):
        if trans_a:
            a = a.T
        if panels.weight is not None and a.ndim == 2 and a.dtype == np.float32 and packs(a.shape[0]):
            y = np.empty((a.shape[0], panels.weight.shape[1]), np.float32)
            if packed(y, a, c, new_array):
                return y
        if prepared_b is not None and _splittable(a, prepared_b):
            y = np.empty((a.shape[0], prepared_b.shape[1]), a.dtype)
            split_gemm(a, prepared_b, y)
        elif prepared_b is not None:
            out_dtype = a.dtype
            y = np.matmul(_widen(a), prepared_b)
            if y.dtype != out_dtype:
                y = y.astype(out_dtype)
        else:
            y = _matmul(a, b.T if trans_b else b)
        if scale_y:
            y = _scaled(y, alpha) if y.dtype.kind in "iu" else np.multiply(y, y.dtype.type(alpha), out=y)
        if c is not None and beta != 0.0:
            if strict_c_shape:
                _check_c_shape(c, y, ctx.opset)
            if prepared_c is not None:
                c = prepared_c
            elif beta != 1.0:
                c = _scaled(c, beta)
            y += c
        return y

    def run_into(y, a, b, c=None):
        if trans_a:
            a = a.T
        if packed(y, a, c, lambda slot, shape, dtype: scratch(y, slot, shape, dtype)):
            return
        if prepared_b is not None:
            wide_a = _widen_into(y, "a", a)
            product_dtype = np.result_type(wide_a.dtype, prepared_b.dtype)
            if product_dtype != y.dtype:
                product = scratch(y, "product", y.shape, product_dtype)
                np.matmul(wide_a, prepared_b, out=product)
                np.copyto(y, product, casting="unsafe")
            elif _splittable(a, prepared_b):
                split_gemm(a, prepared_b, y)
            else:
                np.matmul(a, prepared_b, out=y)
        else:
            _matmul_into(y, a, b.T if trans_b else b)
        if scale_y:
            if y.dtype.kind in "iu":
                _scaled_into(y, "y", y, alpha)
            else:
                np.multiply(y, y.dtype.type(alpha), out=y)
        if c is not None and beta != 0.0:
            if strict_c_shape:
                _check_c_shape(c, y, ctx.opset)
            if prepared_c is not None:
                c = prepared_c
            elif beta != 1.0:
                c = _scaled_into(y, "c", c, beta)
            y += c

    declare_into(run_into, run)
    return run


def _expand_einsum(equation: str, ranks: list[int]) -> tuple[list[str], str]:
    """The equation's input terms and output term with every ``...`` spelled out in
    spare letters (right-aligned, as ellipsis dimensions broadcast) and, in implicit
    mode, the output made explicit."""
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise ValueError(f"Einsum equation {equation!r} names {len(terms)} inputs, got {len(ranks)}")
    spare = [c for c in string.ascii_letters if c not in equation]
    ellipsis_ranks = [rank - (len(t) - 3) if "..." in t else 0 for t, rank in zip(terms, ranks)]
    ellipsis = "".join(spare[: max(ellipsis_ranks, default=0)])
    expanded = [
        t.replace("...", ellipsis[len(ellipsis) - n :] if n else "") for t, n in zip(terms, ellipsis_ranks)
    ]
    if arrow:
        output = rhs.replace("...", ellipsis)
    else:
        letters = lhs.replace("...", "").replace(",", "")
        output = ellipsis + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return expanded, output


def _pair_contraction(a_term: str, b_term: str, out_term: str, a_shape, b_shape):
    """einsum(a_term, b_term -> out_term) as one batched np.matmul: returns the function,
    or None where the equation needs einsum's general machinery (a letter repeated in a
    term, a contracted dimension that broadcasts)."""
    if any(len(set(t)) != len(t) for t in (a_term, b_term, out_term)):
        return None
    a_sizes, b_sizes = dict(zip(a_term, a_shape)), dict(zip(b_term, b_shape))
    if any(c not in a_sizes and c not in b_sizes for c in out_term):
        return None
    # Letters in one input only and not in the output are summed out first.
    a_summed = tuple(i for i, c in enumerate(a_term) if c not in b_sizes and c not in out_term)
    b_summed = tuple(i for i, c in enumerate(b_term) if c not in a_sizes and c not in out_term)
    batch = [c for c in out_term if c in a_sizes and c in b_sizes]
    left = [c for c in out_term if c in a_sizes and c not in b_sizes]
    right = [c for c in out_term if c in b_sizes and c not in a_sizes]
    contracted = [c for c in a_term if c in b_sizes and c not in out_term]
    if any(a_sizes[c] != b_sizes[c] for c in contracted):
        return None
    a_kept = [c for i, c in enumerate(a_term) if i not in a_summed]
    b_kept = [c for i, c in enumerate(b_term) if i not in b_summed]
    a_perm = [a_kept.index(c) for c in batch + left + contracted]
    b_perm = [b_kept.index(c) for c in batch + contracted + right]
    depth = math.prod(a_sizes[c] for c in contracted)
    a_matrix = [a_sizes[c] for c in batch] + [math.prod(a_sizes[c] for c in left), depth]
    b_matrix = [b_sizes[c] for c in batch] + [depth, math.prod(b_sizes[c] for c in right)]
    batch_shape = [max(a_sizes[c], b_sizes[c]) for c in batch]  # size-1 batch dims broadcast
    y_shape = batch_shape + [a_sizes[c] for c in left] + [b_sizes[c] for c in right]
    y_letters = batch + left + right
    out_perm = [y_letters.index(c) for c in out_term]

    def run(a, b):
        if a_summed:
            a = a.sum(axis=a_summed, dtype=a.dtype)
        if b_summed:
            b = b.sum(axis=b_summed, dtype=b.dtype)
        y = pooled(a.transpose(a_perm).reshape(a_matrix), b.transpose(b_perm).reshape(b_matrix))
        return y.reshape(y_shape).transpose(out_perm)

    y_matrix = batch_shape + [math.prod(a_sizes[c] for c in left), math.prod(b_sizes[c] for c in right)]
    from_out = [out_perm.index(i) for i in range(len(out_perm))]

    def run_into(out, a, b):
        # The kernel's result is a transposed view of the matmul's; capture's buffer keeps
        # that layout, so the matmul can write straight through the inverse transpose.
        target = out.transpose(from_out)
        if a_summed or b_summed or not target.flags.c_contiguous or out.dtype != np.result_type(a, b):
            np.copyto(out, run(a, b), casting="unsafe")  # (sums of single-input letters: temporaries)
            return
        a_rows, b_columns = a.transpose(a_perm).reshape(a_matrix), b.transpose(b_perm).reshape(b_matrix)
        pooled(a_rows, b_columns, out=target.reshape(y_matrix))

    declare_into(run_into, run)
    return run


def _plan_einsum(equation: str, operands: list[np.ndarray]):
    terms, output = _expand_einsum(equation, [x.ndim for x in operands])
    if len(operands) == 2:
        pair = _pair_contraction(terms[0], terms[1], output, operands[0].shape, operands[1].shape)
        if pair is not None:
            return pair
    explicit = ",".join(terms) + "->" + output
    path: Any = np.einsum_path(explicit, *operands, optimize="greedy")[0] if len(operands) > 1 else False

    def run(*xs):
        return np.einsum(explicit, *xs, optimize=path)

    def run_into(out, *xs):
        # np.einsum(out=) writes the last contraction into out; earlier ones of a path of
        # several still make temporaries.
        np.einsum(explicit, *xs, optimize=path, out=out)

    declare_into(run_into, run)
    return run


@kernel_builder("Einsum", 12)
def einsum(ctx: KernelContext):
    """Two operands: one batched np.matmul (BLAS) after transposes and reshapes; otherwise
    np.einsum along a greedy contraction path. Planned once per set of input shapes."""
    equation = str(ctx.attributes["equation"]).replace(" ", "")
    plans: dict[tuple[tuple[int, ...], ...], Any] = {}
    max_plans = 64  # bounds the cache when a model's shapes keep changing

    def run(*inputs):
        out_dtype = inputs[0].dtype
        operands = [_widen(x) for x in inputs]
        shapes = tuple(x.shape for x in operands)
        contract = plans.get(shapes)
        if contract is None:
            contract = _plan_einsum(equation, operands)
            if len(plans) >= max_plans:
                plans.clear()
            plans[shapes] = contract
        result = np.asarray(contract(*operands))
        return result if result.dtype == out_dtype else result.astype(out_dtype)

    def run_into(out, *inputs):
        contract = plans.get(tuple(x.shape for x in inputs))
        if contract is None or inputs[0].dtype in _HALF_TYPES or np.result_type(*inputs) != out.dtype:
            np.copyto(out, run(*inputs), casting="unsafe")  # a new plan, or half types widened: eager
        else:
            contract.into(out, *inputs)

    declare_into(run_into, run)
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
