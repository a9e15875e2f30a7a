"""The ops the CUDA provider claims: for each, the opsets it implements, which inputs must be
constants, and a builder that binds attributes once and returns the step's callable."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import numpy as np

from . import _sources, _xp
from ._backend import Backend

__all__ = ["OpInfo", "OpSpec", "OPS", "FLOAT_DTYPES", "PRIVATE_DOMAIN", "CONTRIB_DOMAIN", "CUDA_DOMAIN", "DOMAINS"]

#: The domain of the CPU provider's fused nodes, which this provider also runs.
PRIVATE_DOMAIN = "plugrt.cpu"
#: onnxruntime's contrib ops the core's rewrites write (Gelu, FastGelu below opset 20).
CONTRIB_DOMAIN = "com.microsoft"
#: This provider's own fused nodes (``_fusions``), on the nodes placed on it only.
CUDA_DOMAIN = "plugrt.cuda"
#: The domains ``supports_op`` looks up in ``OPS`` ("" is ai.onnx).
DOMAINS = ("", PRIVATE_DOMAIN, CONTRIB_DOMAIN, CUDA_DOMAIN)
FLOAT_DTYPES = ("float32", "float16")


@dataclasses.dataclass
class OpInfo:
    """What a builder sees of a node: attributes, constant inputs, opset, backend."""

    attributes: dict[str, Any]
    constants: list[np.ndarray | None]
    opset: int
    num_inputs: int
    num_outputs: int
    backend: Backend


Builder = Callable[[OpInfo], Callable[..., Any]]
Check = Callable[[OpInfo], "str | None"]


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One claimed op. ``math`` ops take float32/float16 tensors only (and int32/int64 with
    ``integers``); ``constant_inputs``
    are the input positions that must be constants (shapes, axes, pads: reading them from
    device memory would stall the stream and cannot be captured)."""

    builder: Builder
    since: int = 1
    math: bool = True
    integers: bool = False  # a math op that also takes int32/int64 tensors
    constant_inputs: tuple[int, ...] = ()
    check: Check | None = None
    multi_output: bool = False
    domain: str = ""


OPS: dict[tuple[str, str], OpSpec] = {}


def _op(op_type: str, *, domain: str = "", **kwargs: Any) -> Callable[[Builder], Builder]:
    def register(builder: Builder) -> Builder:
        OPS[(domain, op_type)] = OpSpec(builder, domain=domain, **kwargs)
        return builder

    return register


def _ints(value: Any) -> list[int]:
    return [int(v) for v in np.asarray(value).reshape(-1)]


# -- elementwise -------------------------------------------------------------------------

def _unary(op_type: str, fn: Callable[[Any, Any, dict], Any], **kwargs: Any) -> None:
    def build(info: OpInfo) -> Callable[..., Any]:
        xp, attributes = info.backend.xp, info.attributes
        return lambda x: fn(xp, x, attributes)

    _op(op_type, **kwargs)(build)


def _activation(xp: Any, x: Any, expression: Callable[[Any], Any]) -> Any:
    return expression(x).astype(x.dtype, copy=False)


_unary("Relu", lambda xp, x, a: xp.maximum(x, 0))
_unary("Sigmoid", lambda xp, x, a: _activation(xp, x, lambda v: 1 / (1 + xp.exp(-v))))
_unary("Tanh", lambda xp, x, a: xp.tanh(x))
_unary("Exp", lambda xp, x, a: xp.exp(x))
_unary("Log", lambda xp, x, a: xp.log(x))
_unary("Sqrt", lambda xp, x, a: xp.sqrt(x))
_unary("Abs", lambda xp, x, a: xp.abs(x))
_unary("Neg", lambda xp, x, a: -x)
_unary("Reciprocal", lambda xp, x, a: _activation(xp, x, lambda v: 1 / v))
_unary("Floor", lambda xp, x, a: xp.floor(x))
_unary("Ceil", lambda xp, x, a: xp.ceil(x))
_unary("Sin", lambda xp, x, a: xp.sin(x))
_unary("Cos", lambda xp, x, a: xp.cos(x))
_unary("Erf", lambda xp, x, a: _xp.erf(xp, x.astype(xp.float32)).astype(x.dtype))
_unary("Softplus", lambda xp, x, a: _activation(xp, x, lambda v: xp.logaddexp(v, 0)))
_unary("LeakyRelu", lambda xp, x, a: _activation(xp, x, lambda v: xp.where(v >= 0, v, v * a.get("alpha", 0.01))))
_unary("Elu", lambda xp, x, a: _activation(xp, x, lambda v: xp.where(v >= 0, v, a.get("alpha", 1.0) * xp.expm1(v))))
_unary(
    "Selu",
    lambda xp, x, a: _activation(
        xp, x, lambda v: a.get("gamma", 1.05070102214813232421875)
        * xp.where(v > 0, v, a.get("alpha", 1.67326319217681884765625) * xp.expm1(v)),
    ),
)
_unary(
    "HardSigmoid",
    lambda xp, x, a: _activation(xp, x, lambda v: xp.clip(a.get("alpha", 0.2) * v + a.get("beta", 0.5), 0, 1)),
)
_unary("HardSwish", lambda xp, x, a: _activation(xp, x, lambda v: v * xp.clip(v / 6 + 0.5, 0, 1)))
_unary("Identity", lambda xp, x, a: x, math=False)


def _check_dropout(info: OpInfo) -> str | None:
    if info.num_inputs > 2:
        training = info.constants[2] if len(info.constants) > 2 else None
        if training is None:
            return "Dropout's training_mode input is computed at run time; the CUDA provider runs inference only"
        if bool(np.asarray(training).reshape(-1)[0]):
            return "Dropout in training mode (random masks) is not implemented on CUDA"
    return None


@_op("Dropout", math=False, check=_check_dropout)
def _dropout(info: OpInfo) -> Callable[..., Any]:
    xp = info.backend.xp
    if info.num_outputs > 1:

        def with_mask(x: Any, *rest: Any) -> tuple:
            return (x, xp.ones(x.shape, dtype=bool))

        with_mask.multi_output = True  # type: ignore[attr-defined]
        return with_mask
    return lambda x, *rest: x


def _binary(op_type: str, fn: Callable[[Any, Any, Any], Any], *, math: bool = True) -> None:
    def build(info: OpInfo) -> Callable[..., Any]:
        xp = info.backend.xp
        return lambda a, b: fn(xp, a, b)

    _op(op_type, math=math, since=7)(build)


_binary("Add", lambda xp, a, b: a + b)
_binary("Sub", lambda xp, a, b: a - b)
_binary("Mul", lambda xp, a, b: a * b)
_binary("Div", lambda xp, a, b: a / b)
_binary("Pow", lambda xp, a, b: xp.power(a, b.astype(a.dtype, copy=False)))
_binary("Equal", lambda xp, a, b: a == b)
_binary("Less", lambda xp, a, b: a < b)
_binary("Greater", lambda xp, a, b: a > b)
_binary("LessOrEqual", lambda xp, a, b: a <= b)
_binary("GreaterOrEqual", lambda xp, a, b: a >= b)
_binary("And", lambda xp, a, b: xp.logical_and(a, b), math=False)
_binary("Or", lambda xp, a, b: xp.logical_or(a, b), math=False)


def _variadic(op_type: str, combine: str) -> None:
    def build(info: OpInfo) -> Callable[..., Any]:
        xp = info.backend.xp

        def run(*inputs: Any) -> Any:
            result = inputs[0]
            for other in inputs[1:]:
                result = getattr(xp, combine)(result, other)
            if op_type == "Mean":
                result = result / len(inputs)
            return result.astype(inputs[0].dtype, copy=False) if len(inputs) > 1 else result.copy()

        return run

    _op(op_type, since=8)(build)


_variadic("Sum", "add")
_variadic("Mean", "add")
_variadic("Max", "maximum")
_variadic("Min", "minimum")


@_op("Not", math=False)
def _not(info: OpInfo) -> Callable[..., Any]:
    xp = info.backend.xp
    return lambda x: xp.logical_not(x)


@_op("Clip", since=11)
def _clip(info: OpInfo) -> Callable[..., Any]:
    xp = info.backend.xp

    def run(x: Any, low: Any = None, high: Any = None) -> Any:
        y = x
        if low is not None:
            y = xp.maximum(y, low.astype(x.dtype))
        if high is not None:
            y = xp.minimum(y, high.astype(x.dtype))
        return y if y is not x else x.copy()

    return run


@_op("PRelu", since=9)
def _prelu(info: OpInfo) -> Callable[..., Any]:
    xp = info.backend.xp
    return lambda x, slope: xp.where(x >= 0, x, x * slope).astype(x.dtype, copy=False)


@_op("Where", since=9, math=False)
def _where(info: OpInfo) -> Callable[..., Any]:
    xp = info.backend.xp
    return lambda c, a, b: xp.where(c, a, b)


_CASTS = {1: "float32", 10: "float16", 11: "float64", 6: "int32", 7: "int64", 9: "bool", 2: "uint8", 3: "int8"}


def _check_cast(info: OpInfo) -> str | None:
    to = int(info.attributes.get("to", 0))
    return None if to in _CASTS else f"the CUDA provider casts to {sorted(set(_CASTS.values()))} only (to={to})"


@_op("Cast", since=6, math=False, check=_check_cast)
def _cast(info: OpInfo) -> Callable[..., Any]:
    xp = info.backend.xp
    dtype = xp.dtype(_CASTS[int(info.attributes["to"])])
    return lambda x: x.astype(dtype)


# -- linear algebra ----------------------------------------------------------------------

@_op("MatMul", since=9)
def _matmul(info: OpInfo) -> Callable[..., Any]:
    return info.backend.matmul


@_op("Gemm", since=7)
def _gemm(info: OpInfo) -> Callable[..., Any]:
    backend, attributes = info.backend, dict(info.attributes)

    def run(a: Any, b: Any, c: Any = None) -> Any:
        return _xp.gemm(backend.xp, a, b, c, matmul=backend.matmul, **attributes)

    return run


@_op("FusedMatMul", domain=PRIVATE_DOMAIN)
def _fused_matmul(info: OpInfo) -> Callable[..., Any]:
    backend = info.backend
    return lambda a, w, bias: backend.matmul(a, w) + bias


# -- convolution, pooling, normalisation -------------------------------------------------

_CONV_ATTRIBUTES = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


def _conv_attributes(info: OpInfo) -> dict[str, Any]:
    return {k: v for k, v in info.attributes.items() if k in _CONV_ATTRIBUTES}


@_op("Conv", since=1)
def _conv(info: OpInfo) -> Callable[..., Any]:
    backend, attributes = info.backend, _conv_attributes(info)
    return lambda x, w, b=None: backend.conv(x, w, b, False, attributes)


def _check_fused_conv(info: OpInfo) -> str | None:
    activation = info.attributes.get("activation")
    residual = info.num_inputs > 3  # FusedConv(x, w, b, z): Conv + z, then the activation if any
    if activation == "Relu" or (residual and activation is None):
        return None
    return f"FusedConv with activation {activation!r} (only Relu)"


@_op("FusedConv", domain=PRIVATE_DOMAIN, check=_check_fused_conv)
def _fused_conv(info: OpInfo) -> Callable[..., Any]:
    backend, attributes = info.backend, _conv_attributes(info)
    relu = info.attributes.get("activation") == "Relu"
    return lambda x, w, b=None, z=None: backend.conv(x, w, b, relu, attributes, residual=z)


def _check_pool(info: OpInfo) -> str | None:
    if info.num_outputs > 1:
        return "MaxPool's Indices output is not implemented on CUDA"
    if int(info.attributes.get("storage_order", 0)):
        return "MaxPool storage_order=1 is not implemented on CUDA"
    return None


def _pool(op_type: str, mode: str) -> None:
    names = ("kernel_shape", "auto_pad", "ceil_mode", "count_include_pad", "dilations", "pads", "strides")

    def build(info: OpInfo) -> Callable[..., Any]:
        backend = info.backend
        attributes = {k: v for k, v in info.attributes.items() if k in names}
        if mode == "max":
            attributes.pop("count_include_pad", None)
        return lambda x: backend.pool(x, mode, attributes)

    _op(op_type, check=_check_pool)(build)


_pool("MaxPool", "max")
_pool("AveragePool", "average")


@_op("GlobalAveragePool")
def _global_average_pool(info: OpInfo) -> Callable[..., Any]:
    xp = info.backend.xp
    return lambda x: _xp.global_pool(xp, x, "average")


@_op("GlobalMaxPool")
def _global_max_pool(info: OpInfo) -> Callable[..., Any]:
    xp = info.backend.xp
    return lambda x: _xp.global_pool(xp, x, "max")


def _check_batch_normalization(info: OpInfo) -> str | None:
    if int(info.attributes.get("training_mode", 0)) or info.num_outputs > 1:
        return "BatchNormalization in training mode (running statistics outputs) is not implemented on CUDA"
    return None


@_op("BatchNormalization", since=7, check=_check_batch_normalization)
def _batch_normalization(info: OpInfo) -> Callable[..., Any]:
    xp, epsilon = info.backend.xp, float(info.attributes.get("epsilon", 1e-5))
    return lambda x, scale, bias, mean, var: _xp.batch_normalization(xp, x, scale, bias, mean, var, epsilon=epsilon)


@_op("LRN")
def _lrn(info: OpInfo) -> Callable[..., Any]:
    backend, a = info.backend, info.attributes
    size, alpha, beta, bias = int(a["size"]), float(a.get("alpha", 1e-4)), float(a.get("beta", 0.75)), float(a.get("bias", 1.0))

    def run(x: Any) -> Any:
        kernel = _activation_kernel(backend, x, "lrn_channels") if x.ndim >= 2 else None
        if kernel is None:
            return _xp.lrn(backend.xp, x, size=size, alpha=alpha, beta=beta, bias=bias)
        cp = backend.xp
        x = cp.ascontiguousarray(x)
        y = cp.empty_like(x)
        inner = x.size // (x.shape[0] * x.shape[1]) if x.size else 1
        kernel(_blocks(x.size), (256,), (
            x, y, cp.int64(x.size), cp.int32(x.shape[1]), cp.int64(inner), cp.int32(size),
            cp.float32(alpha), cp.float32(beta), cp.float32(bias),
        ))
        return y

    return run


def _softmax(op_type: str, log: bool) -> None:
    def build(info: OpInfo) -> Callable[..., Any]:
        backend = info.backend
        coerce = info.opset < 13
        axis = int(info.attributes.get("axis", 1 if coerce else -1))
        return lambda x: backend.softmax(x, axis, coerce, log)

    _op(op_type)(build)


_softmax("Softmax", False)
_softmax("LogSoftmax", True)


def _check_layer_normalization(info: OpInfo) -> str | None:
    stash = int(info.attributes.get("stash_type", 1))
    return None if stash == 1 else f"LayerNormalization stash_type={stash} (only 1, float32 statistics)"


def _layer_normalization(info: OpInfo) -> Callable[..., Any]:
    backend = info.backend
    axis, epsilon = int(info.attributes.get("axis", -1)), float(info.attributes.get("epsilon", 1e-5))
    outputs = info.num_outputs

    def run(x: Any, scale: Any, bias: Any = None) -> Any:
        y, mean, inv_std = backend.layer_normalization(x, scale, bias, axis, epsilon)
        return (y, mean, inv_std)[:outputs] if outputs > 1 else y

    run.multi_output = outputs > 1  # type: ignore[attr-defined]
    return run


_op("LayerNormalization", since=17, check=_check_layer_normalization)(_layer_normalization)
_op("LayerNormalization", domain=PRIVATE_DOMAIN, check=_check_layer_normalization)(_layer_normalization)


# -- reductions --------------------------------------------------------------------------

_REDUCTIONS = {
    "ReduceSum": lambda xp, x, axes, keep: x.sum(axis=axes, keepdims=keep),
    "ReduceMean": lambda xp, x, axes, keep: x.mean(axis=axes, keepdims=keep),
    "ReduceMax": lambda xp, x, axes, keep: x.max(axis=axes, keepdims=keep),
    "ReduceMin": lambda xp, x, axes, keep: x.min(axis=axes, keepdims=keep),
    "ReduceProd": lambda xp, x, axes, keep: x.prod(axis=axes, keepdims=keep),
    "ReduceL1": lambda xp, x, axes, keep: xp.abs(x).sum(axis=axes, keepdims=keep),
    "ReduceL2": lambda xp, x, axes, keep: xp.sqrt((x * x).sum(axis=axes, keepdims=keep)),
    "ReduceSumSquare": lambda xp, x, axes, keep: (x * x).sum(axis=axes, keepdims=keep),
    "ReduceLogSumExp": lambda xp, x, axes, keep: xp.log(xp.exp(x).sum(axis=axes, keepdims=keep)),
}
# the opset from which each reduction takes its axes as an input instead of an attribute
_AXES_INPUT_FROM = {name: (13 if name == "ReduceSum" else 18) for name in _REDUCTIONS}


def _reduction(op_type: str) -> None:
    reduce = _REDUCTIONS[op_type]

    def build(info: OpInfo) -> Callable[..., Any]:
        xp = info.backend.xp
        keep = bool(int(info.attributes.get("keepdims", 1)))
        if info.opset >= _AXES_INPUT_FROM[op_type]:
            constant = info.constants[1] if len(info.constants) > 1 else None
            axes = _ints(constant) if constant is not None else []
            if not axes and int(info.attributes.get("noop_with_empty_axes", 0)):
                return lambda x, *rest: x
        else:
            axes = list(info.attributes.get("axes", []))
        chosen = tuple(axes) if axes else None
        return lambda x, *rest: reduce(xp, x, chosen, keep).astype(x.dtype, copy=False)

    _op(op_type, constant_inputs=(1,))(build)


for _name in _REDUCTIONS:
    _reduction(_name)


# -- the decoder's ops (and Shape), registered from their own module ---------------------

from . import _decoder_ops  # noqa: E402,F401  (after the arithmetic it extends to integers)


# -- shapes and data movement (any dtype) ------------------------------------------------

@_op("Reshape", since=5, math=False, constant_inputs=(1,))
def _reshape(info: OpInfo) -> Callable[..., Any]:
    shape = _ints(info.constants[1])
    allowzero = int(info.attributes.get("allowzero", 0))

    def run(x: Any, _shape: Any = None) -> Any:
        target = [x.shape[i] if d == 0 and not allowzero else d for i, d in enumerate(shape)]
        return x.reshape(target)

    return run


@_op("Flatten", math=False)
def _flatten(info: OpInfo) -> Callable[..., Any]:
    axis = int(info.attributes.get("axis", 1))

    def run(x: Any) -> Any:
        split = axis % x.ndim if x.ndim else 0
        return x.reshape(math.prod(x.shape[:split]), -1)

    return run


@_op("Transpose", math=False)
def _transpose(info: OpInfo) -> Callable[..., Any]:
    xp, perm = info.backend.xp, info.attributes.get("perm")
    return lambda x: xp.ascontiguousarray(xp.transpose(x, perm))


def _axes_op(op_type: str, since_input: int) -> None:
    def build(info: OpInfo) -> Callable[..., Any]:
        xp = info.backend.xp
        if info.opset >= since_input:
            constant = info.constants[1] if len(info.constants) > 1 else None
            axes = _ints(constant) if constant is not None else None
        else:
            axes = info.attributes.get("axes")
        if op_type == "Unsqueeze":
            inserted = list(axes or [])  # the schema requires axes; a model without them inserts none

            def unsqueeze(x: Any, *rest: Any) -> Any:
                rank = x.ndim + len(inserted)
                shape = list(x.shape)
                for a in sorted(a % rank for a in inserted):
                    shape.insert(a, 1)
                return x.reshape(shape)

            return unsqueeze

        def squeeze(x: Any, *rest: Any) -> Any:
            chosen = tuple(a % x.ndim for a in axes) if axes else tuple(i for i, d in enumerate(x.shape) if d == 1)
            return xp.squeeze(x, axis=chosen)

        return squeeze

    _op(op_type, math=False, constant_inputs=(1,))(build)


_axes_op("Unsqueeze", 13)
_axes_op("Squeeze", 13)


@_op("Concat", since=4, math=False)
def _concat(info: OpInfo) -> Callable[..., Any]:
    xp, axis = info.backend.xp, int(info.attributes["axis"])
    return lambda *xs: xp.concatenate(xs, axis=axis)


@_op("Split", since=2, math=False, constant_inputs=(1,), multi_output=True)
def _split(info: OpInfo) -> Callable[..., Any]:
    xp, axis = info.backend.xp, int(info.attributes.get("axis", 0))
    parts = info.num_outputs
    if info.opset >= 13:
        constant = info.constants[1] if len(info.constants) > 1 else None
        sizes = _ints(constant) if constant is not None else None
    else:
        sizes = info.attributes.get("split")

    def run(x: Any, *rest: Any) -> list:
        length = x.shape[axis]
        chosen = sizes or [-(-length // parts)] * (parts - 1) + [length - -(-length // parts) * (parts - 1)]
        points = np.cumsum(chosen)[:-1].tolist()
        return [xp.ascontiguousarray(p) for p in xp.split(x, points, axis=axis)]

    return run


@_op("Slice", since=10, math=False, constant_inputs=(1, 2, 3, 4))
def _slice(info: OpInfo) -> Callable[..., Any]:
    starts, ends = _ints(info.constants[1]), _ints(info.constants[2])
    given_axes = _ints(info.constants[3]) if len(info.constants) > 3 and info.constants[3] is not None else None
    steps = _ints(info.constants[4]) if len(info.constants) > 4 and info.constants[4] is not None else [1] * len(starts)

    def run(x: Any, *rest: Any) -> Any:
        index = [slice(None)] * x.ndim
        axes = given_axes if given_axes is not None else list(range(len(starts)))
        for start, end, axis, step in zip(starts, ends, axes, steps):
            size = x.shape[axis]
            index[axis] = slice(*slice(start, end, step).indices(size))
        return x[tuple(index)].copy()

    return run


@_op("Gather", math=False)
def _gather(info: OpInfo) -> Callable[..., Any]:
    xp, axis = info.backend.xp, int(info.attributes.get("axis", 0))

    def run(x: Any, indices: Any) -> Any:
        size = x.shape[axis]
        return xp.take(x, xp.where(indices < 0, indices + size, indices), axis=axis)

    return run


@_op("Expand", since=8, math=False, constant_inputs=(1,))
def _expand(info: OpInfo) -> Callable[..., Any]:
    xp, shape = info.backend.xp, _ints(info.constants[1])

    def run(x: Any, _shape: Any = None) -> Any:
        target = np.broadcast_shapes(tuple(x.shape), tuple(shape))
        return xp.ascontiguousarray(xp.broadcast_to(x, target))

    return run


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "edge", "wrap": "wrap"}


def _check_pad(info: OpInfo) -> str | None:
    mode = info.attributes.get("mode", "constant")
    return None if mode in _PAD_MODES else f"Pad mode {mode!r} is not implemented on CUDA"


@_op("Pad", since=11, math=False, constant_inputs=(1, 2, 3), check=_check_pad)
def _pad(info: OpInfo) -> Callable[..., Any]:
    xp = info.backend.xp
    pads = _ints(info.constants[1])
    value = info.constants[2] if len(info.constants) > 2 and info.constants[2] is not None else None
    axes = _ints(info.constants[3]) if len(info.constants) > 3 and info.constants[3] is not None else None
    mode = _PAD_MODES[info.attributes.get("mode", "constant")]

    def run(x: Any, *rest: Any) -> Any:
        chosen = [a % x.ndim for a in axes] if axes is not None else list(range(x.ndim))
        widths = [(0, 0)] * x.ndim
        half = len(pads) // 2
        for i, axis in enumerate(chosen):
            widths[axis] = (pads[i], pads[i + half])
        if any(b < 0 or e < 0 for b, e in widths):  # negative pads crop
            x = x[tuple(slice(max(0, -b), x.shape[i] - max(0, -e)) for i, (b, e) in enumerate(widths))]
            widths = [(max(0, b), max(0, e)) for b, e in widths]
        if mode == "constant":
            fill = float(np.asarray(value).reshape(-1)[0]) if value is not None and np.asarray(value).size else 0
            return xp.pad(x, widths, mode="constant", constant_values=fill)
        return xp.pad(x, widths, mode=mode)

    return run


_RESIZE_COORDINATES = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric")


def _check_resize(info: OpInfo) -> str | None:
    a = info.attributes
    mode = a.get("mode", "nearest")
    if mode not in ("nearest", "linear"):
        return f"Resize mode {mode!r} is not implemented on CUDA (nearest, linear)"
    coordinates = a.get("coordinate_transformation_mode", "half_pixel")
    if coordinates not in _RESIZE_COORDINATES:
        return f"Resize coordinate_transformation_mode {coordinates!r} is not implemented on CUDA"
    if int(a.get("antialias", 0)) or a.get("axes") is not None or a.get("keep_aspect_ratio_policy", "stretch") != "stretch":
        return "Resize antialias, axes and keep_aspect_ratio_policy are not implemented on CUDA"
    if info.opset < 11:
        return "Resize before opset 11 is not implemented on CUDA"
    return None


@_op("Resize", since=11, constant_inputs=(1, 2, 3), check=_check_resize)
def _resize(info: OpInfo) -> Callable[..., Any]:
    xp, a = info.backend.xp, info.attributes
    scales_given = info.constants[2] if len(info.constants) > 2 else None
    sizes_given = info.constants[3] if len(info.constants) > 3 else None
    options = {
        "mode": a.get("mode", "nearest"),
        "coordinate_transformation_mode": a.get("coordinate_transformation_mode", "half_pixel"),
        "nearest_mode": a.get("nearest_mode", "round_prefer_floor"),
    }

    def run(x: Any, *rest: Any) -> Any:
        if sizes_given is not None and np.asarray(sizes_given).size:
            sizes = _ints(sizes_given)
            scales = [s / d for s, d in zip(sizes, x.shape)]
        else:
            scales = [float(s) for s in np.asarray(scales_given).reshape(-1)]
            sizes = [int(math.floor(d * s)) for d, s in zip(x.shape, scales)]
        return _xp.resize(xp, x, sizes, scales, **options)

    return run


@_op("ConstantOfShape", since=9, math=False, constant_inputs=(0,))
def _constant_of_shape(info: OpInfo) -> Callable[..., Any]:
    xp = info.backend.xp
    shape = _ints(info.constants[0])
    value = info.attributes.get("value")
    fill = np.asarray(value).reshape(-1) if value is not None else np.zeros(1, np.float32)
    return lambda *_: xp.full(shape, fill[0], dtype=fill.dtype)


def inputs_not_constant(spec: OpSpec, constants: Sequence[Any], present: Sequence[bool]) -> list[int]:
    """Positions of inputs ``spec`` needs constant that are given but not constant."""
    return [i for i in spec.constant_inputs if i < len(present) and present[i] and constants[i] is None]


# -- fused elementwise chains: one NVRTC kernel each (``_sources`` "activation") --------
# On the numpy backend (and for dtypes the kernels do not store) the same math runs in
# ``_xp``: that is the copy the tests check against onnxruntime.


def _activation_kernel(backend: Backend, x: Any, name: str) -> Any:
    """The device kernel ``name`` for x's dtype, or None where ``_xp`` computes instead."""
    launch = getattr(backend, "kernel", None)
    if launch is None or x.dtype.name not in _sources.DTYPES or x.size == 0:
        return None
    return launch("activation", x.dtype, name)


def _blocks(total: int) -> tuple[int]:
    return (max(1, min((total + 255) // 256, 65535 * 8)),)


def _gelu_kernel(backend: Backend, approximate: str) -> Callable[..., Any]:
    """Gelu of x (+ bias over the last axis), erf or tanh form."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"Gelu approximate={approximate!r}: use 'none' or 'tanh'")

    def run(x: Any, bias: Any = None) -> Any:
        fits = bias is None or (bias.ndim == 1 and x.ndim >= 1 and bias.shape[0] == x.shape[-1] and bias.dtype == x.dtype)
        name = "gelu_tanh" if approximate == "tanh" else "gelu_erf"
        kernel = _activation_kernel(backend, x, name) if fits and (bias is None or approximate == "tanh") else None
        if kernel is None:
            return _xp.gelu(backend.xp, x if bias is None else x + bias, approximate=approximate)
        cp = backend.xp
        x = cp.ascontiguousarray(x)
        y = cp.empty_like(x)
        if approximate == "tanh":
            hidden = 0 if bias is None else int(bias.shape[0])
            kernel(_blocks(x.size), (256,), (x, x if bias is None else cp.ascontiguousarray(bias), y,
                                             cp.int64(x.size), cp.int32(hidden)))
        else:
            kernel(_blocks(x.size), (256,), (x, y, cp.int64(x.size)))
        return y

    return run


def _check_gelu(info: OpInfo) -> str | None:
    approximate = info.attributes.get("approximate", "none")
    return None if approximate in ("none", "tanh") else f"Gelu approximate={approximate!r} (only 'none' and 'tanh')"


def _gelu(info: OpInfo) -> Callable[..., Any]:
    return _gelu_kernel(info.backend, str(info.attributes.get("approximate", "none")))


_op("Gelu", since=20, check=_check_gelu)(_gelu)
_op("Gelu", domain=PRIVATE_DOMAIN, check=_check_gelu)(_gelu)
_op("Gelu", domain=CONTRIB_DOMAIN)(lambda info: _gelu_kernel(info.backend, "none"))
_op("FastGelu", domain=CONTRIB_DOMAIN)(lambda info: _gelu_kernel(info.backend, "tanh"))


@_op("Silu", domain=CUDA_DOMAIN)
def _silu(info: OpInfo) -> Callable[..., Any]:
    """x * sigmoid(x), from Sigmoid and Mul placed here (``_fusions.FuseSiluPass``)."""
    backend = info.backend

    def run(x: Any) -> Any:
        kernel = _activation_kernel(backend, x, "silu")
        if kernel is None:
            return _xp.silu(backend.xp, x)
        cp = backend.xp
        x = cp.ascontiguousarray(x)
        y = cp.empty_like(x)
        kernel(_blocks(x.size), (256,), (x, y, cp.int64(x.size)))
        return y

    return run


_op("FusedConv", domain=CUDA_DOMAIN, check=_check_fused_conv)(_fused_conv)
