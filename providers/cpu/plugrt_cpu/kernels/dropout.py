"""Dropout kernels: the identity at inference, a seeded Bernoulli mask in training mode."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .._registry import KernelContext, kernel_builder, declare_into


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

    declare_into(_dropout_identity_into, run)
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
        if seed is not None:
            uniform = np.random.RandomState(int(seed)).uniform(0, 1, x.shape)
        else:
            assert rng is not None  # made above whenever there is no seed
            uniform = rng.random(x.shape)
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
            if result is not None:
                np.copyto(buffer, result)

    declare_into(run_into, run)
    return run
