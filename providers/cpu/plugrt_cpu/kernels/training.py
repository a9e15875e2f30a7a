"""Training-preview kernels (ai.onnx.preview.training): Adagrad, Adam, Momentum."""

from __future__ import annotations

import math

import numpy as np

from .._registry import kernel

_DOMAIN = "ai.onnx.preview.training"


def _split_groups(op: str, tensors: tuple, per_tensor: int) -> list[tuple]:
    """Variadic optimizer inputs X1..Xn, G1..Gn, ... regrouped as one tuple per tensor."""
    if len(tensors) % per_tensor:
        raise ValueError(f"{op}: expected a multiple of {per_tensor} tensors after R and T, got {len(tensors)}")
    n = len(tensors) // per_tensor
    return [tuple(tensors[k * n + i] for k in range(per_tensor)) for i in range(n)]


def _same_dtype(value: np.ndarray, like: np.ndarray) -> np.ndarray:
    return value.astype(like.dtype, copy=False)


@kernel("Adagrad", 1, domain=_DOMAIN, multi_output=True)
def adagrad(r, t, *tensors, decay_factor=0.0, epsilon=1e-6, norm_coefficient=0.0):
    rate = float(r) / (1.0 + float(t) * decay_factor)
    new_x, new_h = [], []
    for x, g, h in _split_groups("Adagrad", tensors, 3):
        g_reg = norm_coefficient * x + g
        h_next = h + g_reg * g_reg
        new_x.append(_same_dtype(x - rate * g_reg / (np.sqrt(h_next) + epsilon), x))
        new_h.append(_same_dtype(h_next, h))
    return tuple(new_x + new_h)


@kernel("Adam", 1, domain=_DOMAIN, multi_output=True)
def adam(r, t, *tensors, alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.0, norm_coefficient_post=0.0):
    step = int(t)
    rate = float(r)
    if step > 0:
        # bias correction of both momentums
        rate = rate * math.sqrt(1.0 - beta**step) / (1.0 - alpha**step)
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in _split_groups("Adam", tensors, 4):
        g_reg = norm_coefficient * x + g
        v_next = alpha * v + (1.0 - alpha) * g_reg
        h_next = beta * h + (1.0 - beta) * (g_reg * g_reg)
        x_next = x - rate * (v_next / (np.sqrt(h_next) + epsilon))
        new_x.append(_same_dtype((1.0 - norm_coefficient_post) * x_next, x))
        new_v.append(_same_dtype(v_next, v))
        new_h.append(_same_dtype(h_next, h))
    return tuple(new_x + new_v + new_h)


@kernel("Momentum", 1, domain=_DOMAIN, multi_output=True)
def momentum(r, t, *tensors, alpha, beta, mode, norm_coefficient):
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode not in ("standard", "nesterov"):
        raise NotImplementedError(f"Momentum: mode must be 'standard' or 'nesterov', got {mode!r}")
    rate = float(r)
    # the gradient's coefficient is 1 on the first step
    beta_adjusted = beta if int(t) > 0 else 1.0
    new_x, new_v = [], []
    for x, g, v in _split_groups("Momentum", tensors, 3):
        g_reg = norm_coefficient * x + g
        v_next = alpha * v + beta_adjusted * g_reg
        if mode == "standard":
            x_next = x - rate * v_next
        else:
            x_next = x - rate * (g_reg + alpha * v_next)
        new_x.append(_same_dtype(x_next, x))
        new_v.append(_same_dtype(v_next, v))
    return tuple(new_x + new_v)
