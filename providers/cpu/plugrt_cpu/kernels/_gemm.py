"""Direct calls of the BLAS numpy loaded: GEMM with accumulation (beta) on strided matrix views."""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any, Callable

import numpy as np
from plugrt.threads import blas_threads, openblas_libraries, parallel_for, split_threads

from ._compiled import compiled_module
from ._compiled_parallel import compiled_pool
from ._relu import relu_into
from .elementwise import with_small_buffers

__all__ = [
    "available", "bias_relu", "sgemm_address", "epilogue", "epilogue_loops", "gemm", "matmul", "pooled_matmul", "split_gemm",
    "split_columns", "splits_columns",
]

# cblas enums (cblas.h): row-major storage, no transpose / transpose.
_ROW_MAJOR = 101
_NO_TRANS = 111
_TRANS = 112

# Where a build renames the cblas symbols (scipy-openblas wheels: scipy_ prefix, 64_ suffix
# for 64-bit integers), in the order they are tried.
_NAME_PATTERNS = ("scipy_cblas_{}64_", "cblas_{}64_", "scipy_cblas_{}", "cblas_{}")
_CONFIG_NAMES = ("scipy_openblas_get_config64_", "openblas_get_config64_", "scipy_openblas_get_config", "openblas_get_config")


class _Library:
    """``cblas_sgemm`` and ``cblas_dgemm`` of numpy's OpenBLAS, resolved on first use."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.resolved = False
        self.functions: dict[np.dtype, tuple[Any, Any]] = {}  # dtype -> (function, scalar type)

    def resolve(self) -> dict[np.dtype, tuple[Any, Any]]:
        with self.lock:
            if not self.resolved:
                self.functions = _find_gemms()
                self.resolved = True
        return self.functions


def _integer_type(library: Any, symbol: str) -> Any:
    """The C type of BLAS integers: 64-bit for a ``64_`` symbol or an ILP64 build
    (``USE64BITINT`` in its configuration), else 32-bit."""
    if symbol.endswith("64_"):
        return ctypes.c_int64
    for name in _CONFIG_NAMES:
        config = getattr(library, name, None)
        if config is not None:
            config.restype = ctypes.c_char_p
            config.argtypes = []
            return ctypes.c_int64 if b"USE64BITINT" in (config() or b"") else ctypes.c_int32
    return ctypes.c_int32


def _find_gemms() -> dict[np.dtype, tuple[Any, Any]]:
    """dtype -> (cblas gemm, its scalar ctypes type) from numpy's OpenBLAS; empty for
    another BLAS or where none is found (callers then use numpy)."""
    for path in openblas_libraries():
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        found: dict[np.dtype, tuple[Any, Any]] = {}
        for letter, dtype, scalar in (("s", np.float32, ctypes.c_float), ("d", np.float64, ctypes.c_double)):
            for pattern in _NAME_PATTERNS:
                symbol = pattern.format(letter + "gemm")
                function = getattr(library, symbol, None)
                if function is None:
                    continue
                integer = _integer_type(library, symbol)
                function.restype = None
                function.argtypes = [
                    ctypes.c_int, ctypes.c_int, ctypes.c_int, integer, integer, integer, scalar, ctypes.c_void_p,
                    integer, ctypes.c_void_p, integer, scalar, ctypes.c_void_p, integer,
                ]
                found[np.dtype(dtype)] = (function, scalar)
                break
        if found:
            return found
    return {}


_LIBRARY = _Library()


def available(dtype: np.dtype) -> bool:
    """Whether :func:`gemm` calls BLAS directly for ``dtype`` (float32 and float64 with
    numpy's OpenBLAS); otherwise it computes with numpy."""
    functions = _LIBRARY.functions if _LIBRARY.resolved else _LIBRARY.resolve()
    return np.dtype(dtype) in functions


@functools.cache
def sgemm_address() -> tuple[int, bool] | None:
    """The address of numpy's OpenBLAS ``cblas_sgemm`` and whether its integers are 64-bit,
    for compiled code to call it without the GIL; None where :func:`available` is false."""
    functions = _LIBRARY.functions if _LIBRARY.resolved else _LIBRARY.resolve()
    entry = functions.get(_F32)
    if entry is None:
        return None
    function = entry[0]
    return int(ctypes.cast(function, ctypes.c_void_p).value or 0), function.argtypes[3] is ctypes.c_int64


def _layout(a: np.ndarray) -> tuple[int, int] | None:
    """(cblas transpose flag, leading dimension) of the last two axes of ``a`` (a matrix, or
    every matrix of a batch): rows (or, transposed, columns) of unit step; an axis of one
    element may have any step. None for any other layout."""
    item = a.itemsize
    rows, columns = a.shape[-2:]
    s0, s1 = a.strides[-2:]
    if (s1 == item or columns <= 1) and (rows <= 1 or (s0 % item == 0 and s0 >= item * columns)):
        return _NO_TRANS, max(1, columns if rows <= 1 else s0 // item)
    if (s0 == item or rows <= 1) and (columns <= 1 or (s1 % item == 0 and s1 >= item * rows)):
        return _TRANS, max(1, rows if columns <= 1 else s1 // item)
    return None


def gemm(
    a: np.ndarray,
    b: np.ndarray,
    c: np.ndarray,
    beta: float = 0.0,
    *,
    bias: np.ndarray | None = None,
    relu: bool = False,
) -> None:
    """``c = a @ b + beta * c`` on 2-D views (any leading dimensions, either axis of ``a``
    and ``b`` of unit step, ``c`` with unit-step rows), without copies. The calling thread's
    BLAS thread count applies (``plugrt.threads.blas_threads``). Other layouts, dtypes and
    BLAS libraries are computed with numpy.

    Then ``bias`` (one value per row of ``c``, shape (m, 1)) is added and ``relu`` clamps
    the result at zero, while ``c`` is in cache."""
    _product(a, b, c, beta)
    if bias is not None or relu:
        bias_relu(c, bias, relu)


def bias_relu(c: np.ndarray, bias: np.ndarray | None, relu: bool, residual: np.ndarray | None = None) -> None:
    """``c += residual`` (when given: an array shaped like ``c``), ``c += bias`` (one value
    per row), then a Relu if asked. On a block of a matrix's
    columns numpy's ufuncs copy the rows through their buffers unless these are small, so
    both run with small buffers (measured on 64 rows of 1512 of 3025 floats: the sum 45 us
    with numpy's 8192-value buffers, 8.6 with 1024; as fast as writing the bias before the
    product, which then takes the ctypes call, ~8 us dearer than numpy's matmul)."""
    with_small_buffers(_bias_relu, c, bias, relu, residual)


def epilogue_loops() -> Any:
    """The compiled epilogue loops (``kernels._numba_epilogue``), or None without numba
    or while they are being built (see ``compiled_module``)."""
    return compiled_module("_numba_epilogue")


_F32 = np.dtype(np.float32)
_NO_BIAS: dict[int, np.ndarray] = {}  # float32 zeros by length: the bias of a Conv without one


def epilogue(
    matrix: np.ndarray,
    rows: slice,
    columns: slice,
    bias: np.ndarray | None,
    relu: bool,
    residual: np.ndarray | None = None,
) -> None:
    """:func:`bias_relu` on the block ``matrix[rows, columns]`` (unit-step slices) of a
    C-contiguous matrix: ``+ residual[rows, columns]`` (``residual`` shaped like
    ``matrix``), ``+ bias`` (one value per row of the block, shape (rows, 1)), then a Relu
    when asked. float32 takes one compiled pass where numba is there (one to three numpy
    passes through ufunc buffers otherwise)."""
    if bias is None and residual is None and not relu:
        return
    loops = epilogue_loops()
    if (
        loops is None
        or matrix.dtype != _F32
        or matrix.ndim != 2
        or not matrix.flags.c_contiguous
        or (bias is not None and bias.dtype != _F32)
        or (residual is not None and (residual.dtype != _F32 or residual.shape != matrix.shape or not residual.flags.c_contiguous))
    ):
        bias_relu(matrix[rows, columns], bias, relu, None if residual is None else residual[rows, columns])
        return
    r0, r1, _ = rows.indices(matrix.shape[0])
    j0, j1, _ = columns.indices(matrix.shape[1])
    if bias is None:
        values = _NO_BIAS.get(r1 - r0)
        if values is None:
            values = _NO_BIAS[r1 - r0] = np.zeros(r1 - r0, _F32)
    else:
        values = bias.reshape(-1)
    if residual is None:
        loops.bias_relu_rows(matrix, r0, r1, j0, j1, values, relu)
    else:
        loops.bias_residual_relu_rows(matrix, r0, r1, j0, j1, values, residual, relu)


def _bias_relu(c: np.ndarray, bias: np.ndarray | None, relu: bool, residual: np.ndarray | None) -> None:
    if residual is not None:
        np.add(c, residual, out=c)
    if bias is not None:
        np.add(c, bias, out=c)
    if relu:
        relu_into(c, c)


def _product(a: np.ndarray, b: np.ndarray, c: np.ndarray, beta: float) -> None:
    if beta == 0.0:
        # numpy's matmul calls the same BLAS on these views (leading dimensions and
        # transposes included) for ~1.6 us a call, where building this call's arguments
        # takes ~11 us; and for a single row it takes BLAS's gemv, 3-4x faster than gemm,
        # which packs all of b (1 x 9216 @ 9216 x 4096: 7.8 ms against 28 ms)
        np.matmul(a, b, out=c)
        return
    functions = _LIBRARY.functions if _LIBRARY.resolved else _LIBRARY.resolve()
    entry = functions.get(c.dtype)
    m, n = c.shape
    k = a.shape[1]
    if entry is not None and a.dtype == c.dtype and b.dtype == c.dtype and m > 1 and n and k:
        la, lb, lc = _layout(a), _layout(b), _layout(c)
        if la is not None and lb is not None and lc is not None and lc[0] == _NO_TRANS:
            function, _ = entry
            function(
                _ROW_MAJOR, la[0], lb[0], m, n, k, 1.0, a.ctypes.data, la[1], b.ctypes.data, lb[1], beta,
                c.ctypes.data, lc[1],
            )
            return
    if beta != 1.0:
        c *= beta
    c += np.matmul(a, b)


# Blocks of a split product: at least this many columns (or rows) each, so that every
# block keeps BLAS's panels full; two blocks per thread, claimed dynamically.
_SPLIT_GRAIN = 32
_BLOCKS_PER_THREAD = 2


def split_columns(n: int, body: Callable[[int, int], Any], work: int) -> None:
    """Run ``body(start, stop)`` over column blocks of ``range(n)`` on ``split_threads(work)``
    threads, each with one BLAS thread (or on this thread alone, BLAS single-threaded, for
    small work)."""
    threads = split_threads(work)
    if threads <= 1 or n < 2 * _SPLIT_GRAIN:
        blas_threads(0)
        body(0, n)
        return
    parallel_for(n, body, work, grain=_SPLIT_GRAIN, threads=threads, chunks_per_thread=_BLOCKS_PER_THREAD)


def splits_columns(m: int, n: int) -> bool:
    """Whether :func:`split_gemm` splits an m x n product into blocks of columns (else of
    rows: where it has far fewer columns than rows)."""
    return n >= m or n >= 8 * _SPLIT_GRAIN


def split_gemm(a: np.ndarray, b: np.ndarray, c: np.ndarray, beta: float = 0.0) -> None:
    """:func:`gemm` split into blocks of ``c``'s columns (or of its rows, see
    :func:`splits_columns`) over the free threads; each block packs its share of the wide
    operand and all of the narrow one, as one BLAS thread of a static split would."""
    m, n = c.shape
    work = m * n * a.shape[1]
    if beta == 0.0 and m < _STREAMED_WEIGHT_COST and pooled_matmul(a, b, c):
        return  # a few rows: the weight's read split on the pool (pooled_matmul)
    if splits_columns(m, n):

        def columns(start: int, stop: int) -> None:
            gemm(a, b[:, start:stop], c[:, start:stop], beta)

        split_columns(n, columns, work)
    else:

        def rows(start: int, stop: int) -> None:
            gemm(a[start:stop], b, c[start:stop], beta)

        split_columns(m, rows, work)


_F32 = np.dtype(np.float32)
#: A product of a few rows is as long as the read of its right operand: each of its floats
#: costs about this many multiply-adds' time (one core: ~34 G multiply-adds/s against ~4 G
#: floats/s from memory), so that a classifier's 1 x 1280 @ 1280 x 1000 (5 MB) is split
#: like a product of that many rows. In EfficientViT-B0 beside onnxruntime its two heads
#: took 280-320 us each on one thread (onnxruntime 175-225).
_STREAMED_WEIGHT_COST = 8
# Units of a pooled batch of products a thread (at least): small units let a worker that
# wakes late take its share (12 products of 128 x 128 x 64 on two threads: 137 us in row
# blocks of 64, 165 us a product a unit, 286 us on one thread). One product is cut in one
# block a thread: each block packs all of the narrow operand again ((64, 1024) @ (1024,
# 256) with cold caches: 258 us in two blocks, 279-345 in four, 307 on OpenBLAS's two).
_POOLED_UNITS_PER_THREAD = 8


def _batch_layout(a: np.ndarray, b: np.ndarray, batch: tuple[int, ...]) -> tuple[int, tuple[int, int], tuple[int, int]] | None:
    """How the flattened ``batch`` axes step through ``a`` and ``b``: ``(inner, (a's outer,
    a's inner), (b's outer, b's inner))``, matrix ``u`` at outer index ``u // inner`` and
    inner index ``u % inner``, strides in bytes (0 for a 2-D operand, one matrix for all).
    Adjacent batch axes fold where both operands step through them as one; None where
    more than two strides remain, or an operand's batch axes differ from ``batch``. An
    attention's heads from a transposed projection take two ((4, 4, 256, 24) with batch
    strides (98304, 96): MobileViT's scores)."""
    strides = []
    for x in (a, b):
        if x.ndim == 2:
            strides.append((0,) * len(batch))
        elif x.shape[:-2] != batch:
            return None
        else:
            strides.append(tuple(x.strides[:-2]))
    groups: list[list[int]] = []  # [size, a's stride, b's stride], outermost first
    for size, stride_a, stride_b in zip(batch, *strides):
        if size == 1:
            continue
        if groups and groups[-1][1] == stride_a * size and groups[-1][2] == stride_b * size:
            groups[-1] = [groups[-1][0] * size, stride_a, stride_b]
        else:
            groups.append([size, stride_a, stride_b])
    if len(groups) > 2:
        return None
    if len(groups) < 2:
        outer_a, outer_b = (groups[0][1], groups[0][2]) if groups else (0, 0)
        return 1, (outer_a, 0), (outer_b, 0)
    (_, outer_a, outer_b), (inner, inner_a, inner_b) = groups
    return inner, (outer_a, inner_a), (outer_b, inner_b)


def _gemm_job() -> Any:
    module = compiled_module("_numba_dense")
    return None if module is None else getattr(module, "gemm_job", None)


def pooled_matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> bool:
    """``out = a @ b`` (numpy's matmul: 2-D, or a batch of matrices, one operand possibly
    2-D for every matrix of the other) split on the compiled pool into units that each call
    the one-thread cblas_sgemm without the GIL (``_numba_dense.gemm_job``): matrices a unit
    where the batch has several a thread, else blocks of each product's rows or columns.
    Returns False, having done nothing, where it does not apply: not float32, a layout
    cblas cannot read, a product too small to split (``split_threads``), or no compiled
    pool; the caller then runs numpy's matmul.

    With the compiled pool, OpenBLAS's own threads are not used (``plugrt.threads.
    keep_blas_single``): each spins on its core for a time after every call (OpenBLAS's
    thread timeout, ~0.1 s), taking the core from the pool's next step and from whatever
    else the process runs next. Without it (no numba), numpy's matmul keeps OpenBLAS's
    threads for a big product, as before: splitting on ``parallel_for``'s Python threads
    ran BERT's products 1.8x slower."""
    if not (a.dtype == b.dtype == out.dtype == _F32) or a.ndim < 2 or b.ndim < 2 or not out.flags.c_contiguous:
        return False
    m, k = a.shape[-2:]
    n = b.shape[-1]
    batch = out.shape[:-2]
    count = int(np.prod(batch, dtype=np.int64)) if batch else 1
    if b.shape[-2] != k or out.shape[-2:] != (m, n) or m == 0 or n == 0 or k == 0 or count == 0:
        return False
    threads = split_threads(count * max(m, _STREAMED_WEIGHT_COST) * n * k)
    if threads <= 1:
        return False
    layouts = _layout(a), _layout(b)
    steps = _batch_layout(a, b, batch)
    address, job = sgemm_address(), _gemm_job()
    if None in layouts or steps is None or address is None or job is None:
        return False
    pool = compiled_pool()
    if pool is None:
        return False
    by_rows = not splits_columns(m, n)
    span = m if by_rows else n
    units = (_POOLED_UNITS_PER_THREAD if count > 1 else 1) * threads
    if count >= units:
        block = span  # whole matrices a unit
    else:
        block = max(_SPLIT_GRAIN, -(-span // -(-units // count)))
    blocks = -(-span // block)
    blas_threads(0)  # the calling thread runs units too: its BLAS on one thread
    (trans_a, lda), (trans_b, ldb) = layouts  # type: ignore[misc]
    inner, (outer_a, inner_a), (outer_b, inner_b) = steps
    matrix_bytes = m * n * out.itemsize  # out is C-contiguous: its matrices follow each other
    context = np.array(
        [
            address[0], int(address[1]), int(trans_a == _TRANS), int(trans_b == _TRANS), m, n, k, a.ctypes.data, lda, outer_a,
            b.ctypes.data, ldb, outer_b, out.ctypes.data, n, inner * matrix_bytes, block, blocks, int(by_rows),
            inner, inner_a, inner_b, matrix_bytes,
        ],
        np.int64,
    )
    pool.run(job.address, context, count * blocks, threads)
    return True


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """numpy's ``matmul(a, b, out=out)``, split on the compiled pool where
    :func:`pooled_matmul` applies, else on this thread's one BLAS thread."""
    if out is None:
        if a.dtype != _F32 or b.dtype != _F32 or a.ndim < 2 or b.ndim < 2:
            return np.matmul(a, b)
        try:
            batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        except ValueError:
            return np.matmul(a, b)  # numpy names the mismatch
        out = np.empty((*batch, a.shape[-2], b.shape[-1]), _F32)
    if not pooled_matmul(a, b, out):
        np.matmul(a, b, out=out)
    return out
