"""Neural-network kernels: convolution, pooling, softmax, dropout and local response normalisation."""

from __future__ import annotations

import itertools
import math
import threading
from typing import Any, Callable, Sequence

import numpy as np

from .._registry import KernelContext, kernel, kernel_builder
from .elementwise import scratch, with_small_buffers

# ---------------------------------------------------------------------------
# Window geometry shared by convolution and pooling
# ---------------------------------------------------------------------------

_PLAN_CACHE_SIZE = 16  # distinct input shapes remembered per node


def _ints(value: Any, rank: int, default: int) -> list[int]:
    """An attribute holding one int per spatial axis, or ``default`` on every axis."""
    if value is None or len(value) == 0:
        return [default] * rank
    if len(value) != rank:
        raise ValueError(f"expected {rank} values, got {list(value)}")
    return [int(v) for v in value]


def _pads(value: Any, rank: int) -> tuple[list[int], list[int]]:
    if value is None or len(value) == 0:
        return [0] * rank, [0] * rank
    if len(value) != 2 * rank:
        raise ValueError(f"pads must hold {2 * rank} values, got {list(value)}")
    return [int(v) for v in value[:rank]], [int(v) for v in value[rank:]]


def _auto_pad(value: Any) -> str:
    text = value.decode() if isinstance(value, bytes) else (value or "NOTSET")
    if text not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        raise NotImplementedError(f"auto_pad={text!r} is not one of NOTSET, SAME_UPPER, SAME_LOWER, VALID")
    return text


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def _window_geometry(
    in_shape: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    pads_begin: Sequence[int],
    pads_end: Sequence[int],
    auto_pad: str,
    ceil_mode: bool = False,
) -> tuple[list[int], list[int], list[int]]:
    """Output size and the begin/end padding actually applied on each spatial axis."""
    out, begin, end = [], [], []
    for i, size in enumerate(in_shape):
        span = (kernel[i] - 1) * dilations[i] + 1
        stride = strides[i]
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = _ceil_div(size, stride)
            total = max(0, (o - 1) * stride + span - size)
            small, large = total // 2, total - total // 2
            pb, pe = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
        else:
            pb, pe = (0, 0) if auto_pad == "VALID" else (pads_begin[i], pads_end[i])
            room = size + pb + pe - span
            if ceil_mode:
                o = _ceil_div(room, stride) + 1
                # The last window must start inside the input or its begin padding.
                if (o - 1) * stride >= size + pb:
                    o -= 1
            else:
                o = room // stride + 1
        if o < 0:
            o = 0
        out.append(o)
        begin.append(pb)
        end.append(pe)
    return out, begin, end


def _tap_range(size: int, offset: int, stride: int, lo: int, hi: int) -> tuple[int, int]:
    """Positions ``o`` in [lo, hi) whose sample ``o * stride + offset`` lies in [0, size)."""
    first = max(lo, _ceil_div(-offset, stride))
    last = min(hi, (size - 1 - offset) // stride + 1)
    return first, max(first, last)


class _Tap:
    """One kernel tap: where it reads the input and where it writes the output.

    ``src`` slices the input itself (step = stride). For strided windows ``phase`` names
    the stride phase the tap reads and ``phase_src`` slices that phase plane,
    ``input[..., phase::stride]``, with unit steps.
    """

    __slots__ = ("index", "dst", "src", "empty", "bounds", "phase", "phase_src")

    def __init__(
        self,
        index: int,
        bounds: list[tuple[int, int]],
        offsets: list[int],
        strides: Sequence[int],
        firsts: list[int],
    ):
        self.index = index
        self.bounds = bounds  # per spatial axis: [first, last) of output positions, relative
        self.empty = any(b >= e for b, e in bounds)
        self.dst = tuple(slice(b, e) for b, e in bounds)
        counts = [max(0, e - b) for b, e in bounds]
        self.src = tuple(
            slice(f * st + off, f * st + off + (n - 1) * st + 1, st) if n else slice(0, 0)
            for f, off, st, n in zip(firsts, offsets, strides, counts)
        )
        self.phase = tuple(off % st for off, st in zip(offsets, strides))
        self.phase_src = tuple(
            slice(f + off // st, f + off // st + n) for f, off, st, n in zip(firsts, offsets, strides, counts)
        )


def _taps(
    in_shape: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    pads_begin: Sequence[int],
    out_lo: Sequence[int],
    out_hi: Sequence[int],
) -> list[_Tap]:
    """The taps of a window sliding over ``in_shape``, restricted to output box [out_lo, out_hi)."""
    taps = []
    for index, tap in enumerate(itertools.product(*(range(k) for k in kernel))):
        bounds, offsets, firsts = [], [], []
        for i, t in enumerate(tap):
            off = t * dilations[i] - pads_begin[i]
            first, last = _tap_range(in_shape[i], off, strides[i], out_lo[i], out_hi[i])
            bounds.append((first - out_lo[i], last - out_lo[i]))
            offsets.append(off)
            firsts.append(first)
        taps.append(_Tap(index, bounds, offsets, strides, firsts))
    return taps


def _zero_regions(tap: _Tap, box: Sequence[int]) -> list[tuple[slice, ...]]:
    """The parts of an output box a tap does not cover (they must read as zero padding)."""
    if tap.empty:
        return [tuple(slice(None) for _ in box)]
    regions = []
    for i, (b, e) in enumerate(tap.bounds):
        head = [slice(None)] * len(box)
        if b > 0:
            head[i] = slice(0, b)
            regions.append(tuple(head))
        if e < box[i]:
            tail = [slice(None)] * len(box)
            tail[i] = slice(e, None)
            regions.append(tuple(tail))
    return regions


class _ShapeCache:
    """Plans keyed on input shape, a few at most (dynamic shapes must not grow it unbounded)."""

    def __init__(self, make: Callable[..., Any]):
        self._make = make
        self._plans: dict[Any, Any] = {}

    def __call__(self, *key: Any) -> Any:
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _PLAN_CACHE_SIZE:
                self._plans.clear()
            plan = self._plans[key] = self._make(*key)
        return plan


_FLOAT_BLAS = (np.dtype(np.float32), np.dtype(np.float64))


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype arithmetic runs in: float32 for float16 and ml_dtypes' narrow floats
    (bfloat16, float8: numpy kind 'V'), which have no BLAS and slow ufuncs."""
    dtype = np.dtype(dtype)
    if dtype in _FLOAT_BLAS:
        return dtype
    if dtype.kind in "fV":
        return np.dtype(np.float32)
    return dtype


# ---------------------------------------------------------------------------
# Scratch buffers: per thread, shared by every Conv node, grown on demand
# ---------------------------------------------------------------------------

_WORKSPACE = threading.local()
_CHUNK_BYTES = 8 << 20  # im2col block size: big enough for an efficient GEMM, small enough for cache


def _cast_into_scratch(out: np.ndarray, slot: str, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """x.astype(dtype, copy=False), in a work array of ``out``'s ``into`` call."""
    if x.dtype == dtype:
        return x
    work = scratch(out, slot, x.shape, dtype)
    np.copyto(work, x, casting="unsafe")
    return work


def _fresh(slot: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An ``allocate(slot, shape, dtype)`` for eager calls: a new array."""
    return np.empty(shape, dtype)


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _copied(target: np.ndarray, source: np.ndarray) -> np.ndarray:
    np.copyto(target, source)
    return target


def _zeroed(target: np.ndarray) -> np.ndarray:
    target.fill(0)
    return target


def _copy_to_workspace(slot: str, view: np.ndarray) -> np.ndarray:
    """np.ascontiguousarray(view), in this thread's buffer ``slot`` (for ``into`` variants)."""
    copy, _ = _workspace(slot, view.shape, view.dtype)
    np.copyto(copy, view)
    return copy


def _workspace(slot: str, shape: tuple[int, ...], dtype: np.dtype, layout: Any = None) -> tuple[np.ndarray, bool]:
    """A scratch array of ``shape`` from this thread's buffer ``slot``; the flag says its
    zero padding must be rewritten.

    Consecutive calls with the same ``layout`` (shape, dtype and zeroed regions) find the
    padding still zero, since only the covered regions are ever written.
    """
    slots = getattr(_WORKSPACE, "slots", None)
    if slots is None:
        slots = _WORKSPACE.slots = {}
    nbytes = math.prod(shape) * dtype.itemsize
    buf, last_layout = slots.get(slot, (None, None))
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)
        last_layout = None
    key = (shape, dtype, layout)
    slots[slot] = (buf, key)
    return buf[:nbytes].view(dtype).reshape(shape), layout is None or last_layout != key


# ---------------------------------------------------------------------------
# Conv
# ---------------------------------------------------------------------------


class _ConvPlan:
    """Everything a Conv call needs that depends only on the input shape."""

    def __init__(self, conv: "_Convolution", x_shape: tuple[int, ...], w_shape: tuple[int, ...], itemsize: int):
        n, c = x_shape[:2]
        spatial = list(x_shape[2:])
        rank = len(spatial)
        kernel = list(w_shape[2:])
        strides = _ints(conv.strides, rank, 1)
        dilations = _ints(conv.dilations, rank, 1)
        pb, pe = _pads(conv.pads, rank)
        out, pb, pe = _window_geometry(spatial, kernel, strides, dilations, pb, pe, conv.auto_pad)
        group = conv.group
        m = w_shape[0]
        if c != w_shape[1] * group or m % group:
            raise ValueError(f"Conv: input {x_shape} and weight {w_shape} do not match group={group}")
        self.out = out
        self.out_size = math.prod(out)
        self.m = m
        ksize = math.prod(kernel)
        pointwise = ksize == 1 and not any(pb) and all(
            (o - 1) * s + 1 <= size for o, s, size in zip(out, strides, spatial)
        )
        if pointwise:
            self.kind = "pointwise"
            self.src = (slice(None), slice(None)) + tuple(
                slice(0, (o - 1) * s + 1, s) for o, s in zip(out, strides)
            )
            self.copy_input = any(s != 1 for s in strides) or out != spatial
            return
        if w_shape[1] == 1 and group > 1:
            self.kind = "depthwise"
            self._plan_depthwise(spatial, kernel, strides, dilations, pb, out)
            return
        self.kind = "im2col"
        # A strided window reads each stride phase of the input with unit steps once that
        # phase is copied out contiguously: one gather instead of one per tap.
        self.phase_slices = None
        if any(st > 1 for st in strides):
            phases = {t.phase for t in _taps(spatial, kernel, strides, dilations, pb, [0] * rank, out) if not t.empty}
            self.phase_slices = {
                phase: (slice(None),) + tuple(slice(p, None, st) for p, st in zip(phase, strides)) for phase in phases
            }
        # Blocks of whole rows of the first output axis, each small enough to stay in cache.
        rest = math.prod(out[1:])
        row_bytes = max(1, c * ksize * rest * itemsize)
        rows = max(1, min(out[0], _CHUNK_BYTES // row_bytes)) if out[0] else 1
        self.blocks = []
        for r0 in range(0, out[0], rows):
            r1 = min(out[0], r0 + rows)
            box = [r1 - r0] + out[1:]
            taps = _taps(spatial, kernel, strides, dilations, pb, [r0] + [0] * (rank - 1), [r1] + out[1:])
            zeros = tuple(
                (t.index, region) for t in taps for region in _zero_regions(t, box)
            )
            layout_key = (c, ksize, tuple(box), tuple((i, tuple((s.start, s.stop) for s in r)) for i, r in zeros))
            self.blocks.append((r0 * rest, r1 * rest, (c, ksize, *box), [t for t in taps if not t.empty], zeros, layout_key))

    def _plan_depthwise(
        self,
        spatial: list[int],
        kernel: list[int],
        strides: list[int],
        dilations: list[int],
        pb: list[int],
        out: list[int],
    ) -> None:
        """Depthwise taps as flat shifts of stride-phase planes.

        Every tap reads one phase plane (``padded[..., phase::stride]``) at a fixed
        offset, so on planes flattened to one axis it is a contiguous run: the output is
        computed on a grid as wide as the planes and cropped once.
        """
        rank = len(spatial)
        phases, shifts = [], []
        for tap in itertools.product(*(range(k) for k in kernel)):
            offsets = [t * d for t, d in zip(tap, dilations)]
            phases.append(tuple(o % st for o, st in zip(offsets, strides)))
            shifts.append([o // st for o, st in zip(offsets, strides)])
        most = [max(sh[i] for sh in shifts) for i in range(rank)]
        plane = [out[i] + most[i] + (1 if i == 0 and rank > 1 else 0) for i in range(rank)]
        plane_strides = [math.prod(plane[i + 1 :]) for i in range(rank)]
        self.plane_shape = plane
        self.grid = out[0] * plane_strides[0]  # outputs (and junk columns) per channel
        self.phase_fill = {}  # phase -> (plane region, input region)
        for phase in sorted(set(phases)):
            dst, src = [], []
            for i in range(rank):
                first, last = _tap_range(spatial[i], phase[i] - pb[i], strides[i], 0, plane[i])
                start = first * strides[i] + phase[i] - pb[i]
                dst.append(slice(first, last))
                src.append(slice(start, start + (last - first - 1) * strides[i] + 1, strides[i]) if last > first else slice(0, 0))
            self.phase_fill[phase] = ((slice(None),) + tuple(dst), (slice(None),) + tuple(src))
        self.depthwise_taps = [
            (index, phase, sum(sh * ps for sh, ps in zip(shift, plane_strides)))
            for index, (phase, shift) in enumerate(zip(phases, shifts))
        ]
        self.crop = (slice(None),) + tuple(slice(0, o) for o in out)
        # Without strides every tap reads the one plane at offsets that form a grid, so all
        # taps are one strided view (grid position, *kernel, channel) of a channels-last plane.
        self.tap_grid_steps = None
        if all(st == 1 for st in strides):
            self.tap_grid_steps = [d * ps for d, ps in zip(dilations, plane_strides)]
        self.kernel = list(kernel)


class _ConvWeight:
    """A Conv weight prepared for the GEMM: (group, M/group, C/group * kernel)."""

    def __init__(self, w: np.ndarray, group: int, dtype: np.dtype):
        self.shape = tuple(w.shape)
        m = w.shape[0]
        self.gemm = np.ascontiguousarray(w.reshape(group, m // group, -1), dtype=dtype)


class _Convolution:
    """A Conv node: attributes parsed once, weights reshaped once when constant."""

    def __init__(self, attributes: dict[str, Any], relu: bool = False):
        self.auto_pad = _auto_pad(attributes.get("auto_pad"))
        self.dilations = attributes.get("dilations")
        self.group = int(attributes.get("group", 1))
        self.pads = attributes.get("pads")
        self.strides = attributes.get("strides")
        self.relu = relu  # a fused Relu, applied to each output block while it is in cache
        self._plans = _ShapeCache(lambda xs, ws, item: _ConvPlan(self, xs, ws, item))

    def prepare_weight(self, w: np.ndarray, dtype: np.dtype) -> "_ConvWeight":
        return _ConvWeight(w, self.group, dtype)

    def prepare_bias(self, b: np.ndarray | None, dtype: np.dtype) -> np.ndarray | None:
        return None if b is None else np.ascontiguousarray(b, dtype=dtype).reshape(-1, 1)

    def __call__(
        self, x: np.ndarray, weight: "_ConvWeight", bias: np.ndarray | None, y: np.ndarray | None = None
    ) -> np.ndarray:
        """The convolution, into the C-contiguous ``y`` (n, M, *out) when given (the
        ``into`` variant: the same arithmetic, its copies in thread workspaces)."""
        plan: _ConvPlan = self._plans(x.shape, weight.shape, x.dtype.itemsize)
        if y is not None and plan.kind != "depthwise":  # no reductions but BLAS ones: see with_small_buffers
            return with_small_buffers(self._convolve, x, weight, bias, y, plan)
        return self._convolve(x, weight, bias, y, plan)

    def _convolve(
        self, x: np.ndarray, weight: "_ConvWeight", bias: np.ndarray | None, y: np.ndarray | None, plan: _ConvPlan
    ) -> np.ndarray:
        n, c = x.shape[:2]
        g = self.group
        m = plan.m
        wg = weight.gemm
        if plan.kind == "pointwise":
            xs = x[plan.src] if plan.copy_input else x
            if y is not None and not xs.flags.c_contiguous:
                # what the reshape below would copy to, in a workspace
                xs = _copy_to_workspace("pointwise", xs)
            out = None if y is None else y.reshape(n, m, plan.out_size)
            if g == 1:
                y = np.matmul(wg[0], xs.reshape(n, c, plan.out_size), out=out)
            else:
                grouped = None if out is None else out.reshape(n, g, m // g, plan.out_size)
                y = np.matmul(wg, xs.reshape(n, g, c // g, plan.out_size), out=grouped)
            y = y.reshape(n, m, plan.out_size)
            if bias is not None:
                y += bias
            if self.relu:
                np.maximum(y, 0, out=y)
        elif plan.kind == "depthwise":
            y = self._depthwise(x, wg, plan, bias, y)
        else:
            y = self._im2col(x, wg, plan, bias, y)
        return y.reshape(n, m, *plan.out)

    def _depthwise(
        self, x: np.ndarray, wg: np.ndarray, plan: _ConvPlan, bias: np.ndarray | None, y: np.ndarray | None = None
    ) -> np.ndarray:
        """Per (image, channel) row: the sum over taps of weight * shifted phase plane.

        With more rows than grid positions the planes are laid out channels-last, so that
        every elementwise step runs along the long axis. With ``y`` (the ``into`` variant)
        the planes and sums are work arrays of ``y`` and the elementwise steps run with
        small ufunc buffers; the arithmetic is the same.
        """
        n, g = x.shape[:2]
        mult = wg.shape[1]
        rows = n * g
        if rows == 0 or plan.out_size == 0:
            if y is not None:
                y.fill(0)
                return y.reshape(n, g * mult, plan.out_size)
            return np.zeros((n, g * mult, plan.out_size), dtype=x.dtype)
        into = y is not None
        if into:
            anchor = y

            def allocate(slot: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
                return scratch(anchor, ("depthwise", slot), shape, dtype)

            def elementwise(fn: Callable[..., Any], *args: Any) -> Any:
                return with_small_buffers(fn, *args)

        else:
            allocate, elementwise = _fresh, _call
        xr = x.reshape(rows, *x.shape[2:])
        taps = wg.shape[2]
        weights = np.broadcast_to(wg, (n, g, mult, taps))
        if into:  # what the reshape below copies, in a work array
            weights = _copied(allocate("weights", weights.shape, wg.dtype), weights)
        weights = weights.reshape(rows, mult, taps)
        biases = None
        if bias is not None:
            biases = np.broadcast_to(bias.reshape(g, mult), (n, g, mult))
            if into:
                biases = _copied(allocate("biases", biases.shape, bias.dtype), biases)
            biases = biases.reshape(rows, mult)
        length = plan.grid
        channels_last = rows * 8 >= length  # measured: channels-last wins unless the planes are much longer
        planes = {}
        for phase, (dst, src) in plan.phase_fill.items():
            shape = (*plan.plane_shape, rows) if channels_last else (rows, *plan.plane_shape)
            buf = _zeroed(allocate(("plane", phase), shape, x.dtype)) if into else np.zeros(shape, dtype=x.dtype)
            if channels_last:
                buf[dst[1:]] = np.moveaxis(xr[src], 0, -1)
                planes[phase] = buf.reshape(-1, rows)
            else:
                buf[dst] = xr[src]
                planes[phase] = buf.reshape(rows, -1)
        y = np.empty((n, g, mult, *plan.out), dtype=x.dtype) if y is None else y.reshape(n, g, mult, *plan.out)
        yr = y.reshape(rows, mult, *plan.out)
        grid_shape = (plan.out[0], *plan.plane_shape[1:])
        for j in range(mult):
            if channels_last:
                wj = weights[:, j].T  # (K, rows)
                wj = np.ascontiguousarray(wj) if not into else _copied(allocate(("wj", j), wj.shape, wj.dtype), wj)
                if plan.tap_grid_steps is not None:
                    acc_out = allocate("acc", (length, rows), x.dtype) if into else None
                    acc = self._grid_taps_sum(planes[next(iter(planes))], wj, plan, length, rows, acc_out)
                else:
                    acc = elementwise(
                        self._taps_sum, planes, plan, lambda p, off: p[off : off + length], lambda i: wj[i],
                        length, rows, False, allocate,
                    )
                if biases is not None:
                    elementwise(np.add, acc, biases[:, j], acc)
            else:
                wj = weights[:, j]  # (rows, K)
                acc = elementwise(
                    self._taps_sum,
                    planes, plan, lambda p, off: p[:, off : off + length], lambda i: wj[:, i, None], rows, length, True,
                    allocate,
                )
                if biases is not None:
                    elementwise(np.add, acc, biases[:, j, None], acc)
            if self.relu:
                np.maximum(acc, 0, out=acc)
            if channels_last:
                yr[:, j] = np.moveaxis(acc.reshape(*grid_shape, rows)[plan.crop[1:]], -1, 0)
            else:
                yr[:, j] = acc.reshape(rows, *grid_shape)[plan.crop]
        return y.reshape(n, g * mult, plan.out_size)

    @staticmethod
    def _grid_taps_sum(
        plane: np.ndarray, weights: np.ndarray, plan: _ConvPlan, length: int, rows: int, out: np.ndarray | None = None
    ) -> np.ndarray:
        """All taps at once: one einsum over a strided (position, *kernel, channel) view of a
        channels-last plane, against weights (K, rows)."""
        rank = len(plan.kernel)
        item = plane.itemsize
        windows = np.lib.stride_tricks.as_strided(
            plane,
            shape=(length, *plan.kernel, rows),
            strides=(rows * item, *(step * rows * item for step in plan.tap_grid_steps), item),
            writeable=False,
        )
        taps = list(range(1, rank + 1))
        channel = rank + 1
        kernel = weights.reshape(*plan.kernel, rows)
        return np.einsum(windows, [0, *taps, channel], kernel, [*taps, channel], [0, channel], out=out)

    @staticmethod
    def _taps_sum(
        planes, plan, window, weight, outer: int, inner: int, weight_per_outer: bool, allocate=None
    ) -> np.ndarray:
        """Sum over the depthwise taps of weight(tap) * window(plane, offset), an (outer, inner)
        array, in blocks of the outer axis that stay in cache."""
        allocate = allocate or _fresh
        dtype = next(iter(planes.values())).dtype
        acc = allocate("acc", (outer, inner), dtype)
        block = max(1, (64 << 10) // max(1, inner))
        tmp = allocate("tmp", (min(block, outer), inner), dtype)
        for o0 in range(0, outer, block):
            o1 = min(outer, o0 + block)
            a, t = acc[o0:o1], tmp[: o1 - o0]
            for k, (index, phase, offset) in enumerate(plan.depthwise_taps):
                src = window(planes[phase], offset)[o0:o1]
                w = weight(index)[o0:o1] if weight_per_outer else weight(index)
                if k == 0:
                    np.multiply(src, w, out=a)
                else:
                    np.multiply(src, w, out=t)
                    a += t
        return acc

    def _im2col(
        self, x: np.ndarray, wg: np.ndarray, plan: _ConvPlan, bias: np.ndarray | None, y: np.ndarray | None = None
    ) -> np.ndarray:
        n, c = x.shape[:2]
        g = self.group
        into = y is not None
        y = np.empty((n, plan.m, plan.out_size), dtype=x.dtype) if y is None else y.reshape(n, plan.m, plan.out_size)
        whole = (slice(None),)
        for image in range(n):
            xi = x[image]
            planes = None
            if plan.phase_slices is not None:
                planes = {
                    phase: _copy_to_workspace(f"phase{k}", xi[index]) if into else np.ascontiguousarray(xi[index])
                    for k, (phase, index) in enumerate(plan.phase_slices.items())
                }
            for p0, p1, shape, taps, zeros, layout_key in plan.blocks:
                cols, stale = _workspace("im2col", shape, x.dtype, layout_key)
                if stale:
                    for index, region in zeros:
                        cols[(slice(None), index) + region] = 0
                if planes is None:
                    for tap in taps:
                        cols[(slice(None), tap.index) + tap.dst] = xi[whole + tap.src]
                else:
                    for tap in taps:
                        cols[(slice(None), tap.index) + tap.dst] = planes[tap.phase][whole + tap.phase_src]
                out = y[image, :, p0:p1]
                if g == 1:
                    np.matmul(wg[0], cols.reshape(c * shape[1], p1 - p0), out=out)
                else:
                    np.matmul(wg, cols.reshape(g, -1, p1 - p0), out=out.reshape(g, -1, p1 - p0))
                if bias is not None:
                    out += bias
                if self.relu:
                    np.maximum(out, 0, out=out)
        return y


@kernel_builder("Conv", 1)
def conv(ctx: KernelContext) -> Callable[..., np.ndarray]:
    """Conv: im2col in cache-sized blocks and one GEMM per block (per group batch)."""
    return build_conv(ctx)


def build_conv(ctx: KernelContext, relu: bool = False) -> Callable[..., np.ndarray]:
    """The Conv kernel for ``ctx``; with ``relu`` it also applies a Relu block by block
    (for a fused Conv + Relu node: the output is clamped while still in cache)."""
    op = _Convolution(ctx.attributes, relu)
    w_const = ctx.constant_inputs[1] if len(ctx.constant_inputs) > 1 else None
    b_const = ctx.constant_inputs[2] if len(ctx.constant_inputs) > 2 else None
    if w_const is not None:
        # Constant weights (and bias) are reshaped here, once, in the dtype of the arithmetic.
        dtype = _compute_dtype(w_const.dtype)
        w_prepared = op.prepare_weight(w_const, dtype)
        b_prepared = op.prepare_bias(b_const, dtype) if b_const is not None else None

    def run(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        dtype = _compute_dtype(x.dtype)
        weight = w_prepared if w_const is not None else op.prepare_weight(w, dtype)
        bias = b_prepared if b_const is not None and w_const is not None else op.prepare_bias(b, dtype)
        y = op(x.astype(dtype, copy=False), weight, bias)
        return y.astype(x.dtype, copy=False)

    def run_into(out: np.ndarray, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> None:
        dtype = _compute_dtype(x.dtype)
        weight = w_prepared if w_const is not None else op.prepare_weight(w, dtype)
        bias = b_prepared if b_const is not None and w_const is not None else op.prepare_bias(b, dtype)
        x = _cast_into_scratch(out, "x", x, dtype)
        y = out if out.dtype == dtype and out.flags.c_contiguous else scratch(out, "y", out.shape, dtype)
        op(x, weight, bias, y)
        if y is not out:
            np.copyto(out, y, casting="unsafe")

    run.into = run_into
    return run


@kernel("CausalConvWithState", 27, multi_output=True)
def causal_conv_with_state(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None = None,
    past_state: np.ndarray | None = None,
    *,
    activation: str = "none",
) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal 1-D convolution carrying the last k-1 inputs as state."""
    if activation not in ("none", "silu", "swish"):
        raise NotImplementedError(f"CausalConvWithState: activation={activation!r} is not one of none, silu, swish")
    if x.ndim != 3 or w.ndim != 3 or w.shape[1] != 1:
        raise ValueError(f"CausalConvWithState expects input (B, C, L) and weight (C, 1, k), got {x.shape} and {w.shape}")
    batch, channels, length = x.shape
    k = w.shape[2]
    if past_state is None:
        past_state = np.zeros((batch, channels, k - 1), dtype=x.dtype)
    padded = np.concatenate([past_state.astype(x.dtype, copy=False), x], axis=2)
    dtype = _compute_dtype(x.dtype)
    xp = padded.astype(dtype, copy=False)
    wk = w.astype(dtype, copy=False)[:, 0, :, None]  # (C, k, 1)
    y = xp[:, :, 0:length] * wk[:, 0]
    for j in range(1, k):
        y += xp[:, :, j : j + length] * wk[:, j]
    if b is not None:
        y += b.astype(dtype, copy=False)[:, None]
    if activation != "none":
        with np.errstate(over="ignore"):  # exp(-y) overflows to inf for very negative y: silu -> 0
            y *= 1.0 / (1.0 + np.exp(-y))
    return y.astype(x.dtype, copy=False), padded[:, :, length:]


# ---------------------------------------------------------------------------
# ConvTranspose and Col2Im: a GEMM to columns, then scatter-add the columns
# ---------------------------------------------------------------------------


def _scatter_taps(
    image: Sequence[int],
    blocks: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    pads_begin: Sequence[int],
) -> list[_Tap]:
    """Taps for adding columns (N, C, K, *blocks) into images (N, C, *image), the adjoint of
    im2col: block position ``i`` of tap ``t`` lands on image position
    ``i * stride + t * dilation - pad``, the im2col ranges with image and blocks swapped
    (``tap.src`` slices the image, ``tap.dst`` the blocks)."""
    taps = _taps(image, kernel, strides, dilations, pads_begin, [0] * len(blocks), blocks)
    return [t for t in taps if not t.empty]


def _scatter_columns(cols: np.ndarray, out: np.ndarray, taps: list[_Tap]) -> None:
    lead = (slice(None), slice(None))
    for tap in taps:
        out[lead + tap.src] += cols[lead + (tap.index,) + tap.dst]


class _ConvTransposePlan:
    def __init__(self, op: "_ConvTransposition", x_shape: tuple[int, ...], w_shape: tuple[int, ...]):
        spatial = list(x_shape[2:])
        rank = len(spatial)
        kernel = list(w_shape[2:])
        strides = _ints(op.strides, rank, 1)
        dilations = _ints(op.dilations, rank, 1)
        out_pad = _ints(op.output_padding, rank, 0)
        pb, pe = _pads(op.pads, rank)
        full = [
            strides[i] * (spatial[i] - 1) + out_pad[i] + (kernel[i] - 1) * dilations[i] + 1 for i in range(rank)
        ]
        if op.output_shape is not None and len(op.output_shape):
            out = [int(v) for v in op.output_shape][-rank:]
        elif op.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out = [spatial[i] * strides[i] for i in range(rank)]
        else:
            out = None
        if out is not None:
            # The spec puts the extra odd padding at the end for SAME_UPPER, at the start otherwise.
            pb = []
            for i in range(rank):
                total = full[i] - out[i]
                pb.append(total // 2 if op.auto_pad == "SAME_UPPER" else total - total // 2)
        else:
            out = [full[i] - pb[i] - pe[i] for i in range(rank)]
        self.out = out
        self.kernel = kernel
        self.taps = _scatter_taps(out, spatial, kernel, strides, dilations, pb)


class _ConvTransposition:
    def __init__(self, attributes: dict[str, Any]):
        self.auto_pad = _auto_pad(attributes.get("auto_pad"))
        self.dilations = attributes.get("dilations")
        self.group = int(attributes.get("group", 1))
        self.output_padding = attributes.get("output_padding")
        self.output_shape = attributes.get("output_shape")
        self.pads = attributes.get("pads")
        self.strides = attributes.get("strides")
        self._plans = _ShapeCache(lambda xs, ws: _ConvTransposePlan(self, xs, ws))

    def prepare_weight(self, w: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, tuple[int, ...]]:
        """W (C, M/group, *k) as (group, M/group * K, C/group): the GEMM's left operand."""
        g = self.group
        c = w.shape[0]
        wt = w.reshape(g, c // g, -1).transpose(0, 2, 1)
        return np.ascontiguousarray(wt, dtype=dtype), w.shape

    def __call__(self, x: np.ndarray, wt: np.ndarray, w_shape: tuple[int, ...], b: np.ndarray | None) -> np.ndarray:
        n, c = x.shape[:2]
        if c != w_shape[0] or c % self.group:
            raise ValueError(f"ConvTranspose: input {x.shape} and weight {w_shape} do not match group={self.group}")
        plan: _ConvTransposePlan = self._plans(x.shape, w_shape)
        g = self.group
        m = w_shape[1] * g
        ksize = math.prod(plan.kernel)
        in_size = math.prod(x.shape[2:])
        if g == 1:
            cols = np.matmul(wt[0], x.reshape(n, c, in_size))
        else:
            cols = np.matmul(wt, x.reshape(n, g, c // g, in_size))
        cols = cols.reshape(n, m, ksize, *x.shape[2:])
        y = np.zeros((n, m, *plan.out), dtype=x.dtype)
        _scatter_columns(cols, y, plan.taps)
        if b is not None:
            y += b.astype(x.dtype, copy=False).reshape(m, *([1] * len(plan.out)))
        return y


@kernel_builder("ConvTranspose", 1)
def conv_transpose(ctx: KernelContext) -> Callable[..., np.ndarray]:
    """ConvTranspose: one GEMM from input channels to columns, then a scatter-add per tap."""
    op = _ConvTransposition(ctx.attributes)
    w_const = ctx.constant_inputs[1] if len(ctx.constant_inputs) > 1 else None
    if w_const is not None:
        w_prepared = op.prepare_weight(w_const, _compute_dtype(w_const.dtype))

    def run(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        dtype = _compute_dtype(x.dtype)
        wt, w_shape = w_prepared if w_const is not None else op.prepare_weight(w, dtype)
        y = op(x.astype(dtype, copy=False), wt, w_shape, b)
        return y.astype(x.dtype, copy=False)

    return run


@kernel("Col2Im", 18)
def col2im(
    x: np.ndarray,
    image_shape: np.ndarray,
    block_shape: np.ndarray,
    *,
    dilations: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> np.ndarray:
    """Col2Im: sum the sliding blocks (N, C*K, L) back into images (N, C, *image_shape)."""
    image = [int(v) for v in np.asarray(image_shape).reshape(-1)]
    kernel = [int(v) for v in np.asarray(block_shape).reshape(-1)]
    rank = len(image)
    if len(kernel) != rank:
        raise ValueError(f"Col2Im: image_shape {image} and block_shape {kernel} differ in rank")
    stride_list = _ints(strides, rank, 1)
    dilation_list = _ints(dilations, rank, 1)
    pb, pe = _pads(pads, rank)
    blocks, _, _ = _window_geometry(image, kernel, stride_list, dilation_list, pb, pe, "NOTSET")
    n, ck, length = x.shape
    ksize = math.prod(kernel)
    if ck % ksize or length != math.prod(blocks):
        raise ValueError(
            f"Col2Im: input {x.shape} does not hold C*{ksize} rows of {math.prod(blocks)} blocks {blocks}"
        )
    c = ck // ksize
    dtype = _compute_dtype(x.dtype)
    cols = x.astype(dtype, copy=False).reshape(n, c, ksize, *blocks)
    y = np.zeros((n, c, *image), dtype=dtype)
    _scatter_columns(cols, y, _scatter_taps(image, blocks, kernel, stride_list, dilation_list, pb))
    return y.astype(x.dtype, copy=False)


@kernel("DeformConv", 19)
def deform_conv(
    x: np.ndarray,
    w: np.ndarray,
    offset: np.ndarray,
    b: np.ndarray | None = None,
    mask: np.ndarray | None = None,
    *,
    dilations: Sequence[int] | None = None,
    group: int = 1,
    kernel_shape: Sequence[int] | None = None,
    offset_group: int = 1,
    pads: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
) -> np.ndarray:
    """DeformConv: sample every tap at its offset position (multilinear, zero outside), then GEMM."""
    n, c = x.shape[:2]
    spatial = list(x.shape[2:])
    rank = len(spatial)
    kernel = list(w.shape[2:])
    m = w.shape[0]
    if c != w.shape[1] * group or m % group or c % offset_group:
        raise ValueError(f"DeformConv: input {x.shape}, weight {w.shape}, group={group}, offset_group={offset_group}")
    stride_list = _ints(strides, rank, 1)
    dilation_list = _ints(dilations, rank, 1)
    pb, pe = _pads(pads, rank)
    out, _, _ = _window_geometry(spatial, kernel, stride_list, dilation_list, pb, pe, "NOTSET")
    ksize = math.prod(kernel)
    size = math.prod(out)
    if tuple(offset.shape) != (n, offset_group * ksize * rank, *out):
        raise ValueError(f"DeformConv: offset shape {offset.shape} != {(n, offset_group * ksize * rank, *out)}")
    dtype = _compute_dtype(x.dtype)
    pos_dtype = np.result_type(dtype, offset.dtype, np.float32)
    off = offset.astype(pos_dtype, copy=False).reshape(n, offset_group, ksize, rank, size)
    # Undisplaced sample position of every (tap, output) pair on each axis.
    taps = np.array(list(itertools.product(*(range(k) for k in kernel))), dtype=np.int64).reshape(ksize, rank)
    grids = np.meshgrid(*(np.arange(o) for o in out), indexing="ij")
    base = [
        (taps[:, i, None] * dilation_list[i] + grids[i].reshape(1, size) * stride_list[i] - pb[i]).astype(pos_dtype)
        for i in range(rank)
    ]
    pos = [base[i] + off[:, :, :, i] for i in range(rank)]  # each (n, og, K, P)
    floor = [np.floor(p) for p in pos]
    frac = [p - f for p, f in zip(pos, floor)]
    floor = [f.astype(np.int64) for f in floor]
    cog = c // offset_group
    xf = x.astype(dtype, copy=False).reshape(n, offset_group, cog, math.prod(spatial))
    cols = np.zeros((n, offset_group, cog, ksize * size), dtype=dtype)
    plane_strides = [math.prod(spatial[i + 1 :]) for i in range(rank)]
    for corner in itertools.product((0, 1), repeat=rank):
        weight = np.ones((n, offset_group, ksize, size), dtype=pos_dtype)
        flat = np.zeros((n, offset_group, ksize, size), dtype=np.int64)
        valid = np.ones((n, offset_group, ksize, size), dtype=bool)
        for i, bit in enumerate(corner):
            idx = floor[i] + bit
            weight *= frac[i] if bit else 1 - frac[i]
            valid &= (idx >= 0) & (idx < spatial[i])
            flat += np.clip(idx, 0, spatial[i] - 1) * plane_strides[i]
        weight = np.where(valid, weight, 0).astype(dtype, copy=False)
        values = np.take_along_axis(xf, flat.reshape(n, offset_group, 1, ksize * size), axis=3)
        cols += values * weight.reshape(n, offset_group, 1, ksize * size)
    cols = cols.reshape(n, offset_group, cog, ksize, size)
    if mask is not None:
        cols *= mask.astype(dtype, copy=False).reshape(n, offset_group, 1, ksize, size)
    wg = w.astype(dtype, copy=False).reshape(group, m // group, -1)
    y = np.matmul(wg, cols.reshape(n, group, (c // group) * ksize, size)).reshape(n, m, size)
    if b is not None:
        y += b.astype(dtype, copy=False).reshape(m, 1)
    return y.reshape(n, m, *out).astype(x.dtype, copy=False)


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
        self.taps = [t for t in _taps(spatial, kernel, strides, dilations, pb, [0] * rank, out) if not t.empty]
        # A box window is separable: pool one axis at a time, the outer axes first, whose taps
        # read whole contiguous rows; each pass also shrinks what the next one reads.
        self.axis_passes = []
        for i in range(rank):
            if kernel[i] == 1 and strides[i] == 1 and out[i] == spatial[i] and pb[i] == 0:
                continue
            axis_taps = [t for t in _taps([spatial[i]], [kernel[i]], [strides[i]], [dilations[i]], [pb[i]], [0], [out[i]])]
            lead = (slice(None),) * (2 + i)
            full = next((t for t in axis_taps if t.bounds[0] == (0, out[i])), None)
            others = [(lead + t.dst, lead + t.src) for t in axis_taps if not t.empty and t is not full]
            flat = None
            if strides[i] == 1 and 0 < out[i] <= spatial[i]:
                # Short rows make per-row work dominate: shift the whole flattened array at
                # once and redo the few border positions the shift gets wrong.
                offsets = [t * dilations[i] - pb[i] for t in range(kernel[i])]
                bounds = [(max(0, -o), min(out[i], spatial[i] - o)) for o in offsets]
                inner = (max(b[0] for b in bounds), min(b[1] for b in bounds))
                border = [o for o in range(out[i]) if not inner[0] <= o < inner[1]]
                flat = (offsets, [(o, [off for off, (b, e) in zip(offsets, bounds) if b <= o < e]) for o in border])
            self.axis_passes.append((2 + i, out[i], lead + full.src if full is not None else None, others, flat))
        # One window over the whole unpadded input, as at the end of many CNNs.
        self.whole_window = all(o == 1 for o in out) and list(kernel) == spatial and not any(pb) and not any(pe) and all(
            d == 1 for d in dilations
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
    for k, (axis, size, full_src, others, flat) in enumerate(plan.axis_passes):
        if flat is not None and y.flags.c_contiguous:
            y = _pool_axis_flat(y, axis, size, flat, combine, identity, _slots_of(allocate, k))
            continue
        if full_src is not None:
            start = y[full_src]  # a tap that covers every output starts the result
            acc = allocate(k, start.shape, y.dtype)
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
    for k, off in enumerate(offsets):
        shift = off * inner
        lo, hi = max(0, -shift), total - max(0, shift)
        if k == 0:
            dst[:lo] = identity
            dst[hi:] = identity
            dst[lo:hi] = src[lo + shift : hi + shift]
        else:
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

    def max(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        plan: _PoolPlan = self._plans(x.shape)
        n, c = x.shape[:2]
        lowest = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
        if not self.want_indices:
            return _separable_pool(x, plan, np.maximum, lowest), None
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
                np.copyto(buffer, result)
            return
        plan: _PoolPlan = self._plans(x.shape)
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
        if self.mode == "avg":
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

    run.into = into
    return run


@kernel_builder("MaxPool", 1, multi_output=True)
def max_pool(ctx: KernelContext) -> Callable[..., tuple[np.ndarray, np.ndarray | None]]:
    """MaxPool (Indices output with storage_order, dilations, ceil_mode, auto_pad)."""
    pool = _Pooling("MaxPool", "max", ctx.attributes, want_indices=ctx.num_outputs > 1)
    return _bound_into(pool.max, pool.max_into)


@kernel_builder("AveragePool", 1)
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


global_average_pool.into = lambda out, x: _spatial_mean(x, out)


@kernel("GlobalMaxPool", 1)
def global_max_pool(x: np.ndarray) -> np.ndarray:
    return x.max(axis=tuple(range(2, x.ndim)), keepdims=True)


def _global_max_pool_into(out: np.ndarray, x: np.ndarray) -> None:
    x.max(axis=tuple(range(2, x.ndim)), keepdims=True, out=out)


global_max_pool.into = _global_max_pool_into


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


global_lp_pool.into = _global_lp_pool_into


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


# ---------------------------------------------------------------------------
# Softmax family: opset < 13 flattens to 2-D at `axis`, opset >= 13 works on one axis
# ---------------------------------------------------------------------------


# Each takes ``out`` for the ``into`` variants: the same steps into it, with the per-row
# statistics in a work array.


def _row_statistics(x: np.ndarray, axis: int, out: np.ndarray | None, dtype: Any = None) -> np.ndarray | None:
    """The work array for per-row values of x along ``axis`` (keepdims), or None (eager)."""
    if out is None:
        return None
    shape = list(x.shape)
    shape[axis] = 1
    return scratch(out, ("statistics", dtype), tuple(shape), dtype or x.dtype)


def _per_row(ufunc: np.ufunc, a: np.ndarray, b: np.ndarray, out: np.ndarray | None, into: bool) -> np.ndarray:
    """ufunc(a, b, out=out), b broadcast per row: in an ``into`` call with small buffers."""
    with np.errstate(invalid="ignore"):  # an all -inf row gives NaN, as in onnx's reference
        return with_small_buffers(ufunc, a, b, out) if into else ufunc(a, b, out=out)


def _softmax_axis(x: np.ndarray, axis: int, out: np.ndarray | None = None) -> np.ndarray:
    statistics = _row_statistics(x, axis, out)
    into = out is not None
    y = _per_row(np.subtract, x, x.max(axis=axis, keepdims=True, out=statistics), out, into)
    np.exp(y, out=y)
    _per_row(np.divide, y, y.sum(axis=axis, keepdims=True, out=statistics), y, into)
    return y


def _log_softmax_axis(x: np.ndarray, axis: int, out: np.ndarray | None = None) -> np.ndarray:
    statistics = _row_statistics(x, axis, out)
    into = out is not None
    y = _per_row(np.subtract, x, x.max(axis=axis, keepdims=True, out=statistics), out, into)
    exp = np.exp(y, out=None if out is None else scratch(out, "exp", y.shape, y.dtype))
    _per_row(np.subtract, y, np.log(exp.sum(axis=axis, keepdims=True, out=statistics), out=statistics), y, into)
    return y


def _hardmax_axis(x: np.ndarray, axis: int, out: np.ndarray | None = None) -> np.ndarray:
    if out is None:
        y = np.zeros_like(x)
        np.put_along_axis(y, np.expand_dims(np.argmax(x, axis=axis), axis), 1, axis=axis)
        return y
    out.fill(0)
    first = np.argmax(x, axis=axis, keepdims=True, out=_row_statistics(x, axis, out, np.intp))
    np.put_along_axis(out, first, 1, axis=axis)
    return out


def _on_axis(
    fn: Callable[..., np.ndarray], x: np.ndarray, axis: int, out: np.ndarray | None = None
) -> np.ndarray:
    # Every step rounds to the input's own type (float16 / bfloat16 too), as onnx's
    # reference does: its expected outputs differ from a float32 computation by an ulp.
    if x.size == 0:
        return x.copy() if out is None else out
    return fn(x, axis) if out is None else fn(x, axis, out)


def _on_2d(fn: Callable[..., np.ndarray], x: np.ndarray, axis: int, out: np.ndarray | None = None) -> np.ndarray:
    """The opset 1-12 semantics: coerce to (prod(shape[:axis]), prod(shape[axis:]))."""
    if axis < 0:
        axis += x.ndim
    if not 0 <= axis <= x.ndim:
        raise ValueError(f"axis {axis} is out of range for rank {x.ndim}")
    rows = math.prod(x.shape[:axis])
    if out is None:
        return _on_axis(fn, x.reshape(rows, -1), 1).reshape(x.shape)
    if not out.flags.c_contiguous:
        np.copyto(out, _on_2d(fn, x, axis))
        return out
    _on_axis(fn, x.reshape(rows, -1), 1, out.reshape(rows, -1))
    return out


@kernel("Softmax", 1)
def softmax_2d(x: np.ndarray, *, axis: int = 1) -> np.ndarray:
    return _on_2d(_softmax_axis, x, axis)


@kernel("Softmax", 13)
def softmax(x: np.ndarray, *, axis: int = -1) -> np.ndarray:
    return _on_axis(_softmax_axis, x, axis)


@kernel("LogSoftmax", 1)
def log_softmax_2d(x: np.ndarray, *, axis: int = 1) -> np.ndarray:
    return _on_2d(_log_softmax_axis, x, axis)


@kernel("LogSoftmax", 13)
def log_softmax(x: np.ndarray, *, axis: int = -1) -> np.ndarray:
    return _on_axis(_log_softmax_axis, x, axis)


@kernel("Hardmax", 1)
def hardmax_2d(x: np.ndarray, *, axis: int = 1) -> np.ndarray:
    return _on_2d(_hardmax_axis, x, axis)


@kernel("Hardmax", 13)
def hardmax(x: np.ndarray, *, axis: int = -1) -> np.ndarray:
    return _on_axis(_hardmax_axis, x, axis)


def _2d_into(fn: Callable[..., np.ndarray]) -> Callable[..., None]:
    def into(out: np.ndarray, x: np.ndarray, *, axis: int = 1) -> None:
        _on_2d(fn, x, axis, out)

    return into


def _axis_into(fn: Callable[..., np.ndarray]) -> Callable[..., None]:
    def into(out: np.ndarray, x: np.ndarray, *, axis: int = -1) -> None:
        _on_axis(fn, x, axis, out)

    return into


softmax_2d.into, softmax.into = _2d_into(_softmax_axis), _axis_into(_softmax_axis)
log_softmax_2d.into, log_softmax.into = _2d_into(_log_softmax_axis), _axis_into(_log_softmax_axis)
hardmax_2d.into, hardmax.into = _2d_into(_hardmax_axis), _axis_into(_hardmax_axis)


# ---------------------------------------------------------------------------
# Dropout and LRN
# ---------------------------------------------------------------------------


@kernel_builder("Dropout", 1, 7, 10, multi_output=True)
def dropout_legacy(ctx: KernelContext) -> Callable[..., tuple[np.ndarray, np.ndarray | None]]:
    """Dropout before opset 12: inference is the identity (is_test is not honoured: no training here).

    The mask has the input's type before opset 10 and is boolean from opset 10.
    """
    mask_dtype = np.bool_ if ctx.opset >= 10 else None
    want_mask = ctx.num_outputs > 1

    def run(x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        mask = np.ones(x.shape, dtype=mask_dtype or x.dtype) if want_mask else None
        return x, mask

    run.into = _dropout_identity_into
    return run


def _dropout_identity_into(out: tuple[np.ndarray, ...], x: np.ndarray, *_inputs: Any) -> None:
    """Inference Dropout into (output, mask): x copied, the mask all ones."""
    np.copyto(out[0], x)
    if len(out) > 1:
        out[1].fill(1)


@kernel_builder("Dropout", 12, multi_output=True)
def dropout(ctx: KernelContext) -> Callable[..., tuple[np.ndarray, np.ndarray | None]]:
    """Dropout: the identity unless training_mode is true, then a seeded Bernoulli mask."""
    seed = ctx.attributes.get("seed")
    want_mask = ctx.num_outputs > 1
    rng = np.random.default_rng() if seed is None else None

    def run(
        x: np.ndarray, ratio: np.ndarray | None = None, training_mode: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        drop = 0.5 if ratio is None else float(np.asarray(ratio))
        training = training_mode is not None and bool(np.asarray(training_mode))
        if not training or drop == 0:
            return x, (np.ones(x.shape, dtype=np.bool_) if want_mask else None)
        if not 0 <= drop < 1:
            raise ValueError(f"Dropout: ratio {drop} must lie in [0, 1)")
        # A given seed reproduces numpy's legacy stream, as onnx's test data does.
        uniform = np.random.RandomState(int(seed)).uniform(0, 1, x.shape) if seed is not None else rng.random(x.shape)
        mask = uniform >= drop
        y = (mask * x * (1.0 / (1.0 - drop))).astype(x.dtype, copy=False)
        return y, (mask if want_mask else None)

    def run_into(
        out: tuple[np.ndarray, ...],
        x: np.ndarray,
        ratio: np.ndarray | None = None,
        training_mode: np.ndarray | None = None,
    ) -> None:
        drop = 0.5 if ratio is None else float(np.asarray(ratio))
        if training_mode is None or not bool(np.asarray(training_mode)) or drop == 0:
            _dropout_identity_into(out, x)
            return
        # Training draws a new mask: eager, then copied (unseeded, capture finds it differs
        # from the first draw and leaves the node eager).
        for buffer, result in zip(out, run(x, ratio, training_mode)):
            np.copyto(buffer, result)

    run.into = run_into
    return run


@kernel("LRN", 1)
def lrn(x: np.ndarray, *, alpha: float = 0.0001, beta: float = 0.75, bias: float = 1.0, size: int) -> np.ndarray:
    """Local response normalisation across channels (axis 1), in cache-sized spatial blocks."""
    return _lrn(x, alpha, beta, bias, size)


def _lrn_into(
    out: np.ndarray, x: np.ndarray, *, alpha: float = 0.0001, beta: float = 0.75, bias: float = 1.0, size: int
) -> None:
    with_small_buffers(_lrn, x, alpha, beta, bias, size, out)  # elementwise steps on strided blocks


lrn.into = _lrn_into


def _lrn(x: np.ndarray, alpha: float, beta: float, bias: float, size: int, out: np.ndarray | None = None) -> np.ndarray:
    """LRN; into ``out`` when given (the ``into`` variant, with its work arrays kept)."""
    dtype = _compute_dtype(x.dtype)
    n, channels = x.shape[:2]
    into = out is not None
    work = _cast_into_scratch(out, "x", x, dtype) if into else x.astype(dtype, copy=False)
    flat = work.reshape(n, channels, -1)
    if into and out.dtype == dtype and out.flags.c_contiguous:
        y = out.reshape(flat.shape)
    else:
        y = np.empty(flat.shape, dtype=dtype) if not into else scratch(out, "y", flat.shape, dtype)
    before = (size - 1) // 2
    after = size - 1 - before  # ceil((size - 1) / 2)
    span = flat.shape[2]
    block = max(1, (256 << 10) // max(1, n * channels * dtype.itemsize))
    for start in range(0, span, block):
        xs = flat[:, :, start : start + block]
        if into:
            work = (n, channels, min(block, span))
            square = np.multiply(xs, xs, out=scratch(out, "square", work, dtype)[:, :, : xs.shape[2]])
            total = scratch(out, "total", work, dtype)[:, :, : xs.shape[2]]
            np.copyto(total, square)
        else:
            square = xs * xs
            total = square.copy()
        for shift in range(1, max(before, after) + 1):
            if shift <= before and shift < channels:
                total[:, shift:] += square[:, :-shift]
            if shift <= after and shift < channels:
                total[:, :-shift] += square[:, shift:]
        total *= dtype.type(alpha / size)
        total += dtype.type(bias)
        if beta == 0.75:  # the usual value: sqrt(t) * sqrt(sqrt(t)) is far cheaper than pow
            np.sqrt(total, out=square)
            np.sqrt(square, out=total)
            total *= square
        elif beta == 0.5:
            np.sqrt(total, out=total)
        elif beta != 1:
            np.power(total, dtype.type(beta), out=total)
        np.divide(xs, total, out=y[:, :, start : start + block])
    if not into:
        return y.reshape(x.shape).astype(x.dtype, copy=False)
    if not np.may_share_memory(y, out):
        np.copyto(out, y.reshape(x.shape), casting="unsafe")
    return out
