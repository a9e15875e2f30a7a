"""Which engine runs a 2-D convolution, and why: cuDNN (one fused call: convolution, bias,
residual add, activation), a 1x1 convolution as one GEMM (no im2col), the own depthwise
kernel, or im2col + GEMM, the fallback when cuDNN cannot be used.

The choice is pure logic over shapes and what is installed, so it is tested without a GPU;
``CupyBackend.conv`` carries it out.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

__all__ = ["ConvPlan", "plan_conv", "CUDNN", "GEMM_1X1", "DEPTHWISE", "IM2COL", "GENERIC"]

CUDNN = "cudnn"
GEMM_1X1 = "gemm1x1"
DEPTHWISE = "depthwise"
IM2COL = "im2col"
GENERIC = "generic"  # the array-namespace convolution (_xp.conv): other ranks and dtypes

_DTYPES = ("float32", "float16")


@dataclasses.dataclass(frozen=True)
class ConvPlan:
    engine: str
    reason: str  # why this engine, for the provider's notes


def _ints(value: Any, default: Sequence[int]) -> list[int]:
    return [int(v) for v in value] if value else list(default)


def plan_conv(
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    dtype: str,
    attributes: dict,
    *,
    cudnn_reason: str | None,
    gemm_reason: str | None,
    residual: bool = False,
) -> ConvPlan:
    """The engine for ``Conv(x, w)`` with ``attributes`` (ONNX Conv's).

    ``cudnn_reason`` is None when cuDNN can run convolutions here, else why not (the
    frontend missing, say); ``gemm_reason`` likewise for cuBLASLt. ``residual``: an add of
    another tensor is fused into the convolution (only cuDNN fuses it into one call)."""
    if len(x_shape) != 4 or len(w_shape) != 4 or dtype not in _DTYPES:
        return ConvPlan(GENERIC, f"{len(x_shape) - 2}-D {dtype} convolution: the generic array form")
    c = int(x_shape[1])
    m, cg, kh, kw = (int(v) for v in w_shape)
    group = int(attributes.get("group", 1))
    strides = _ints(attributes.get("strides"), [1, 1])
    pads = _ints(attributes.get("pads"), [0, 0, 0, 0])
    auto_pad = attributes.get("auto_pad", "NOTSET")
    pointwise = kh == kw == 1 and group == 1 and not any(pads) and auto_pad in ("NOTSET", "VALID")
    if pointwise and strides == [1, 1] and gemm_reason is None and not (residual and cudnn_reason is None):
        return ConvPlan(GEMM_1X1, "1x1 convolution, stride 1, no padding: one GEMM over the channels (cuBLASLt), no im2col")
    if cudnn_reason is None:
        return ConvPlan(CUDNN, "cuDNN: convolution, bias, residual add and activation in one fused call")
    if group == c == m and cg == 1:
        return ConvPlan(DEPTHWISE, f"depthwise: the own kernel (cuDNN not used: {cudnn_reason})")
    return ConvPlan(IM2COL, f"im2col + GEMM fallback (cuDNN not used: {cudnn_reason})")
