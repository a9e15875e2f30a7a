"""A device-memory test provider: its arrays live in a memory numpy cannot read.

``DeviceArray`` wraps a private ndarray and refuses every way numpy could coerce it
(``__array__`` raises, ufuncs refuse it, it is not iterable), so any host access the core
makes by mistake fails loudly. Only this provider's members and kernels look inside.
``FakeDevice`` claims about a dozen common ops with its own kernels and declines the
rest with a reason; ``FullFakeDevice`` also runs every other op the CPU provider has a
kernel for (inside device memory), so whole models can live on the device. Plugins for
both are discovered through faked entry points (``device.fake_device:plugin``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from plugrt.hookspecs import hookimpl
from plugrt.provider import (
    CaptureContext,
    CapturedPartition,
    CompiledPartition,
    Device,
    DeviceKind,
    Partition,
    Step,
    Support,
    SupportContext,
    node_label,
)

MEMORY = "fakedevice"


class HostAccessError(TypeError):
    """Something tried to read device memory as if it were a host array."""


class DeviceArray:
    """An array in the fake device's memory. ``shape``, ``dtype`` and slicing (a view)
    are all the core may use; numpy refuses to coerce it."""

    __slots__ = ("_data", "base")
    __iter__ = None  # not a sequence either
    __array_ufunc__ = None  # numpy ufuncs refuse it

    def __init__(self, data: np.ndarray, base: "DeviceArray | None" = None):
        self._data = data
        self.base = base

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise HostAccessError("a fake-device array was read as a host array: copy it with the provider's to_host")

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        raise HostAccessError(f"numpy.{func.__name__} was called on a fake-device array")

    @property
    def shape(self) -> tuple[int, ...]:
        return self._data.shape

    @property
    def dtype(self) -> np.dtype:
        return self._data.dtype

    def __getitem__(self, key: Any) -> "DeviceArray":
        if not isinstance(key, tuple) or not all(isinstance(k, slice) for k in key):
            raise HostAccessError(f"fake-device arrays are sliced with a tuple of slices only, not {key!r}")
        return DeviceArray(self._data[key], base=self)

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype})"


def _data(array: Any) -> Any:
    """A kernel's view inside device memory; a host array here is a bug in the core."""
    if array is None:
        return None
    if type(array) is not DeviceArray:
        raise HostAccessError(f"a {type(array).__name__} reached a fake-device kernel: the core skipped a transfer")
    return array._data


# -- kernels: functions over the private arrays, attributes keyword-only ----------------


def _softmax(x: np.ndarray, *, axis: int = -1, opset: int = 13) -> np.ndarray:
    if opset < 13:  # the input is coerced to 2-D at ``axis``
        flat = x.reshape(int(np.prod(x.shape[:axis], dtype=np.int64)), -1)
        return _softmax(flat, axis=1).reshape(x.shape)
    shifted = np.exp(x - x.max(axis=axis, keepdims=True))
    return shifted / shifted.sum(axis=axis, keepdims=True)


def _gemm(a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0):
    y = (a.T if transA else a) @ (b.T if transB else b)
    if alpha != 1.0:
        y = y * np.asarray(alpha, y.dtype)
    if c is not None:
        y = y + (c * np.asarray(beta, y.dtype) if beta != 1.0 else c)
    return y


def _reshape(x, shape, *, allowzero=0):
    shape = [int(d) for d in shape]
    if not allowzero:
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return x.reshape(shape)


def _flatten(x, *, axis=1):
    rows = int(np.prod(x.shape[:axis], dtype=np.int64))
    return x.reshape(rows, -1)


def _transpose(x, *, perm=None):
    return np.ascontiguousarray(np.transpose(x, perm))


def _concat(*xs, axis):
    return np.concatenate(xs, axis=axis)


def _relu(x):
    return np.maximum(x, np.zeros((), x.dtype))


def _sum(*xs):
    return functools.reduce(np.add, xs)


KERNELS: dict[str, Callable[..., np.ndarray]] = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": np.divide,
    "Sum": _sum,
    "Relu": _relu,
    "MatMul": np.matmul,
    "Gemm": _gemm,
    "Softmax": _softmax,
    "Reshape": _reshape,
    "Flatten": _flatten,
    "Transpose": _transpose,
    "Concat": _concat,
}

#: Element types the kernels handle.
FLOATS = (1, 10, 11)  # float, float16, double


class FakeDevice:
    """Test provider with its own memory space (see the module docstring)."""

    name = "fakedevice"
    priority = 60
    protocol_version = 1
    memory = MEMORY
    default_device = Device(DeviceKind.NPU, 0, "Fake device memory")

    def __init__(self) -> None:
        self.allocated = 0  # bytes of device arrays made so far (allocations, transfers, kernel results)

    # -- required -------------------------------------------------------------------------

    def devices(self) -> list[Device]:
        return [self.default_device]

    def supports_op(self, node: Any, ctx: SupportContext) -> Support:
        if node.domain not in ("", "ai.onnx"):
            return Support.no(f"the fake device runs ai.onnx ops only, not domain {node.domain!r}")
        if node.op_type not in KERNELS:
            return Support.no(f"the fake device has no {node.op_type} kernel; it runs {', '.join(sorted(KERNELS))}")
        for value in node.inputs:
            if value is not None and value.dtype is not None and int(value.dtype) not in FLOATS + (7,):
                return Support.no(f"the fake device computes in float types, not {value.dtype.name}")
        return Support.yes()

    def compile(self, partition: Partition) -> CompiledPartition:
        steps = [self._step(node, partition) for node in partition.nodes]
        return CompiledPartition(partition, steps, self.name)

    def _step(self, node: Any, partition: Partition) -> Step:
        attributes = {name: attr.value for name, attr in node.attributes.items()}
        kernel = KERNELS[node.op_type]
        if node.op_type == "Softmax":
            attributes.setdefault("axis", 1 if partition.opset_imports.get("", 13) < 13 else -1)
            attributes["opset"] = partition.opset_imports.get("", 13)
        if attributes:
            kernel = functools.partial(kernel, **attributes)
        inputs = list(node.inputs)
        while inputs and inputs[-1] is None:
            inputs.pop()
        label = node_label(node)
        return Step(self._on_device(kernel), inputs, list(node.outputs)[:1], name=label, op_type=node.op_type, nodes=(label,))

    def _on_device(self, kernel: Callable[..., Any]) -> Callable[..., DeviceArray]:
        wrap = self._wrap

        def run(*arrays: Any) -> DeviceArray:
            return wrap(np.asarray(kernel(*[_data(a) for a in arrays])))

        run.kernel = kernel  # type: ignore[attr-defined]
        return run

    def _wrap(self, data: np.ndarray) -> DeviceArray:
        self.allocated += data.nbytes
        return DeviceArray(data)

    # -- MemoryCapability -----------------------------------------------------------------

    def allocate(self, shape: tuple[int, ...], dtype: Any, device: Device | None) -> DeviceArray:
        return self._wrap(np.empty(tuple(shape), np.dtype(dtype)))

    def to_device(self, array: Any, device: Device | None) -> DeviceArray:
        if type(array) is not np.ndarray:
            raise HostAccessError(f"to_device takes a host numpy.ndarray, not {type(array).__name__}")
        return self._wrap(array.copy())

    def to_host(self, array: Any) -> np.ndarray:
        return _data(array).copy()

    def copy_into(self, source: Any, target: Any) -> None:
        src = source._data if type(source) is DeviceArray else source
        dst = target._data if type(target) is DeviceArray else target
        if type(src) is not np.ndarray or type(dst) is not np.ndarray:
            raise HostAccessError(f"copy_into({type(source).__name__}, {type(target).__name__})")
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError(f"copy_into: {src.dtype}{list(src.shape)} into {dst.dtype}{list(dst.shape)}")
        np.copyto(dst, src)

    def owns(self, array: Any) -> bool:
        return type(array) is DeviceArray

    def allocated_bytes(self) -> int:
        return self.allocated

    # -- CaptureCapability --------------------------------------------------------------

    def capture(self, compiled: CompiledPartition, ctx: CaptureContext) -> CapturedPartition:
        """Each step writes into device buffers from the capture's pool on replay."""
        runs: list[Callable[[], None]] = []
        nodes: list[tuple[str, bool, str]] = []
        for step in compiled.steps:
            inputs = [ctx.array(v) for v in step.inputs]
            recorded = step.fn(*inputs)
            results = list(recorded) if step.multi_output else [recorded]
            buffers = [None if r is None else ctx.buffer_like(r) for r in results]
            replay = functools.partial(
                _replay_into,
                step.fn.kernel,
                [None if b is None else b._data for b in buffers],
                [_data(a) for a in inputs],
                step.multi_output,
            )
            replay()
            for value, buffer in zip(step.outputs, buffers):
                ctx.set(value, buffer)
            runs.append(replay)
            nodes.append((step.name, True, ""))
            ctx.step_done(step)
        return CapturedPartition(runs, nodes)


def _replay_into(kernel: Callable[..., Any], outs: list, inputs: list, multi_output: bool) -> None:
    results = kernel(*inputs) if multi_output else [kernel(*inputs)]
    for out, result in zip(outs, results):
        if out is not None:
            np.copyto(out, result)


class FullFakeDevice(FakeDevice):
    """The fake device, also running every op the CPU provider has a kernel for (its
    kernels applied inside device memory), so a whole model can live on the device."""

    name = "fakedevice_full"

    def __init__(self) -> None:
        super().__init__()
        from plugrt_cpu import CPUProvider

        self._cpu = CPUProvider()

    def supports_op(self, node: Any, ctx: SupportContext) -> Support:
        own = super().supports_op(node, ctx)
        return own if own else self._cpu.supports_op(node, ctx)

    def _step(self, node: Any, partition: Partition) -> Step:
        if node.op_type in KERNELS and node.domain in ("", "ai.onnx"):
            return super()._step(node, partition)
        step = self._cpu.bind(node, partition.opset_imports, partition.build_subgraph)
        fn, wrap = step.fn, self._wrap
        if step.multi_output:
            count = len(step.outputs)

            def run_many(*arrays: Any) -> list:
                results = fn(*[_data(a) for a in arrays])[:count]
                return [None if r is None else wrap(np.asarray(r)) for r in results]

            run_many.kernel = lambda *data: fn(*data)[:count]  # type: ignore[attr-defined]
            return Step(run_many, step.inputs, step.outputs, multi_output=True, name=step.name, op_type=step.op_type, nodes=step.nodes)
        run = self._on_device(fn)
        return Step(run, step.inputs, step.outputs, name=step.name, op_type=step.op_type, nodes=step.nodes)

class OldProtocolDevice(FakeDevice):
    """Declares a protocol version this plugrt does not support."""

    name = "olddevice"
    protocol_version = 99


class plugin:
    @staticmethod
    @hookimpl
    def plugrt_providers() -> list:
        return [FakeDevice()]


class full_plugin:
    @staticmethod
    @hookimpl
    def plugrt_providers() -> list:
        return [FullFakeDevice()]


class old_protocol_plugin:
    @staticmethod
    @hookimpl
    def plugrt_providers() -> list:
        return [OldProtocolDevice()]
