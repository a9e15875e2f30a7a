"""The array backend a compiled partition runs on: cupy with the provider's own CUDA kernels,
or numpy (the same kernel math on the host, which is how the provider is tested without a GPU)."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator

from . import _sources, _xp

__all__ = ["Backend", "NumpyBackend", "CupyBackend", "GEMM_ENV"]

#: "auto" (cuBLAS when eager, the own GEMM under capture), "own" (always the own GEMM, so
#: eager runs and graph replays are bitwise equal) or "cublas" (never captured). The default
#: is provisional until measured on a GPU.
GEMM_ENV = "PLUGRT_CUDA_GEMM"
_GEMM_ENGINES = ("auto", "own", "cublas")


class Backend:
    """What kernels call: ``xp`` and the operations that have a faster device form."""

    xp: Any
    name = "base"

    def matmul(self, a: Any, b: Any) -> Any:
        return self.xp.matmul(a, b)

    def conv(self, x: Any, w: Any, b: Any, relu: bool, attributes: dict) -> Any:
        y = _xp.conv(self.xp, x, w, b, matmul=self.matmul, **attributes)
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
        self.loaded_from_cubin: set[tuple[str, str]] = set()
        self.cubins_refused: dict[tuple[str, str], str] = {}  # module -> why the driver refused its cubin

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
        if self.gemm_engine == "cublas" or (self.gemm_engine == "auto" and not self._capturing()):
            return self.xp.matmul(a, b)
        return self.gemm(a, b)

    def gemm(self, a: Any, b: Any, bias: Any = None, alpha: float = 1.0) -> Any:
        """alpha * a @ b (+ bias over the last axis) with the own kernel, numpy's matmul
        broadcasting over leading axes. A 2-D operand is shared by every batch (stride 0)
        and a transposed 2-D view is read in place (a Gemm's transB weight is never copied)."""
        cp = self.xp
        dtype = cp.result_type(a, b)
        if dtype.name not in _sources.DTYPES or a.ndim < 2 or b.ndim < 2:
            return cp.matmul(a, b)  # vectors and other dtypes: cupy's own (never captured as GEMM)
        batch = tuple(cp.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
        m, k = a.shape[-2:]
        n = b.shape[-1]
        a_data, a_trans, lda, a_stride = _operand(cp, a, batch, dtype)
        b_data, b_trans, ldb, b_stride = _operand(cp, b, batch, dtype)
        count = 1
        for d in batch:
            count *= d
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

    def conv(self, x: Any, w: Any, b: Any, relu: bool, attributes: dict) -> Any:
        cp = self.xp
        if x.ndim != 4 or x.dtype.name not in _sources.DTYPES or w.dtype != x.dtype:
            return super().conv(x, w, b, relu, attributes)
        n, c, h, wd = x.shape
        m, cg, kh, kw = w.shape
        group = int(attributes.get("group", 1))
        strides = list(attributes.get("strides") or [1, 1])
        dilations = list(attributes.get("dilations") or [1, 1])
        begin, end, (oh, ow) = _xp.conv_pads(
            (h, wd), (kh, kw), strides, dilations, attributes.get("pads"), attributes.get("auto_pad", "NOTSET")
        )
        x = cp.ascontiguousarray(x)
        geometry = [h, wd, kh, kw, oh, ow, strides[0], strides[1], begin[0], begin[1], dilations[0], dilations[1]]
        if group == c == m and cg == 1:
            y = cp.empty((n, m, oh, ow), x.dtype)
            fn = self.kernel("depthwise", x.dtype, "depthwise_conv2d")
            total = y.size
            bias = cp.ascontiguousarray(b, dtype=x.dtype) if b is not None else y
            fn(_grid(total), (256,), (x, cp.ascontiguousarray(w), bias, y, cp.int32(n), cp.int32(c),
                                      *[cp.int32(v) for v in geometry], cp.int32(b is not None), cp.int32(relu)))
            return y
        cols = cp.empty((n, c * kh * kw, oh * ow), x.dtype)
        fn = self.kernel("im2col", x.dtype, "im2col2d")
        fn(_grid(cols.size), (256,), (x, cols, cp.int32(n), cp.int32(c), *[cp.int32(v) for v in geometry]))
        if group == 1:  # one weight matrix for every image: the GEMM reads it with batch stride 0
            y = self.matmul(w.reshape(m, cg * kh * kw), cols).reshape(n, m, oh, ow)
        else:
            cols = cols.reshape(n, group, (c // group) * kh * kw, oh * ow)
            y = self.matmul(w.reshape(group, m // group, cg * kh * kw), cols).reshape(n, m, oh, ow)
        if b is not None:
            y += b.reshape(1, m, 1, 1)
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


def _grid(total: int) -> tuple[int]:
    return (max(1, min((total + 255) // 256, 65535 * 8)),)
