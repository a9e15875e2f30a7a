"""Loss kernels: NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss."""

from __future__ import annotations

import numpy as np

from .._registry import kernel

_REDUCTIONS = ("none", "sum", "mean")


def _nll(log_prob: np.ndarray, target: np.ndarray, weight, ignore_index, reduction: str) -> np.ndarray:
    """Negative log-likelihood of `target` classes in `log_prob` (N, C, d1..dk), reduced."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if log_prob.ndim < 2:
        raise ValueError(f"input must have shape (N, C, d1, ..., dk); got rank {log_prob.ndim}")
    dtype = log_prob.dtype
    target = target.astype(np.int64, copy=False)
    ignored = None if ignore_index is None else target == ignore_index
    safe_target = target if ignored is None else np.where(ignored, 0, target)
    picked = np.take_along_axis(log_prob, safe_target[:, None], axis=1)[:, 0]
    loss = -picked
    if weight is not None:
        sample_weight = weight[safe_target].astype(dtype, copy=False)
        if ignored is not None:
            sample_weight = np.where(ignored, dtype.type(0), sample_weight)
    elif ignored is not None:
        sample_weight = (~ignored).astype(dtype)
    else:
        sample_weight = None
    if sample_weight is not None:
        loss = loss * sample_weight
    if reduction == "none":
        return loss.astype(dtype, copy=False)
    total = loss.sum(dtype=dtype)
    if reduction == "sum":
        return np.asarray(total, dtype=dtype)
    count = sample_weight.sum(dtype=dtype) if sample_weight is not None else dtype.type(loss.size)
    return np.asarray(total / count, dtype=dtype)


@kernel("NegativeLogLikelihoodLoss", 12, 13, 22)
def negative_log_likelihood_loss(input, target, weight=None, *, ignore_index=None, reduction="mean"):
    return _nll(input, target, weight, ignore_index, reduction)


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


@kernel("SoftmaxCrossEntropyLoss", 12, 13, multi_output=True)
def softmax_cross_entropy_loss(scores, labels, weights=None, *, ignore_index=None, reduction="mean"):
    log_prob = _log_softmax(scores, axis=1)
    return _nll(log_prob, labels, weights, ignore_index, reduction), log_prob
