"""Scaled dot-product attention as one step: ``softmax(scale * q @ k^T + mask) @ v``.

What transformers' SDPA exports (BERT, GPT-2) and torchvision's ViT write as five to
eight nodes: the queries and the transposed keys each multiplied by a root of the scale
(the keys' transpose copied to do so), the scores' product, the mask's Add and the Softmax
(``AddSoftmax`` here), a NaN guard, the product by the values and a Transpose of the
heads back beside each other, copied by the Reshape after it. Here, with numba and the
compiled pool, each (batch entry, head) is one unit of one job (``_numba_dense.
attention_job``): the scores by the one-thread cblas_sgemm on q and k where they lie (a
transposed view is cblas's transpose flag), each row scaled, masked and normalised while
it is in cache, and ``p @ v`` written straight into the output's rows for that head,
whatever order of axes the output was asked in. Elsewhere (no numba, float64, operands
cblas cannot read where they lie) numpy's matmul, the Softmax kernel and the guard.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import numpy as np

from plugrt.threads import blas_threads, parallel_threads

from ._compiled import compiled_module
from ._compiled_parallel import compiled_pool
from ._gemm import _TRANS, _layout, sgemm_address
from .elementwise import scratch
from .softmax import _softmax_axis

__all__ = ["attend"]

_F32 = np.dtype(np.float32)


def _broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """numpy's broadcast of ``shapes`` (``np.broadcast_shapes`` allocates ~12 KB a call,
    which a replay must not)."""
    rank = max(len(shape) for shape in shapes)
    result = [1] * rank
    for shape in shapes:
        for axis, size in enumerate(shape, rank - len(shape)):
            if size != result[axis] and size != 1:
                if result[axis] != 1:
                    raise ValueError(f"attention operands' batch axes {shapes} do not broadcast")
                result[axis] = size
    return tuple(result)


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    inverse = [0] * len(perm)
    for index, axis in enumerate(perm):
        inverse[axis] = index
    return tuple(inverse)


def attend(
    q: np.ndarray,
    kt: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    scale: float,
    zero_nan: bool,
    perm: tuple[int, ...],
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``softmax(scale * q @ kt + mask) @ v`` over the last axis (numpy's matmul and
    broadcasting: q (..., S, D), kt (..., D, T), v (..., T, E), the mask onto (..., S, T)),
    with 0 where the softmax gives NaN when ``zero_nan``; the result transposed by
    ``perm`` (the Transpose after it, its last axis kept last), into ``out`` when given."""
    if min(q.ndim, kt.ndim, v.ndim) < 2 or q.shape[-1] != kt.shape[-2] or kt.shape[-1] != v.shape[-2]:
        raise ValueError(
            f"attention operands do not chain: q {q.shape} @ k^T {kt.shape} @ v {v.shape} (each product's inner sizes must match)"
        )
    if mask is not None and (mask.ndim < 1 or mask.shape[-1] not in (1, kt.shape[-1]) or (mask.ndim > 1 and mask.shape[-2] not in (1, q.shape[-2]))):
        raise ValueError(f"attention mask {mask.shape} does not broadcast onto the scores (..., {q.shape[-2]}, {kt.shape[-1]})")
    dtype = np.result_type(q, kt, v)
    batch = _broadcast(q.shape[:-2], kt.shape[:-2], v.shape[:-2], () if mask is None else mask.shape[:-2])
    shape = (*batch, q.shape[-2], v.shape[-1])
    y = np.empty(tuple(shape[axis] for axis in perm), dtype) if out is None else out
    view = y.transpose(_inverse(perm))  # the result's axes, y's memory
    if not _compiled(q, kt, v, mask, scale, zero_nan, view, y if out is not None else None):
        _numpy(q, kt, v, mask, scale, zero_nan, view, out)
    return y


def _steps(x: np.ndarray) -> tuple[int, int]:
    """Floats from one batch entry and from one head to the next of a 4-D operand (0 along
    an axis of one: broadcast)."""
    item = x.itemsize
    return tuple(0 if x.shape[axis] == 1 else x.strides[axis] // item for axis in (0, 1))  # type: ignore[return-value]


#: The attention's job takes a second thread from this many multiply-adds on (its two
#: products; a fourth of the pool's general threshold, as each row's softmax runs in the
#: same job). GPT-2 prefill's 4 heads of 64 x 64 (2.1 M): 105 us on one thread, 69 on
#: two; 2 heads of 32 x 32 (0.13 M): 32 on one, 54 on two.
_PARALLEL_WORK_SCALE = 4
#: Plans kept (one per shape and layout of the operands); past this, a new one is made
#: each call.
_PLAN_LIMIT = 256


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a call of one shape and layout needs but the operands' addresses and its
    threads (asked each call: the free cores change): the job's context with those left
    out, its units and multiply-adds."""

    context: np.ndarray
    units: int
    work: int
    scores: int  # floats of work per slot


_PLANS: dict[tuple, _Plan | None] = {}


def _plan(q: np.ndarray, kt: np.ndarray, v: np.ndarray, rows: np.ndarray | None, scale: float, zero_nan: bool,
          view: np.ndarray, loops: ModuleType, address: tuple[int, bool]) -> _Plan | None:
    """The plan of a call of these operands' shapes and layouts (None: cblas cannot read
    one of them where it lies)."""
    layouts = _layout(q), _layout(kt), _layout(v)
    if None in layouts:
        return None
    batch, heads, s, e = view.shape
    d, t = kt.shape[-2:]
    units = batch * heads
    (q_trans, q_ld), (k_trans, k_ld), (v_trans, v_ld) = layouts  # type: ignore[misc]
    item = view.itemsize
    context = np.zeros(loops.ATTENTION_WORDS, np.int64)
    context[: loops.ATT_WIDTH + 1] = [address[0], int(address[1]), heads, s, t, d, e]
    context[loops.ATT_Q_BATCH : loops.ATT_Q_TRANS + 1] = [*_steps(q), q_ld, int(q_trans == _TRANS)]
    context[loops.ATT_K_BATCH : loops.ATT_K_TRANS + 1] = [*_steps(kt), k_ld, int(k_trans == _TRANS)]
    context[loops.ATT_V_BATCH : loops.ATT_V_TRANS + 1] = [*_steps(v), v_ld, int(v_trans == _TRANS)]
    context[loops.ATT_OUT_BATCH : loops.ATT_OUT_LD + 1] = [view.strides[0] // item, view.strides[1] // item, view.strides[2] // item]
    if rows is not None:
        context[loops.ATT_MASK_BATCH : loops.ATT_MASK_LD + 1] = [
            *_steps(rows), 0 if rows.shape[2] == 1 else rows.strides[2] // rows.itemsize
        ]
    context[loops.ATT_SCALE] = int(np.float32(scale).view(np.int32)) & 0xFFFFFFFF
    context[loops.ATT_ZERO_NAN] = int(zero_nan)
    return _Plan(context, units, units * s * t * (d + e), s * t)


def _compiled(
    q: np.ndarray, kt: np.ndarray, v: np.ndarray, mask: np.ndarray | None, scale: float, zero_nan: bool,
    view: np.ndarray, anchor: np.ndarray | None,
) -> bool:
    """The heads as one job on the compiled pool; False, with nothing written, where it does
    not apply (not float32, not four axes, a layout cblas cannot read, no numba or pool)."""
    if view.ndim != 4 or not (q.ndim == kt.ndim == v.ndim == 4) or view.size == 0:
        return False
    if not (q.dtype == kt.dtype == v.dtype == view.dtype == _F32) or (mask is not None and (mask.dtype != _F32 or not 0 < mask.ndim <= 4)):
        return False
    if view.strides[-1] != view.itemsize or any(s % view.itemsize for s in view.strides):
        return False
    loops = compiled_module("_numba_dense")
    pool = compiled_pool() if loops is not None else None
    address = sgemm_address() if pool is not None else None
    if loops is None or pool is None or address is None:
        return False
    rows: np.ndarray | None = None  # the mask as four axes
    if mask is not None:
        padded: tuple[int, ...] = (1,) * (4 - mask.ndim) + tuple(mask.shape)
        rows = mask.reshape(padded)
        steps: tuple[int, ...] = rows.strides
        if mask.shape[-1] != kt.shape[-1] or (steps[-1] != rows.itemsize and mask.shape[-1] > 1) or steps[2] % rows.itemsize:
            return False
    key = (
        q.shape, q.strides, kt.shape, kt.strides, v.shape, v.strides, view.shape, view.strides, scale, zero_nan,
        None if rows is None else (rows.shape, rows.strides),
    )
    plan = _PLANS.get(key, False)
    if plan is False:
        plan = _plan(q, kt, v, rows, scale, zero_nan, view, loops, address)
        if len(_PLANS) < _PLAN_LIMIT:
            _PLANS[key] = plan
    if plan is None:
        return False
    assert isinstance(plan, _Plan)
    threads = min(parallel_threads(_PARALLEL_WORK_SCALE * plan.work), plan.units)
    shape = (pool.slots(plan.units, threads), plan.scores)
    work = np.empty(shape, _F32) if anchor is None else scratch(anchor, "attention-scores", shape, _F32)
    context = plan.context.copy()
    context[loops.ATT_Q] = q.ctypes.data
    context[loops.ATT_K] = kt.ctypes.data
    context[loops.ATT_V] = v.ctypes.data
    context[loops.ATT_OUT] = view.ctypes.data
    context[loops.ATT_MASK] = 0 if rows is None else rows.ctypes.data
    context[loops.ATT_WORK] = work.ctypes.data
    blas_threads(0)  # the calling thread runs units too: its BLAS on one thread
    pool.run(loops.attention_job.address, context, plan.units, threads)
    return True


def _numpy(
    q: np.ndarray, kt: np.ndarray, v: np.ndarray, mask: np.ndarray | None, scale: float, zero_nan: bool,
    view: np.ndarray, out: np.ndarray | None,
) -> None:
    """The same by numpy's matmul and the Softmax kernel; with ``out`` (an ``into`` call)
    every intermediate in work arrays kept with it, so that a replay allocates nothing."""
    shape = (*view.shape[:-1], kt.shape[-1])

    def work(slot: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return np.empty(shape, dtype) if out is None else scratch(out, slot, shape, dtype)

    if _broadcast(q.shape[:-2], kt.shape[:-2]) != shape[:-2]:  # the mask widens the batch
        scores = np.matmul(q, kt)
    else:
        scores = np.matmul(q, kt, out=work("attention-scores", shape, view.dtype))
    scores *= scores.dtype.type(scale)
    if mask is not None:
        scores = np.add(scores, mask, out=scores if scores.shape == shape else work("attention-scores", shape, view.dtype))
    probabilities = _softmax_axis(scores, -1, scores)
    if zero_nan:
        nan = np.isnan(probabilities, out=work("attention-nan", shape, np.dtype(np.bool_)))
        np.copyto(probabilities, 0, where=nan)
    result = work("attention-result", view.shape, view.dtype)
    np.matmul(probabilities, v, out=result)
    np.copyto(view, result)
