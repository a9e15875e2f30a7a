"""Pooling kernels: MaxPool, AveragePool, LpPool, their global forms and MaxUnpool."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any, Callable, Sequence

import numpy as np
from plugrt.threads import PARALLEL_MIN_WORK, parallel_for, threads_for

from .._registry import KernelContext, kernel, kernel_builder, declare_into
from ._compiled import POOL_LOOPS, compiled_module
from ._compiled_parallel import compiled_pool as compiled_jobs
from ._window import (
    _FLOAT_BLAS,
    _auto_pad,
    _cast_into_scratch,
    _compute_dtype,
    _fresh,
    _ints,
    _pads,
    _ShapeCache,
    _taps,
    _window_geometry,
    _workspace,
)
from .elementwise import scratch, with_small_buffers

_FLOAT32 = np.dtype(np.float32)
# Element operations from which the compiled loops share planes out over the free cores
# on the compiled pool, and units of planes per thread there.
_COMPILED_MIN_OPS = 1 << 18
_COMPILED_UNITS_PER_THREAD = 2


def compiled_pool() -> ModuleType | None:
    """The numba-compiled 2-D pooling loops (``kernels._numba_pool``), or None when numba
    is not installed, the environment sets ``PLUGRT_NUMBA=0`` or they are still being built
    (see ``compiled_module``)."""
    return compiled_module("_numba_pool")


# ---------------------------------------------------------------------------
# Pooling: a loop over the (small) kernel window, each tap one strided slice
# ---------------------------------------------------------------------------


class _PoolPlan:
    """Output size, taps and per-position divisors for one input shape."""

    def __init__(self, pool: "_Pooling", x_shape: tuple[int, ...]):
        spatial = list(x_shape[2:])
        rank = len(spatial)
        kernel = [int(k) for k in pool.kernel_shape]
        if len(kernel) != rank:
            raise ValueError(f"{pool.op_type}: kernel_shape {kernel} does not match input rank {len(x_shape)}")
        strides = _ints(pool.strides, rank, 1)
        dilations = _ints(pool.dilations, rank, 1)
        pb, pe = _pads(pool.pads, rank)
        out, pb, pe = _window_geometry(spatial, kernel, strides, dilations, pb, pe, pool.auto_pad, pool.ceil_mode)
        self.out = out
        # What the compiled 2-D loops take: kernel, strides, dilations and begin pads per
        # axis (rows, then columns); None where they do not apply.
        self.geometry: tuple[int, ...] | None = None
        if rank == 2 and pool.mode in ("max", "avg") and not pool.want_indices and min(spatial) > 0:
            self.geometry = (*kernel, *strides, *dilations, *pb)
        self.scales: np.ndarray | None = None  # float32 reciprocal counts, for the compiled average
        self.work_length = 0  # float32 elements of the compiled loops' per-thread row buffers
        self.taps = [t for t in _taps(spatial, kernel, strides, dilations, pb, [0] * rank, out) if not t.empty]
        # A box window is separable: pool one axis at a time, the outer axes first, whose taps
        # read whole contiguous rows; each pass also shrinks what the next one reads.
        self.axis_passes = []
        for i in range(rank):
            if kernel[i] == 1 and strides[i] == 1 and out[i] == spatial[i] and pb[i] == 0:
                continue
            axis_taps = [
                t for t in _taps([spatial[i]], [kernel[i]], [strides[i]], [dilations[i]], [pb[i]], [0], [out[i]])
            ]
            lead = (slice(None),) * (2 + i)
            # Taps that cover every output start the result: the first two combined in one
            # pass, rather than a copy of one and a pass for the other.
            full = [t for t in axis_taps if t.bounds[0] == (0, out[i])][:2]
            others = [(lead + t.dst, lead + t.src) for t in axis_taps if not t.empty and t not in full]
            flat = None
            if strides[i] == 1 and 0 < out[i] <= spatial[i]:
                # Short rows make per-row work dominate: shift the whole flattened array at
                # once and redo the few border positions the shift gets wrong.
                offsets = [t * dilations[i] - pb[i] for t in range(kernel[i])]
                bounds = [(max(0, -o), min(out[i], spatial[i] - o)) for o in offsets]
                inner = (max(b[0] for b in bounds), min(b[1] for b in bounds))
                border = [o for o in range(out[i]) if not inner[0] <= o < inner[1]]
                flat = (offsets, [(o, [off for off, (b, e) in zip(offsets, bounds) if b <= o < e]) for o in border])
            self.axis_passes.append((2 + i, out[i], [lead + t.src for t in full], others, flat))
        # One window over the whole unpadded input, as at the end of many CNNs.
        self.whole_window = (
            all(o == 1 for o in out)
            and list(kernel) == spatial
            and not any(pb)
            and not any(pe)
            and all(d == 1 for d in dilations)
        )
        self.counts = None
        if pool.mode == "avg":
            # Taps that read the input (or, with count_include_pad, the explicit padding too).
            counts = np.ones(out, dtype=np.int64)
            for i in range(rank):
                start = np.arange(out[i]) * strides[i] - pb[i]
                hits = start[:, None] + np.arange(kernel[i])[None, :] * dilations[i]
                lo, hi = (-pb[i], spatial[i] + pe[i]) if pool.count_include_pad else (0, spatial[i])
                per_axis = ((hits >= lo) & (hits < hi)).sum(axis=1)
                counts = counts * per_axis.reshape([-1 if j == i else 1 for j in range(rank)])
            self.counts = counts
            if self.geometry is not None:
                with np.errstate(divide="ignore"):  # a count of 0 (a window in the padding): NaN, as 0 / 0
                    self.scales = np.float32(1.0) / counts.astype(np.float32)
        self.tap_indices = None
        if pool.want_indices:
            # Flat index of each tap's source element in the (row- or column-major) image plane.
            if pool.storage_order == 0:
                plane = [math.prod(spatial[i + 1 :]) for i in range(rank)]
            else:
                plane = [math.prod(spatial[:i]) for i in range(rank)]
            self.tap_indices = []
            for tap in self.taps:
                index = np.zeros([e - b for b, e in tap.bounds], dtype=np.int64)
                for i, s in enumerate(tap.src):
                    positions = np.arange(s.start, s.stop, s.step, dtype=np.int64) * plane[i]
                    index = index + positions.reshape([-1 if j == i else 1 for j in range(rank)])
                self.tap_indices.append(index)
            self.plane_size = math.prod(spatial)


def _slots_of(allocate: Callable[..., np.ndarray], prefix: Any) -> Callable[..., np.ndarray]:
    """``allocate`` with its slots named under ``prefix``."""
    return lambda slot, shape, dtype: allocate((prefix, slot), shape, dtype)


def _separable_pool(
    x: np.ndarray, plan: _PoolPlan, combine: np.ufunc, identity: Any, allocate: Callable[..., np.ndarray] = _fresh
) -> np.ndarray:
    """Max or sum over the window, one spatial axis after another; always a fresh array
    (from ``allocate(slot, shape, dtype)``: work arrays in an ``into`` variant)."""
    y = x
    for k, (axis, size, full_srcs, others, flat) in enumerate(plan.axis_passes):
        if flat is not None and y.flags.c_contiguous:
            y = _pool_axis_flat(y, axis, size, flat, combine, identity, _slots_of(allocate, k))
            continue
        if full_srcs:
            start = y[full_srcs[0]]
            acc = allocate(k, start.shape, y.dtype)
            if len(full_srcs) > 1:
                combine(start, y[full_srcs[1]], out=acc)
            else:
                np.copyto(acc, start)
        else:
            shape = list(y.shape)
            shape[axis] = size
            acc = allocate(k, tuple(shape), y.dtype)
            acc.fill(identity)
        for dst_index, src_index in others:
            dst = acc[dst_index]
            combine(dst, y[src_index], out=dst)
        y = acc
    if y is x:
        y = allocate("copy", x.shape, x.dtype)
        np.copyto(y, x)
    return y


def _pool_axis_flat(
    y: np.ndarray,
    axis: int,
    size: int,
    flat: tuple[list[int], list[tuple[int, list[int]]]],
    combine: np.ufunc,
    identity: Any,
    allocate: Callable[..., np.ndarray] = _fresh,
) -> np.ndarray:
    """A stride-1 pass along ``axis`` done on the flattened array (``y`` is C-contiguous)."""
    offsets, border = flat
    inner = math.prod(y.shape[axis + 1 :])
    acc = allocate("acc", y.shape, y.dtype)  # as long as the input on ``axis``; cropped at the end
    src, dst = y.reshape(-1), acc.reshape(-1)
    total = src.size
    shifts = [off * inner for off in offsets]
    # The first two taps are combined in one pass where both read inside the array;
    # elsewhere they read past its ends, only at border positions, which are redone below.
    first = shifts[:2]
    lo = min(total, max(0, *(-shift for shift in first)))
    hi = max(lo, total - max(0, *first))
    dst[:lo] = identity
    dst[hi:] = identity
    if len(first) == 1:
        dst[lo:hi] = src[lo + first[0] : hi + first[0]]
    else:
        combine(src[lo + first[0] : hi + first[0]], src[lo + first[1] : hi + first[1]], out=dst[lo:hi])
    for shift in shifts[2:]:
        lo = min(total, max(0, -shift))
        hi = max(lo, total - max(0, shift))
        combine(dst[lo:hi], src[lo + shift : hi + shift], out=dst[lo:hi])
    # The shifts mixed neighbouring rows into the border positions: redo those exactly.
    lead = (slice(None),) * axis
    for position, valid in border:
        out = acc[lead + (position,)]
        if not valid:
            out[...] = identity
            continue
        out[...] = y[lead + (position + valid[0],)]
        for off in valid[1:]:
            combine(out, y[lead + (position + off,)], out=out)
    if size == y.shape[axis]:
        return acc
    cropped = acc[lead + (slice(0, size),)]
    result = allocate("cropped", cropped.shape, y.dtype)
    np.copyto(result, cropped)
    return result


class _Pooling:
    """MaxPool / AveragePool / LpPool with their attributes parsed once."""

    def __init__(self, op_type: str, mode: str, attributes: dict[str, Any], want_indices: bool = False):
        self.op_type = op_type
        self.mode = mode
        kernel_shape = attributes.get("kernel_shape")
        if not kernel_shape:
            raise ValueError(f"{op_type}: the kernel_shape attribute is required")
        self.kernel_shape = list(kernel_shape)
        self.auto_pad = _auto_pad(attributes.get("auto_pad"))
        self.ceil_mode = bool(attributes.get("ceil_mode", 0))
        self.count_include_pad = bool(attributes.get("count_include_pad", 0))
        self.dilations = attributes.get("dilations")
        self.pads = attributes.get("pads")
        self.strides = attributes.get("strides")
        self.storage_order = int(attributes.get("storage_order", 0))
        self.p = attributes.get("p", 2)
        self.want_indices = want_indices
        if self.storage_order not in (0, 1):
            raise NotImplementedError(f"{op_type}: storage_order={self.storage_order} is not 0 or 1")
        self._plans = _ShapeCache(lambda shape: _PoolPlan(self, shape))

    def compiled(self, x: np.ndarray, plan: _PoolPlan, out: np.ndarray | None = None) -> np.ndarray | None:
        """MaxPool or AveragePool by the compiled 2-D loops, into ``out`` when given (the
        ``into`` variant: nothing allocated but this thread's row buffers, once), split
        over the cores by image plane; None where they do not apply (not float32 NCHW,
        a strided input or output, numba off), and the numpy path runs instead."""
        if plan.geometry is None or x.dtype != _FLOAT32 or not x.flags.c_contiguous:
            return None
        loops = compiled_pool()
        if loops is None:
            return None
        n, c, height, width = x.shape
        out_h, out_w = plan.out
        if out is None:
            out = np.empty((n, c, out_h, out_w), dtype=_FLOAT32)
        elif out.dtype != _FLOAT32 or not out.flags.c_contiguous or out.shape != (n, c, out_h, out_w):
            return None
        planes = n * c
        if planes == 0 or out.size == 0:
            return out
        kh, kw, sh, sw, dh, dw, ph, pw = plan.geometry
        if plan.work_length == 0:
            plan.work_length = int(loops.work_length(height, width, out_h, out_w, kh, kw, sh, sw, dh, dw, ph, pw))
        length = plan.work_length
        xs, ys = x.reshape(planes, height, width), out.reshape(planes, out_h, out_w)
        scales = plan.scales

        # Work in element operations of the two passes: a second thread starts at 4M
        # (~0.5 ms). Measured on 2 cores: no faster at 0.2 ms (waking it and handing the
        # GIL back and forth cost what it saves), 1.5x faster at 1 ms. On the compiled
        # pool (no GIL, no waking) from 256K (~30 us).
        ops = planes * out_h * (width * kh + out_w * kw)
        jobs = compiled_jobs()
        if jobs is not None:
            threads = threads_for(PARALLEL_MIN_WORK) if ops >= _COMPILED_MIN_OPS else 1
            units = min(planes, threads * _COMPILED_UNITS_PER_THREAD)
            slots = jobs.slots(units, threads)
            work, _ = _workspace("pool-rows", (slots * length,), _FLOAT32)
            context = np.array(
                [
                    xs.ctypes.data, ys.ctypes.data, planes, height, width, out_h, out_w, units, kh, kw, sh, sw, dh,
                    dw, ph, pw, 0 if scales is None else scales.ctypes.data, work.ctypes.data, length,
                ],
                np.int64,
            )
            jobs.run(loops.pool_planes.address, context, units, threads)
            return out

        def chunk(start: int, stop: int) -> None:
            work, _ = _workspace("pool-row", (length,), _FLOAT32)
            if scales is None:
                loops.max_pool2d(xs, ys, start, stop, kh, kw, sh, sw, dh, dw, ph, pw, work)
            else:
                loops.avg_pool2d(xs, ys, start, stop, kh, kw, sh, sw, dh, dw, ph, pw, scales, work)

        parallel_for(planes, chunk, ops)
        return out

    def max(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        plan: _PoolPlan = self._plans(x.shape)
        n, c = x.shape[:2]
        lowest = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
        if not self.want_indices:
            y = self.compiled(x, plan)
            return (_separable_pool(x, plan, np.maximum, lowest) if y is None else y), None
        y = np.full((n, c, *plan.out), lowest, dtype=x.dtype)
        lead = (slice(None), slice(None))
        index = np.full(y.shape, -1, dtype=np.int64)
        for tap, tap_index in zip(plan.taps, plan.tap_indices):
            dst = y[lead + tap.dst]
            src = x[lead + tap.src]
            dst_index = index[lead + tap.dst]
            better = (src > dst) | (dst_index < 0)  # strict: the first maximum in window order wins
            np.copyto(dst, src, where=better)
            np.copyto(dst_index, tap_index, where=better)
        base = np.arange(n * c, dtype=np.int64).reshape(n, c, *([1] * len(plan.out))) * plan.plane_size
        index += base
        return y, index

    def max_into(self, out: tuple[np.ndarray, ...], x: np.ndarray) -> None:
        if self.want_indices:  # the indices path builds masks per tap: eager, then copied
            for buffer, result in zip(out, self.max(x)):
                if result is not None:
                    np.copyto(buffer, result)
            return
        plan: _PoolPlan = self._plans(x.shape)
        if self.compiled(x, plan, out[0]) is not None:
            return
        lowest = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
        allocate = _scratch_of(out[0])
        np.copyto(out[0], with_small_buffers(_separable_pool, x, plan, np.maximum, lowest, allocate))

    def sum_pool(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """AveragePool and LpPool: a sum over the window (of |x|^p for LpPool); into
        ``out`` when given (the ``into`` variant, work arrays kept for the next call,
        elementwise passes with small ufunc buffers)."""
        plan: _PoolPlan = self._plans(x.shape)
        if self.mode == "avg" and plan.whole_window:
            return _spatial_mean(x, out)
        if self.mode == "avg":
            y = self.compiled(x, plan, out)
            if y is not None:
                return y
        n, c = x.shape[:2]
        dtype = _compute_dtype(x.dtype)
        allocate = _fresh if out is None else _scratch_of(out)
        xs = x.astype(dtype, copy=False) if out is None else _cast_into_scratch(out, "x", x, dtype)
        p = self.p
        if self.mode == "lp":
            powers = allocate("powers", xs.shape, dtype)
            if p == 2:
                np.multiply(xs, xs, out=powers)
            else:
                np.abs(xs, out=powers)
                if p != 1:
                    np.power(powers, dtype.type(p), out=powers)
            xs = powers
        if out is None:
            y = self._window_sums(xs, plan, allocate)
        else:
            y = with_small_buffers(self._window_sums, xs, plan, allocate)
        if self.mode == "lp" and p == 2:
            np.sqrt(y, out=y)
        elif self.mode == "lp" and p != 1:
            np.power(y, dtype.type(1.0 / p), out=y)
        if out is None:
            return y.astype(x.dtype, copy=False)
        np.copyto(out, y, casting="unsafe")
        return out

    def _window_sums(self, xs: np.ndarray, plan: _PoolPlan, allocate: Callable[..., np.ndarray]) -> np.ndarray:
        """The sums over the window (averages for AveragePool)."""
        y = _separable_pool(xs, plan, np.add, 0, allocate)
        if self.mode == "avg" and plan.counts is not None:  # counts exist in avg mode
            counts = allocate("counts", plan.counts.shape, y.dtype)
            np.copyto(counts, plan.counts, casting="unsafe")
            y /= counts
        return y

    def sum_pool_into(self, out: np.ndarray, x: np.ndarray) -> None:
        self.sum_pool(x, out)


def _scratch_of(out: np.ndarray) -> Callable[..., np.ndarray]:
    """An ``allocate(slot, shape, dtype)`` handing out the work arrays of ``out``'s ``into`` call."""
    return lambda slot, shape, dtype: scratch(out, slot, shape, dtype)


def _bound_into(method: Callable[..., Any], into: Callable[..., Any]) -> Callable[..., Any]:
    """A bound method as a kernel with an ``into`` (bound methods take no attributes)."""

    def run(*inputs: Any) -> Any:
        return method(*inputs)

    declare_into(into, run)
    return run


@kernel_builder("MaxPool", 1, multi_output=True, compiled=POOL_LOOPS)
def max_pool(ctx: KernelContext) -> Callable[..., tuple[np.ndarray, np.ndarray | None]]:
    """MaxPool (Indices output with storage_order, dilations, ceil_mode, auto_pad)."""
    pool = _Pooling("MaxPool", "max", ctx.attributes, want_indices=ctx.num_outputs > 1)
    return _bound_into(pool.max, pool.max_into)


@kernel_builder("AveragePool", 1, compiled=POOL_LOOPS)
def average_pool(ctx: KernelContext) -> Callable[[np.ndarray], np.ndarray]:
    """AveragePool (count_include_pad, ceil_mode, dilations)."""
    pool = _Pooling("AveragePool", "avg", ctx.attributes)
    return _bound_into(pool.sum_pool, pool.sum_pool_into)


@kernel_builder("LpPool", 1)
def lp_pool(ctx: KernelContext) -> Callable[[np.ndarray], np.ndarray]:
    """LpPool: (sum |x|^p over the window)^(1/p); padding contributes nothing."""
    pool = _Pooling("LpPool", "lp", ctx.attributes)
    return _bound_into(pool.sum_pool, pool.sum_pool_into)


_GEMV_MEAN_MAX = 4096  # longer rows are summed pairwise (np.mean) for accuracy


def _spatial_mean(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Mean over every axis after the first two, kept as size-1 axes (into ``out`` when
    given: the ``into`` variant)."""
    dtype = _compute_dtype(x.dtype)
    size = math.prod(x.shape[2:])
    shape = (*x.shape[:2], *([1] * (x.ndim - 2)))
    if x.dtype in _FLOAT_BLAS and 0 < size <= _GEMV_MEAN_MAX and x.flags.c_contiguous:
        # A matrix-vector product with ones is one BLAS call; a per-row reduction is slow on short rows.
        if out is None:
            ones = np.full(size, 1.0 / size, dtype=x.dtype)
            return np.matmul(x.reshape(-1, size), ones).reshape(shape)
        ones = scratch(out, "ones", (size,), x.dtype)
        ones.fill(1.0 / size)
        if out.flags.c_contiguous:
            np.matmul(x.reshape(-1, size), ones, out=out.reshape(-1))
        else:
            np.copyto(out, np.matmul(x.reshape(-1, size), ones).reshape(shape))
        return out
    axes = tuple(range(2, x.ndim))
    if out is None:
        return x.mean(axis=axes, keepdims=True, dtype=dtype).astype(x.dtype, copy=False)
    mean = out if out.dtype == dtype else scratch(out, "mean", out.shape, dtype)
    x.mean(axis=axes, keepdims=True, dtype=dtype, out=mean)
    if mean is not out:
        np.copyto(out, mean, casting="unsafe")
    return out


@kernel("GlobalAveragePool", 1)
def global_average_pool(x: np.ndarray) -> np.ndarray:
    return _spatial_mean(x)


declare_into(lambda out, x: _spatial_mean(x, out), global_average_pool)


@kernel("GlobalMaxPool", 1)
def global_max_pool(x: np.ndarray) -> np.ndarray:
    return x.max(axis=tuple(range(2, x.ndim)), keepdims=True)


def _global_max_pool_into(out: np.ndarray, x: np.ndarray) -> None:
    x.max(axis=tuple(range(2, x.ndim)), keepdims=True, out=out)


declare_into(_global_max_pool_into, global_max_pool)


@kernel("GlobalLpPool", 1)
def global_lp_pool(x: np.ndarray, *, p: float = 2) -> np.ndarray:
    dtype = _compute_dtype(x.dtype)
    xs = np.abs(x.astype(dtype, copy=False))
    axes = tuple(range(2, x.ndim))
    if p == 2:
        y = np.sqrt(np.square(xs).sum(axis=axes, keepdims=True))
    else:
        y = (xs ** dtype.type(p)).sum(axis=axes, keepdims=True) ** dtype.type(1.0 / p)
    return y.astype(x.dtype, copy=False)


def _global_lp_pool_into(out: np.ndarray, x: np.ndarray, *, p: float = 2) -> None:
    dtype = _compute_dtype(x.dtype)
    xs = np.abs(_cast_into_scratch(out, "x", x, dtype), out=scratch(out, "abs", x.shape, dtype))
    axes = tuple(range(2, x.ndim))
    total = out if out.dtype == dtype else scratch(out, "total", out.shape, dtype)
    if p == 2:
        np.square(xs, out=xs).sum(axis=axes, keepdims=True, out=total)
        np.sqrt(total, out=total)
    else:
        np.power(xs, dtype.type(p), out=xs).sum(axis=axes, keepdims=True, out=total)
        np.power(total, dtype.type(1.0 / p), out=total)
    if total is not out:
        np.copyto(out, total, casting="unsafe")


declare_into(_global_lp_pool_into, global_lp_pool)


@kernel("MaxUnpool", 9)
def max_unpool(
    x: np.ndarray,
    indices: np.ndarray,
    output_shape: np.ndarray | None = None,
    *,
    kernel_shape: Sequence[int] = (),
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> np.ndarray:
    """MaxUnpool: scatter X to the flat MaxPool indices, zeros elsewhere.

    With an explicit ``output_shape`` that differs from the shape the attributes infer,
    onnx's reference and test data read the indices in the inferred shape and embed that
    result at the origin of the larger output; onnxruntime and PyTorch read them in
    ``output_shape`` itself. We follow onnx, unless an index only fits ``output_shape``.
    """
    rank = x.ndim - 2
    if len(kernel_shape) != rank:
        raise ValueError(f"MaxUnpool: kernel_shape {list(kernel_shape)} does not match input rank {x.ndim}")
    if indices.shape != x.shape:
        raise ValueError(f"MaxUnpool: indices shape {indices.shape} differs from input shape {x.shape}")
    stride_list = _ints(strides, rank, 1)
    pb, pe = _pads(pads, rank)
    inferred = [*x.shape[:2]] + [
        (x.shape[2 + i] - 1) * stride_list[i] - (pb[i] + pe[i]) + int(kernel_shape[i]) for i in range(rank)
    ]
    shape = inferred
    if output_shape is not None:
        shape = [int(v) for v in np.asarray(output_shape).reshape(-1)]
        if len(shape) != x.ndim:
            raise ValueError(f"MaxUnpool: output_shape {shape} does not have rank {x.ndim}")
    flat_index = indices.reshape(-1)
    largest = int(flat_index.max()) if flat_index.size else -1
    scatter_shape = inferred if largest < math.prod(inferred) else shape
    if largest >= math.prod(scatter_shape) or (flat_index.size and int(flat_index.min()) < 0):
        raise ValueError(f"MaxUnpool: an index lies outside the output shape {scatter_shape}")
    flat = np.zeros(math.prod(scatter_shape), dtype=x.dtype)
    flat[flat_index] = x.reshape(-1)
    y = flat.reshape(scatter_shape)
    if scatter_shape == shape:
        return y
    result = np.zeros(shape, dtype=x.dtype)
    common = tuple(slice(0, min(a, b)) for a, b in zip(shape, y.shape))
    result[common] = y[common]
    return result
