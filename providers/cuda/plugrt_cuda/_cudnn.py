"""Convolutions through cuDNN 9's graph API, by NVIDIA's Python frontend
(``nvidia-cudnn-frontend``, module ``cudnn``), when it is installed.

One graph per convolution shape: the convolution, then the bias add, the residual add and
the ReLU as pointwise nodes cuDNN fuses into the same kernel. Its execution plan is built
on the first call (a warm-up before any capture runs it), then every call (eager, or being
recorded into a CUDA graph) only sets the handle's stream and launches the plan with a
workspace allocated at plan time.

Nothing is imported until a convolution asks: ``import plugrt_cuda`` stays light, and where
the frontend is missing ``unavailable_reason`` says so and the convolutions fall back.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
from typing import Any, Callable

__all__ = ["ConvKey", "Cudnn", "FRONTEND_PACKAGE", "import_frontend"]

FRONTEND_PACKAGE = "nvidia-cudnn-frontend"


def import_frontend() -> Any:
    return importlib.import_module("cudnn")


@dataclasses.dataclass(frozen=True)
class ConvKey:
    """What a cuDNN convolution graph is built for."""

    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    dtype: str
    pre_padding: tuple[int, int]
    post_padding: tuple[int, int]
    strides: tuple[int, int]
    dilations: tuple[int, int]
    group: int
    bias: bool
    residual: bool
    relu: bool
    tf32: bool


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return list(reversed(strides))


class Cudnn:
    """A cuDNN handle and the convolution graphs built on it."""

    def __init__(self, cp: Any, importer: Callable[[], Any] | None = None):
        self.cp = cp
        self.unavailable_reason: str | None = None
        self._cudnn: Any = None
        self._handle: Any = None
        self._graphs: dict[ConvKey, tuple[Any, dict[str, Any], Any]] = {}
        self._lock = threading.Lock()
        try:
            self._cudnn = (importer or import_frontend)()
        except ImportError as exc:
            self.unavailable_reason = (
                f"{FRONTEND_PACKAGE} is not installed ({exc}); pip install {FRONTEND_PACKAGE} to run convolutions "
                "through cuDNN"
            )
        except Exception as exc:  # a frontend whose cuDNN library does not load
            self.unavailable_reason = f"{FRONTEND_PACKAGE} failed to import ({type(exc).__name__}: {exc})"

    @property
    def available(self) -> bool:
        return self.unavailable_reason is None

    def handle(self) -> Any:
        if self._handle is None:
            self._handle = self._cudnn.create_handle()
        return self._handle

    def _data_type(self, dtype: str) -> Any:
        types = self._cudnn.data_type
        return types.HALF if dtype == "float16" else types.FLOAT

    def build(self, key: ConvKey) -> tuple[Any, dict[str, Any], Any]:
        """The graph, its tensors by role and its workspace for ``key`` (built once)."""
        found = self._graphs.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._graphs.get(key)
            if found is None:
                found = self._graphs[key] = self._build(key)
        return found

    def _build(self, key: ConvKey) -> tuple[Any, dict[str, Any], Any]:
        cudnn, cp = self._cudnn, self.cp
        io = self._data_type(key.dtype)
        graph = cudnn.pygraph(
            io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT,
            handle=self.handle(),
        )
        m = key.w_shape[0]
        x = graph.tensor(name="X", dim=list(key.x_shape), stride=_contiguous_strides(key.x_shape), data_type=io)
        w = graph.tensor(name="W", dim=list(key.w_shape), stride=_contiguous_strides(key.w_shape), data_type=io)
        tensors: dict[str, Any] = {"x": x, "w": w}
        y = graph.conv_fprop(
            image=x, weight=w, pre_padding=list(key.pre_padding), post_padding=list(key.post_padding),
            stride=list(key.strides), dilation=list(key.dilations), compute_data_type=cudnn.data_type.FLOAT,
        )
        if key.bias:
            tensors["b"] = graph.tensor(name="B", dim=[1, m, 1, 1], stride=[m, 1, 1, 1], data_type=io)
            y = graph.add(a=y, b=tensors["b"], compute_data_type=cudnn.data_type.FLOAT)
        if key.residual:  # a tensor of the output's shape, added before the activation
            out_shape = self.output_shape(key)
            tensors["r"] = graph.tensor(name="R", dim=list(out_shape), stride=_contiguous_strides(out_shape), data_type=io)
            y = graph.add(a=y, b=tensors["r"], compute_data_type=cudnn.data_type.FLOAT)
        if key.relu:
            y = graph.relu(input=y, compute_data_type=cudnn.data_type.FLOAT)
        y.set_output(True).set_data_type(io)
        tensors["y"] = y
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        if key.dtype == "float32" and not key.tf32:
            # exact FP32: no plan that rounds the inputs to TF32 on tensor cores
            graph.deselect_numeric_notes([cudnn.numerical_note.TENSOR_CORE])
        graph.check_support()
        graph.build_plans()
        size = int(graph.get_workspace_size())
        workspace = cp.empty(max(size, 1), cp.uint8)  # before any capture: a replay never allocates
        return graph, tensors, workspace

    @staticmethod
    def output_shape(key: ConvKey) -> tuple[int, int, int, int]:
        n, _, h, w = key.x_shape
        m, _, kh, kw = key.w_shape
        out = []
        for size, k, s, d, b, e in zip((h, w), (kh, kw), key.strides, key.dilations, key.pre_padding, key.post_padding):
            out.append((size + b + e - ((k - 1) * d + 1)) // s + 1)
        return (n, m, out[0], out[1])

    def conv(self, key: ConvKey, x: Any, w: Any, b: Any = None, residual: Any = None) -> Any:
        """Run the graph of ``key`` on the current stream; returns the new output array."""
        cp = self.cp
        graph, tensors, workspace = self.build(key)
        from ._backend import _address

        y = cp.empty(self.output_shape(key), x.dtype)
        # bare device addresses: an array would be read through DLPack, whose producer-side
        # stream synchronisation touches the legacy stream, which a capture must not
        pack = {tensors["x"]: _address(x), tensors["w"]: _address(w), tensors["y"]: _address(y)}
        if key.bias:
            pack[tensors["b"]] = _address(b)
        if key.residual:
            pack[tensors["r"]] = _address(residual)
        handle = self.handle()
        # the handle's stream is the one being run or recorded now, set before every call
        self._cudnn.set_stream(handle, cp.cuda.get_current_stream().ptr)
        graph.execute(pack, _address(workspace), handle=handle)
        return y
