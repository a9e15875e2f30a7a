"""Conv whose output is added to a residual, then optionally clamped (Relu): the sum written by the convolution's own GEMMs."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from plugrt.threads import blas_threads

from .._registry import KernelContext, declare_into
from ._gemm import available, split_gemm
from .conv import ConvConstants, _Convolution
from ._relu import relu_into
from ._window import _cast_into_scratch, _copy_to_workspace
from .elementwise import scratch, with_small_buffers
from .winograd import winograd_loops

__all__ = ["build_residual_conv"]


def build_residual_conv(ctx: KernelContext, relu: bool) -> Callable[..., np.ndarray]:
    """The kernel of ``Relu(Conv(x, w, b) + z)`` (without the Relu when ``relu`` is false)
    for a node with inputs (x, w, b, z).

    Where the residual ``z`` has the output's shape and dtype, the sum is made by the
    Conv's own passes: a pointwise Conv adds each output block's share of ``z``, the bias
    and the Relu right after the block's product, while it is in cache, on whichever
    thread computed it (where the output is ``z``'s own buffer, it starts as ``z + b`` and
    the products accumulate onto it: BLAS ``beta=1``); a 3x3 Conv by Winograd adds ``z`` in
    its output transform and the compiled im2col units in their GEMM's epilogue (where the
    output is not ``z``'s buffer), as the same Conv without a residual would run; a Conv on
    the tap grid adds ``z`` as it crops. No separate pass adds the residual, and no sum is allocated besides the
    output. Anything else (a broadcasting residual, other dtypes, no direct BLAS) computes
    the Conv, then the sum.
    """
    op = _Convolution(ctx.attributes)
    constants = ConvConstants(ctx, op)  # the weight build_conv prepares, shared through a WeightStore

    def fused(x: np.ndarray, weight: Any, bias: np.ndarray | None, z: np.ndarray, y: np.ndarray | None) -> np.ndarray | None:
        """The sum computed by the product itself, into ``y`` or a new array; None where
        this shape, dtype or library does not allow it."""
        if x.dtype != z.dtype or not available(x.dtype):
            return None
        plan = op._plans(x.shape, weight.shape, x.dtype.itemsize)
        if z.shape != (x.shape[0], plan.m, *plan.out):
            return None
        if plan.kind == "pointwise" and (y is None or not np.may_share_memory(y, z)):
            blas_threads(0)  # the products split themselves over threads, as in Conv
            return op._pointwise(x, weight.gemm, plan, bias, y, z, relu, packed=weight.packed()).reshape(z.shape)
        if plan.kind == "pointwise" and op.group == 1:
            return _pointwise(x, weight.gemm[0], bias, z, plan, relu, y)
        apart = y is None or not np.may_share_memory(y, z)
        if plan.kind == "im2col" and apart and z.dtype == x.dtype and z.flags.c_contiguous:
            # Winograd's output transform, or the compiled units' GEMM epilogue, adds z as it
            # stores: the paths Conv takes without a residual. Not into z's own buffer: a
            # Winograd call that meets a non-finite input leaves it to the direct way after
            # other bands have stored, and the units' BLAS GEMM stores before it adds.
            if plan.winograd is not None and winograd_loops() is not None:
                shape = (x.shape[0], plan.m, *plan.out)
                done = plan.winograd(x, weight, bias, relu, np.empty(shape, x.dtype) if y is None else y.reshape(shape), z)
                if done is not None:
                    return done
            # z stands in for the output here: the output takes its shape and C order
            if op._gathers(x, plan) and (found := op._compiled_units(x, weight.gemm, bias, z, z)) is not None:
                return op._im2col(x, weight.gemm, plan, bias, y, packed=weight.packed(), residual=z, relu=relu,
                                  found=found).reshape(z.shape)
        if plan.kind == "im2col" and plan.grid is not None:  # BLAS is there: checked above
            return plan.grid(x, weight, bias, relu, y, residual=z)
        return None

    def run(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, z: np.ndarray) -> np.ndarray:
        dtype, weight, bias = constants(x.dtype, w, b)
        xc = x.astype(dtype, copy=False)
        y = fused(xc, weight, bias, z, None) if x.dtype == dtype else None
        if y is None:
            y = op(xc, weight, bias).astype(x.dtype, copy=False) + z
            if relu:
                relu_into(y, y)
        return y

    def run_into(out: np.ndarray, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, z: np.ndarray) -> None:
        dtype, weight, bias = constants(x.dtype, w, b)
        if x.dtype == dtype == out.dtype and out.flags.c_contiguous:
            if with_small_buffers(fused, x, weight, bias, z, out) is not None:
                return
        xc = _cast_into_scratch(out, "x", x, dtype)
        plan = op._plans(xc.shape, weight.shape, dtype.itemsize)
        shape = (xc.shape[0], plan.m, *plan.out)
        direct = out.shape == shape and out.dtype == dtype and out.flags.c_contiguous
        # the Conv is written before the residual is read: not into the residual's own buffer
        y = out if direct and not np.may_share_memory(out, z) else scratch(out, "y", shape, dtype)
        op(xc, weight, bias, y)
        with_small_buffers(_add_into, y, z, out)
        if relu:
            relu_into(out, out)

    declare_into(run_into, run)
    return run


def _pointwise(
    x: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None,
    z: np.ndarray,
    plan: Any,
    relu: bool,
    y: np.ndarray | None,
) -> np.ndarray:
    """A 1x1 Conv (one group) accumulated onto ``z + bias``, in place where ``y`` is
    ``z``'s buffer: one GEMM per image."""
    n, c = x.shape[:2]
    size = plan.out_size
    if y is None:
        y = np.add(z, bias.reshape(-1, *([1] * len(plan.out)))) if bias is not None else z.copy()
    elif bias is not None:
        np.add(z, bias.reshape(-1, *([1] * len(plan.out))), out=y)
    else:
        np.copyto(y, z)
    xs = x[plan.src] if plan.copy_input else x
    if not xs.flags.c_contiguous:
        xs = _copy_to_workspace("residual_pointwise", xs)
    rows = y.reshape(n, plan.m, size)
    columns = xs.reshape(n, c, size)
    for image in range(n):
        split_gemm(weight, columns[image], rows[image], 1.0)
    if relu:
        relu_into(y, y)
    return y


def _add_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    np.add(a, b, out=out, casting="unsafe")
