"""numba-compiled float32 loops of the dense layers' products (``x @ W + bias``, then a GELU): the activation read where it is, the weight in panels laid out once, and the bias (+ GELU) epilogue of a block of columns.

Why: a transformer's Linear layers are ``(tokens, K) @ (K, N)`` with ``N`` the weight's
columns. The constant weight is laid out once into 16-column panels; the activation's
rows are read where they are (each step of a tile broadcasts one float of each of its
rows), and each tile of 8 rows by three panels lands in ``C`` row-major, in place, with
nothing transposed. The activation used to be packed per call into the micro-kernel's row
tiles, on one thread before the product: 0.39 ms warm and 0.75 cold for ConvNeXt's
3136 x 384 (the product itself 1.3 ms on two threads).

Imported only through :func:`plugrt_cpu.kernels._compiled.compiled_module` (``None``
without numba or with ``PLUGRT_NUMBA=0``); the callers then run BLAS and numpy's ufuncs.
Compiled code is cached on disk (``cache=True``).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._numba_gemm import _V, _VI64, _VMASK, _VW, _ahead, _c, _floats, _k_loop, _splat, _vector_at, _vector_functions
from ._numba_loops import _gelu, _gelu_tanh, _softmax_row
from ._numba_parallel import float32_pointer, int64_pointer, sgemm_any32, sgemm_any64

__all__ = [
    "ATTENTION_WORDS", "FEW_WORDS", "GELU_ERF", "GELU_NONE", "GELU_TANH", "GEMM_WORDS", "JOB_WORDS", "VECTOR", "attention_job", "bias_columns", "few_rows_job", "few_rows_product", "gemm_job", "panel_job",
    "panel_product",
]

VECTOR = 16  # columns of one panel of the weight: one vector of the micro-kernel
#: The epilogue's activation after the bias (the ``gelu`` argument of the products): none,
#: the erf GELU, or its tanh approximation (GPT-2's).
GELU_NONE, GELU_ERF, GELU_TANH = 0, 1, 2
_FLOAT = 4
_F32_ZERO = np.float32(0.0)

_FLAGS: dict[str, Any] = dict(fastmath={"contract", "arcp", "nsz", "afn", "reassoc"}, nogil=True, boundscheck=False, error_model="numpy", cache=True)
_MATRIX = numba.float32[:, ::1]
_BIAS = numba.types.Array(numba.float32, 1, "C", readonly=True)
_PANELS = numba.types.Array(numba.float32, 3, "C", readonly=True)


#: Rows of ``a`` per tile: half a packed weight tile of ``_numba_gemm`` (MR rows). Eight rows by three panels
#: make 24 accumulators: each step of K loads three vectors of the weight and broadcasts
#: eight floats of ``a`` for 24 fused multiply-adds, where sixteen rows by one panel took
#: seventeen loads for sixteen. (197 x 768 @ 768 x 3072 on one thread of a 2.6 GHz Xeon:
#: 125-133 -> 156-160 GFLOP/s, onnxruntime's MLAS 137-138.)
ROWS = 8
PANELS = 3


def _tile_step(builder, left, weights, row_at, panel_at, rows, panels):  # type: ignore[no-untyped-def]
    """The step of K of a tile of ``rows`` rows by ``panels`` panels: each panel's vector
    (at ``panel_at[p]`` floats from ``weights`` plus the step's) times each row's float
    (at ``row_at[r]`` floats from ``left`` plus the step), added to its accumulator."""
    fma = _vector_functions(builder.module)[0]

    def step(index, accumulators):  # type: ignore[no-untyped-def]
        at = builder.mul(index, _c(_VW))
        vectors = [builder.load(_vector_at(builder, weights, builder.add(at, panel_at[p])), align=4) for p in range(panels)]
        sums = list(accumulators)
        for r in range(rows):
            value = _splat(builder, builder.load(builder.gep(left, [builder.add(row_at[r], index)])), _V)
            for p in range(panels):
                sums[r * panels + p] = builder.call(fma, [value, vectors[p], accumulators[r * panels + p]])
        return sums

    return step


def _clamped(builder, count, used, scale):  # type: ignore[no-untyped-def]
    """``min(i, used - 1) * scale`` for ``i`` in ``range(count)``: the offsets of a tile's
    rows (or panels), those past the ``used`` ones reading the last used one again (their
    sums are not stored)."""
    last = builder.sub(used, _c(1))
    return [builder.mul(builder.select(builder.icmp_signed("<", _c(i), used), _c(i), last), scale) for i in range(count)]


def _column_masks(builder, columns):  # type: ignore[no-untyped-def]
    """(all lanes, the lanes below ``columns``): a whole panel's store and the last one's."""
    lanes = ir.Constant(_VI64, list(range(_VW)))
    return ir.Constant(_VMASK, [1] * _VW), builder.icmp_signed("<", lanes, _splat(builder, columns, _VI64))


def _panel_codegen(panels: int):  # type: ignore[no-untyped-def]
    """The code of ``_panel_tile{panels}``."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        a, lda, x, stride, k, c, ldc, columns, rows, accumulate = args
        _, masked_load, masked_store = _vector_functions(builder.module)
        four = ir.Constant(ir.IntType(32), 4)
        zero = ir.Constant(_V, [0.0] * _VW)
        full, last = _column_masks(builder, columns)
        masks = [full] * (panels - 1) + [last]
        left, weights = _floats(builder, a), _floats(builder, x)
        row_at = _clamped(builder, ROWS, rows, lda)

        step = _tile_step(builder, left, weights, row_at, [builder.mul(stride, _c(p)) for p in range(panels)], ROWS, panels)
        sums = _k_loop(builder, k, ROWS * panels, step)
        out = _floats(builder, c)
        adding = builder.icmp_signed("!=", accumulate, _c(0))
        for r in range(ROWS):
            with builder.if_then(builder.icmp_signed("<", _c(r), rows)):
                for p in range(panels):
                    where = _vector_at(builder, out, builder.add(builder.mul(_c(r), ldc), _c(p * _VW)))
                    value = sums[r * panels + p]
                    before = builder.block
                    with builder.if_then(adding):
                        added = builder.fadd(value, builder.call(masked_load, [where, four, masks[p], zero]))
                        added_end = builder.block
                    result = builder.phi(_V)
                    result.add_incoming(added, added_end)
                    result.add_incoming(value, before)
                    builder.call(masked_store, [result, where, four, masks[p]])

    return codegen


def _panel_tile(panels: int):  # type: ignore[no-untyped-def]
    @intrinsic
    def tile(typingctx, a, lda, x, stride, k, c, ldc, columns, rows, accumulate):  # type: ignore[no-untyped-def]
        """``C[r, :] (+)= sum_k a[r, k] * X_p[k, :]`` for rows ``r < rows`` (at most ROWS) and
        ``panels`` weight panels side by side: ``a`` the tile's first row at its first step
        (rows ``lda`` floats apart, read where they are), ``x`` the first panel's step 0
        (the next panel ``stride`` floats on), ``c`` the tile's first element (row step
        ``ldc``), ``columns`` the valid columns of the last panel (the others are whole);
        ``accumulate`` non-zero adds to C."""
        return types.void(*([types.int64] * 10)), _panel_codegen(panels)

    return tile


_panel_tile1, _panel_tile2, _panel_tile3 = _panel_tile(1), _panel_tile(2), _panel_tile(3)


@numba.njit([numba.void(_MATRIX, _BIAS, numba.int64, numba.int64, numba.int64)], **_FLAGS)
def bias_columns(c, bias, j0, j1, gelu):  # pragma: no cover  (compiled)
    """``c[:, j0:j1] += bias[j0:j1]``, then the GELU ``gelu`` names (``GELU_ERF`` as
    ``_numba_loops.bias_gelu_rows`` computes it, ``GELU_TANH`` as ``_numba_loops.gelu_tanh``),
    in place: the epilogue of one block of columns while it is in cache."""
    count = j1 - j0
    shift = bias[j0:j1]
    for i in range(c.shape[0]):
        row = c[i, j0:j1]
        if gelu == GELU_ERF:
            for j in range(count):
                row[j] = _gelu(row[j] + shift[j])
        elif gelu == GELU_TANH:
            for j in range(count):
                row[j] = _gelu_tanh(row[j] + shift[j])
        else:
            for j in range(count):
                row[j] = row[j] + shift[j]


@numba.njit(
    [numba.void(numba.int64, numba.int64, _PANELS, _MATRIX, _BIAS, numba.int64, numba.int64, numba.int64, numba.int64, numba.int64,
                numba.int64, numba.int64)],
    **_FLAGS,
)
def panel_product(a, lda, panels, c, bias, gelu, t0, t1, depth, r_lo, r_hi, block):  # pragma: no cover  (compiled)
    """``c[r, j] = epilogue(a @ w)[r, j]`` for rows [r_lo, r_hi) (``r_lo`` a multiple of MR)
    and the columns of panels [t0, t1): ``a`` the address of the activation (M, K), its
    rows ``lda`` floats apart, read where they are; ``panels`` the weight (K, N) as (ceil(N / VECTOR), K, VECTOR) panels, zero past column
    N; the epilogue adds ``bias`` (N,) and then the GELU ``gelu`` names (``GELU_*``).

    The rows go in blocks of ``block`` rows (a multiple of MR: ``dense.cache_rows``), each
    block through every group of PANELS panels, ROWS rows of ``a`` a tile. Each group runs
    in slices of at most ``depth`` steps of K, every row tile of the block over one slice
    of the group before the next: the slice (contiguous blocks: the weight was laid out
    once) stays in the L1 cache while the row tiles' slices come from L2. A slice after the
    first adds the partial sums; the epilogue runs on the block's columns of the group
    while they are in cache."""
    k = panels.shape[1]
    n = c.shape[1]
    ldc = c.shape[1]
    x, out = panels.ctypes.data, c.ctypes.data
    slices = (k + depth - 1) // depth
    stride = k * VECTOR  # floats from one panel to the next
    for b0 in range(r_lo, r_hi, block):
        b1 = min(r_hi, b0 + block)
        tiles = (b1 - b0 + ROWS - 1) // ROWS
        for t in range(t0, t1, PANELS):
            count = min(PANELS, t1 - t)
            j0 = t * VECTOR
            width = min(count * VECTOR, n - j0)
            columns = width - (count - 1) * VECTOR  # of the group's last panel
            group = x + t * stride * _FLOAT
            for s in range(slices):
                k0 = s * k // slices
                steps = (s + 1) * k // slices - k0
                # the next slice of the group's panels (after the last, the next group's first),
                # a share before each row tile: it comes from memory while this slice computes
                if s + 1 < slices:
                    ahead = group + (s + 1) * k // slices * VECTOR * _FLOAT
                    ahead_bytes = ((s + 2) * k // slices - (s + 1) * k // slices) * VECTOR * _FLOAT
                    ahead_panels = count
                else:
                    ahead = x + (t + PANELS) * stride * _FLOAT
                    ahead_bytes = (k // slices) * VECTOR * _FLOAT
                    ahead_panels = min(PANELS, t1 - t - PANELS)
                for r0 in range(b0, b1, ROWS):
                    for p in range(ahead_panels):
                        _ahead(ahead + p * stride * _FLOAT, ahead_bytes, (r0 - b0) // ROWS, tiles)
                    left = a + (r0 * lda + k0) * _FLOAT
                    right = group + k0 * VECTOR * _FLOAT
                    offset = out + (r0 * ldc + j0) * _FLOAT
                    tile_rows = min(ROWS, b1 - r0)
                    if count == 3:
                        _panel_tile3(left, lda, right, stride, steps, offset, ldc, columns, tile_rows, s)
                    elif count == 2:
                        _panel_tile2(left, lda, right, stride, steps, offset, ldc, columns, tile_rows, s)
                    else:
                        _panel_tile1(left, lda, right, stride, steps, offset, ldc, columns, tile_rows, s)
            bias_columns(c[b0:b1], bias, j0, j0 + width, gelu)


# -- products of fewer rows than a packed row tile (a classifier at batch 1, a decode step) --

#: (rows, panels) of the few-row tiles: the weight's panels streamed from memory once for
#: every row of the tile, each step ``panels`` vector loads for rows x panels fused
#: multiply-adds (a row tile of MR rows would multiply MR - rows rows of padding).
FEW_TILES = ((1, 8), (2, 8), (4, 6))


def _few_codegen(rows: int, panels: int):  # type: ignore[no-untyped-def]
    """The code of a few-row tile of at most ``rows`` rows by ``panels`` panels."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        a, lda, x, stride, k, c, ldc, used_rows, count, columns, bias = args
        _, masked_load, masked_store = _vector_functions(builder.module)
        four = ir.Constant(ir.IntType(32), 4)
        zero = ir.Constant(_V, [0.0] * _VW)
        full, last = _column_masks(builder, columns)
        left, weights = _floats(builder, a), _floats(builder, x)
        row_at, panel_at = _clamped(builder, rows, used_rows, lda), _clamped(builder, panels, count, stride)

        sums = _k_loop(builder, k, rows * panels, _tile_step(builder, left, weights, row_at, panel_at, rows, panels))
        out, shift = _floats(builder, c), _floats(builder, bias)
        for p in range(panels):
            with builder.if_then(builder.icmp_signed("<", _c(p), count)):
                mask = builder.select(builder.icmp_signed("==", _c(p), builder.sub(count, _c(1))), last, full)
                offset = builder.call(masked_load, [_vector_at(builder, shift, _c(p * _VW)), four, mask, zero])
                for r in range(rows):
                    with builder.if_then(builder.icmp_signed("<", _c(r), used_rows)):
                        where = _vector_at(builder, out, builder.add(builder.mul(_c(r), ldc), _c(p * _VW)))
                        builder.call(masked_store, [builder.fadd(sums[r * panels + p], offset), where, four, mask])

    return codegen


def _few_tile(rows: int, panels: int):  # type: ignore[no-untyped-def]
    @intrinsic
    def tile(typingctx, a, lda, x, stride, k, c, ldc, used_rows, count, columns, bias):  # type: ignore[no-untyped-def]
        """``C[r, :] = bias + sum_k a[r, k] * X_p[k, :]`` for rows ``r < used_rows`` (at most
        ``rows``) and panels ``p < count`` (at most ``panels``): ``a`` row 0 of the rows
        (row step ``lda`` floats), ``x`` the first panel's step 0 (the next ``stride`` floats
        on), ``c`` the tile's first element (row step ``ldc``), ``columns`` the valid
        columns of panel ``count - 1``, ``bias`` the first panel's columns of the bias."""
        return types.void(*([types.int64] * 11)), _few_codegen(rows, panels)

    return tile


_few_tile1, _few_tile2, _few_tile4 = (_few_tile(*shape) for shape in FEW_TILES)


@numba.njit([numba.void(numba.int64, numba.int64, numba.int64, _PANELS, _MATRIX, _BIAS, numba.int64, numba.int64, numba.int64)], **_FLAGS)
def few_rows_product(a, lda, m, panels, c, bias, gelu, t0, t1):  # pragma: no cover  (compiled)
    """``c[:, j] = epilogue(a @ w)[:, j]`` for the columns of panels [t0, t1): ``a`` the
    address of the first of ``m`` rows (few: under a packed row tile) of K floats, ``lda``
    floats apart, read where they are; ``panels`` the weight (K, N) as (ceil(N / VECTOR),
    K, VECTOR) panels. Every panel is streamed once for up to four rows (``FEW_TILES``).
    The epilogue adds ``bias`` (N,), then the GELU ``gelu`` names (``GELU_*``)."""
    k = panels.shape[1]
    n = c.shape[1]
    ldc = c.shape[1]
    stride = k * VECTOR
    x = panels.ctypes.data
    for r0 in range(0, m, 4):
        rows = min(4, m - r0)
        left = a + r0 * lda * _FLOAT
        widest = 6 if rows > 2 else 8
        for t in range(t0, t1, widest):
            count = min(widest, t1 - t)
            j0 = t * VECTOR
            columns = min(count * VECTOR, n - j0) - (count - 1) * VECTOR
            right = x + t * stride * _FLOAT
            offset = c.ctypes.data + (r0 * ldc + j0) * _FLOAT
            shift = bias.ctypes.data + j0 * _FLOAT
            if rows == 1:
                _few_tile1(left, lda, right, stride, k, offset, ldc, rows, count, columns, shift)
            elif rows == 2:
                _few_tile2(left, lda, right, stride, k, offset, ldc, rows, count, columns, shift)
            else:
                _few_tile4(left, lda, right, stride, k, offset, ldc, rows, count, columns, shift)
    if gelu == GELU_ERF:
        for i in range(m):
            row = c[i]
            for j in range(t0 * VECTOR, min(n, t1 * VECTOR)):
                row[j] = _gelu(row[j])
    elif gelu == GELU_TANH:
        for i in range(m):
            row = c[i]
            for j in range(t0 * VECTOR, min(n, t1 * VECTOR)):
                row[j] = _gelu_tanh(row[j])


# The context of ``few_rows_job`` (int64 words; see ``kernels.dense.dense_product``): a unit
# is ``FEW_PANELS_PER_UNIT`` panels of every row.
FEW_A, FEW_LDA, FEW_ROWS, FEW_DEPTH, FEW_PANELS, FEW_PANEL_COUNT, FEW_C, FEW_COLUMNS, FEW_BIAS, FEW_GELU, FEW_PER_UNIT = range(11)
FEW_WORDS = 11


@numba.cfunc(numba.void(numba.int64, numba.int64, numba.int64, numba.int64), nogil=True, cache=True)
def few_rows_job(c, start, stop, slot):  # pragma: no cover  (compiled)
    """Units [start, stop) of :func:`few_rows_product` on the compiled pool, without the GIL."""
    context = numba.carray(int64_pointer(c), FEW_WORDS)
    m, count, n = context[FEW_ROWS], context[FEW_PANEL_COUNT], context[FEW_COLUMNS]
    panels = numba.carray(float32_pointer(context[FEW_PANELS]), (count, context[FEW_DEPTH], VECTOR))
    out = numba.carray(float32_pointer(context[FEW_C]), (m, n))
    bias = numba.carray(float32_pointer(context[FEW_BIAS]), n)
    per_unit = context[FEW_PER_UNIT]
    few_rows_product(
        context[FEW_A], context[FEW_LDA], m, panels, out, bias, context[FEW_GELU], start * per_unit, min(count, stop * per_unit)
    )


# The context of ``panel_job`` (int64 words; see ``kernels.dense.dense_product``): a unit
# is ``JOB_ROW_BLOCK`` rows (a multiple of MR; the last block fewer) by
# ``JOB_PANELS_PER_UNIT`` panels, unit ``u`` the block ``u // JOB_CHUNKS`` of rows and the
# chunk ``u % JOB_CHUNKS`` of panels; ``JOB_CACHE_ROWS`` is ``panel_product``'s ``block``.
(
    JOB_A, JOB_LDA, JOB_DEPTH_K, JOB_PANELS, JOB_PANEL_COUNT, JOB_C, JOB_ROWS, JOB_COLUMNS, JOB_BIAS,
    JOB_GELU, JOB_SLICE, JOB_PANELS_PER_UNIT, JOB_ROW_BLOCK, JOB_CHUNKS, JOB_CACHE_ROWS,
) = range(15)
JOB_WORDS = 15


@numba.cfunc(numba.void(numba.int64, numba.int64, numba.int64, numba.int64), nogil=True, cache=True)
def panel_job(c, start, stop, slot):  # pragma: no cover  (compiled)
    """Units [start, stop) of a dense product on the compiled pool: each unit a block of
    rows by ``JOB_PANELS_PER_UNIT`` weight panels, by :func:`panel_product`, without the GIL."""
    context = numba.carray(int64_pointer(c), JOB_WORDS)
    k = context[JOB_DEPTH_K]
    count = context[JOB_PANEL_COUNT]
    rows = context[JOB_ROWS]
    panels = numba.carray(float32_pointer(context[JOB_PANELS]), (count, k, VECTOR))
    out = numba.carray(float32_pointer(context[JOB_C]), (rows, context[JOB_COLUMNS]))
    bias = numba.carray(float32_pointer(context[JOB_BIAS]), context[JOB_COLUMNS])
    group, block, chunks = context[JOB_PANELS_PER_UNIT], context[JOB_ROW_BLOCK], context[JOB_CHUNKS]
    for unit in range(start, stop):
        r_lo = (unit // chunks) * block
        first = (unit % chunks) * group
        last = min(count, first + group)
        r_hi = min(rows, r_lo + block)
        if first < last and r_lo < r_hi:
            panel_product(
                context[JOB_A], context[JOB_LDA], panels, out, bias, context[JOB_GELU], first, last, context[JOB_SLICE], r_lo, r_hi,
                context[JOB_CACHE_ROWS],
            )


# The context of ``gemm_job`` (int64 words; see ``kernels._gemm.pooled_matmul``): the
# cblas_sgemm and whether its integers are 64-bit, each operand's transpose, the sizes of
# one product, each matrix's address, leading dimension and bytes to the next matrix of the
# batch, and how the units cut it: ``GEMM_BLOCKS`` blocks of ``GEMM_BLOCK`` rows (or
# columns) a matrix. A batch whose axes fold into two strides (an attention's heads of a
# transposed projection: the batch axes of (4, 4, 256, 24) with strides (98304, 96)) counts
# matrix ``u`` as ``(u // GEMM_INNER, u % GEMM_INNER)``, the ``GEMM_STRIDE_*`` words the
# bytes from one outer index to the next and the ``GEMM_INNER_*`` ones from one inner
# index to the next (``GEMM_INNER`` 1: one stride).
(
    GEMM_FUNCTION, GEMM_LONG, GEMM_TRANS_A, GEMM_TRANS_B, GEMM_M, GEMM_N, GEMM_K, GEMM_A, GEMM_LDA, GEMM_STRIDE_A,
    GEMM_B, GEMM_LDB, GEMM_STRIDE_B, GEMM_C, GEMM_LDC, GEMM_STRIDE_C, GEMM_BLOCK, GEMM_BLOCKS, GEMM_BY_ROWS,
    GEMM_INNER, GEMM_INNER_A, GEMM_INNER_B, GEMM_INNER_C,
) = range(23)
GEMM_WORDS = 23


@numba.cfunc(numba.void(numba.int64, numba.int64, numba.int64, numba.int64), nogil=True, cache=True)
def gemm_job(c, start, stop, slot):  # pragma: no cover  (compiled)
    """Units [start, stop) of a (batched) float32 product on the compiled pool: unit ``u``
    is block ``u % GEMM_BLOCKS`` of the rows (or columns) of matrix ``u // GEMM_BLOCKS``,
    one call of the one-thread cblas_sgemm each, without the GIL."""
    context = numba.carray(int64_pointer(c), GEMM_WORDS)
    trans_a, trans_b = context[GEMM_TRANS_A], context[GEMM_TRANS_B]
    m, n, k = context[GEMM_M], context[GEMM_N], context[GEMM_K]
    lda, ldb, ldc = context[GEMM_LDA], context[GEMM_LDB], context[GEMM_LDC]
    block, blocks, by_rows = context[GEMM_BLOCK], context[GEMM_BLOCKS], context[GEMM_BY_ROWS] != 0
    inner = context[GEMM_INNER]
    for unit in range(start, stop):
        matrix = unit // blocks
        lo = (unit - matrix * blocks) * block
        outer = matrix // inner
        within = matrix - outer * inner
        a = context[GEMM_A] + outer * context[GEMM_STRIDE_A] + within * context[GEMM_INNER_A]
        b = context[GEMM_B] + outer * context[GEMM_STRIDE_B] + within * context[GEMM_INNER_B]
        out = context[GEMM_C] + outer * context[GEMM_STRIDE_C] + within * context[GEMM_INNER_C]
        rows, columns = m, n
        if by_rows:
            rows = min(m, lo + block) - lo
            a += (lo if trans_a != 0 else lo * lda) * _FLOAT
            out += lo * ldc * _FLOAT
        else:
            columns = min(n, lo + block) - lo
            b += (lo * ldb if trans_b != 0 else lo) * _FLOAT
            out += lo * _FLOAT
        if rows <= 0 or columns <= 0:
            continue
        if context[GEMM_LONG] != 0:
            sgemm_any64(context[GEMM_FUNCTION], trans_a, trans_b, rows, columns, k, a, lda, b, ldb, out, ldc)
        else:
            sgemm_any32(context[GEMM_FUNCTION], trans_a, trans_b, rows, columns, k, a, lda, b, ldb, out, ldc)


# The context of ``attention_job`` (int64 words; see ``kernels.attention``): the
# cblas_sgemm and whether its integers are 64-bit; the heads a batch entry (H), the queries
# (S), the keys (T), the query/key width (D) and the value width (E); then for each
# operand its address and its steps in floats from one batch entry and from one head to
# the next (0 where it is broadcast): q (S, D) rows ``ATT_Q_LD`` apart, its transpose flag;
# the keys' operand of the scores' product (D, T), as cblas takes it (transpose flag,
# leading dimension); v (T, E), likewise; the output's (S, E) rows ``ATT_OUT_LD`` apart; the
# additive mask (0: none), each query's row of T values ``ATT_MASK_LD`` apart (0: one row
# for every query); the scale (a float32 in the word's low half); whether NaN rows become
# zeros; the work rows (one (S, T) block per slot of the pool).
(
    ATT_FUNCTION, ATT_LONG, ATT_HEADS, ATT_QUERIES, ATT_KEYS, ATT_DEPTH, ATT_WIDTH,
    ATT_Q, ATT_Q_BATCH, ATT_Q_HEAD, ATT_Q_LD, ATT_Q_TRANS,
    ATT_K, ATT_K_BATCH, ATT_K_HEAD, ATT_K_LD, ATT_K_TRANS,
    ATT_V, ATT_V_BATCH, ATT_V_HEAD, ATT_V_LD, ATT_V_TRANS,
    ATT_OUT, ATT_OUT_BATCH, ATT_OUT_HEAD, ATT_OUT_LD,
    ATT_MASK, ATT_MASK_BATCH, ATT_MASK_HEAD, ATT_MASK_LD,
    ATT_SCALE, ATT_ZERO_NAN, ATT_WORK,
) = range(33)
ATTENTION_WORDS = 33


@numba.cfunc(numba.void(numba.int64, numba.int64, numba.int64, numba.int64), nogil=True, cache=True)
def attention_job(c, start, stop, slot):  # pragma: no cover  (compiled)
    """Units [start, stop) of a scaled dot-product attention on the compiled pool, one
    (batch entry, head) a unit, without the GIL: the scores ``q @ k^T`` by the one-thread
    cblas_sgemm into this slot's work rows, each row scaled, the mask's row added and its
    softmax taken while it is in cache (NaN -> 0 where asked), then ``p @ v`` by cblas
    straight into the output's rows for this head."""
    context = numba.carray(int64_pointer(c), ATTENTION_WORDS)
    function, heads = context[ATT_FUNCTION], context[ATT_HEADS]
    s, t, d, e = context[ATT_QUERIES], context[ATT_KEYS], context[ATT_DEPTH], context[ATT_WIDTH]
    scale = numba.carray(float32_pointer(c + ATT_SCALE * 8), 1)[0]
    zero_nan = context[ATT_ZERO_NAN] != 0
    mask = context[ATT_MASK]
    scores = context[ATT_WORK] + slot * s * t * _FLOAT
    rows = numba.carray(float32_pointer(scores), (s, t))
    for unit in range(start, stop):
        b = unit // heads
        h = unit - b * heads
        q = context[ATT_Q] + (b * context[ATT_Q_BATCH] + h * context[ATT_Q_HEAD]) * _FLOAT
        k = context[ATT_K] + (b * context[ATT_K_BATCH] + h * context[ATT_K_HEAD]) * _FLOAT
        v = context[ATT_V] + (b * context[ATT_V_BATCH] + h * context[ATT_V_HEAD]) * _FLOAT
        out = context[ATT_OUT] + (b * context[ATT_OUT_BATCH] + h * context[ATT_OUT_HEAD]) * _FLOAT
        if context[ATT_LONG] != 0:
            sgemm_any64(function, context[ATT_Q_TRANS], context[ATT_K_TRANS], s, t, d, q, context[ATT_Q_LD], k, context[ATT_K_LD], scores, t)
        else:
            sgemm_any32(function, context[ATT_Q_TRANS], context[ATT_K_TRANS], s, t, d, q, context[ATT_Q_LD], k, context[ATT_K_LD], scores, t)
        added = mask + (b * context[ATT_MASK_BATCH] + h * context[ATT_MASK_HEAD]) * _FLOAT
        for i in range(s):
            row = rows[i]
            if mask != 0:
                values = numba.carray(float32_pointer(added + i * context[ATT_MASK_LD] * _FLOAT), t)
                for j in range(t):
                    row[j] = row[j] * scale + values[j]
            else:
                for j in range(t):
                    row[j] = row[j] * scale
            _softmax_row(row, row)
            if zero_nan:
                for j in range(t):
                    value = row[j]
                    row[j] = value if value == value else _F32_ZERO
        if context[ATT_LONG] != 0:
            sgemm_any64(function, 0, context[ATT_V_TRANS], s, e, t, scores, t, v, context[ATT_V_LD], out, context[ATT_OUT_LD])
        else:
            sgemm_any32(function, 0, context[ATT_V_TRANS], s, e, t, scores, t, v, context[ATT_V_LD], out, context[ATT_OUT_LD])
