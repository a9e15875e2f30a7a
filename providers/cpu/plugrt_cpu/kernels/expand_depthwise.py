"""A 1x1 Conv and the depthwise Conv that alone reads its output, as one step.

MobileNet's, EfficientNet's and their kin's inverted residual blocks widen their input
by a 1x1 Conv (an activation after it), then run a depthwise Conv over the wide tensor.
Run as two steps, the wide tensor goes to memory as planes, and the depthwise Conv reads
it back and interleaves it, 16 channels to a vector, into a padded block before it sums
(``_numba_depthwise.blocked_depthwise``): MobileNet v2's second block writes and reads
4.8 MB between them. ``plugrt.cpu::ExpandDepthwise`` (written by
``fusions.FuseExpandDepthwisePass``) computes each block of 16 wide channels straight
into the padded block, as one vector a position (``_numba_depthwise.expand_depthwise``),
and sums the depthwise taps over it while it is in cache; the wide tensor is never made.

Where the compiled loops or their pool are not there, for another dtype, or where the
first call timed the two steps faster on this machine and shape, the two Conv kernels
run one after the other, as they would unfused.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Callable

import numpy as np
from plugrt.threads import PARALLEL_MIN_WORK, threads_for

from .._registry import KernelContext, declare_into
from . import conv as convolution
from . import conv_activation
from ._compiled_parallel import compiled_pool
from ._window import _copy_to_workspace, _ShapeCache, _workspace
from .elementwise import scratch

__all__ = ["EXPAND_PREFIX", "build_expand_depthwise"]

#: Attributes of the 1x1 Conv on an ExpandDepthwise node carry this prefix (its
#: ``activation`` and ``activation_params``); the rest are the depthwise Conv's.
EXPAND_PREFIX = "expand_"

_F32 = np.dtype(np.float32)


def _activation(attributes: dict[str, Any], prefix: str) -> tuple[str | None, list[float]]:
    name = attributes.get(prefix + "activation")
    params = [float(p) for p in attributes.get(prefix + "activation_params", [])]
    if name is not None and name not in conv_activation.ACTIVATIONS:
        raise NotImplementedError(
            f"ExpandDepthwise: {prefix}activation={name!r} is not supported; use one of {sorted(conv_activation.ACTIVATIONS)}"
        )
    if name is not None and len(params) != conv_activation.ACTIVATIONS[name]:
        raise ValueError(
            f"ExpandDepthwise: {prefix}activation={name!r} takes {conv_activation.ACTIVATIONS[name]} activation_params, got {params}"
        )
    return name, params


def _step(ctx: KernelContext, attributes: dict[str, Any], inputs: tuple[int, int], activation: tuple[str | None, list[float]]):  # type: ignore[no-untyped-def]
    """One of the two Convs as its own kernel (the way it runs unfused): its input is
    fed, its weight and bias are the node's inputs ``inputs``."""
    name, params = activation

    def at(values: list[Any], index: int) -> Any:
        return values[index] if index < len(values) else None

    step_ctx = dataclasses.replace(
        ctx, op_type="Conv", domain="", attributes=attributes, num_inputs=3,
        input_dtypes=[at(ctx.input_dtypes, 0), *(at(ctx.input_dtypes, i) for i in inputs)],
        constant_inputs=[None, *(at(ctx.constant_inputs, i) for i in inputs)],
    )
    return convolution.build_conv(step_ctx, relu=name == "Relu", activation=_step_activation(name, params))


def _step_activation(name: str | None, params: list[float]) -> Any:
    return None if name in (None, "Relu") else conv_activation.activation_in_place(name, params)


def _bounds(name: str | None, params: list[float]) -> tuple[int, float, float]:
    """The 1x1 Conv's (activation code, low, high) for the compiled loops: a Clip and a
    Relu are bounds on the sums in registers (code 0), the others codes without bounds."""
    if name == "Relu":
        return 0, 0.0, math.inf
    if name == "Clip":
        return 0, params[0], params[1]
    if name == "HardSwish":
        return conv_activation.HARD_SWISH, -math.inf, math.inf
    if name == "SiLU":
        return conv_activation.SILU, -math.inf, math.inf
    return 0, -math.inf, math.inf


class _Shape:
    """What the compiled loops need for one input shape: the output's, the padded
    block's geometry and position table, the work a thread needs, and which way won."""

    def __init__(self, loops: Any, height: int, width: int, out: tuple[int, ...], kernel: tuple[int, ...],
                 strides: tuple[int, ...], dilations: tuple[int, ...], pads: tuple[int, ...]) -> None:
        self.out = out
        self.geometry, self.table, self.floats = loops.expand_geometry(kernel, strides, dilations, pads, height, width, *out)
        self.fused_wins: bool | None = None
        # ``expand_job`` contexts, per calling thread and thread count (the fused call's)
        self.contexts: dict[tuple[int, int], tuple[np.ndarray, int, np.ndarray]] = {}


def build_expand_depthwise(ctx: KernelContext) -> Callable[..., np.ndarray]:
    """The kernel of ``plugrt.cpu::ExpandDepthwise(x, w1, b1, w2, b2)``: ``Conv(x, w1, b1)``
    (1x1, stride 1, no pads, one group; then ``expand_activation``), then the depthwise
    ``Conv(., w2, b2)`` of the other attributes (then ``activation``)."""
    attributes = dict(ctx.attributes)
    expand_activation = _activation(attributes, EXPAND_PREFIX)
    depthwise_activation = _activation(attributes, "")
    depthwise_attributes = {k: v for k, v in attributes.items() if not k.startswith(EXPAND_PREFIX) and not k.startswith("activation")}
    first = _step(ctx, {}, (1, 2), expand_activation)
    second = _step(ctx, depthwise_attributes, (3, 4), depthwise_activation)
    first_into, second_into = first.into, second.into  # type: ignore[attr-defined]
    kernel = tuple(int(k) for k in attributes.get("kernel_shape", ()))
    strides = tuple(int(s) for s in attributes.get("strides", (1, 1)))
    dilations = tuple(int(d) for d in attributes.get("dilations", (1, 1)))
    pads = tuple(int(p) for p in attributes.get("pads", (0, 0, 0, 0)))
    w1, b1, w2, b2 = ctx.constant_inputs[1:5] if len(ctx.constant_inputs) >= 5 else (None,) * 4
    blocked: list[Any] = []  # the weights as the compiled loops read them, made on first use

    def plan(shape: tuple[int, ...]) -> _Shape | None:
        height, width = shape[2:]
        out_shape = tuple(
            (size + pads[i] + pads[i + 2] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1
            for i, size in enumerate((height, width))
        )
        if min(out_shape) <= 0:
            return None
        return _Shape(convolution.depthwise_loops(), height, width, out_shape, kernel, strides, dilations, pads[:2])

    shapes = _ShapeCache(plan)  # a few input shapes at most
    e_code, e_low, e_high = _bounds(*expand_activation)
    depthwise_relu = depthwise_activation[0] == "Relu"  # the rest after the sums, as the Conv's compiled paths apply them
    d_code, d_low, d_high = getattr(_step_activation(*depthwise_activation), "fused", (0, 0.0, 0.0))
    compilable = (
        w1 is not None and w2 is not None and w1.dtype == _F32 and w2.dtype == _F32 and w1.ndim == 4 and w2.ndim == 4
        and len(kernel) == 2 and w2.shape[1] == 1 and w1.shape[0] == w2.shape[0]
        and int(attributes.get("group", 1)) == w2.shape[0] and attributes.get("auto_pad", "NOTSET") in ("NOTSET", b"NOTSET")
    )

    def separate(x: np.ndarray, wa: np.ndarray, ba: np.ndarray | None, wb: np.ndarray, bb: np.ndarray | None,
                 out: np.ndarray | None) -> np.ndarray:
        if out is None:
            return second(first(x, wa, ba), wb, bb)
        wide = scratch(out, "expanded", (x.shape[0], wa.shape[0], *x.shape[2:]), out.dtype)
        first_into(wide, x, wa, ba)
        second_into(out, wide, wb, bb)
        return out

    def weights(loops: Any) -> list[Any]:
        if not blocked:
            assert w1 is not None and w2 is not None  # compilable
            m = w1.shape[0]
            zeros = np.zeros(m, np.float32)
            we, be = loops.block_weights(w1.reshape(m, -1), zeros if b1 is None else b1.astype(np.float32))
            wd, bd = loops.block_weights(w2.reshape(m, -1), zeros if b2 is None else b2.astype(np.float32))
            blocked.extend((we, be, wd, bd, np.array([e_low, d_low], np.float32), np.array([e_high, d_high], np.float32)))
        return blocked

    def fused(loops: Any, pool: Any, x: np.ndarray, layout: _Shape, y: np.ndarray) -> None:
        we, be, wd, bd, lows, highs = weights(loops)
        n, k, height, width = x.shape
        blocks = we.shape[0]
        units = n * blocks
        m = y.shape[1]
        work = m * (height * width * k + layout.out[0] * layout.out[1] * kernel[0] * kernel[1])
        threads = min(units, threads_for(PARALLEL_MIN_WORK) if work >= convolution._COMPILED_SPLIT_WORK else 1)
        slots = pool.slots(units, threads)
        buffer, _ = _workspace("expand-depthwise", (slots * layout.floats,), _F32)
        # the context is kept on the shape per thread and thread count (every word but the
        # input's, the work arrays' and the output's address is fixed there): made each
        # call, its nine ``ndarray.ctypes`` reads took ~20 us, as much as some calls' work
        key = (threading.get_ident(), threads)
        kept = layout.contexts.get(key)
        if kept is None or kept[2] is not we:
            bits = lows.view(np.uint32), highs.view(np.uint32)
            context = np.array(
                [
                    0, n, k, height, width, we.ctypes.data, be.ctypes.data, e_code, int(bits[0][0]), int(bits[1][0]),
                    layout.table.ctypes.data, wd.ctypes.data, blocks, wd.shape[1], bd.ctypes.data, layout.geometry.ctypes.data,
                    int(depthwise_relu), d_code, int(bits[0][1]), int(bits[1][1]), 0, layout.floats, 0,
                    m, layout.out[0], layout.out[1],
                ],
                np.int64,
            )
            kept = layout.contexts[key] = (context, int(context.ctypes.data), we)
        loops.job_addresses(kept[0], loops.EXPAND_X, x, -1, buffer, loops.EXPAND_WORK, buffer, loops.EXPAND_Y, y)
        pool.run(loops.expand_job.address, kept[1], units, threads)

    def run_either(x: np.ndarray, wa: np.ndarray, ba: np.ndarray | None, wb: np.ndarray, bb: np.ndarray | None,
                   out: np.ndarray | None) -> np.ndarray:
        if not compilable or w1 is None or w2 is None:
            return separate(x, wa, ba, wb, bb, out)
        loops = convolution.depthwise_loops()
        pool = compiled_pool() if loops is not None else None
        if (
            pool is None or x.dtype != _F32 or x.ndim != 4 or x.shape[1] != w1.shape[1] or wa.shape != w1.shape or wb.shape != w2.shape
            or (ba is None) != (b1 is None) or (bb is None) != (b2 is None)
            or (out is not None and (out.dtype != _F32 or not out.flags.c_contiguous))
        ):
            return separate(x, wa, ba, wb, bb, out)
        layout = shapes(x.shape)
        if layout is None or layout.fused_wins is False:
            return separate(x, wa, ba, wb, bb, out)
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x) if out is None else _copy_to_workspace("expand-depthwise-input", x)
        y = out if out is not None else np.empty((x.shape[0], w1.shape[0], *layout.out), _F32)
        if layout.fused_wins is None:  # the first call times both ways; each writes all of y

            def unfused() -> None:
                separate(x, wa, ba, wb, bb, y)

            layout.fused_wins = convolution._faster(lambda: fused(loops, pool, x, layout, y), unfused)
        if layout.fused_wins:
            fused(loops, pool, x, layout, y)
        else:
            separate(x, wa, ba, wb, bb, y)
        return y

    def run(x: np.ndarray, wa: np.ndarray, ba: np.ndarray | None, wb: np.ndarray, bb: np.ndarray | None = None) -> np.ndarray:
        return run_either(x, wa, ba, wb, bb, None)

    def run_into(out: np.ndarray, x: np.ndarray, wa: np.ndarray, ba: np.ndarray | None, wb: np.ndarray,
                 bb: np.ndarray | None = None) -> None:
        run_either(x, wa, ba, wb, bb, out)

    declare_into(run_into, run)
    return run
