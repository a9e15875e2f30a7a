"""The nominal host's estimate of a node: arithmetic and memory traffic from inferred shapes."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["NOMINAL_FLOPS", "NOMINAL_BYTES", "NODE_OVERHEAD", "value_bytes", "node_flops", "node_bytes", "nominal_cost"]

#: Floating-point operations per second of the nominal host.
NOMINAL_FLOPS = 20e9
#: Bytes per second the nominal host reads and writes.
NOMINAL_BYTES = 10e9
#: Seconds to call one kernel on the nominal host.
NODE_OVERHEAD = 2e-6
#: An unknown element type is taken as four bytes.
_UNKNOWN_ITEMSIZE = 4


def value_bytes(value: "ir.Value | None") -> int:
    """Bytes of ``value`` as its inferred type and shape say; an unknown or symbolic
    dimension counts as 1, an unknown element type as 4 bytes, an unknown shape as 0."""
    if value is None or value.shape is None:
        return 0
    count = 1
    for dim in value.shape:
        count *= dim if isinstance(dim, int) and dim > 0 else 1
    itemsize = _UNKNOWN_ITEMSIZE
    if value.dtype is not None:
        try:
            itemsize = max(int(value.dtype.itemsize), 1)
        except (AttributeError, TypeError, ValueError):
            pass
    return count * itemsize


def _elements(value: "ir.Value | None") -> int:
    if value is None or value.shape is None:
        return 1
    return math.prod(d if isinstance(d, int) and d > 0 else 1 for d in value.shape)


def _dims(value: "ir.Value | None") -> list[int] | None:
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) and d > 0 else 1 for d in value.shape]


def node_flops(node: "ir.Node") -> float:
    """Arithmetic of ``node``: multiply-adds (twice) of Conv, ConvTranspose, MatMul and
    Gemm; one operation per output element for everything else."""
    out = node.outputs[0] if node.outputs else None
    if node.domain in ("", "ai.onnx") and len(node.inputs) >= 2:
        weight = _dims(node.inputs[1])
        if node.op_type == "Conv" and weight and len(weight) >= 2:
            return 2.0 * _elements(out) * math.prod(weight[1:])
        if node.op_type == "ConvTranspose" and weight and len(weight) >= 2:
            return 2.0 * _elements(node.inputs[0]) * math.prod(weight[1:])
        if node.op_type in ("MatMul", "Gemm"):
            a = _dims(node.inputs[0])
            if a:
                transposed = node.op_type == "Gemm" and "transA" in node.attributes and node.attributes["transA"].value
                inner = a[0] if transposed and len(a) == 2 else a[-1]
                return 2.0 * _elements(out) * inner
    return float(sum(_elements(v) for v in node.outputs if v is not None))


def node_bytes(node: "ir.Node") -> float:
    """Bytes ``node`` reads and writes (its inputs and outputs, weights included)."""
    return float(sum(value_bytes(v) for v in [*node.inputs, *node.outputs]))


def nominal_cost(node: "ir.Node") -> float:
    """The nominal host's seconds for ``node``: a kernel call plus the larger of its
    arithmetic and its memory traffic."""
    return NODE_OVERHEAD + max(node_flops(node) / NOMINAL_FLOPS, node_bytes(node) / NOMINAL_BYTES)
