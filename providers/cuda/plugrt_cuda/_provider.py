"""The CUDA provider: probes lazily, claims the ops in ``_ops`` for float32/float16, keeps
values in device memory, captures partitions as CUDA graphs and saves compiled kernels."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from plugrt.errors import EpContextError, UnsupportedOpError
from plugrt.provider import (
    CaptureContext,
    CapturedPartition,
    CompiledPartition,
    Device,
    DeviceKind,
    NotCapturable,
    Partition,
    Step,
    Support,
    SupportContext,
    node_label,
)

from . import __version__, _context, _probe
from ._backend import Backend, CupyBackend
from ._ops import DOMAINS, FLOAT_DTYPES, OPS, OpInfo, inputs_not_constant
from ._decoder_ops import INTEGER_DTYPES  # noqa: I001 (after _ops, which registers it)

if TYPE_CHECKING:  # onnx_ir is imported where a model is placed: discovery stays cheap
    import onnx_ir as ir

__all__ = ["CUDAProvider", "CompiledState"]

_ONNX_DOMAINS = ("", "ai.onnx")
#: the element types the provider keeps in device memory: those cupy arrays hold and its
#: kernels compute with. Everything else (strings, bfloat16, float8/float4, int4/int2 and
#: their unsigned forms, complex, any type added later) is declined in supports_op.
_DEVICE_DTYPES = frozenset(
    {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"}
)


@dataclasses.dataclass
class CompiledState:
    """Provider-private data of a compiled partition."""

    backend: Backend
    verdict: str = ""  # for a partition restored from a context: "" or why it was recompiled


def _claimed() -> str:
    return ", ".join(sorted({op for domain, op in OPS if domain == ""}))


class CUDAProvider:
    """Device arrays are cupy arrays; kernels are cupy's and the provider's own (``_sources``)."""

    name = "cuda"
    priority = 100
    memory = "cuda"
    device_kinds = (DeviceKind.GPU,)  # known without importing cupy: device="cpu" never probes
    context_source_keys = ("cuda",)
    sdk_version = _context.FORMAT

    def __init__(
        self,
        *,
        importer: Callable[[], Any] = _probe.import_cupy,
        backend: Backend | None = None,
    ) -> None:
        # ``backend`` runs the kernels over another array module (numpy in tests without
        # a GPU); the default is cupy, created on first use.
        self._importer = importer
        self._probe: _probe.Probe | None = None
        self._backend = backend

    # -- availability ------------------------------------------------------------------

    def probe(self) -> _probe.Probe:
        if self._probe is None:
            self._probe = _probe.probe(self._importer)
        return self._probe

    def devices(self) -> list[Device]:
        return list(self.probe().devices)

    @property
    def unavailable_reason(self) -> str:
        return self.probe().reason or ""

    @property
    def default_device(self) -> Device:
        devices = self.probe().devices
        return devices[0] if devices else Device(DeviceKind.GPU, 0)

    @property
    def architecture(self) -> str:
        """The first device's "sm_XY", "" when unknown (kernels then compile through cupy)."""
        found = self.probe()
        return found.architectures[0] if found.architectures else ""

    def backend(self) -> Backend:
        if self._backend is None:
            self._backend = CupyBackend(self._importer(), arch=self.architecture)
        return self._backend

    def notes(self) -> list[str]:
        """What the provider chose and why, for a user reading why a model runs as it does:
        the GEMM engine, and the engine of each convolution shape run so far."""
        backend = self._backend
        if not isinstance(backend, CupyBackend):
            return []
        shared = backend._shared
        if shared["lt"] is not None:
            lines = [f"GEMMs: cuBLASLt {shared['lt'].version} on the provider's handle, eager and in CUDA graphs"]
        elif shared["lt_reason"] is not None:
            lines = [f"GEMMs: cuBLAS eager and the own kernel in CUDA graphs (cuBLASLt not used: {shared['lt_reason']})"]
        else:
            lines = []
        for (x_shape, w_shape, dtype, _, residual), plan in shared.get("conv_notes", {}).items():
            shown = f"Conv x{list(x_shape)} w{list(w_shape)} {dtype}{' + residual' if residual else ''}"
            lines.append(f"{shown}: {plan.engine}: {plan.reason}")
        return lines

    # -- placement ---------------------------------------------------------------------

    #: Seconds a partition costs here (placement by estimate): a synchronisation with the
    #: host at its end, and the launches of its first kernels.
    partition_overhead = 30e-6

    def estimate_cost(self, node: ir.Node, ctx: Any) -> float:
        """Seconds for ``node`` (placement by estimate, ``device="auto"``): a kernel launch,
        then its arithmetic and memory traffic at the rates of a modest GPU (10 TFLOP/s,
        500 GB/s), so that only work big enough to pay for its transfers comes here."""
        return 10e-6 + ctx.flops(node) / 10e12 + ctx.bytes(node) / 500e9


    def supports_op(self, node: ir.Node, ctx: SupportContext) -> Support:
        from plugrt.ir_utils import constant_array

        domain = "" if node.domain in _ONNX_DOMAINS else node.domain
        shown = f"{domain or 'ai.onnx'}::{node.op_type}"
        if domain not in DOMAINS:
            return Support.no(f"the CUDA provider runs ai.onnx and com.microsoft ops only, not {shown}")
        spec = OPS.get((domain, node.op_type))
        if spec is None:
            return Support.no(f"the CUDA provider has no kernel for {shown}; it claims {_claimed()}")
        opset = ctx.opset(node.domain)
        if domain == "" and opset < spec.since:
            return Support.no(
                f"the CUDA provider implements {node.op_type} from opset {spec.since}; the model imports "
                f"opset {opset}: convert it with onnx.version_converter.convert_version"
            )
        inputs = list(node.inputs)
        for role, value in [("input", v) for v in inputs] + [("output", v) for v in node.outputs]:
            if value is None:
                continue
            why = _dtype_problem(value, role)
            if why:
                return Support.no(f"{shown}: {why}")
        if spec.math:
            first = next((v for v in inputs if v is not None), None)
            dtype = _dtype_name(first)
            if dtype not in FLOAT_DTYPES and not (spec.integers and dtype in INTEGER_DTYPES):
                return Support.no(
                    f"{shown}: the CUDA provider computes float32 and float16 only; input "
                    f"{first.name if first is not None else '?'!r} is {dtype or 'of unknown type'}"
                )
        constants = [constant_array(v) if v is not None else None for v in inputs]
        missing = inputs_not_constant(spec, constants, [v is not None for v in inputs])
        if missing:
            names = ", ".join(repr(inputs[i].name) for i in missing)  # type: ignore[union-attr]
            return Support.no(
                f"{shown}: input {names} is computed at run time; the CUDA provider needs it constant "
                "(reading it from device memory would stall the stream and break capture)"
            )
        if spec.check is not None:
            why = spec.check(self._info(node, opset, constants, backend=None))
            if why:
                return Support.no(why)
        return Support.yes()

    def rewrite_model(self, model: ir.Model, options: Any) -> bool:
        """float16 decoding when the session asks for it (``cuda.float16_decoding``)."""
        from ._float16 import OPTION, to_float16

        try:
            wanted = bool(options[OPTION])
        except KeyError:  # a core that does not know the option
            return False
        return to_float16(model) if wanted else False

    # -- passes ------------------------------------------------------------------------

    def passes(self, model: "ir.Model") -> list:
        """This provider's own fusions (``_fusions``), run after placement on the nodes
        placed on it: SiLU as one kernel, Conv + Relu as one convolution."""
        from . import _fusions

        return _fusions.fusion_passes()

    # -- compile -----------------------------------------------------------------------

    def compile(self, partition: Partition) -> CompiledPartition:
        return self._compile(partition, self.backend())

    def _compile(self, partition: Partition, backend: Backend, verdict: str = "", restored: bool = False) -> CompiledPartition:
        if isinstance(backend, CupyBackend):
            # the partition's precision, from the session's options (``cuda.tf32``)
            options = getattr(partition, "options", None) or {}
            backend = backend.configured(tf32=bool(options.get("cuda.tf32", True)))
        steps = [self._bind(node, partition.opset_imports, backend) for node in partition.nodes]
        return CompiledPartition(partition, steps, self.name, restored=restored, state=CompiledState(backend, verdict))

    def _info(self, node: ir.Node, opset: int, constants: list, backend: Backend | None) -> OpInfo:
        attributes = {name: _attribute_value(attr) for name, attr in node.attributes.items()}
        outputs = list(node.outputs)
        while len(outputs) > 1 and outputs[-1] is None:
            outputs.pop()
        return OpInfo(attributes, constants, opset, len(node.inputs), len(outputs), backend)  # type: ignore[arg-type]

    def _bind(self, node: ir.Node, opset_imports: dict[str, int], backend: Backend) -> Step:
        from plugrt.ir_utils import constant_array

        domain = "" if node.domain in _ONNX_DOMAINS else node.domain
        spec = OPS.get((domain, node.op_type))
        opset = opset_imports.get(domain, 1 if domain else 0)
        label = node_label(node)
        if spec is None:
            raise UnsupportedOpError(
                domain, node.op_type, opset, node=label, providers_consulted=[self.name],
                reasons={self.name: "no CUDA kernel"},
            )
        inputs = list(node.inputs)
        while inputs and inputs[-1] is None:
            inputs.pop()
        constants = [constant_array(v) if v is not None else None for v in inputs]
        info = self._info(node, opset, constants, backend)
        fn = spec.builder(info)
        multi = spec.multi_output or bool(getattr(fn, "multi_output", False))
        if isinstance(backend, CupyBackend):
            fn = _on_stream(fn, backend)
        # Constant inputs (weights) are not uploaded here: the plan moves each to the device
        # once (shared by every session of a WeightStore) and passes it at run time.
        outputs: list[ir.Value | None] = [v for v in list(node.outputs)[: info.num_outputs]]
        return Step(fn, inputs, outputs, multi_output=multi, name=label, op_type=node.op_type, domain=domain, nodes=(label,))

    # -- memory (MemoryCapability) -----------------------------------------------------

    def _cupy(self) -> Any:
        return self.backend().xp

    def _on(self, device: Device | None) -> Any:
        return self._cupy().cuda.Device(device.index if device is not None else self.default_device.index)

    def allocate(self, shape: tuple[int, ...], dtype: Any, device: Device | None) -> Any:
        with self._on(device):
            return self._cupy().empty(tuple(shape), np.dtype(dtype))

    def to_device(self, array: Any, device: Device | None) -> Any:
        """A device copy of a host array, through pinned staging, asynchronous on the
        provider's stream; a CUDA array from another library (torch, JAX, anything with
        ``__cuda_array_interface__`` or ``__dlpack__``) is taken without a copy, its
        producer's work ordered before the provider's stream (DLPack's consumer stream)."""
        cp = self._cupy()
        if isinstance(array, cp.ndarray):
            return array
        backend = self.backend()
        if hasattr(array, "__cuda_array_interface__"):
            return cp.asarray(array)
        if hasattr(array, "__dlpack__") and not isinstance(array, np.ndarray):
            device_type = array.__dlpack_device__()[0] if hasattr(array, "__dlpack_device__") else None
            if device_type in (2, 3, 13):  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
                if isinstance(backend, CupyBackend):
                    with backend.stream:  # cupy passes the current stream as the consumer's
                        return cp.from_dlpack(array)
                return cp.from_dlpack(array)
        with self._on(device):
            host = np.ascontiguousarray(array)
            if isinstance(backend, CupyBackend):
                return backend.upload(host)
            return cp.asarray(host)

    def to_host(self, array: Any) -> np.ndarray:
        cp = self._cupy()
        if not isinstance(array, cp.ndarray):
            return np.asarray(array)
        backend = self.backend()
        if isinstance(backend, CupyBackend):
            return backend.download(array)
        return cp.asnumpy(array)

    def copy_into(self, source: Any, target: Any) -> None:
        cp = self._cupy()
        backend = self.backend()
        staged = isinstance(backend, CupyBackend)
        if isinstance(target, np.ndarray):
            np.copyto(target, backend.download(source) if staged else cp.asnumpy(source))  # type: ignore[attr-defined]
        elif isinstance(source, np.ndarray):
            if target.flags.c_contiguous and source.flags.c_contiguous:
                if staged:
                    backend.upload(source, out=target)  # type: ignore[attr-defined]
                else:
                    target.set(source)
            else:
                cp.copyto(target, cp.asarray(source))
        else:
            cp.copyto(target, source)

    def owns(self, array: Any) -> bool:
        return type(array).__module__.startswith("cupy") and hasattr(array, "data") and hasattr(array, "device")

    def allocated_bytes(self) -> int:
        return int(self._cupy().get_default_memory_pool().total_bytes())

    def from_pointer(self, pointer: int, shape: tuple[int, ...], dtype: Any, device: Device | None) -> Any:
        """A device array over caller-owned memory at ``pointer`` (onnxruntime's
        ``IOBinding.bind_input(name, "cuda", id, type, shape, ptr)``), without a copy."""
        from ._capture import wrap_pointer

        index = device.index if device is not None else self.default_device.index
        return wrap_pointer(self._cupy(), pointer, tuple(shape), dtype, index)

    # -- capture (CaptureCapability) ---------------------------------------------------

    #: Plain runs replay CUDA graphs (``graphs="auto"``): one launch per captured segment
    #: instead of one Python-dispatched launch per kernel.
    capture_plain_runs = True
    #: (rtol, atol) a graph's first replay is checked to against the eager run: graphs
    #: run the own GEMM where an eager run may call cuBLAS, which sums in another order.
    replay_tolerance = (1e-3, 1e-4)

    def count_allocations(self) -> Any:
        """A context manager counting blocks taken from cupy's memory pools on this thread
        while a replay runs (``session.capture_stats.sites``)."""
        from ._capture import NoAllocations, allocation_counter

        backend = self.backend()
        if not isinstance(backend, CupyBackend):  # another array module (numpy in tests): no pool to read
            return NoAllocations()
        return allocation_counter(backend.xp)

    def stream_error(self) -> str:
        """Why the current stream is in error after a replay; "" when it is not."""
        from ._capture import stream_error

        backend = self.backend()
        return stream_error(backend.xp) if isinstance(backend, CupyBackend) else ""

    def capture(self, compiled: CompiledPartition, ctx: CaptureContext) -> CapturedPartition | NotCapturable:
        from ._capture import capture_partition

        state = compiled.state
        if not isinstance(state, CompiledState) or not isinstance(state.backend, CupyBackend):
            return NotCapturable([(s.name, "CUDA graphs need the cupy backend") for s in compiled.steps])
        return capture_partition(compiled, ctx, state.backend)

    # -- EPContext (ContextCapability, ContextCompatibilityCapability) -----------------

    def save_context(self, compiled: CompiledPartition) -> bytes:
        state = compiled.state
        if not isinstance(state, CompiledState) or not isinstance(state.backend, CupyBackend):
            raise EpContextError(f"partition {compiled.partition.name!r} was not compiled by the CUDA provider on a GPU")
        found = self.probe()
        arch = self.architecture
        cubins = state.backend.compiled_cubins(arch)
        saved = _context.SavedContext(
            arch, found.driver_version, found.runtime_version, found.cupy_version, cubins,
            state.backend.cubins_nvrtc_version(),
        )
        return _context.dumps(saved)

    def check_context(self, meta: Mapping[str, Any]) -> Support:
        version = meta.get("ep_sdk_version")
        if version not in (None, "", _context.FORMAT):
            return Support.no(f"CUDA context format {version!r}; this plugrt-cuda {__version__} reads {_context.FORMAT!r}: re-export the model")
        return Support.yes()

    def load_context(self, blob: bytes, meta: Mapping[str, Any]) -> CompiledPartition:
        """Restore a partition: load the saved cubins when they fit this GPU and driver,
        else compile from source and say why in ``state.verdict``."""
        label = meta.get("partition_name", "?")
        partition = meta.get("partition")
        if not isinstance(partition, Partition):
            raise EpContextError("CUDA load_context needs meta['partition'], the Partition the context stands for")
        try:
            saved = _context.loads(blob)
        except ValueError as exc:
            raise EpContextError(f"CUDA context of partition {label!r} cannot be restored: {exc}") from exc
        found = self.probe()
        why = _context.verdict(saved, arch=self.architecture, driver_version=found.driver_version)
        if why is not None:
            return self._compile(partition, self.backend(), verdict=f"recompiled: {why}")
        backend = CupyBackend(self._importer(), saved.cubins, arch=self.architecture, cubins_nvrtc=saved.nvrtc_version)
        return self._compile(partition, backend, verdict="restored", restored=True)


def _on_stream(fn: Callable[..., Any], backend: CupyBackend) -> Callable[..., Any]:
    """``fn`` run on the provider's own stream when the caller left the default one current;
    under a capture (or a stream the caller chose) it runs where it is called."""
    current = backend.xp.cuda.get_current_stream

    def run(*args: Any) -> Any:
        if current().ptr != 0:
            return fn(*args)
        with backend.stream:
            return fn(*args)

    if hasattr(fn, "multi_output"):  # what the core reads off a kernel
        run.multi_output = fn.multi_output  # type: ignore[attr-defined]
    if getattr(fn, "into", None) is not None:
        run.into = _on_stream(fn.into, backend)  # type: ignore[attr-defined]
    run.__wrapped__ = fn  # type: ignore[attr-defined]
    return run


def _dtype_name(value: ir.Value | None) -> str | None:
    import onnx_ir as ir

    if value is None or not isinstance(value.type, ir.TensorType) or value.dtype is None:
        return None
    try:
        return np.dtype(value.dtype.numpy()).name
    except Exception:
        return value.dtype.name.lower()


def _dtype_problem(value: ir.Value, role: str) -> str | None:
    import onnx_ir as ir

    if value.type is not None and not isinstance(value.type, ir.TensorType):
        return f"{role} {value.name!r} is a {type(value.type).__name__}, the CUDA provider takes tensors only"
    if value.dtype is None:
        return None  # unknown until run time: the kernels check what arrives
    if _dtype_name(value) not in _DEVICE_DTYPES:
        return (
            f"{role} {value.name!r} is {value.dtype.name.lower()}, which the CUDA provider does not hold on the device "
            f"(it holds {', '.join(sorted(_DEVICE_DTYPES))})"
        )
    return None


def _attribute_value(attr: ir.Attr) -> Any:
    import onnx_ir as ir

    """An attribute as a builder receives it (Python numbers, strings, lists, numpy arrays)."""
    kind, value = attr.type, attr.value
    if kind in (ir.AttributeType.FLOAT, ir.AttributeType.INT):
        return float(value) if kind == ir.AttributeType.FLOAT else int(value)
    if kind == ir.AttributeType.STRING:
        return value.decode("utf-8") if isinstance(value, bytes) else value
    if kind in (ir.AttributeType.FLOATS, ir.AttributeType.INTS):
        return [float(v) if kind == ir.AttributeType.FLOATS else int(v) for v in value]
    if kind == ir.AttributeType.TENSOR:
        return value.numpy()
    return value
