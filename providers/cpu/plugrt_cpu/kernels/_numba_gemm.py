"""A float32 GEMM with the weight packed once, for AVX-512 hosts: ``C = W @ X`` with the
epilogue (residual, bias, Relu) applied as each tile of ``C`` is stored. The Conv units
(``_numba_conv``) call it in place of the BLAS GEMM where the host has AVX-512.

Why: OpenBLAS packs both operands on every call, and a Conv's operands come cold from the
previous step (its weight from memory, its input just written by another thread): in the
models its 1x1 and im2col products ran at 26-32 multiply-adds per ns and thread where
onnxruntime's kernels, whose weights are laid out once when the session is built, ran at
38-46. This kernel reads the weight in the order it was packed and the columns where they
are, so nothing is copied per call.

The micro-kernel is written in LLVM IR (an ``@intrinsic``): a tile of ``MR`` = 16 rows of
``C`` by one 16-float vector of columns, its 16 accumulators in registers, each step ``k``
one (masked) vector load of ``X[k, n:n + 16]`` and 16 fused multiply-adds by the
broadcast ``W[r, k]``. Masked loads and stores take a ragged last tile of columns, so no
read or write passes the end of a row. The packed weight is ``[ceil(M / MR)][K][MR]``,
zero rows after ``M``; a tile stores only its rows below ``M``.

Rounding: fused multiply-adds in ``k`` order, so the values differ from BLAS's within the
usual float32 GEMM error; the epilogue adds in ``_numba_epilogue``'s order,
``(c + residual) + bias``, then ``c < 0 -> 0`` (NaN stays NaN).

Imported only through :func:`plugrt_cpu.kernels._compiled.compiled_module` (``None``
without numba or with ``PLUGRT_NUMBA=0``); :func:`available` says whether the host has
the vector unit it is written for. Compiled code is cached on disk (``cache=True``).
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._host_cpu import data_cache_bytes, host_features

__all__ = ["MR", "READ_ROWS_MAX_DEPTH", "available", "gathered_product", "pack_weight", "packed_product", "read_product"]

MR = 16  # rows of C (output channels) per tile
NB = 7  # columns of a narrow product's tiles (``_column_tile``): 7x7, 14x14, 28x28 outputs
_VW = 16  # floats per vector: the columns of a tile
_UNROLL = 4  # steps of k per loop iteration
# Steps of k per slice: a slice of a deep product's columns then fits the chunk whole.
_SLICE = 1024
_NARROW = 112  # columns up to which a product may go by ``_column_tile``
_FLOAT = 4


def _chunk_floats() -> int:
    """Floats of X one chunk of column tiles spans (K x columns): five eighths of the L2
    cache, so that a chunk stays there while every row tile of W passes over it (measured
    on a 1 MiB L2: 160 Ki floats). The host's L2 where numba compiles for this host, else
    512 KiB's (a cache compiled for a portable target holds no one host's sizes). The value
    is compiled in: numba's on-disk cache is keyed by the CPU's name and features, and one
    CPU model has one L2 size."""
    l2 = data_cache_bytes(2, 512 * 1024) if host_features() else 512 * 1024
    return max(16 * 1024, l2 * 5 // 8 // _FLOAT)


_CHUNK_FLOATS = _chunk_floats()

_F32 = ir.FloatType()
_I64 = ir.IntType(64)
_I32 = ir.IntType(32)
_I1 = ir.IntType(1)
_V = ir.VectorType(_F32, _VW)
_VMASK = ir.VectorType(_I1, _VW)
_VI64 = ir.VectorType(_I64, _VW)
_V8 = ir.VectorType(_F32, 8)  # a row of a narrow tile: NB columns and one spare
_VMASK8 = ir.VectorType(_I1, 8)


@functools.cache
def available() -> bool:
    """Whether the host has AVX-512 and numba compiles for it (the kernel's vectors are
    512 bits; elsewhere LLVM would split each into narrower ones, and BLAS is the better
    choice). ``NUMBA_CPU_NAME`` set to another CPU (a portable cache) turns it off."""
    return bool(host_features().get("avx512f", False))


def pack_weight(weight: np.ndarray) -> np.ndarray:
    """``weight`` (M, K) float32 as the kernel reads it: ``[ceil(M / MR)][K][MR]``, rows
    after M zero, on a 64-byte boundary."""
    m, k = weight.shape
    blocks = -(-m // MR)
    raw = np.empty(blocks * k * MR + 16, np.float32)
    offset = (-raw.ctypes.data % 64) // _FLOAT
    packed = raw[offset : offset + blocks * k * MR].reshape(blocks, k, MR)
    padded = np.zeros((blocks * MR, k), np.float32)
    padded[:m] = weight
    packed[...] = padded.reshape(blocks, MR, k).transpose(0, 2, 1)
    return packed


def _c(value: int) -> ir.Constant:
    return ir.Constant(_I64, value)


def _splat(builder, value, vector_type):  # type: ignore[no-untyped-def]
    undefined = ir.Constant(vector_type, ir.Undefined)
    one = builder.insert_element(undefined, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undefined, ir.Constant(ir.VectorType(_I32, vector_type.count), [0] * vector_type.count))


def _store_row(builder, value, masked, mask, target, residual_at, bias_at, has_residual, has_bias, relu):  # type: ignore[no-untyped-def]
    """Store one row of a tile, ``value`` (a vector of its columns), at ``target`` under
    ``mask``: ``(value + residual) + bias`` (the residual's row at ``residual_at`` where
    ``has_residual``, the row's bias at ``bias_at`` where ``has_bias``), then ``< 0 -> 0``
    where ``relu`` (NaN stays NaN). ``masked``: the masked load and store for its type."""
    masked_load, masked_store = masked
    kind = value.type
    four = ir.Constant(_I32, 4)
    zero = ir.Constant(kind, [0.0] * kind.count)
    before = builder.block
    with builder.if_then(has_residual):
        added = builder.fadd(value, builder.call(masked_load, [residual_at, four, mask, zero]))
        added_end = builder.block
    summed = builder.phi(kind)
    summed.add_incoming(added, added_end)
    summed.add_incoming(value, before)
    before = builder.block
    with builder.if_then(has_bias):
        biased = builder.fadd(summed, _splat(builder, builder.load(bias_at), kind))
        biased_end = builder.block
    result = builder.phi(kind)
    result.add_incoming(biased, biased_end)
    result.add_incoming(summed, before)
    negative = builder.and_(builder.fcmp_ordered("<", result, zero), _splat(builder, relu, ir.VectorType(_I1, kind.count)))
    builder.call(masked_store, [builder.select(negative, zero, result), target, four, mask])


def _floats(builder, address):  # type: ignore[no-untyped-def]
    return builder.inttoptr(address, _F32.as_pointer())


def _vector_at(builder, base, index):  # type: ignore[no-untyped-def]
    return builder.bitcast(builder.gep(base, [index]), _V.as_pointer())


def _vector_functions(module):  # type: ignore[no-untyped-def]
    """LLVM's fused multiply-add, masked load and masked store of a 16-float vector, declared
    in ``module``: what the tiles' code calls."""
    fma = cgutils.get_or_insert_function(module, ir.FunctionType(_V, [_V, _V, _V]), "llvm.fma.v16f32")
    masked_load = cgutils.get_or_insert_function(
        module, ir.FunctionType(_V, [_V.as_pointer(), _I32, _VMASK, _V]), "llvm.masked.load.v16f32.p0"
    )
    masked_store = cgutils.get_or_insert_function(
        module, ir.FunctionType(ir.VoidType(), [_V, _V.as_pointer(), _I32, _VMASK]), "llvm.masked.store.v16f32.p0"
    )
    return fma, masked_load, masked_store


def _k_loop(builder, k, count, step):  # type: ignore[no-untyped-def]
    """Emit ``count`` vector accumulators summed over ``k`` steps (``step(index,
    accumulators)`` returns the next ones): a loop of ``_UNROLL`` steps an iteration, then
    the last ``k % _UNROLL`` one at a time. Returns the sums, in the block after."""
    zero = ir.Constant(_V, [0.0] * _VW)
    function = builder.function
    entry = builder.block
    body = function.append_basic_block("k.body")
    middle = function.append_basic_block("k.middle")
    tail = function.append_basic_block("k.tail")
    done = function.append_basic_block("k.done")
    quads = builder.sdiv(k, _c(_UNROLL))
    builder.cbranch(builder.icmp_signed(">", quads, _c(0)), body, middle)

    builder.position_at_end(body)
    i = builder.phi(_I64)
    phis = [builder.phi(_V) for _ in range(count)]
    i.add_incoming(_c(0), entry)
    for phi in phis:
        phi.add_incoming(zero, entry)
    current = list(phis)
    for u in range(_UNROLL):
        current = step(builder.add(builder.mul(i, _c(_UNROLL)), _c(u)), current)
    i_next = builder.add(i, _c(1))
    body_end = builder.block
    i.add_incoming(i_next, body_end)
    for phi, value in zip(phis, current):
        phi.add_incoming(value, body_end)
    builder.cbranch(builder.icmp_signed("<", i_next, quads), body, middle)

    builder.position_at_end(middle)
    after_body = [builder.phi(_V) for _ in range(count)]
    for phi, value in zip(after_body, current):
        phi.add_incoming(zero, entry)
        phi.add_incoming(value, body_end)
    first_left = builder.mul(quads, _c(_UNROLL))
    builder.cbranch(builder.icmp_signed("<", first_left, k), tail, done)

    builder.position_at_end(tail)
    j = builder.phi(_I64)
    tail_phis = [builder.phi(_V) for _ in range(count)]
    j.add_incoming(first_left, middle)
    for phi, value in zip(tail_phis, after_body):
        phi.add_incoming(value, middle)
    tail_values = step(j, tail_phis)
    j_next = builder.add(j, _c(1))
    tail_end = builder.block
    j.add_incoming(j_next, tail_end)
    for phi, value in zip(tail_phis, tail_values):
        phi.add_incoming(value, tail_end)
    builder.cbranch(builder.icmp_signed("<", j_next, k), tail, done)

    builder.position_at_end(done)
    sums = []
    for r in range(count):
        phi = builder.phi(_V)
        phi.add_incoming(after_body[r], middle)
        phi.add_incoming(tail_values[r], tail_end)
        sums.append(phi)
    return sums


@intrinsic
def _prefetch(typingctx, address):  # type: ignore[no-untyped-def]
    """Ask for the cache line at ``address`` in the L2 cache (``prefetcht1``), not waiting."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        bytes_ = ir.IntType(8).as_pointer()
        hint = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [bytes_, _I32, _I32, _I32]), "llvm.prefetch.p0"
        )
        builder.call(hint, [builder.inttoptr(args[0], bytes_), ir.Constant(_I32, 0), ir.Constant(_I32, 2), ir.Constant(_I32, 1)])

    return types.void(types.int64), codegen


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _ahead(address, size, part, parts):  # pragma: no cover  (compiled)
    """Prefetch part ``part`` of ``parts`` of the ``size`` bytes at ``address``: the next
    row tile's weight, a share before each of the current tile's column passes, so that
    it comes from memory while they compute (the first pass over a tile otherwise waits on
    it: on 2048 x 512 @ 512 x 49, one thread ran at 33 multiply-adds per ns instead of 39)."""
    lines = (size + 63) // 64
    for line in range(part * lines // parts, (part + 1) * lines // parts):
        _prefetch(address + line * 64)


def _tile_codegen(stride):  # type: ignore[no-untyped-def]
    """The code of ``_tile`` (``stride`` 0), or of ``_read_tile`` at column stride 1 or 2."""
    strided = stride > 0

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        if strided:
            w, x, table, k, c, ldc, columns, rows, bias, residual, relu = args
            offsets = builder.inttoptr(table, _I64.as_pointer())
        else:
            w, x, ldx, k, c, ldc, columns, rows, bias, residual, relu = args
        fma, masked_load, masked_store = _vector_functions(builder.module)
        four = ir.Constant(_I32, 4)
        zero = ir.Constant(_V, [0.0] * _VW)
        lanes = ir.Constant(_VI64, list(range(_VW)))
        mask = builder.icmp_signed("<", lanes, _splat(builder, columns, _VI64))
        weights, xs = _floats(builder, w), _floats(builder, x)
        if stride == 2:  # the 2 * columns - 1 floats a row's columns span, in two vectors: their even lanes
            span = _splat(builder, builder.sub(builder.mul(columns, _c(2)), _c(1)), _VI64)
            low = builder.icmp_signed("<", lanes, span)
            high = builder.icmp_signed("<", builder.add(lanes, _splat(builder, _c(_VW), _VI64)), span)
            even = ir.Constant(ir.VectorType(_I32, _VW), [2 * j for j in range(_VW)])

        def load_row(index):  # type: ignore[no-untyped-def]
            if not strided:
                return builder.call(masked_load, [_vector_at(builder, xs, builder.mul(index, ldx)), four, mask, zero])
            start = builder.gep(xs, [builder.load(builder.gep(offsets, [index]))])
            if stride == 1:
                return builder.call(masked_load, [builder.bitcast(start, _V.as_pointer()), four, mask, zero])
            first = builder.call(masked_load, [builder.bitcast(start, _V.as_pointer()), four, low, zero])
            second = builder.call(masked_load, [builder.bitcast(builder.gep(start, [_c(_VW)]), _V.as_pointer()), four, high, zero])
            return builder.shuffle_vector(first, second, even)

        def step(index, accumulators):  # type: ignore[no-untyped-def]
            row = load_row(index)
            first = builder.mul(index, _c(MR))
            return [
                builder.call(fma, [_splat(builder, builder.load(builder.gep(weights, [builder.add(first, _c(r))])), _V), row, a])
                for r, a in enumerate(accumulators)
            ]

        sums = _k_loop(builder, k, MR, step)
        out, others, biases = _floats(builder, c), _floats(builder, residual), _floats(builder, bias)
        has_residual = builder.icmp_signed("!=", residual, _c(0))
        has_bias = builder.icmp_signed("!=", bias, _c(0))
        clamp = builder.icmp_signed("!=", relu, _c(0))
        for r in range(MR):
            with builder.if_then(builder.icmp_signed("<", _c(r), rows)):
                offset = builder.mul(_c(r), ldc)
                _store_row(
                    builder, sums[r], (masked_load, masked_store), mask, _vector_at(builder, out, offset),
                    _vector_at(builder, others, offset), builder.gep(biases, [_c(r)]), has_residual, has_bias, clamp,
                )

    return codegen


@intrinsic
def _tile(typingctx, w, x, ldx, k, c, ldc, columns, rows, bias, residual, relu):  # type: ignore[no-untyped-def]
    """One tile: ``C[r, :columns] = epilogue(sum_k W[k][r] * X[k, :columns])`` for rows
    ``r < rows`` (at most MR), ``columns`` at most 16. Addresses: ``w`` the tile's packed
    rows, ``x`` row 0 of its columns (row step ``ldx`` floats), ``c`` and ``residual``
    (0: none) row 0 of the tile (row step ``ldc``), ``bias`` the tile's first row's (0:
    none); ``relu`` non-zero clamps."""
    signature = types.void(*([types.int64] * 11))
    return signature, _tile_codegen(0)


@intrinsic
def _read_tile(typingctx, w, x, table, k, c, ldc, columns, rows, bias, residual, relu):  # type: ignore[no-untyped-def]
    """``_tile`` reading its columns straight from a Conv's zero-padded input: step
    ``k``'s column ``j`` is the float at ``x + table[k] + j``, one masked vector load
    (16 output positions of one output row), so a shallow Conv needs no im2col block and
    stores whole vectors."""
    signature = types.void(*([types.int64] * 11))
    return signature, _tile_codegen(1)


@intrinsic
def _read_tile2(typingctx, w, x, table, k, c, ldc, columns, rows, bias, residual, relu):  # type: ignore[no-untyped-def]
    """``_read_tile`` at column stride 2: column ``j`` at ``x + table[k] + 2 j``, two
    masked vector loads a step and their even lanes (a stem's 3x3/2 on 224 x 224)."""
    signature = types.void(*([types.int64] * 11))
    return signature, _tile_codegen(2)



def _transposed_rows(builder, columns_):  # type: ignore[no-untyped-def]
    """The ``NB`` (<= 8) column vectors of a tile (lane ``r``: row ``r`` of 16) as 8 vectors
    of two rows each (lanes 0-7: row ``2q``'s columns, lanes 8-15: row ``2q + 1``'s): three
    rounds of two-source shuffles (24 ``vpermt2ps``), where extracting the 112 floats one
    at a time cost ~5 cycles a float (a 16-column tile's vector stores do not need it)."""
    zero = ir.Constant(_V, [0.0] * _VW)
    vectors = list(columns_) + [zero] * (8 - len(columns_))

    def shuffle(a, b, lanes):  # type: ignore[no-untyped-def]
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, _VW), lanes))

    # 1: pairs of columns interleaved, rows 0-7 (low) and 8-15 (high): lane 2 r + e
    low = [shuffle(vectors[2 * p], vectors[2 * p + 1], [i // 2 + 16 * (i % 2) for i in range(16)]) for p in range(4)]
    high = [shuffle(vectors[2 * p], vectors[2 * p + 1], [8 + i // 2 + 16 * (i % 2) for i in range(16)]) for p in range(4)]
    rows_ = []
    for half in (low, high):
        # 2: four columns of four rows: lane 4 r + e, from pairs (0, 1) (columns 0-3) and (2, 3) (4-7)
        quads = []
        for first, second in ((half[0], half[1]), (half[2], half[3])):
            for group in range(2):  # rows 0-3, rows 4-7 of this half
                lanes = [2 * (4 * group + i // 4) + (i % 4 % 2) + 16 * (i % 4 // 2) for i in range(16)]
                quads.append(shuffle(first, second, lanes))
        # quads: [cols 0-3 rows 0-3, cols 0-3 rows 4-7, cols 4-7 rows 0-3, cols 4-7 rows 4-7]
        for group in range(2):
            left, right = quads[group], quads[2 + group]
            for pair in range(2):  # rows 2 pair, 2 pair + 1 of the four
                lanes = [8 * pair + 4 * (i // 8) + (i % 4) + 16 * (i % 8 // 4) for i in range(16)]
                rows_.append(shuffle(left, right, lanes))
    return rows_


def _store_columns(builder, columns_, first_row, c, ldc, columns, rows, bias, residual, relu):  # type: ignore[no-untyped-def]
    """The epilogue of a narrow tile (``_column_codegen``'s ``NB`` column vectors of 16
    rows, the tile's rows ``first_row`` on): row ``r < rows`` gets ``(value + residual) +
    bias``, then ``< 0 -> 0`` where ``relu`` (NaN stays NaN), stored as one masked vector of
    its ``columns`` floats."""
    masked_load = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V8, [_V8.as_pointer(), _I32, _VMASK8, _V8]), "llvm.masked.load.v8f32.p0"
    )
    masked_store = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [_V8, _V8.as_pointer(), _I32, _VMASK8]), "llvm.masked.store.v8f32.p0"
    )
    lanes8 = ir.Constant(ir.VectorType(_I64, 8), list(range(8)))
    mask = builder.icmp_signed("<", lanes8, _splat(builder, columns, ir.VectorType(_I64, 8)))
    out, others, biases = _floats(builder, c), _floats(builder, residual), _floats(builder, bias)
    has_residual = builder.icmp_signed("!=", residual, _c(0))
    has_bias = builder.icmp_signed("!=", bias, _c(0))
    clamp = builder.icmp_signed("!=", relu, _c(0))
    pairs = _transposed_rows(builder, columns_)
    for r in range(MR):
        row = first_row + r
        with builder.if_then(builder.icmp_signed("<", _c(row), rows)):
            offset = builder.mul(_c(row), ldc)
            value = builder.shuffle_vector(
                pairs[r // 2], ir.Constant(_V, ir.Undefined), ir.Constant(ir.VectorType(_I32, 8), [8 * (r % 2) + i for i in range(8)])
            )
            _store_row(
                builder, value, (masked_load, masked_store), mask, builder.bitcast(builder.gep(out, [offset]), _V8.as_pointer()),
                builder.bitcast(builder.gep(others, [offset]), _V8.as_pointer()), builder.gep(biases, [_c(row)]), has_residual,
                has_bias, clamp,
            )


def _column_codegen(indirect, tiles=1):  # type: ignore[no-untyped-def]
    """The code of ``_column_tile`` (``indirect``: of ``_gathered_tile``); with ``tiles``
    2, of ``_column_pair`` (``_gathered_pair``): two row tiles, whose packed weights are
    ``wstride`` floats apart, share each step's broadcast columns."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        args = list(args)
        wstride = args.pop(1) if tiles == 2 else _c(0)
        if indirect:
            w, x, table, first, width, row_step, stride, k, c, ldc, columns, rows, bias, residual, relu = args
            offsets = builder.inttoptr(table, _I64.as_pointer())
        else:
            w, x, ldx, k, c, ldc, columns, rows, bias, residual, relu = args
        fma = _vector_functions(builder.module)[0]
        weights, xs = _floats(builder, w), _floats(builder, x)
        bases = [weights] + ([builder.gep(weights, [wstride])] if tiles == 2 else [])
        last = builder.sub(columns, _c(1))
        at = [builder.select(builder.icmp_signed("<", _c(j), columns), _c(j), last) for j in range(NB)]
        if indirect:  # column j is output position first + j: its window, row by row
            at = [builder.add(first, a) for a in at]
            at = [builder.add(builder.mul(builder.sdiv(a, width), row_step), builder.mul(builder.srem(a, width), stride)) for a in at]

        def step(index, accumulators):  # type: ignore[no-untyped-def]
            vectors = [builder.load(_vector_at(builder, base, builder.mul(index, _c(MR))), align=4) for base in bases]
            row = builder.load(builder.gep(offsets, [index])) if indirect else builder.mul(index, ldx)
            sums = list(accumulators)
            for j in range(NB):
                value = _splat(builder, builder.load(builder.gep(xs, [builder.add(row, at[j])])), _V)
                for t, vector in enumerate(vectors):
                    sums[t * NB + j] = builder.call(fma, [value, vector, accumulators[t * NB + j]])
            return sums

        sums = _k_loop(builder, k, tiles * NB, step)
        for t in range(tiles):
            _store_columns(builder, sums[t * NB : (t + 1) * NB], t * MR, c, ldc, columns, rows, bias, residual, relu)

    return codegen


@intrinsic
def _column_tile(typingctx, w, x, ldx, k, c, ldc, columns, rows, bias, residual, relu):  # type: ignore[no-untyped-def]
    """``_tile`` turned around, for narrow products: a vector of the tile's MR rows by
    ``NB`` columns, each step one vector load of the packed ``W[k]`` and ``NB`` fused
    multiply-adds by the broadcast ``X[k, j]``; ``columns`` at most ``NB`` (a column past
    them reads the last one and is not stored). Same arguments as ``_tile``. On a 7x7
    output (49 columns) the 16-column tiles compute 64; these compute 49."""
    signature = types.void(*([types.int64] * 11))

    return signature, _column_codegen(False)


@intrinsic
def _gathered_tile(typingctx, w, x, table, first, width, row_step, stride, k, c, ldc, columns, rows, bias, residual, relu):  # type: ignore[no-untyped-def]
    """``_column_tile`` reading its columns straight from a Conv's zero-padded input: step
    ``k``'s column ``j`` is output position ``p = first + j`` (the last one again past
    ``columns``), the float at ``x + (p // width) * row_step + (p % width) * stride +
    table[k]`` (``table``: int64 offsets of each (channel, kernel row, kernel column) tap
    from a window), so no im2col block is gathered first, and a tile's columns may run
    on from one output row (``width`` positions) into the next."""
    signature = types.void(*([types.int64] * 15))
    return signature, _column_codegen(True)


@intrinsic
def _column_pair(typingctx, w, wstride, x, ldx, k, c, ldc, columns, rows, bias, residual, relu):  # type: ignore[no-untyped-def]
    """``_column_tile`` over two row tiles at once (``rows`` up to 2 MR; the second
    tile's packed weight ``wstride`` floats after the first's): each step loads the two
    weight vectors and ``NB`` broadcast columns for ``2 NB`` fused multiply-adds, where
    one tile's ``NB`` waited on as many loads (7 accumulators are also fewer than the
    multiply-adds in flight that hide their latency)."""
    signature = types.void(*([types.int64] * 12))
    return signature, _column_codegen(False, 2)


@intrinsic
def _gathered_pair(typingctx, w, wstride, x, table, first, width, row_step, stride, k, c, ldc, columns, rows, bias, residual,
                   relu):  # type: ignore[no-untyped-def]
    """``_gathered_tile`` over two row tiles at once, as ``_column_pair``."""
    signature = types.void(*([types.int64] * 16))
    return signature, _column_codegen(True, 2)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def packed_product(w, x, ldx, k, c, ldc, m, n, bias, residual, relu):  # pragma: no cover  (compiled)
    """``C[:m, :n] = epilogue(W @ X)``: ``w`` the packed weight's first row tile (from
    :func:`pack_weight`, ``k`` deep), ``x`` X's row 0 (row step ``ldx`` floats, ``n``
    columns), ``c`` and ``residual`` (0: none) C's row 0 (row step ``ldc``), ``bias`` the
    bias of row 0 (0: none), ``relu`` non-zero clamps. All addresses (int64).

    Deep products run in slices of ``k`` of at most ``_SLICE`` steps: a slice after the
    first adds C's partial sums (as a residual), and only the last adds the bias and
    clamps."""
    slices = (k + _SLICE - 1) // _SLICE
    for s in range(slices):
        k0 = s * k // slices
        depth = (s + 1) * k // slices - k0
        last = s == slices - 1
        added = residual if s == 0 else c
        _slice(w + k0 * MR * _FLOAT, x + k0 * ldx * _FLOAT, ldx, k, depth, c, ldc, m, n, bias if last else 0, added, relu if last else 0)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _slice(w, x, ldx, k, depth, c, ldc, m, n, bias, residual, relu):  # pragma: no cover  (compiled)
    size = MR * depth * _FLOAT  # one row tile's weight in this slice
    if _narrow(n):  # columns of NB: two row tiles at a time over all of X (in L2), their weight in L2
        blocks = (n + NB - 1) // NB
        for r0 in range(0, m, 2 * MR):
            rows = min(2 * MR, m - r0)
            weights = w + r0 * k * _FLOAT
            row_bias = bias + r0 * _FLOAT if bias != 0 else 0
            for j0 in range(0, n, NB):
                if r0 + 2 * MR < m:
                    _ahead(weights + 2 * MR * k * _FLOAT, 2 * size, j0 // NB, blocks)
                offset = (r0 * ldc + j0) * _FLOAT
                added = residual + offset if residual != 0 else 0
                if rows > MR:
                    _column_pair(weights, MR * k, x + j0 * _FLOAT, ldx, depth, c + offset, ldc, min(NB, n - j0), rows,
                                 row_bias, added, relu)
                else:
                    _column_tile(weights, x + j0 * _FLOAT, ldx, depth, c + offset, ldc, min(NB, n - j0), rows,
                                 row_bias, added, relu)
        return
    tiles = (n + _VW - 1) // _VW
    per_chunk = max(1, _CHUNK_FLOATS // max(1, depth * _VW))
    chunks = (tiles + per_chunk - 1) // per_chunk
    per_chunk = (tiles + chunks - 1) // chunks  # as even as they go: every chunk reads all of W
    for first in range(0, tiles, per_chunk):  # a chunk of column tiles stays in L2 ...
        end = min(tiles, first + per_chunk)
        for r0 in range(0, m, MR):  # ... while every row tile passes over it
            rows = min(MR, m - r0)
            weights = w + r0 * k * _FLOAT
            row_bias = bias + r0 * _FLOAT if bias != 0 else 0
            for t in range(first, end):
                if r0 + MR < m:
                    _ahead(weights + MR * k * _FLOAT, size, t - first, end - first)
                j0 = t * _VW
                offset = (r0 * ldc + j0) * _FLOAT
                _tile(
                    weights,
                    x + j0 * _FLOAT,
                    ldx,
                    depth,
                    c + offset,
                    ldc,
                    min(_VW, n - j0),
                    rows,
                    row_bias,
                    residual + offset if residual != 0 else 0,
                    relu,
                )


@numba.njit(nogil=True, cache=True)
def _narrow(n):  # pragma: no cover  (compiled)
    """Whether ``n`` columns go by ``_column_tile``: few, and the 16-column tiles would
    compute at least 1/8 more than them (49: 64 against 49)."""
    return n <= _NARROW and 8 * ((n + _VW - 1) // _VW) * _VW >= 9 * ((n + NB - 1) // NB) * NB


@numba.njit(nogil=True, cache=True, boundscheck=False)
def gathered_product(w, x, table, k, stride, row_step, c, ldc, m, out_rows, out_w, bias, residual, relu):  # pragma: no cover  (compiled)
    """A Conv's product with its columns read straight from its zero-padded input (no
    im2col block): ``C[:m, i * out_w + j] = epilogue(sum_k W[:, k] * x[i * row_step + j *
    stride + table[k]])`` for output rows ``i < out_rows`` and columns ``j < out_w``.
    ``w`` the packed weight's first row tile (``k`` deep); ``x`` the first window of
    output row 0 in the padded input (floats); ``table`` int64 offsets of the ``k`` taps;
    ``c``, ``residual`` (0: none) and ``bias`` (0: none) as in :func:`packed_product`.
    Tiles of 16 channels by ``NB`` consecutive output positions (``_gathered_tile``),
    running on from one output row into the next: an 8 x 8 output is ten tiles, not
    sixteen of 7 and 1 columns (Inception v3's 448 -> 384 3x3 on 8 x 8: 1.9 -> 1.2 ms).
    Deep products in slices of ``_SLICE`` taps, as there."""
    total = out_rows * out_w
    parts = (total + NB - 1) // NB
    slices = (k + _SLICE - 1) // _SLICE
    for s in range(slices):
        k0 = s * k // slices
        depth = (s + 1) * k // slices - k0
        final = s == slices - 1
        added = residual if s == 0 else c
        taps = table + k0 * 8
        size = MR * depth * _FLOAT
        for r0 in range(0, m, 2 * MR):  # two row tiles at a time (``_gathered_pair``)
            rows = min(2 * MR, m - r0)
            weights = w + (r0 * k + k0 * MR) * _FLOAT
            row_bias = bias + r0 * _FLOAT if bias != 0 and final else 0
            for part in range(parts):
                if r0 + 2 * MR < m:
                    _ahead(weights + 2 * MR * k * _FLOAT, 2 * size, part, parts)
                p0 = part * NB
                offset = (r0 * ldc + p0) * _FLOAT
                into = added + offset if added != 0 else 0
                if rows > MR:
                    _gathered_pair(weights, MR * k, x, taps, p0, out_w, row_step, stride, depth, c + offset, ldc,
                                   min(NB, total - p0), rows, row_bias, into, relu if final else 0)
                else:
                    _gathered_tile(weights, x, taps, p0, out_w, row_step, stride, depth, c + offset, ldc,
                                   min(NB, total - p0), rows, row_bias, into, relu if final else 0)


#: Taps below which a Conv read from its padded input goes by 16-position row tiles
#: (``read_product``) rather than the 7-position ones of ``gathered_product``: a deep
#: product's scalar stores are few against its steps; a shallow one's are not.
READ_ROWS_MAX_DEPTH = 64


@numba.njit(nogil=True, cache=True, boundscheck=False)
def read_product(w, x, table, k, stride, row_step, c, ldc, m, out_rows, out_w, bias, residual, relu):  # pragma: no cover  (compiled)
    """:func:`gathered_product` for a shallow Conv (``k`` under ``READ_ROWS_MAX_DEPTH``,
    one slice) at column stride 1 or 2: tiles of MR channels by 16 positions of one
    output row (``_read_tile``), each step one vector of the row's windows (two and a
    shuffle at stride 2), stored as vectors. Same arguments as :func:`gathered_product`."""
    for r0 in range(0, m, MR):
        rows = min(MR, m - r0)
        weights = w + r0 * k * _FLOAT
        row_bias = bias + r0 * _FLOAT if bias != 0 else 0
        for i in range(out_rows):
            for j0 in range(0, out_w, _VW):
                offset = (r0 * ldc + i * out_w + j0) * _FLOAT
                at = x + (i * row_step + j0 * stride) * _FLOAT
                into = residual + offset if residual != 0 else 0
                if stride == 1:
                    _read_tile(weights, at, table, k, c + offset, ldc, min(_VW, out_w - j0), rows, row_bias, into, relu)
                else:
                    _read_tile2(weights, at, table, k, c + offset, ldc, min(_VW, out_w - j0), rows, row_bias, into, relu)
