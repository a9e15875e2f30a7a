"""The template's kernels: one numpy function per opcode, and the ONNX ops it claims."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

__all__ = ["OpSpec", "CLAIMED_OPS", "KERNELS", "ELEMENT_TYPE"]

#: The only element type the template claims (ONNX's TensorProto.FLOAT).
ELEMENT_TYPE = np.dtype(np.float32)


def sigmoid(x):
    # exp(-x) overflowing to inf for very negative x gives 1 / inf = 0, as it should.
    with np.errstate(over="ignore"):
        e = np.exp(np.negative(x))
    return np.reciprocal(np.add(e, 1))


def relu(x):
    return np.maximum(x, 0)


def leaky_relu(x, *, alpha=0.01):
    # x where x >= 0, alpha * x below: the larger of the two when alpha <= 1.
    return (np.maximum if alpha <= 1 else np.minimum)(x, np.multiply(x, alpha))


def gemm(a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0):
    y = np.matmul(a.T if transA else a, b.T if transB else b)
    if alpha != 1.0:
        np.multiply(y, np.float32(alpha), out=y)
    if c is not None and beta != 0.0:
        y += c if beta == 1.0 else c * np.float32(beta)
    return y


#: opcode -> numpy kernel. Inputs are positional (None for an omitted optional input);
#: attributes are keyword-only. This table is also the list of opcodes a saved context
#: may contain: load_context refuses any other.
KERNELS: dict[str, Callable[..., Any]] = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": np.true_divide,
    "Pow": np.power,
    "Square": np.square,  # Pow with a constant exponent of 2, chosen at compile
    "Neg": np.negative,
    "Abs": np.absolute,
    "Sqrt": np.sqrt,
    "Exp": np.exp,
    "Log": np.log,
    "Tanh": np.tanh,
    "Relu": relu,
    "Sigmoid": sigmoid,
    "LeakyRelu": leaky_relu,
    "MatMul": np.matmul,
    "Gemm": gemm,
}


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One ONNX op the template claims.

    ``versions``: the ai.onnx versions (since_version) the kernel implements exactly;
    a model whose opset selects any other version of the op is declined.
    ``attributes``: the op's attributes with the spec's defaults (all numeric); a node
    with any other attribute is declined.
    """

    versions: tuple[int, ...]
    attributes: dict[str, float | int] = dataclasses.field(default_factory=dict)


_UNARY = OpSpec((6, 13))
_BINARY = OpSpec((7, 13, 14))  # 7: numpy broadcasting replaced `broadcast`/`axis`

#: ONNX op -> what the template claims of it. Everything else is declined.
CLAIMED_OPS: dict[str, OpSpec] = {
    "Add": _BINARY,
    "Sub": _BINARY,
    "Mul": _BINARY,
    "Div": _BINARY,
    "Pow": OpSpec((7, 12, 13, 15)),
    "Neg": _UNARY,
    "Abs": _UNARY,
    "Sqrt": _UNARY,
    "Exp": _UNARY,
    "Log": _UNARY,
    "Tanh": _UNARY,
    "Sigmoid": _UNARY,
    "Relu": OpSpec((6, 13, 14)),
    "LeakyRelu": OpSpec((6, 16), {"alpha": 0.01}),
    "MatMul": OpSpec((1, 9, 13)),
    "Gemm": OpSpec((7, 9, 11, 13), {"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0}),
}
