"""cuBLASLt through ctypes, on a handle the provider owns: GEMMs that CUDA graphs can record.

cupy refuses its own cuBLAS wrappers while a stream captures (its bindings check in
``setStream``); cuBLASLt itself records fine when every call names its stream and workspace
and the algorithm is chosen before the capture. So the provider calls the library cupy
already loaded (``libcublasLt.so.12``/``.13``) directly:

- ``find_library`` looks for it (already loaded by cupy, the CUDA 13 and 12 wheels, a system
  install) and says where it looked when it is absent;
- ``bind`` declares every function's prototype (restype/argtypes) once;
- ``Lt`` owns the handle and a cache of plans per GEMM shape: the matmul descriptor, the
  four layouts and the algorithm the heuristic chose, made once per (m, n, k, dtype,
  transposes, batch, epilogue, compute type, alignment) and reused by every later call,
  captured or not.

Row-major operands go through the transposition identity: a row-major (r, c) matrix read
column-major is its transpose, so ``C = A @ B`` is computed as ``C^T = B^T @ A^T`` with the
library's "A" slot given our B and its "B" slot our A, and C comes out row-major.

Nothing here loads a library at import time: ``import plugrt_cuda`` stays free of CUDA.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import os
import sys
import threading
from typing import Any, Callable, Sequence

from plugrt.errors import PlugrtError

__all__ = [
    "CublasError",
    "CublasNotFoundError",
    "GemmShape",
    "Lt",
    "LtPlan",
    "PROTOTYPES",
    "bind",
    "candidate_paths",
    "compute_type",
    "find_library",
    "row_major_layouts",
    "status_name",
]

# -- constants (cublasLt.h, cublas_api.h, library_types.h of CUDA 12 and 13) ----------------

CUDA_R_32F = 0
CUDA_R_16F = 2
CUDA_R_16BF = 14
_DATA_TYPES = {"float32": CUDA_R_32F, "float16": CUDA_R_16F, "bfloat16": CUDA_R_16BF}

CUBLAS_COMPUTE_32F = 68
CUBLAS_COMPUTE_32F_FAST_TF32 = 77

CUBLAS_OP_N = 0
CUBLAS_OP_T = 1

DESC_TRANSA = 3
DESC_TRANSB = 4
DESC_EPILOGUE = 7
DESC_BIAS_POINTER = 8

EPILOGUE_DEFAULT = 1
EPILOGUE_RELU = 2
EPILOGUE_BIAS = 4
EPILOGUE_RELU_BIAS = 6

LAYOUT_BATCH_COUNT = 5
LAYOUT_STRIDED_BATCH_OFFSET = 6

PREF_MAX_WORKSPACE_BYTES = 1
PREF_MIN_ALIGNMENT = {"A": 5, "B": 6, "C": 7, "D": 8}

#: bytes of the workspace each stream's calls get (what the heuristic may choose algorithms
#: for); allocated before any capture, so a recorded GEMM never allocates
WORKSPACE_BYTES = 16 << 20

_STATUS = {
    0: "CUBLAS_STATUS_SUCCESS",
    1: "CUBLAS_STATUS_NOT_INITIALIZED",
    3: "CUBLAS_STATUS_ALLOC_FAILED",
    7: "CUBLAS_STATUS_INVALID_VALUE",
    8: "CUBLAS_STATUS_ARCH_MISMATCH",
    11: "CUBLAS_STATUS_MAPPING_ERROR",
    13: "CUBLAS_STATUS_EXECUTION_FAILED",
    14: "CUBLAS_STATUS_INTERNAL_ERROR",
    15: "CUBLAS_STATUS_NOT_SUPPORTED",
    16: "CUBLAS_STATUS_LICENSE_ERROR",
}


#: statuses that mean "not this shape" (no algorithm, an unsupported layout or alignment):
#: the provider runs that GEMM on another engine instead of failing the run
FALLBACK_STATUSES = frozenset({7, 15})


def status_name(status: int) -> str:
    return _STATUS.get(int(status), f"cublasStatus_t {int(status)}")


class CublasError(PlugrtError, RuntimeError):
    """A cuBLASLt call returned an error status."""

    def __init__(self, function: str, status: int, detail: str = ""):
        self.function = function
        self.status = int(status)
        self.status_name = status_name(status)
        super().__init__(f"{function} failed with {self.status_name}{': ' + detail if detail else ''}")


class CublasNotFoundError(PlugrtError, OSError):
    """No libcublasLt could be loaded; says where it was looked for and how to get one."""

    def __init__(self, tried: Sequence[str], errors: Sequence[str] = ()):
        self.tried = list(tried)
        hint = (
            "install the cuBLAS of the CUDA that cupy runs (pip install nvidia-cublas for CUDA 13, "
            "nvidia-cublas-cu12 for CUDA 12) or set CUDA_PATH to a CUDA toolkit"
        )
        shown = "; ".join(errors) if errors else ", ".join(self.tried)
        super().__init__(f"libcublasLt was not found (tried {shown}); {hint}")


# -- discovery ---------------------------------------------------------------------------

def _site_dirs() -> list[str]:
    import site

    dirs = list(sys.path)
    try:
        dirs += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # virtualenv's old site module
        pass
    seen: list[str] = []
    for d in dirs:
        if d and d not in seen and os.path.isdir(d):
            seen.append(d)
    return seen


#: a libcublasLt to use before any other (a path, or a name the loader finds)
LIBRARY_ENV = "PLUGRT_CUDA_CUBLASLT"


def candidate_paths(
    majors: Sequence[int] = (13, 12), site_dirs: Sequence[str] | None = None, environ: dict | None = None
) -> list[str]:
    """Where libcublasLt may be, best first: ``$PLUGRT_CUDA_CUBLASLT``, the bare soname (found when cupy or the
    system loader already knows it), the CUDA 13 wheel (``nvidia/cu13/lib``), the CUDA 12
    wheel (``nvidia/cublas/lib``), then ``$CUDA_PATH``/``$CUDA_HOME`` and /usr/local/cuda."""
    environ = dict(os.environ if environ is None else environ)
    site_dirs = _site_dirs() if site_dirs is None else list(site_dirs)
    paths: list[str] = [environ[LIBRARY_ENV]] if environ.get(LIBRARY_ENV) else []
    for major in majors:
        name = f"libcublasLt.so.{major}"
        paths.append(name)
        wheel_dirs = ["nvidia/cu13/lib", "nvidia/cublas/lib"] if major >= 13 else ["nvidia/cublas/lib"]
        for base in site_dirs:
            for sub in wheel_dirs:
                paths.append(os.path.join(base, sub, name))
        for var in ("CUDA_PATH", "CUDA_HOME"):
            if environ.get(var):
                paths.append(os.path.join(environ[var], "lib64", name))
        paths.append(os.path.join("/usr/local/cuda/lib64", name))
        paths.extend(sorted(glob.glob(f"/usr/local/cuda-{major}*/lib64/{name}")))
    unique: list[str] = []
    for p in paths:
        if p not in unique:
            unique.append(p)
    return unique


def find_library(
    majors: Sequence[int] = (13, 12),
    loader: Callable[[str], Any] = ctypes.CDLL,
    paths: Sequence[str] | None = None,
) -> Any:
    """The first libcublasLt that loads (``loader`` is replaced in tests); CublasNotFoundError
    naming each path tried and why it failed otherwise."""
    tried = list(paths) if paths is not None else candidate_paths(majors)
    errors = []
    for path in tried:
        if os.sep in path and not os.path.exists(path):
            continue
        try:
            return loader(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
    raise CublasNotFoundError(tried, errors)


# -- prototypes --------------------------------------------------------------------------

_p = ctypes.c_void_p
_int = ctypes.c_int
_size = ctypes.c_size_t
_pp = ctypes.POINTER(ctypes.c_void_p)

#: name -> (restype, argtypes) of every cuBLASLt function the provider calls
PROTOTYPES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "cublasLtCreate": (_int, (_pp,)),
    "cublasLtDestroy": (_int, (_p,)),
    "cublasLtGetVersion": (_size, ()),
    "cublasLtMatmulDescCreate": (_int, (_pp, _int, _int)),
    "cublasLtMatmulDescDestroy": (_int, (_p,)),
    "cublasLtMatmulDescSetAttribute": (_int, (_p, _int, _p, _size)),
    "cublasLtMatrixLayoutCreate": (_int, (_pp, _int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64)),
    "cublasLtMatrixLayoutDestroy": (_int, (_p,)),
    "cublasLtMatrixLayoutSetAttribute": (_int, (_p, _int, _p, _size)),
    "cublasLtMatmulPreferenceCreate": (_int, (_pp,)),
    "cublasLtMatmulPreferenceDestroy": (_int, (_p,)),
    "cublasLtMatmulPreferenceSetAttribute": (_int, (_p, _int, _p, _size)),
    # handle, desc, A, B, C, D layouts, preference, requested count, results[], returned count*
    "cublasLtMatmulAlgoGetHeuristic": (_int, (_p, _p, _p, _p, _p, _p, _p, _int, _p, ctypes.POINTER(_int))),
    # handle, desc, alpha*, A, Adesc, B, Bdesc, beta*, C, Cdesc, D, Ddesc, algo*, workspace, size, stream
    "cublasLtMatmul": (_int, (_p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _size, _p)),
}


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t: the algorithm (64 opaque bytes), its workspace,
    its status, waves count and reserved words (96 bytes in CUDA 12 and 13)."""

    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspaceSize", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("wavesCount", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def bind(lib: Any) -> Any:
    """Declare every prototype on ``lib`` (a ctypes.CDLL, or a fake in tests) and return it;
    a missing symbol raises CublasNotFoundError naming it (a library too old to use)."""
    for name, (restype, argtypes) in PROTOTYPES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError as exc:
            raise CublasNotFoundError([getattr(lib, "_name", "libcublasLt")], [f"symbol {name} missing: {exc}"]) from exc
        fn.restype = restype
        fn.argtypes = list(argtypes)
    return lib


def _check(function: str, status: int, detail: str = "") -> None:
    if status != 0:
        raise CublasError(function, status, detail)


# -- plans -------------------------------------------------------------------------------

def compute_type(dtype: str, tf32: bool) -> int:
    """The compute type of a GEMM: float32 inputs use TF32 tensor cores when ``tf32`` (as
    onnxruntime's CUDA provider does by default), exact FP32 otherwise; float16 and
    bfloat16 always accumulate in FP32 (the option does not touch them)."""
    if dtype not in _DATA_TYPES:
        raise ValueError(f"cuBLASLt GEMMs take {', '.join(_DATA_TYPES)}, not {dtype}")
    return CUBLAS_COMPUTE_32F_FAST_TF32 if (dtype == "float32" and tf32) else CUBLAS_COMPUTE_32F


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """One row-major GEMM ``D[b] = alpha * op(A[b]) @ op(B[b]) (+ bias) (relu)``: the key of
    a plan. ``lda``/``ldb`` are the row lengths of the stored matrices, a stride of 0 means
    the operand is shared by every batch, ``align`` the smallest pointer alignment in bytes."""

    m: int
    n: int
    k: int
    dtype: str
    a_trans: bool = False
    b_trans: bool = False
    lda: int = 0
    ldb: int = 0
    batch: int = 1
    a_stride: int = 0
    b_stride: int = 0
    bias: bool = False
    relu: bool = False
    compute: int = CUBLAS_COMPUTE_32F
    align: int = 256

    def __post_init__(self) -> None:
        # leading dimensions of contiguous operands, when not given
        if not self.lda:
            object.__setattr__(self, "lda", self.m if self.a_trans else self.k)
        if not self.ldb:
            object.__setattr__(self, "ldb", self.k if self.b_trans else self.n)


@dataclasses.dataclass(frozen=True)
class ColumnMajorLayout:
    rows: int
    cols: int
    ld: int
    op: int  # CUBLAS_OP_N or CUBLAS_OP_T applied to this stored matrix
    stride: int  # elements between batches (0: shared)


def row_major_layouts(shape: GemmShape) -> tuple[ColumnMajorLayout, ColumnMajorLayout, ColumnMajorLayout]:
    """Column-major (library "A", library "B", D) layouts that compute the row-major GEMM.

    ``D^T (n x m) = op(B)^T (n x k) @ op(A)^T (k x m)``: the library's A is our B, its B our
    A; a stored row-major (r, c) matrix is a column-major (c, r) one with ld = c, and an
    operand we transpose is passed as the stored matrix with the library's op T."""
    m, n, k = shape.m, shape.n, shape.k
    if shape.b_trans:  # B = stored(n, k)^T; stored read column-major is (k, n), op T gives (n, k)
        lib_a = ColumnMajorLayout(k, n, shape.ldb, CUBLAS_OP_T, shape.b_stride)
    else:  # stored (k, n) read column-major is (n, k)
        lib_a = ColumnMajorLayout(n, k, shape.ldb, CUBLAS_OP_N, shape.b_stride)
    if shape.a_trans:  # A = stored(k, m)^T; stored read column-major is (m, k), op T gives (k, m)
        lib_b = ColumnMajorLayout(m, k, shape.lda, CUBLAS_OP_T, shape.a_stride)
    else:
        lib_b = ColumnMajorLayout(k, m, shape.lda, CUBLAS_OP_N, shape.a_stride)
    out = ColumnMajorLayout(n, m, n, CUBLAS_OP_N, m * n)
    return lib_a, lib_b, out


@dataclasses.dataclass
class LtPlan:
    """The descriptors and the chosen algorithm of one GemmShape (destroyed with the Lt)."""

    shape: GemmShape
    desc: ctypes.c_void_p
    layouts: tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # library A, library B, D (also C)
    algo: HeuristicResult
    workspace_size: int


def _alignment(*pointers: int) -> int:
    align = 256
    for p in pointers:
        while align > 1 and p % align:
            align //= 2
    return align


class Lt:
    """A cuBLASLt handle and its plans. Every call takes the stream to run on and the
    workspace to use, so nothing is bound to cupy's current stream and a call recorded in
    a CUDA graph replays as recorded."""

    def __init__(self, lib: Any, workspace_bytes: int = WORKSPACE_BYTES):
        self.lib = bind(lib)
        handle = ctypes.c_void_p()
        _check("cublasLtCreate", lib.cublasLtCreate(ctypes.byref(handle)))
        self.handle = handle
        self.workspace_bytes = workspace_bytes
        self.version = int(lib.cublasLtGetVersion())
        self._plans: dict[GemmShape, LtPlan] = {}
        self._lock = threading.RLock()

    @classmethod
    def load(cls, majors: Sequence[int] = (13, 12)) -> Lt:
        return cls(find_library(majors))

    @property
    def plans(self) -> dict[GemmShape, LtPlan]:
        return self._plans

    def plan(self, shape: GemmShape) -> LtPlan:
        found = self._plans.get(shape)
        if found is None:
            with self._lock:
                found = self._plans.get(shape)
                if found is None:
                    found = self._make_plan(shape)
                    self._plans[shape] = found
        return found

    def _set(self, function: str, setter: Any, obj: Any, attribute: int, value: Any) -> None:
        _check(function, setter(obj, attribute, ctypes.cast(ctypes.byref(value), ctypes.c_void_p), ctypes.sizeof(value)))

    def _layout(self, data_type: int, layout: ColumnMajorLayout, batch: int) -> ctypes.c_void_p:
        lib = self.lib
        handle = ctypes.c_void_p()
        _check(
            "cublasLtMatrixLayoutCreate",
            lib.cublasLtMatrixLayoutCreate(ctypes.byref(handle), data_type, layout.rows, layout.cols, layout.ld),
        )
        if batch > 1:
            self._set("cublasLtMatrixLayoutSetAttribute", lib.cublasLtMatrixLayoutSetAttribute, handle,
                      LAYOUT_BATCH_COUNT, ctypes.c_int32(batch))
            self._set("cublasLtMatrixLayoutSetAttribute", lib.cublasLtMatrixLayoutSetAttribute, handle,
                      LAYOUT_STRIDED_BATCH_OFFSET, ctypes.c_int64(layout.stride))
        return handle

    def descriptors(self, shape: GemmShape) -> tuple[ctypes.c_void_p, tuple[ctypes.c_void_p, ...]]:
        """The matmul descriptor and the (library A, library B, D) layouts of ``shape``:
        host-side objects only (made without a device)."""
        lib = self.lib
        data_type = _DATA_TYPES[shape.dtype]
        lib_a, lib_b, out = row_major_layouts(shape)
        desc = ctypes.c_void_p()
        _check("cublasLtMatmulDescCreate", lib.cublasLtMatmulDescCreate(ctypes.byref(desc), shape.compute, CUDA_R_32F))
        setter = lib.cublasLtMatmulDescSetAttribute
        self._set("cublasLtMatmulDescSetAttribute", setter, desc, DESC_TRANSA, ctypes.c_int32(lib_a.op))
        self._set("cublasLtMatmulDescSetAttribute", setter, desc, DESC_TRANSB, ctypes.c_int32(lib_b.op))
        epilogue = {(False, False): EPILOGUE_DEFAULT, (False, True): EPILOGUE_RELU,
                    (True, False): EPILOGUE_BIAS, (True, True): EPILOGUE_RELU_BIAS}[(shape.bias, shape.relu)]
        if epilogue != EPILOGUE_DEFAULT:
            self._set("cublasLtMatmulDescSetAttribute", setter, desc, DESC_EPILOGUE, ctypes.c_int32(epilogue))
        layouts = (self._layout(data_type, lib_a, shape.batch), self._layout(data_type, lib_b, shape.batch),
                   self._layout(data_type, out, shape.batch))
        return desc, layouts

    def _make_plan(self, shape: GemmShape) -> LtPlan:
        lib = self.lib
        desc, layouts = self.descriptors(shape)
        pref = ctypes.c_void_p()
        result = HeuristicResult()
        count = ctypes.c_int(0)
        try:
            _check("cublasLtMatmulPreferenceCreate", lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)))
            pset = lib.cublasLtMatmulPreferenceSetAttribute
            self._set("cublasLtMatmulPreferenceSetAttribute", pset, pref, PREF_MAX_WORKSPACE_BYTES,
                      ctypes.c_uint64(self.workspace_bytes))
            if shape.align < 256:
                for attribute in PREF_MIN_ALIGNMENT.values():
                    self._set("cublasLtMatmulPreferenceSetAttribute", pset, pref, attribute, ctypes.c_uint32(shape.align))
            _check(
                "cublasLtMatmulAlgoGetHeuristic",
                lib.cublasLtMatmulAlgoGetHeuristic(
                    self.handle, desc, layouts[0], layouts[1], layouts[2], layouts[2], pref, 1,
                    ctypes.cast(ctypes.byref(result), ctypes.c_void_p), ctypes.byref(count),
                ),
                f"m={shape.m} n={shape.n} k={shape.k} {shape.dtype}",
            )
        except BaseException:
            self._destroy(desc, layouts)
            raise
        finally:
            if pref:
                lib.cublasLtMatmulPreferenceDestroy(pref)
        if count.value < 1 or result.state != 0:
            self._destroy(desc, layouts)
            raise CublasError(
                "cublasLtMatmulAlgoGetHeuristic", result.state or 15,
                f"no algorithm for m={shape.m} n={shape.n} k={shape.k} {shape.dtype}",
            )
        return LtPlan(shape, desc, layouts, result, int(result.workspaceSize))  # type: ignore[arg-type]

    def matmul(
        self, shape: GemmShape, a_ptr: int, b_ptr: int, d_ptr: int, *, stream: int, workspace: int,
        alpha: float = 1.0, bias_ptr: int = 0,
    ) -> None:
        """Enqueue ``D = alpha * op(A) @ op(B) (+ bias) (relu)`` on ``stream`` (a raw
        cudaStream_t); pointers are device addresses of row-major operands."""
        plan = self.plan(shape)
        if shape.bias:
            with self._lock:  # the bias pointer lives in the shared descriptor until the call
                self._call(plan, a_ptr, b_ptr, d_ptr, stream, workspace, alpha, bias_ptr)
        else:
            self._call(plan, a_ptr, b_ptr, d_ptr, stream, workspace, alpha, 0)

    def _call(
        self, plan: LtPlan, a_ptr: int, b_ptr: int, d_ptr: int, stream: int, workspace: int, alpha: float, bias_ptr: int
    ) -> None:
        lib, shape = self.lib, plan.shape
        if shape.bias:
            self._set("cublasLtMatmulDescSetAttribute", lib.cublasLtMatmulDescSetAttribute, plan.desc,
                      DESC_BIAS_POINTER, ctypes.c_void_p(bias_ptr))
        alpha_c, beta_c = ctypes.c_float(alpha), ctypes.c_float(0.0)
        lib_a, lib_b, out = plan.layouts
        _check(
            "cublasLtMatmul",
            lib.cublasLtMatmul(
                self.handle, plan.desc, ctypes.cast(ctypes.byref(alpha_c), ctypes.c_void_p),
                ctypes.c_void_p(b_ptr), lib_a, ctypes.c_void_p(a_ptr), lib_b,
                ctypes.cast(ctypes.byref(beta_c), ctypes.c_void_p), ctypes.c_void_p(d_ptr), out,
                ctypes.c_void_p(d_ptr), out, ctypes.cast(ctypes.byref(plan.algo.algo), ctypes.c_void_p),
                ctypes.c_void_p(workspace), self.workspace_bytes if workspace else 0, ctypes.c_void_p(stream),
            ),
            f"m={shape.m} n={shape.n} k={shape.k} {shape.dtype}",
        )

    def _destroy(self, desc: Any, layouts: Sequence[Any]) -> None:
        for layout in layouts:
            self.lib.cublasLtMatrixLayoutDestroy(layout)
        self.lib.cublasLtMatmulDescDestroy(desc)

    def close(self) -> None:
        with self._lock:
            for plan in self._plans.values():
                self._destroy(plan.desc, plan.layouts)
            self._plans.clear()
            if self.handle:
                self.lib.cublasLtDestroy(self.handle)
                self.handle = ctypes.c_void_p()


def shape_of(
    m: int, n: int, k: int, dtype: str, *, a_trans: bool, b_trans: bool, lda: int, ldb: int, batch: int,
    a_stride: int, b_stride: int, bias: bool, relu: bool, tf32: bool, pointers: Sequence[int], itemsize: int,
) -> GemmShape:
    """The plan key of a call: the alignment of its pointers joins the shape (an algorithm
    chosen for 16-byte aligned operands must not run on a view 4 bytes off)."""
    align = _alignment(*pointers)
    # leading dimensions and batch strides move the pointer of every row / batch too
    for elements in (lda, ldb, n, a_stride, b_stride, m * n):
        if elements:
            align = min(align, _alignment(elements * itemsize))
    return GemmShape(m, n, k, dtype, a_trans, b_trans, lda, ldb, batch, a_stride, b_stride, bias, relu,
                     compute_type(dtype, tf32), align)
