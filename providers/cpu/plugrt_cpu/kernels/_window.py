"""Shared by the window kernels (convolution, pooling): window geometry, taps, per-shape plan caches, scratch workspaces."""

from __future__ import annotations

import itertools
import math
import threading
from typing import Any, Callable, Sequence

import numpy as np

from .._counters import track_cache
from .elementwise import scratch

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


def _phase_fill(
    spatial: Sequence[int], phase: Sequence[int], pads_begin: Sequence[int], strides: Sequence[int], plane: Sequence[int]
) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """(plane region, input region): where stride phase ``phase`` of the zero-padded input
    (``padded[..., phase::stride]``) lands on a plane of shape ``plane``, and the strided
    input region it copies there, over the spatial axes."""
    dst, src = [], []
    for i in range(len(spatial)):
        first, last = _tap_range(spatial[i], phase[i] - pads_begin[i], strides[i], 0, plane[i])
        start = first * strides[i] + phase[i] - pads_begin[i]
        dst.append(slice(first, last))
        src.append(slice(start, start + (last - first - 1) * strides[i] + 1, strides[i]) if last > first else slice(0, 0))
    return tuple(dst), tuple(src)


class _Tap:
    """One kernel tap: where it reads the input (``src``, step = stride) and where it writes
    the output (``dst``)."""

    __slots__ = ("index", "dst", "src", "empty", "bounds")

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


class _ShapeCache:
    """Plans keyed on input shape, a few at most (dynamic shapes must not grow it unbounded)."""

    def __init__(self, make: Callable[..., Any]):
        self._make = make
        self._plans: dict[Any, Any] = {}
        self.hits = 0  # look-ups, for Session.stats()
        self.misses = 0
        track_cache(self)

    def __call__(self, *key: Any) -> Any:
        plan = self._plans.get(key)
        if plan is None:
            self.misses += 1
            if len(self._plans) >= _PLAN_CACHE_SIZE:
                self._plans.clear()
            plan = self._plans[key] = self._make(*key)
            return plan
        self.hits += 1
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
