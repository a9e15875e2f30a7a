"""The array backend a compiled partition runs on: cupy with the provider's own CUDA kernels,
or numpy (the same kernel math on the host, which is how the provider is tested without a GPU)."""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from typing import Any, Iterator

from . import _sources, _xp

__all__ = ["Backend", "NumpyBackend", "CupyBackend", "GEMM_ENV"]

#: "auto" (cuBLASLt on the provider's own handle, eager and under capture; where it cannot
#: be loaded, cupy's cuBLAS eager and the own GEMM under capture), "cublaslt" (cuBLASLt, an
#: error where it is absent), "own" (always the own 64x64-tile GEMM, so eager runs and graph
#: replays are bitwise equal) or "cublas" (cupy's cuBLAS wrappers, never captured).
GEMM_ENV = "PLUGRT_CUDA_GEMM"
_GEMM_ENGINES = ("auto", "cublaslt", "own", "cublas")
#: the dtypes cuBLASLt computes here (float64 and the integers go to cupy's matmul)
_LT_DTYPES = ("float32", "float16")


class Backend:
    """What kernels call: ``xp`` and the operations that have a faster device form."""

    xp: Any
    name = "base"

    def matmul(self, a: Any, b: Any) -> Any:
        return self.xp.matmul(a, b)

    def conv(self, x: Any, w: Any, b: Any, relu: bool, attributes: dict, residual: Any = None) -> Any:
        y = _xp.conv(self.xp, x, w, b, matmul=self.matmul, **attributes)
        if residual is not None:
            y = y + residual
        return self.xp.maximum(y, 0, out=y) if relu else y

    def pool(self, x: Any, mode: str, attributes: dict) -> Any:
        return _xp.pool(self.xp, x, mode, **attributes)

    def softmax(self, x: Any, axis: int, coerce_2d: bool, log: bool) -> Any:
        fn = _xp.log_softmax if log else _xp.softmax
        return fn(self.xp, x, axis=axis, coerce_2d=coerce_2d)

    def layer_normalization(self, x: Any, scale: Any, bias: Any, axis: int, epsilon: float) -> tuple:
        return _xp.layer_normalization(self.xp, x, scale, bias, axis=axis, epsilon=epsilon)


class NumpyBackend(Backend):
    name = "numpy"

    def __init__(self) -> None:
        import numpy

        self.xp = numpy


class CupyBackend(Backend):
    """cupy arrays; the 2-D convolution, pooling, row softmax/layernorm and GEMM run the
    provider's own kernels (sources in ``_sources``), compiled once per dtype and module."""

    name = "cupy"

    def __init__(
        self, cupy: Any, cubins: dict[tuple[str, str], bytes] | None = None, arch: str = "", cubins_nvrtc: int = 0
    ) -> None:
        self.xp = cupy
        self.arch = arch  # "sm_90": modules are compiled for it with NVRTC (cached), else by cupy
        self._cubins = dict(cubins or {})  # (module, dtype) -> cubin for this device (EPContext)
        self._cubins_nvrtc = cubins_nvrtc  # the NVRTC version that built ``cubins``
        self._warming = 0  # > 0 while a capture's warm-up runs the steps as they will be recorded
        self._modules: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()
        engine = os.environ.get(GEMM_ENV, "auto").strip().lower() or "auto"
        if engine not in _GEMM_ENGINES:
            from plugrt.errors import InvalidOptionValueError

            raise InvalidOptionValueError(GEMM_ENV, engine, ", ".join(_GEMM_ENGINES))
        self.gemm_engine = engine
        #: float32 GEMMs and convolutions on TF32 tensor cores (the ``cuda.tf32`` option);
        #: per partition: ``configured`` makes a view with its own value
        self.tf32 = True
        # what every view of this backend shares: the cuBLASLt handle and its plans, the
        # cuDNN convolutions, the provider's stream, workspaces and pinned staging buffers
        self._shared: dict[str, Any] = {"lt": None, "lt_reason": None, "workspaces": {}, "stream": None,
                                        "cudnn": None, "pinned": {}}
        self.loaded_from_cubin: set[tuple[str, str]] = set()
        self.cubins_refused: dict[tuple[str, str], str] = {}  # module -> why the driver refused its cubin

    def configured(self, *, tf32: bool) -> CupyBackend:
        """A view of this backend with its own precision settings, sharing every compiled
        module, library handle, plan and buffer (one per partition, by its options)."""
        if tf32 == self.tf32:
            return self
        view = copy.copy(self)
        view.tf32 = tf32
        view._warming = 0
        return view

    # -- libraries, stream, workspaces -------------------------------------------------

    def lt(self) -> Any:
        """The provider-owned cuBLASLt (``_cublas.Lt``), loaded on first use; None when it
        cannot be (``lt_reason`` says why), unless PLUGRT_CUDA_GEMM=cublaslt asks for it."""
        shared = self._shared
        if shared["lt"] is None and shared["lt_reason"] is None:
            with self._lock:
                if shared["lt"] is None and shared["lt_reason"] is None:
                    from . import _cublas

                    try:
                        major = int(self.xp.cuda.runtime.runtimeGetVersion()) // 1000
                        majors = (major,) if major in (12, 13) else (13, 12)
                        shared["lt"] = _cublas.Lt.load(majors)
                    except Exception as exc:  # no library, or one without the symbols
                        shared["lt_reason"] = f"{type(exc).__name__}: {exc}"
        if shared["lt"] is None and self.gemm_engine == "cublaslt":
            from plugrt.errors import ProviderUnavailableError

            raise ProviderUnavailableError("cuda", f"{GEMM_ENV}=cublaslt, but cuBLASLt cannot be used: {shared['lt_reason']}")
        return shared["lt"]

    @property
    def lt_reason(self) -> str | None:
        return self._shared["lt_reason"]

    @property
    def stream(self) -> Any:
        """The provider's own stream: every kernel, library call and copy of a plain run goes
        on it. Blocking (not ``non_blocking``): it stays ordered with the legacy default
        stream other libraries use, so arrays they hand over need no explicit event."""
        found = self._shared["stream"]
        if found is None:
            with self._lock:
                found = self._shared["stream"]
                if found is None:
                    found = self._shared["stream"] = self.xp.cuda.Stream(non_blocking=False)
        return found

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """Make the provider's stream current unless another non-default stream already is
        (a capture's, or one the caller chose): then work stays on that one."""
        if self.xp.cuda.get_current_stream().ptr != 0:
            yield
            return
        with self.stream:
            yield

    def workspace(self, stream: Any) -> int:
        """The device address of ``stream``'s cuBLASLt workspace, allocated on first use.
        A capture asks for its stream's before recording, so a recorded GEMM never
        allocates; each stream has its own, so GEMMs on two streams never share one."""
        from ._cublas import WORKSPACE_BYTES

        spaces = self._shared["workspaces"]
        found = spaces.get(stream.ptr)
        if found is None:
            with self._lock:
                found = spaces.get(stream.ptr)
                if found is None:
                    # the stream is kept with its buffer: its address is never reused while here
                    found = spaces[stream.ptr] = (stream, self.xp.empty(WORKSPACE_BYTES, self.xp.uint8))
        return _address(found[1])

    def _copy_stream(self) -> Any:
        current = self.xp.cuda.get_current_stream()
        return self.stream if current.ptr == 0 else current

    def _pinned(self, nbytes: int, stream: Any) -> Any:
        """A pinned host buffer of ``nbytes``, kept referenced (with an event recorded on
        ``stream`` after the copy that uses it) until that copy has finished."""
        cp = self.xp
        pending: list = self._shared["pinned"].setdefault("pending", [])
        while pending and pending[0][0].done:  # copies finish in order on one stream
            pending.pop(0)
        memory = cp.cuda.alloc_pinned_memory(nbytes)
        event = cp.cuda.Event(block=False, disable_timing=True)
        pending.append((event, memory))
        return memory, event

    def upload(self, host: Any, out: Any = None) -> Any:
        """``host`` (a C-contiguous numpy array) copied to the device through pinned staging,
        asynchronously on the provider's stream (or the current one when a caller chose it):
        later work on that stream sees the data, and the host array may change at once."""
        import numpy

        cp = self.xp
        out = cp.empty(host.shape, host.dtype) if out is None else out
        if host.nbytes == 0:
            return out
        stream = self._copy_stream()
        memory, event = self._pinned(host.nbytes, stream)
        staging = numpy.frombuffer(memory, dtype=host.dtype, count=host.size).reshape(host.shape)
        staging[...] = host
        out.set(staging, stream=stream)
        event.record(stream)
        return out

    def download(self, array: Any) -> Any:
        """A host copy of ``array``: an asynchronous copy on the provider's stream (so it
        follows every kernel queued there) into pinned memory, then that stream is waited
        for, so the result is complete when returned."""
        import numpy

        cp = self.xp
        array = cp.ascontiguousarray(array)
        if array.nbytes == 0:
            return numpy.empty(array.shape, array.dtype)
        stream = self._copy_stream()
        memory = cp.cuda.alloc_pinned_memory(array.nbytes)
        host = numpy.frombuffer(memory, dtype=array.dtype, count=array.size).reshape(array.shape)
        array.get(stream=stream, out=host)
        stream.synchronize()
        return host

    def synchronize(self) -> None:
        """Wait for the provider's stream (a capture orders its recording after it)."""
        if self._shared["stream"] is not None:
            self._shared["stream"].synchronize()

    def prepare_capture(self, stream: Any) -> None:
        """Before recording on ``stream``: its cuBLASLt workspace, when cuBLASLt is in use."""
        if self._shared["lt"] is not None:
            self.workspace(stream)

    def release_workspace(self, stream: Any) -> None:
        """Forget ``stream``'s workspace (a capture's stream, once its graph is gone)."""
        self._shared["workspaces"].pop(getattr(stream, "ptr", None), None)

    # -- modules -----------------------------------------------------------------------

    def kernel(self, module: str, dtype: Any, name: str) -> Any:
        key = (module, self.xp.dtype(dtype).name)
        found = self._modules.get(key)
        if found is None:
            with self._lock:
                found = self._modules.get(key)
                if found is None:
                    found = self._load(key)
                    self._modules[key] = found
        return found.get_function(name)

    def _load(self, key: tuple[str, str]) -> Any:
        cubin = self._cubins.get(key)
        restored = cubin is not None
        if cubin is None and self.arch:
            # one NVRTC compile per (source, dtype, architecture), shared with save_context
            cubin = _sources.compile_cubin(key[0], key[1], self.arch)
        if cubin is not None:
            try:
                module = self.xp.cuda.function.Module()
                module.load(cubin)
            except Exception as exc:
                # the driver refused the cubin (one built by a newer CUDA than it runs, say):
                # cupy compiles the source its own way instead, and the reason is kept
                self.cubins_refused[key] = f"{type(exc).__name__}: {exc}"
            else:
                if restored:
                    self.loaded_from_cubin.add(key)
                return module
        return self.xp.RawModule(code=_sources.module_source(*key), options=("-std=c++14",))

    def compiled_cubins(self, arch: str) -> dict[tuple[str, str], bytes]:
        """Cubins of every module used so far, for ``arch`` (what an EPContext stores);
        each is compiled at most once per process (``_sources.compile_cubin`` caches)."""
        return {key: self._cubins.get(key) or _sources.compile_cubin(key[0], key[1], arch) for key in self._modules}

    def cubins_nvrtc_version(self) -> int:
        """The NVRTC version (13020 for 13.2) an EPContext of ``compiled_cubins`` records:
        the newer of the restored cubins' and this process's NVRTC, which compiles the rest."""
        if self._modules.keys() <= self._cubins.keys():
            return self._cubins_nvrtc
        major, minor = _sources.nvrtc_version()
        return max(self._cubins_nvrtc, major * 1000 + minor * 10)

    # -- capture -----------------------------------------------------------------------

    @contextlib.contextmanager
    def warming_for_capture(self) -> Iterator[None]:
        """Run steps outside a capture as they will run inside one (the own GEMM instead
        of cuBLAS), so every kernel the recording launches is compiled and loaded first."""
        self._warming += 1
        try:
            yield
        finally:
            self._warming -= 1

    # -- operations --------------------------------------------------------------------

    def _capturing(self) -> bool:
        return self._warming > 0 or bool(self.xp.cuda.get_current_stream().is_capturing())

    def matmul(self, a: Any, b: Any) -> Any:
        engine = self.gemm_engine
        if engine in ("auto", "cublaslt"):
            y = self.lt_gemm(a, b)
            if y is not None:
                return y
        if engine == "cublas" or (engine == "auto" and not self._capturing()):
            return self.xp.matmul(a, b)
        return self.gemm(a, b)

    def lt_gemm(self, a: Any, b: Any, bias: Any = None, relu: bool = False, alpha: float = 1.0) -> Any:
        """``alpha * a @ b`` (+ bias over the last axis) (relu) through cuBLASLt on the
        current stream, numpy's matmul broadcasting over leading axes; None when cuBLASLt is
        not loaded or the operands are not float32/float16 matrices (the caller decides)."""
        cp = self.xp
        if a.ndim < 2 or b.ndim < 2:
            return None
        dtype = cp.result_type(a, b)
        if dtype.name not in _LT_DTYPES:
            return None
        lt = self.lt()
        if lt is None:
            return None
        from . import _cublas

        batch, m, k, n, count, (a_data, a_trans, lda, a_stride), (b_data, b_trans, ldb, b_stride) = _gemm_operands(
            cp, a, b, dtype
        )
        out = cp.empty(batch + (m, n), dtype)
        if count == 0 or m == 0 or n == 0:
            return out
        if k == 0:
            out.fill(0)
            out = out if bias is None else out + bias
            return cp.maximum(out, 0, out=out) if relu else out
        rows, gemm_batch = m, count
        if count > 1 and b_stride == 0 and not a_trans and a_stride == m * k:
            # a stack of row-major A against one B is one taller GEMM: (count*m, k) @ (k, n)
            rows, gemm_batch, a_stride = count * m, 1, 0
        bias_arg = cp.ascontiguousarray(bias, dtype=dtype).reshape(-1) if bias is not None else None
        if bias_arg is not None and bias_arg.size != n:
            bias_arg = None  # not a vector over the last axis: added afterwards
        a_ptr, b_ptr, out_ptr = _address(a_data), _address(b_data), _address(out)
        bias_ptr = _address(bias_arg) if bias_arg is not None else 0
        pointers = [a_ptr, b_ptr, out_ptr] + ([bias_ptr] if bias_arg is not None else [])
        shape = _cublas.shape_of(
            rows, n, k, dtype.name, a_trans=bool(a_trans), b_trans=bool(b_trans), lda=lda, ldb=ldb, batch=gemm_batch,
            a_stride=a_stride, b_stride=b_stride, bias=bias_arg is not None, relu=relu and (bias is None or bias_arg is not None),
            tf32=self.tf32, pointers=pointers, itemsize=dtype.itemsize,
        )
        refused = self._shared.setdefault("lt_refused", {})
        if shape in refused:
            return None
        stream = cp.cuda.get_current_stream()
        try:
            lt.matmul(shape, a_ptr, b_ptr, out_ptr, stream=stream.ptr, workspace=self.workspace(stream), alpha=alpha,
                      bias_ptr=bias_ptr)
        except _cublas.CublasError as exc:
            if exc.status not in _cublas.FALLBACK_STATUSES:
                raise
            # no algorithm for this shape and alignment (an odd float16 leading dimension, say):
            # the caller's other engine runs it, now and on every later call
            refused[shape] = str(exc)
            return None
        if bias is not None and bias_arg is None:
            out += bias
            if relu:
                cp.maximum(out, 0, out=out)
        return out

    def gemm(self, a: Any, b: Any, bias: Any = None, alpha: float = 1.0) -> Any:
        """alpha * a @ b (+ bias over the last axis) with the own kernel, numpy's matmul
        broadcasting over leading axes. A 2-D operand is shared by every batch (stride 0)
        and a transposed 2-D view is read in place (a Gemm's transB weight is never copied)."""
        cp = self.xp
        dtype = cp.result_type(a, b)
        if dtype.name not in _sources.DTYPES or a.ndim < 2 or b.ndim < 2:
            return cp.matmul(a, b)  # vectors and other dtypes: cupy's own (never captured as GEMM)
        batch, m, k, n, count, (a_data, a_trans, lda, a_stride), (b_data, b_trans, ldb, b_stride) = _gemm_operands(
            cp, a, b, dtype
        )
        out = cp.empty(batch + (m, n), dtype)
        if count == 0 or m == 0 or n == 0:
            return out
        if k == 0:
            out.fill(0)
            return out if bias is None else out + bias
        fn = self.kernel("gemm", dtype, "gemm")
        grid = ((n + 63) // 64, (m + 63) // 64, count)
        bias_arg = cp.ascontiguousarray(bias, dtype=dtype) if bias is not None else out
        args = (a_data, b_data, out, bias_arg, cp.int32(m), cp.int32(n), cp.int32(k), cp.int32(lda), cp.int32(ldb),
                cp.int32(n), cp.int32(a_trans), cp.int32(b_trans), cp.int64(a_stride), cp.int64(b_stride),
                cp.int64(m * n), cp.float32(alpha), cp.int32(bias is not None))
        fn(grid, (256,), args)
        return out

    def cudnn(self) -> Any:
        """The shared ``_cudnn.Cudnn`` (its ``unavailable_reason`` says when it cannot run)."""
        found = self._shared["cudnn"]
        if found is None:
            with self._lock:
                found = self._shared["cudnn"]
                if found is None:
                    from ._cudnn import Cudnn

                    found = self._shared["cudnn"] = Cudnn(self.xp)
        return found

    def conv_plan(self, x_shape: tuple, w_shape: tuple, dtype: str, attributes: dict, residual: bool = False) -> Any:
        """The engine for this convolution and why (``_conv.plan_conv``); each distinct plan
        is kept in ``conv_notes`` for the provider's notes."""
        notes = self._shared.setdefault("conv_notes", {})
        key = (tuple(x_shape), tuple(w_shape), dtype, tuple(sorted((k, str(v)) for k, v in attributes.items())), residual)
        found = notes.get(key)
        if found is not None:
            return found
        from ._conv import plan_conv

        if self.gemm_engine in ("auto", "cublaslt"):
            gemm_reason = None if self.lt() is not None else f"cuBLASLt cannot be used: {self.lt_reason}"
        else:
            gemm_reason = f"{GEMM_ENV}={self.gemm_engine}"
        plan = plan_conv(x_shape, w_shape, dtype, attributes, cudnn_reason=self.cudnn().unavailable_reason,
                         gemm_reason=gemm_reason, residual=residual)
        notes[key] = plan
        return plan

    def conv(self, x: Any, w: Any, b: Any, relu: bool, attributes: dict, residual: Any = None) -> Any:
        from . import _conv

        cp = self.xp
        if w.dtype != x.dtype:
            return super().conv(x, w, b, relu, attributes, residual)
        plan = self.conv_plan(tuple(x.shape), tuple(w.shape), x.dtype.name, attributes, residual is not None)
        if plan.engine == _conv.GENERIC:
            return super().conv(x, w, b, relu, attributes, residual)
        n, c, h, wd = x.shape
        m, cg, kh, kw = w.shape
        group = int(attributes.get("group", 1))
        strides = list(attributes.get("strides") or [1, 1])
        dilations = list(attributes.get("dilations") or [1, 1])
        begin, end, (oh, ow) = _xp.conv_pads(
            (h, wd), (kh, kw), strides, dilations, attributes.get("pads"), attributes.get("auto_pad", "NOTSET")
        )
        x = cp.ascontiguousarray(x)
        if plan.engine == _conv.CUDNN:
            from ._cudnn import ConvKey

            key = ConvKey(tuple(x.shape), tuple(w.shape), x.dtype.name, (begin[0], begin[1]), (end[0], end[1]),
                          (strides[0], strides[1]), (dilations[0], dilations[1]), group, b is not None,
                          residual is not None, relu, self.tf32)
            return self.cudnn().conv(
                key, x, cp.ascontiguousarray(w), cp.ascontiguousarray(b) if b is not None else None,
                cp.ascontiguousarray(residual) if residual is not None else None,
            )
        if plan.engine == _conv.GEMM_1X1:
            # y[i] = W (m, c) @ x[i] (c, h*w): the weight shared by every image, no im2col
            y = self.matmul(w.reshape(m, c), x.reshape(n, c, h * wd)).reshape(n, m, oh, ow)
            return self._conv_epilogue(y, b, relu, residual)
        geometry = [h, wd, kh, kw, oh, ow, strides[0], strides[1], begin[0], begin[1], dilations[0], dilations[1]]
        if plan.engine == _conv.DEPTHWISE:
            y = cp.empty((n, m, oh, ow), x.dtype)
            fn = self.kernel("depthwise", x.dtype, "depthwise_conv2d")
            total = y.size
            bias = cp.ascontiguousarray(b, dtype=x.dtype) if b is not None else y
            fused_relu = relu and residual is None
            fn(_grid(total), (256,), (x, cp.ascontiguousarray(w), bias, y, cp.int32(n), cp.int32(c),
                                      *[cp.int32(v) for v in geometry], cp.int32(b is not None), cp.int32(fused_relu)))
            return self._conv_epilogue(y, None, relu and not fused_relu, residual)
        cols = cp.empty((n, c * kh * kw, oh * ow), x.dtype)
        fn = self.kernel("im2col", x.dtype, "im2col2d")
        fn(_grid(cols.size), (256,), (x, cols, cp.int32(n), cp.int32(c), *[cp.int32(v) for v in geometry]))
        if group == 1:  # one weight matrix for every image: the GEMM reads it with batch stride 0
            y = self.matmul(w.reshape(m, cg * kh * kw), cols).reshape(n, m, oh, ow)
        else:
            cols = cols.reshape(n, group, (c // group) * kh * kw, oh * ow)
            y = self.matmul(w.reshape(group, m // group, cg * kh * kw), cols).reshape(n, m, oh, ow)
        return self._conv_epilogue(y, b, relu, residual)

    def _conv_epilogue(self, y: Any, b: Any, relu: bool, residual: Any) -> Any:
        cp = self.xp
        if b is not None:
            y += b.reshape(1, -1, 1, 1)
        if residual is not None:
            y += residual
        return cp.maximum(y, 0, out=y) if relu else y

    def pool(self, x: Any, mode: str, attributes: dict) -> Any:
        cp = self.xp
        if x.ndim != 4 or x.dtype.name not in _sources.DTYPES:
            return super().pool(x, mode, attributes)
        n, c, h, wd = x.shape
        kernel = list(attributes["kernel_shape"])
        strides = list(attributes.get("strides") or [1, 1])
        dilations = list(attributes.get("dilations") or [1, 1])
        begin, end, (oh, ow) = _xp.conv_pads(
            (h, wd), kernel, strides, dilations, attributes.get("pads"), attributes.get("auto_pad", "NOTSET"),
            bool(attributes.get("ceil_mode", 0)),
        )
        code = 0 if mode == "max" else (2 if attributes.get("count_include_pad", 0) else 1)
        y = cp.empty((n, c, oh, ow), x.dtype)
        fn = self.kernel("pool", x.dtype, "pool2d")
        args = [n, c, h, wd, kernel[0], kernel[1], oh, ow, strides[0], strides[1], begin[0], begin[1], end[0], end[1],
                dilations[0], dilations[1], code]
        fn(_grid(y.size), (256,), (cp.ascontiguousarray(x), y, *[cp.int32(v) for v in args]))
        return y

    def softmax(self, x: Any, axis: int, coerce_2d: bool, log: bool) -> Any:
        cp = self.xp
        if x.dtype.name not in _sources.DTYPES or x.size == 0 or (axis % x.ndim != x.ndim - 1 and not coerce_2d):
            return super().softmax(x, axis, coerce_2d, log)
        cols = 1
        for d in x.shape[axis % x.ndim :]:
            cols *= d
        x = cp.ascontiguousarray(x)
        y = cp.empty_like(x)
        self.kernel("softmax", x.dtype, "softmax_rows")((x.size // cols,), (256,), (x, y, cp.int32(cols), cp.int32(log)))
        return y

    def layer_normalization(self, x: Any, scale: Any, bias: Any, axis: int, epsilon: float) -> tuple:
        cp = self.xp
        if x.dtype.name not in _sources.DTYPES or x.size == 0:
            return super().layer_normalization(x, scale, bias, axis, epsilon)
        axis = axis % x.ndim
        cols = 1
        for d in x.shape[axis:]:
            cols *= d
        rows = x.size // cols
        x = cp.ascontiguousarray(x)
        y = cp.empty_like(x)
        stats_shape = x.shape[:axis] + (1,) * (x.ndim - axis)
        mean = cp.empty(stats_shape, cp.float32)
        inv_std = cp.empty(stats_shape, cp.float32)
        scale = cp.ascontiguousarray(cp.broadcast_to(scale, x.shape[axis:]), dtype=x.dtype)
        bias_arg = cp.ascontiguousarray(cp.broadcast_to(bias, x.shape[axis:]), dtype=x.dtype) if bias is not None else y
        self.kernel("layernorm", x.dtype, "layernorm_rows")(
            (rows,), (256,),
            (x, scale, bias_arg, y, mean, inv_std, cp.int32(cols), cp.float32(epsilon), cp.int32(bias is not None)),
        )
        return y, mean, inv_std


def _gemm_operands(cp: Any, a: Any, b: Any, dtype: Any) -> tuple:
    """(batch shape, m, k, n, GEMMs in the batch, A's and B's :func:`_operand`) of ``a @ b``
    with numpy's broadcasting over the leading axes."""
    batch = tuple(cp.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    m, k = a.shape[-2:]
    count = 1
    for d in batch:
        count *= d
    return batch, m, k, b.shape[-1], count, _operand(cp, a, batch, dtype), _operand(cp, b, batch, dtype)


def _operand(cp: Any, x: Any, batch: tuple, dtype: Any) -> tuple[Any, int, int, int]:
    """(data, transposed, leading dimension, batch stride) of a GEMM operand for the kernel."""
    rows, cols = x.shape[-2:]
    if x.ndim == 2 and x.dtype == dtype:
        if x.flags.c_contiguous:
            return x, 0, cols, 0
        if x.T.flags.c_contiguous:  # a transposed view: read the stored (cols, rows) matrix
            return x.T, 1, rows, 0
    if x.ndim == 2:
        return cp.ascontiguousarray(x, dtype=dtype), 0, cols, 0
    if tuple(x.shape[:-2]) != batch:
        x = cp.broadcast_to(x, batch + (rows, cols))
    return cp.ascontiguousarray(x, dtype=dtype), 0, cols, rows * cols


def _address(x: Any) -> int:
    """The device address of a cupy array's first element (a numpy array's host address,
    where tests stand numpy in for cupy)."""
    data = x.data
    return int(data.ptr) if hasattr(data, "ptr") else int(x.__array_interface__["data"][0])


def _grid(total: int) -> tuple[int]:
    return (max(1, min((total + 255) // 256, 65535 * 8)),)
