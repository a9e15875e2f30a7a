"""cuBLASLt through ctypes, without a GPU.

A fake libcublasLt implements the documented column-major semantics of the calls the
provider makes (layouts, transposes, strided batches, the bias/ReLU epilogues) over host
memory at the addresses it is given; the provider's row-major GEMMs through it must equal
numpy's ``a @ b``. The prototypes are checked against the C signatures, and the library's
discovery, plan cache, compute types and error mapping are checked on their own.
"""

from __future__ import annotations

import ctypes
import os
import types

import numpy as np
import pytest

from plugrt_cuda import _cublas
from plugrt_cuda._cublas import (
    CUBLAS_COMPUTE_32F,
    CUBLAS_COMPUTE_32F_FAST_TF32,
    CublasError,
    CublasNotFoundError,
    GemmShape,
    Lt,
)

# the arity of each function in cublasLt.h (CUDA 12 and 13), counted from the header
C_ARITY = {
    "cublasLtCreate": 1,
    "cublasLtDestroy": 1,
    "cublasLtGetVersion": 0,
    "cublasLtMatmulDescCreate": 3,
    "cublasLtMatmulDescDestroy": 1,
    "cublasLtMatmulDescSetAttribute": 4,
    "cublasLtMatrixLayoutCreate": 5,
    "cublasLtMatrixLayoutDestroy": 1,
    "cublasLtMatrixLayoutSetAttribute": 4,
    "cublasLtMatmulPreferenceCreate": 1,
    "cublasLtMatmulPreferenceDestroy": 1,
    "cublasLtMatmulPreferenceSetAttribute": 4,
    "cublasLtMatmulAlgoGetHeuristic": 10,
    "cublasLtMatmul": 16,
}


def _value(x) -> int:
    if isinstance(x, ctypes._Pointer) or type(x).__name__ == "CArgObject":
        raise TypeError("pass addresses, not byref objects, here")
    return int(x.value or 0) if hasattr(x, "value") else int(x)


def _out(ref, value: int) -> None:
    """Write ``value`` through a ctypes.byref(...) out-parameter."""
    ref._obj.value = value


_NP = {0: np.float32, 2: np.float16}


def _memory(address: int, count: int, dtype: np.dtype) -> np.ndarray:
    """``count`` elements of ``dtype`` at ``address`` (host memory), writable."""
    raw = (ctypes.c_uint8 * (count * np.dtype(dtype).itemsize)).from_address(address)
    return np.ctypeslib.as_array(raw).view(dtype)


class _Fn:
    def __init__(self, lib: FakeLt, name: str):
        self.lib, self.name = lib, name
        self.restype = None
        self.argtypes = None

    def __call__(self, *args):
        self.lib.calls.append((self.name, args))
        if self.name in self.lib.fail:
            return self.lib.fail[self.name]
        return getattr(self.lib, "_" + self.name)(*args)


class FakeLt:
    """libcublasLt's semantics over host memory: column-major matrices, element (r, c) of
    batch z at ``base + (z * stride + c * ld + r) * itemsize``."""

    def __init__(self, missing: tuple[str, ...] = ()):
        self.calls: list = []
        self.fail: dict[str, int] = {}
        self.objects: dict[int, dict] = {}
        self._next = 1000
        self._missing = set(missing)
        self._fns = {name: _Fn(self, name) for name in C_ARITY if name not in self._missing}
        self._name = "fake libcublasLt"

    def __getattr__(self, name):
        fns = self.__dict__.get("_fns", {})
        if name in fns:
            return fns[name]
        raise AttributeError(name)

    def _new(self, ref, **fields) -> int:
        self._next += 1
        self.objects[self._next] = dict(fields)
        _out(ref, self._next)
        return 0

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)

    # -- the functions ---------------------------------------------------------------
    def _cublasLtCreate(self, ref):
        return self._new(ref, kind="handle")

    def _cublasLtDestroy(self, handle):
        return 0

    def _cublasLtGetVersion(self):
        return 130000

    def _cublasLtMatmulDescCreate(self, ref, compute, scale):
        return self._new(ref, kind="desc", compute=compute, scale=scale, attrs={})

    def _cublasLtMatrixLayoutCreate(self, ref, dtype, rows, cols, ld):
        return self._new(ref, kind="layout", dtype=dtype, rows=rows, cols=cols, ld=ld, attrs={})

    def _cublasLtMatmulPreferenceCreate(self, ref):
        return self._new(ref, kind="pref", attrs={})

    def _set(self, obj, attribute, buf, size):
        raw = ctypes.string_at(_value(buf), int(size))
        self.objects[_value(obj)]["attrs"][int(attribute)] = int.from_bytes(raw, "little", signed=size in (4, 8) and attribute != 8)
        return 0

    _cublasLtMatmulDescSetAttribute = _set
    _cublasLtMatrixLayoutSetAttribute = _set
    _cublasLtMatmulPreferenceSetAttribute = _set

    def _destroy(self, obj):
        self.objects.pop(_value(obj), None)
        return 0

    _cublasLtMatmulDescDestroy = _destroy
    _cublasLtMatrixLayoutDestroy = _destroy
    _cublasLtMatmulPreferenceDestroy = _destroy

    def _cublasLtMatmulAlgoGetHeuristic(self, handle, desc, a, b, c, d, pref, requested, results, count_ref):
        result = _cublas.HeuristicResult.from_address(_value(results))
        result.state = 0
        result.workspaceSize = 1024
        result.algo[0] = 42
        count_ref._obj.value = 1
        return 0

    def _matrix(self, layout: dict, address: int, batch: int) -> np.ndarray:
        dtype = np.dtype(_NP[layout["dtype"]])
        stride = layout["attrs"].get(_cublas.LAYOUT_STRIDED_BATCH_OFFSET, 0)
        rows, cols, ld = layout["rows"], layout["cols"], layout["ld"]
        mats = []
        for z in range(batch):
            r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
            index = z * stride + c * ld + r
            span = int(index.max()) + 1
            flat = _memory(address, span, dtype)
            mats.append(flat[index].astype(np.float64))
        return np.stack(mats)

    def _cublasLtMatmul(self, handle, desc, alpha, a, adesc, b, bdesc, beta, c, cdesc, d, ddesc, algo, ws, ws_size, stream):
        desc_ = self.objects[_value(desc)]
        la, lb, ld_ = (self.objects[_value(x)] for x in (adesc, bdesc, ddesc))
        batch = la["attrs"].get(_cublas.LAYOUT_BATCH_COUNT, 1)
        for layout in (lb, ld_):
            assert layout["attrs"].get(_cublas.LAYOUT_BATCH_COUNT, 1) == batch
        alpha_ = ctypes.c_float.from_address(_value(alpha)).value
        assert ctypes.c_float.from_address(_value(beta)).value == 0.0
        assert ctypes.c_uint64.from_address(_value(algo)).value == 42  # the algorithm the heuristic chose
        A = self._matrix(la, _value(a), batch)
        B = self._matrix(lb, _value(b), batch)
        if desc_["attrs"].get(_cublas.DESC_TRANSA, 0) == _cublas.CUBLAS_OP_T:
            A = A.transpose(0, 2, 1)
        if desc_["attrs"].get(_cublas.DESC_TRANSB, 0) == _cublas.CUBLAS_OP_T:
            B = B.transpose(0, 2, 1)
        D = alpha_ * (A @ B)
        epilogue = desc_["attrs"].get(_cublas.DESC_EPILOGUE, _cublas.EPILOGUE_DEFAULT)
        if epilogue & _cublas.EPILOGUE_BIAS:  # a vector over D's rows, the same for every batch
            address = desc_["attrs"][_cublas.DESC_BIAS_POINTER]
            dtype = np.dtype(_NP[ld_["dtype"]])
            bias = _memory(address, D.shape[1], dtype)
            D = D + bias.astype(np.float64)[None, :, None]
        if epilogue & _cublas.EPILOGUE_RELU:
            D = np.maximum(D, 0)
        dtype = np.dtype(_NP[ld_["dtype"]])
        stride = ld_["attrs"].get(_cublas.LAYOUT_STRIDED_BATCH_OFFSET, 0)
        rows, cols, lead = ld_["rows"], ld_["cols"], ld_["ld"]
        assert D.shape[1:] == (rows, cols)
        span = (batch - 1) * stride + (cols - 1) * lead + rows
        out = _memory(_value(d), span, dtype)
        r, cc = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        for z in range(batch):
            out[z * stride + cc * lead + r] = D[z].astype(dtype)
        return 0


# -- prototypes ------------------------------------------------------------------------

def test_every_prototype_has_the_c_arity_and_bind_declares_it():
    assert set(_cublas.PROTOTYPES) == set(C_ARITY)
    for name, (_restype, argtypes) in _cublas.PROTOTYPES.items():
        assert len(argtypes) == C_ARITY[name], name
    lib = _cublas.bind(FakeLt())
    for name, (restype, argtypes) in _cublas.PROTOTYPES.items():
        fn = getattr(lib, name)
        assert fn.restype is restype and list(fn.argtypes) == list(argtypes), name
    # the matmul's last argument is the stream, its 15th the workspace size (size_t)
    assert _cublas.PROTOTYPES["cublasLtMatmul"][1][14] is ctypes.c_size_t
    assert _cublas.PROTOTYPES["cublasLtMatrixLayoutCreate"][1][2:] == (ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64)


def test_the_prototypes_are_accepted_by_real_ctypes_functions():
    # argtypes are checked by ctypes when assigned: a real function object must take them
    libc = ctypes.CDLL(None)
    for restype, argtypes in _cublas.PROTOTYPES.values():
        fn = libc.strlen  # any symbol: only the assignment is checked
        fn.restype, fn.argtypes = restype, list(argtypes)
    assert ctypes.sizeof(_cublas.HeuristicResult) == 96  # cublasLtMatmulHeuristicResult_t


def test_a_library_without_a_symbol_names_it():
    with pytest.raises(CublasNotFoundError, match="cublasLtMatmulAlgoGetHeuristic"):
        _cublas.bind(FakeLt(missing=("cublasLtMatmulAlgoGetHeuristic",)))


# -- the row-major identity ------------------------------------------------------------

RNG = np.random.default_rng(25)


def _stored(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x)


@pytest.mark.parametrize("a_trans", [False, True])
@pytest.mark.parametrize("b_trans", [False, True])
@pytest.mark.parametrize("m,n,k", [(3, 5, 4), (1, 7, 2), (6, 1, 9)])
def test_the_column_major_reading_of_row_major_operands_is_a_at_b(m, n, k, a_trans, b_trans):
    a = RNG.standard_normal((m, k))
    b = RNG.standard_normal((k, n))
    a_buf = _stored(a.T) if a_trans else _stored(a)  # what is in memory, row-major
    b_buf = _stored(b.T) if b_trans else _stored(b)
    shape = GemmShape(m, n, k, "float32", a_trans, b_trans)
    lib_a, lib_b, out = _cublas.row_major_layouts(shape)

    def col_major(buf, layout):
        flat = buf.reshape(-1)
        r, c = np.meshgrid(np.arange(layout.rows), np.arange(layout.cols), indexing="ij")
        mat = flat[c * layout.ld + r]
        return mat.T if layout.op == _cublas.CUBLAS_OP_T else mat

    d_col = col_major(b_buf, lib_a) @ col_major(a_buf, lib_b)  # the library's A is our B
    assert d_col.shape == (out.rows, out.cols) == (n, m)
    d_flat = np.empty(m * n)
    r, c = np.meshgrid(np.arange(n), np.arange(m), indexing="ij")
    d_flat[c * out.ld + r] = d_col
    np.testing.assert_allclose(d_flat.reshape(m, n), a @ b, rtol=1e-12)


# -- the handle, plans and calls -------------------------------------------------------

def _addr(x: np.ndarray) -> int:
    return x.__array_interface__["data"][0]


def _shape(a, b, out, **kw) -> GemmShape:
    m, k = a.shape[-2:]
    n = b.shape[-1]
    return _cublas.shape_of(m, n, k, a.dtype.name, a_trans=False, b_trans=False, lda=k, ldb=n, batch=1, a_stride=0,
                            b_stride=0, bias=False, relu=False, tf32=kw.get("tf32", True),
                            pointers=[_addr(a), _addr(b), _addr(out)], itemsize=a.dtype.itemsize)


def test_one_plan_per_shape_reused_by_every_call():
    lib = FakeLt()
    lt = Lt(lib)
    a, b = RNG.standard_normal((4, 3)).astype(np.float32), RNG.standard_normal((3, 5)).astype(np.float32)
    out = np.empty((4, 5), np.float32)
    for _ in range(3):
        lt.matmul(_shape(a, b, out), _addr(a), _addr(b), _addr(out), stream=0, workspace=0)
    np.testing.assert_allclose(out, a @ b, rtol=1e-5)
    assert lib.count("cublasLtMatmulAlgoGetHeuristic") == 1 and lib.count("cublasLtMatmul") == 3
    exact = _shape(a, b, out, tf32=False)
    lt.matmul(exact, _addr(a), _addr(b), _addr(out), stream=0, workspace=0)
    assert lib.count("cublasLtMatmulAlgoGetHeuristic") == 2 and len(lt.plans) == 2
    computes = [args[1] for name, args in lib.calls if name == "cublasLtMatmulDescCreate"]
    assert computes == [CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_COMPUTE_32F]
    lt.close()
    assert not [o for o in lib.objects.values() if o["kind"] != "handle"]  # every descriptor destroyed


def test_plan_keys_tell_shapes_dtypes_transposes_and_alignment_apart():
    base = dict(a_trans=False, b_trans=False, lda=3, ldb=5, batch=1, a_stride=0, b_stride=0, bias=False, relu=False,
                tf32=True, pointers=[256, 512, 1024], itemsize=4)
    key = _cublas.shape_of(4, 5, 3, "float32", **base)
    assert key == _cublas.shape_of(4, 5, 3, "float32", **base)
    assert key != _cublas.shape_of(4, 5, 3, "float16", **{**base, "itemsize": 2})
    assert key != _cublas.shape_of(4, 5, 3, "float32", **{**base, "b_trans": True})
    assert key != _cublas.shape_of(4, 5, 3, "float32", **{**base, "tf32": False})
    assert key.align == 4  # rows of 3 and 5 floats: 4-byte aligned
    aligned = _cublas.shape_of(4, 8, 8, "float32", **{**base, "lda": 8, "ldb": 8})
    assert aligned.align == 32
    off = _cublas.shape_of(4, 8, 8, "float32", **{**base, "lda": 8, "ldb": 8, "pointers": [256 + 4, 512, 1024]})
    assert off.align == 4 and off != aligned


def test_compute_type_follows_the_tf32_option_for_float32_only():
    assert _cublas.compute_type("float32", True) == CUBLAS_COMPUTE_32F_FAST_TF32
    assert _cublas.compute_type("float32", False) == CUBLAS_COMPUTE_32F
    assert _cublas.compute_type("float16", True) == CUBLAS_COMPUTE_32F  # accumulates in float32
    with pytest.raises(ValueError, match="float64"):
        _cublas.compute_type("float64", True)


def test_an_error_status_becomes_a_typed_error_with_its_name():
    lib = FakeLt()
    lt = Lt(lib)
    a, b = np.ones((2, 2), np.float32), np.ones((2, 2), np.float32)
    out = np.empty((2, 2), np.float32)
    lib.fail["cublasLtMatmul"] = 15
    with pytest.raises(CublasError, match="cublasLtMatmul failed with CUBLAS_STATUS_NOT_SUPPORTED") as info:
        lt.matmul(_shape(a, b, out), _addr(a), _addr(b), _addr(out), stream=0, workspace=0)
    assert info.value.status == 15 and info.value.function == "cublasLtMatmul"
    lib.fail = {"cublasLtCreate": 3}
    with pytest.raises(CublasError, match="CUBLAS_STATUS_ALLOC_FAILED"):
        Lt(lib)
    assert _cublas.status_name(99) == "cublasStatus_t 99"


def test_no_algorithm_is_an_error_not_a_call_with_garbage():
    lib = FakeLt()
    lib._cublasLtMatmulAlgoGetHeuristic = lambda *args: (args[-1]._obj.__setattr__("value", 0), 0)[1]  # type: ignore[method-assign]
    lt = Lt(lib)
    a = np.ones((2, 2), np.float32)
    with pytest.raises(CublasError, match="no algorithm for m=2 n=2 k=2"):
        lt.matmul(_shape(a, a, a), _addr(a), _addr(a), _addr(a), stream=0, workspace=0)
    assert lib.count("cublasLtMatmul") == 0


# -- discovery -------------------------------------------------------------------------

def test_candidate_paths_cover_the_wheels_and_system_installs(tmp_path):
    site = str(tmp_path)
    paths = _cublas.candidate_paths((13, 12), site_dirs=[site], environ={"CUDA_PATH": "/opt/cuda"})
    assert paths[0] == "libcublasLt.so.13"
    assert os.path.join(site, "nvidia/cu13/lib/libcublasLt.so.13") in paths  # CUDA 13 wheel (nvidia-cublas)
    assert os.path.join(site, "nvidia/cublas/lib/libcublasLt.so.12") in paths  # CUDA 12 wheel (nvidia-cublas-cu12)
    assert "/opt/cuda/lib64/libcublasLt.so.12" in paths and "/usr/local/cuda/lib64/libcublasLt.so.13" in paths
    assert paths.index("libcublasLt.so.13") < paths.index("libcublasLt.so.12")


def test_an_absent_library_says_where_it_looked_and_how_to_get_one():
    def loader(path):
        raise OSError(f"{path}: cannot open shared object file")

    with pytest.raises(CublasNotFoundError) as info:
        _cublas.find_library(loader=loader, paths=["libcublasLt.so.13", "libcublasLt.so.12"])
    text = str(info.value)
    assert "libcublasLt.so.13" in text and "libcublasLt.so.12" in text and "pip install nvidia-cublas" in text
    assert isinstance(info.value, OSError)


def test_the_first_library_that_loads_is_used():
    tried = []

    def loader(path):
        tried.append(path)
        if path.endswith(".13"):
            raise OSError("no")
        return types.SimpleNamespace(path=path)

    assert _cublas.find_library(loader=loader, paths=["libcublasLt.so.13", "libcublasLt.so.12"]).path.endswith(".12")
    assert tried == ["libcublasLt.so.13", "libcublasLt.so.12"]


def _real_library():
    try:
        return _cublas.bind(_cublas.find_library())  # raises naming a missing symbol
    except CublasNotFoundError as exc:
        pytest.skip(f"{exc} (set {_cublas.LIBRARY_ENV} to a libcublasLt to run this here)")


def test_a_real_libcublaslt_accepts_every_descriptor_and_attribute_without_a_device():
    """Descriptors are host objects: the real library checks each attribute's id and size,
    so this proves the enum values and value widths the provider uses, with no GPU."""
    lib = _real_library()
    lt = Lt.__new__(Lt)  # no handle: cublasLtCreate needs a device
    lt.lib, lt.workspace_bytes = lib, _cublas.WORKSPACE_BYTES
    for shape in [
        GemmShape(4, 5, 3, "float32"),
        GemmShape(4, 5, 3, "float16", a_trans=True, b_trans=True, compute=CUBLAS_COMPUTE_32F),
        GemmShape(4, 5, 3, "float32", batch=3, a_stride=0, b_stride=15, bias=True, relu=True,
                  compute=CUBLAS_COMPUTE_32F_FAST_TF32),
    ]:
        desc, layouts = lt.descriptors(shape)
        lt._set("set", lib.cublasLtMatmulDescSetAttribute, desc, _cublas.DESC_BIAS_POINTER, ctypes.c_void_p(4096))
        with pytest.raises(CublasError, match="CUBLAS_STATUS_INVALID_VALUE"):  # a wrong width is refused
            lt._set("set", lib.cublasLtMatmulDescSetAttribute, desc, _cublas.DESC_TRANSA, ctypes.c_int8(1))
        lt._destroy(desc, layouts)
    pref = ctypes.c_void_p()
    assert lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)) == 0
    lt._set("set", lib.cublasLtMatmulPreferenceSetAttribute, pref, _cublas.PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(1 << 20))
    for attribute in _cublas.PREF_MIN_ALIGNMENT.values():
        lt._set("set", lib.cublasLtMatmulPreferenceSetAttribute, pref, attribute, ctypes.c_uint32(4))
    assert lib.cublasLtMatmulPreferenceDestroy(pref) == 0


# -- the backend's GEMMs through the fake library --------------------------------------

class _FakeStreamObj:
    def __init__(self, ptr: int):
        self.ptr = ptr

    def synchronize(self):
        pass

    def is_capturing(self) -> bool:
        return False


def _fake_cupy():
    stream = _FakeStreamObj(0)
    cuda = types.SimpleNamespace(
        get_current_stream=lambda: stream,
        runtime=types.SimpleNamespace(runtimeGetVersion=lambda: 13000),
    )
    ns = types.SimpleNamespace(cuda=cuda)

    class XP:
        def __getattr__(self, name):
            return getattr(ns, name) if hasattr(ns, name) else getattr(np, name)

    return XP()


@pytest.fixture
def lt_backend(monkeypatch):
    from plugrt_cuda._backend import CupyBackend

    lib = FakeLt()
    monkeypatch.setattr(_cublas.Lt, "load", classmethod(lambda cls, majors=(13, 12): cls(lib)))
    monkeypatch.setattr(_cublas, "WORKSPACE_BYTES", 1 << 10)
    backend = CupyBackend(_fake_cupy())
    return backend, lib


CASES = {
    "2d": (lambda: RNG.standard_normal((5, 3)), lambda: RNG.standard_normal((3, 4))),
    "transposed weight": (lambda: RNG.standard_normal((5, 3)), lambda: RNG.standard_normal((4, 3)).T),
    "transposed input": (lambda: RNG.standard_normal((3, 5)).T, lambda: RNG.standard_normal((3, 4))),
    "batched x 2d": (lambda: RNG.standard_normal((2, 3, 5, 3)), lambda: RNG.standard_normal((3, 4))),
    "2d x batched": (lambda: RNG.standard_normal((5, 3)), lambda: RNG.standard_normal((2, 3, 4))),
    "batched x batched": (lambda: RNG.standard_normal((2, 5, 3)), lambda: RNG.standard_normal((2, 3, 4))),
    "broadcast batch": (lambda: RNG.standard_normal((1, 5, 3)), lambda: RNG.standard_normal((3, 3, 4))),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_backend_matmul_through_cublaslt_equals_numpy(lt_backend, case, dtype):
    backend, lib = lt_backend
    make_a, make_b = CASES[case]
    a, b = make_a().astype(dtype), make_b().astype(dtype)
    got = backend.matmul(a, b)
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert got.shape == want.shape and got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-3 if dtype == np.float16 else 1e-5, atol=2e-2 if dtype == np.float16 else 1e-5)
    assert lib.count("cublasLtMatmul") == 1


def test_a_stack_of_inputs_against_one_weight_is_one_taller_gemm(lt_backend):
    backend, lib = lt_backend
    a, b = RNG.standard_normal((4, 6, 3)).astype(np.float32), RNG.standard_normal((3, 2)).astype(np.float32)
    backend.matmul(a, b)
    (plan,) = backend.lt().plans
    assert (plan.m, plan.batch) == (24, 1)


def test_bias_and_relu_run_in_the_epilogue(lt_backend):
    backend, lib = lt_backend
    a, b = RNG.standard_normal((5, 3)).astype(np.float32), RNG.standard_normal((3, 4)).astype(np.float32)
    bias = RNG.standard_normal(4).astype(np.float32)
    got = backend.lt_gemm(a, b, bias=bias, relu=True, alpha=0.5)
    np.testing.assert_allclose(got, np.maximum(0.5 * (a @ b) + bias, 0), rtol=1e-5, atol=1e-6)
    (plan,) = backend.lt().plans
    assert plan.bias and plan.relu


def test_tf32_off_for_a_partition_selects_exact_float32(lt_backend):
    backend, lib = lt_backend
    exact = backend.configured(tf32=False)
    assert exact is not backend and exact.lt() is backend.lt()  # one handle, one plan cache
    a = np.ones((2, 2), np.float32)
    backend.matmul(a, a)
    exact.matmul(a, a)
    assert sorted(p.compute for p in backend.lt().plans) == [CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32]
    assert backend.configured(tf32=True) is backend


def test_float64_and_vectors_go_to_the_array_module(lt_backend):
    backend, lib = lt_backend
    a = np.ones((2, 2))
    np.testing.assert_array_equal(backend.matmul(a, a), a @ a)
    v = np.ones(2, np.float32)
    np.testing.assert_array_equal(backend.matmul(v, np.ones((2, 2), np.float32)), v @ np.ones((2, 2), np.float32))
    assert lib.count("cublasLtMatmul") == 0


def test_without_cublaslt_auto_falls_back_and_cublaslt_engine_refuses(monkeypatch):
    from plugrt.errors import ProviderUnavailableError
    from plugrt_cuda._backend import GEMM_ENV, CupyBackend

    def absent(cls, majors=(13, 12)):
        raise CublasNotFoundError(["libcublasLt.so.13"])

    monkeypatch.setattr(_cublas.Lt, "load", classmethod(absent))
    backend = CupyBackend(_fake_cupy())
    a = np.ones((2, 2), np.float32)
    np.testing.assert_array_equal(backend.matmul(a, a), a @ a)  # cupy's matmul (eager)
    assert "libcublasLt was not found" in backend.lt_reason
    monkeypatch.setenv(GEMM_ENV, "cublaslt")
    with pytest.raises(ProviderUnavailableError, match="cuBLASLt cannot be used"):
        CupyBackend(_fake_cupy()).matmul(a, a)


def test_a_shape_cublaslt_has_no_algorithm_for_runs_on_another_engine(lt_backend):
    backend, lib = lt_backend
    lib.fail["cublasLtMatmulAlgoGetHeuristic"] = 15
    a, b = np.ones((3, 5), np.float32), np.ones((5, 2), np.float32)
    np.testing.assert_array_equal(backend.matmul(a, b), a @ b)  # cupy's matmul (eager) instead
    np.testing.assert_array_equal(backend.matmul(a, b), a @ b)
    assert lib.count("cublasLtMatmulAlgoGetHeuristic") == 1  # refused once, remembered
    lib.fail = {"cublasLtMatmul": 13}  # an execution failure is an error, not a fallback
    with pytest.raises(CublasError, match="CUBLAS_STATUS_EXECUTION_FAILED"):
        backend.matmul(np.ones((4, 4), np.float32), np.ones((4, 4), np.float32))
