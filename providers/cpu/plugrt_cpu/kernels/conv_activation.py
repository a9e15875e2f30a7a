"""The activations a fused Conv step applies to its output in place: Clip, HardSwish and SiLU.

MobileNet v2 follows most of its Conv by a Clip to [0, 6] (ReLU6), MobileNet v3 by a
HardSwish, EfficientNet by a SiLU (exported as Sigmoid and a Mul of the Conv's output by
it). Run as their own steps, each allocates an output and passes over the Conv's output
once or several times more; applied in place right after the Conv, while the output is
still in cache, they write nothing new. Each has a numba body (one pass, float32; see
``_numba_epilogue``) where the compiled loops are there, and numpy ufuncs in place
otherwise, with the values the standalone kernels give (the same operations in the same
order; SiLU's compiled exp is a polynomial the loop vectorises, within float32 rounding
of numpy's: one pass over 96 x 112 x 112 values took 0.69 ms where numpy's four took 1.53).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from plugrt.threads import parallel_threads

from ._compiled_parallel import compiled_pool
from ._gemm import epilogue_loops
from .elementwise import scratch

__all__ = ["ACTIVATIONS", "activation_in_place", "pooled"]

#: The activation names a fused Conv takes, with how many ``activation_params`` each reads.
ACTIVATIONS: dict[str, int] = {"Relu": 0, "Clip": 2, "HardSwish": 0, "SiLU": 0}

#: The codes the compiled Conv paths take for an activation they apply block by block
#: (``_numba_epilogue.ACT_*``, checked equal by the tests): on the thread that computed a
#: block, while it is in cache, where a pass over the whole output after the Conv would
#: run on one thread from memory.
SILU, HARD_SWISH, CLIP = 1, 2, 3

_F32 = np.dtype(np.float32)
InPlace = Callable[[np.ndarray, Any], None]


def _flat(y: np.ndarray) -> np.ndarray | None:
    """``y`` as one flat float32 run for the compiled loops, or None when it is not one."""
    if y.dtype != _F32 or not y.flags.c_contiguous:
        return None
    return y.reshape(-1)


# An activation over this many values or more is shared out on the compiled pool's threads
# (``pooled``); each value counts as _ACTIVATION_COST element operations against their
# threshold (a SiLU's exp). A standalone SiLU over MobileViT's 128 x 64 x 64: 247 us on
# one thread (with a copy first), onnxruntime's 119 on two.
_POOL_MIN_VALUES = 1 << 15
_ACTIVATION_COST = 16
_UNITS_PER_THREAD = 4


def pooled(target: np.ndarray, source: np.ndarray, code: int, low: float = 0.0, high: float = 0.0) -> bool:
    """``target = activation(source)`` (``code``: SILU, HARD_SWISH or CLIP with its bounds;
    ``target`` may be ``source``) as one job on the compiled pool's threads
    (``_numba_epilogue.activation_job``), the values each unit copies (where not in
    place) and activates while they are in cache. False, having done nothing, where it
    does not apply: no numba or pool, not one float32 C-order run each, too few values,
    or one thread."""
    loops = epilogue_loops()
    if loops is None or target.size < _POOL_MIN_VALUES or target.shape != source.shape:
        return False
    flat_target, flat_source = _flat(target), _flat(source)
    pool = compiled_pool()
    if flat_target is None or flat_source is None or pool is None:
        return False
    threads = parallel_threads(target.size * _ACTIVATION_COST)
    if threads <= 1:
        return False
    length = flat_target.shape[0]
    per_unit = -(-length // (threads * _UNITS_PER_THREAD))
    per_unit += -per_unit % 16  # whole vectors a unit
    context = np.array(
        [
            flat_source.ctypes.data, flat_target.ctypes.data, length, per_unit, code,
            int(np.float32(low).view(np.uint32)), int(np.float32(high).view(np.uint32)),
        ],
        np.int64,
    )
    pool.run(loops.activation_job.address, context, -(-length // per_unit), threads)
    return True


def _fused(code: int) -> Callable[[InPlace], InPlace]:
    def mark(function: InPlace) -> InPlace:
        function.fused = (code, 0.0, 0.0)  # type: ignore[attr-defined]
        return function

    return mark


def _clip(low: float, high: float) -> InPlace:
    def run(y: np.ndarray, anchor: Any) -> None:
        loops = epilogue_loops()
        flat = _flat(y) if loops is not None else None
        if flat is not None:
            loops.clip_in_place(flat, low, high)
        else:
            np.clip(y, low, high, out=y)

    run.fused = (CLIP, low, high)  # type: ignore[attr-defined]
    return run


@_fused(HARD_SWISH)
def _hard_swish(y: np.ndarray, anchor: Any) -> None:
    if pooled(y, y, HARD_SWISH):
        return
    loops = epilogue_loops()
    flat = _flat(y) if loops is not None else None
    if flat is not None:
        loops.hard_swish_in_place(flat)
        return
    gate = _work(y, anchor, "hard-swish")
    np.multiply(y, 1 / 6, out=gate)
    gate += 0.5
    np.clip(gate, 0, 1, out=gate)
    y *= gate


@_fused(SILU)
def _silu(y: np.ndarray, anchor: Any) -> None:
    """y / (1 + exp(-y)): exp(-y) overflowing to inf gives -0, as Sigmoid's 0 times y does."""
    if pooled(y, y, SILU):
        return
    loops = epilogue_loops()
    flat = _flat(y) if loops is not None else None
    if flat is not None:
        loops.silu_in_place(flat)
        return
    denominator = _work(y, anchor, "silu")
    with np.errstate(over="ignore"):
        np.negative(y, out=denominator)
        np.exp(denominator, out=denominator)
    denominator += 1
    np.divide(y, denominator, out=y)


def _work(y: np.ndarray, anchor: Any, slot: str) -> np.ndarray:
    """A work array shaped like ``y``: kept with ``anchor`` (the ``into`` variant's output,
    so a replay allocates nothing), fresh when there is none."""
    return np.empty_like(y) if anchor is None else scratch(anchor, slot, y.shape, y.dtype)


def activation_in_place(name: str, params: list[float]) -> InPlace | None:
    """``f(y, anchor)`` applying activation ``name`` to ``y`` in place (``anchor``: the output
    buffer of an ``into`` call, whose work arrays it keeps, or None); None for the Relu,
    which the Conv paths apply block by block themselves. ``f.fused`` is its code and
    bounds for the compiled paths, which then apply it block by block instead."""
    if name == "Relu":
        return None
    if name == "Clip":
        low, high = params
        return _clip(low, high)
    if name == "HardSwish":
        return _hard_swish
    if name == "SiLU":
        return _silu
    raise ValueError(f"FusedConv: activation={name!r} is not supported; use one of {sorted(ACTIVATIONS)}")
