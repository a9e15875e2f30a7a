"""Squeeze-excitation as one step: the spatial mean, two small products and the channel gate.

MobileNet v3, EfficientNet and RegNet-Y scale their channels by a gate computed from the
channels' means: GlobalAveragePool, a 1x1 Conv to fewer channels, an activation, a 1x1
Conv back, a Sigmoid or HardSigmoid, and the Mul of the input by the gate. As six steps
(eight with a SiLU written out) they cost more in per-step work than in arithmetic (the
products are matrix-vector products of a few thousand multiply-adds). Here the mean is one
BLAS matrix-vector product (pooling's ``_spatial_mean``), the two Convs two products on
the (images, channels) means, and the gate one broadcast multiply into the output; the
``into`` variant keeps its small work arrays with the output buffer, so a replay allocates
nothing. With numba's compiled loops, float32 runs the whole step as one compiled call per
image (``_numba_epilogue.squeeze_excite``): MobileNet v3's steps on a few thousand values
took ~100 us of numpy calls each.

The step writes over its input where the input dies at it (``inplace_keeps_first``: the
output has the input's shape whatever the weights'): the scaling then stores into lines
the means pass has just read, where a new output was one more buffer through the cache.
MobileNet v3 small 2-5% faster a run, EfficientNet-B0 2-3% (same process, alternating).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from plugrt.threads import blas_threads

from .._registry import KernelContext, declare_into
from ._gemm import epilogue_loops
from .conv_activation import activation_in_place
from .elementwise import _sigmoid_into, scratch
from .normalization import zero_vector
from .pooling import _spatial_mean

__all__ = ["GATES", "HIDDEN_ACTIVATIONS", "build_squeeze_excite"]

#: The activations between the two products, and the gates after the second.
HIDDEN_ACTIVATIONS = ("Relu", "SiLU", "HardSwish")
GATES = ("Sigmoid", "HardSigmoid")


def _relu(h: np.ndarray, anchor: np.ndarray | None) -> None:
    np.maximum(h, 0, out=h)


def _gate(name: str, alpha: float, beta: float) -> Callable[[np.ndarray], None]:
    """``f(g)``: the gate on ``g`` in place."""

    def sigmoid(g: np.ndarray) -> None:
        _sigmoid_into(g, g)

    def hard_sigmoid(g: np.ndarray) -> None:
        g *= alpha
        g += beta
        np.clip(g, 0, 1, out=g)

    return sigmoid if name == "Sigmoid" else hard_sigmoid


def _work(into: np.ndarray | None, slot: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A work array: kept with ``into`` (the output buffer of an ``into`` call, so that a
    replay allocates nothing), or fresh without one."""
    if into is None:
        return np.empty(shape, dtype)
    return scratch(into, ("squeeze-excite", slot), shape, dtype)


def _compiled_arguments(
    w1: np.ndarray, b1: np.ndarray | None, w2: np.ndarray, b2: np.ndarray | None, r: int, c: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The weights (r, C) and (C, r) and biases as the compiled step reads them: float32,
    C order, zeros for an absent bias; None where a bias is not float32."""
    weights = [np.ascontiguousarray(w, np.float32) for w in (w1.reshape(r, c), w2.reshape(c, r))]
    biases = [zero_vector(size) if b is None else b.reshape(size) for b, size in ((b1, r), (b2, c))]
    if any(b.dtype != np.float32 or not b.flags.c_contiguous for b in biases):
        return None
    return weights[0], biases[0], weights[1], biases[1]


_LOCAL = threading.local()


def _gate_work(hidden: int, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """The compiled step's two float32 work vectors (hidden, channels), kept per thread
    and size: not with the output buffer as ``_work`` keeps them, which an in-place call
    (the output is the input's buffer, new every run) would make new each time, with a
    finalizer to drop them."""
    kept = getattr(_LOCAL, "work", None)
    if kept is None:
        kept = _LOCAL.work = {}
    pair = kept.get((hidden, channels))
    if pair is None:
        pair = kept[(hidden, channels)] = (np.empty(hidden, np.float32), np.empty(channels, np.float32))
    return pair


def build_squeeze_excite(ctx: KernelContext) -> Callable[..., np.ndarray]:
    """``SqueezeExcite(x, w1, b1, w2, b2)``: ``x * gate(act(mean(x) @ w1.T + b1) @ w2.T + b2)``
    per image and channel, ``w1`` (hidden, C, 1, ...) and ``w2`` (C, hidden, 1, ...) as the
    two 1x1 Convs hold them, the biases optional (empty inputs)."""
    hidden_name = ctx.attributes.get("activation", "Relu")
    gate_name = ctx.attributes.get("gate", "Sigmoid")
    if hidden_name not in HIDDEN_ACTIVATIONS or gate_name not in GATES:
        raise NotImplementedError(
            f"SqueezeExcite: activation={hidden_name!r}, gate={gate_name!r} is not supported; "
            f"activation is one of {HIDDEN_ACTIVATIONS}, gate one of {GATES}"
        )
    # the Conv + activation fusions' in-place bodies (the same values as the standalone kernels)
    hidden = _relu if hidden_name == "Relu" else activation_in_place(hidden_name, [])
    assert hidden is not None
    alpha, beta = float(ctx.attributes.get("alpha", 0.2)), float(ctx.attributes.get("beta", 0.5))
    gate = _gate(gate_name, alpha, beta)
    codes = (HIDDEN_ACTIVATIONS.index(hidden_name), GATES.index(gate_name))  # the compiled step's
    # the compiled call's weights and biases, laid out once where they are the node's
    # constants (a few microseconds of reshapes and checks a call, on steps of 10-20 us)
    prepared: dict[str, Any] = {}
    constants = [*ctx.constant_inputs[1:5], *([None] * (5 - max(1, len(ctx.constant_inputs))))]

    def products(
        x: np.ndarray,
        w1: np.ndarray,
        b1: np.ndarray | None,
        w2: np.ndarray,
        b2: np.ndarray | None,
        into: np.ndarray | None,
    ) -> np.ndarray:
        """The gate, (images, channels, 1, ...), in work arrays kept with ``into`` (the output
        buffer of an ``into`` call) or fresh ones."""

        def work(slot: str, shape: tuple[int, ...]) -> np.ndarray:
            return _work(into, slot, shape, x.dtype)

        n, c = x.shape[:2]
        r = w1.shape[0]
        # products of a few thousand multiply-adds: one BLAS thread (a second one, woken for
        # so little, costs more than it shares, and stalls when another process holds a core)
        blas_threads(n * c * (x[0, 0].size + 2 * r))
        means = _spatial_mean(x, None if into is None else work("means", (n, c, *([1] * (x.ndim - 2)))))
        h = work("hidden", (n, r))
        np.matmul(means.reshape(n, c), w1.reshape(r, c).T, out=h)
        if b1 is not None:
            h += b1
        hidden(h, into)
        g = work("gate", (n, c))
        np.matmul(h, w2.reshape(c, r).T, out=g)
        if b2 is not None:
            g += b2
        gate(g)
        return g.reshape(n, c, *([1] * (x.ndim - 2)))

    def compiled(
        x: np.ndarray,
        w1: np.ndarray,
        b1: np.ndarray | None,
        w2: np.ndarray,
        b2: np.ndarray | None,
        into: np.ndarray | None,
    ) -> np.ndarray | None:
        """The whole step by one compiled call per image (float32, C order, numba there)
        into ``into`` (an ``into`` call's output, which keeps the work arrays) or a new
        array: the output, or None where it does not run."""
        loops = epilogue_loops()
        if loops is None or x.dtype != np.float32 or x.ndim < 3 or not x.flags.c_contiguous:
            return None
        if into is not None and not into.flags.c_contiguous:
            return None
        n, c = x.shape[:2]
        r = w1.shape[0]
        laid_out = prepared.get("arrays")
        if laid_out is None or prepared.get("from") != (id(w1), id(b1), id(w2), id(b2), c):
            laid_out = _compiled_arguments(w1, b1, w2, b2, r, c)
            if laid_out is None:
                return None
            if all(a is None or a is constant for a, constant in zip((w1, b1, w2, b2), constants)):
                prepared["arrays"], prepared["from"] = laid_out, (id(w1), id(b1), id(w2), id(b2), c)
        w1c, b1c, w2c, b2c = laid_out
        h, g = _gate_work(r, c)
        out = np.empty_like(x) if into is None else into
        if n == 1:  # the model's batch of one: no per-image views
            loops.squeeze_excite(
                x.reshape(c, -1), w1c, b1c, w2c, b2c, codes[0], codes[1], alpha, beta, h, g, out.reshape(c, -1)
            )
            return out
        rows, targets = x.reshape(n, c, -1), out.reshape(n, c, -1)
        for image in range(n):
            loops.squeeze_excite(
                rows[image], w1c, b1c, w2c, b2c, codes[0], codes[1], alpha, beta, h, g, targets[image]
            )
        return out

    def run(
        x: np.ndarray, w1: np.ndarray, b1: np.ndarray | None, w2: np.ndarray, b2: np.ndarray | None = None
    ) -> np.ndarray:
        out = compiled(x, w1, b1, w2, b2, None)
        if out is not None:
            return out
        return np.multiply(x, products(x, w1, b1, w2, b2, None))

    def run_into(
        out: np.ndarray,
        x: np.ndarray,
        w1: np.ndarray,
        b1: np.ndarray | None,
        w2: np.ndarray,
        b2: np.ndarray | None = None,
    ) -> None:
        if compiled(x, w1, b1, w2, b2, out) is not None:
            return
        np.multiply(x, products(x, w1, b1, w2, b2, out), out=out)

    declare_into(run_into, run)
    return run
