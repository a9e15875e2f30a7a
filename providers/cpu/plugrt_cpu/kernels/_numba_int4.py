"""4-bit MatMulNBits from its packed weights: int8 x int4 products accumulated in int32
(AVX-512 VNNI, AVX2 or portable bodies, chosen at run time) and float products on weights
dequantized on the fly, never a float copy of the weight.

The weight is repacked once (:func:`pack`, numpy, at compile time) into tiles of
``ROWS`` = 16 output columns (rows of MatMulNBits' ``B``): for each block of K, each
group of 32 values of K, four 64-byte chunks; chunk ``c`` holds, for tile row ``r`` and
``j < 4``, the byte ``r * 4 + j`` whose low nibble is ``q[r, 32 s + 4 c + j]`` and whose
high nibble is ``q[r, 32 s + 16 + 4 c + j]``. So one chunk, split into its nibbles, is
two vectors of 16 int32 lanes (one lane per row) each holding four consecutive K values,
which ``vpdpbusd`` multiplies by four activations broadcast to every lane: the lanes stay
rows, the block's scales (stored ``[tile][block][16]``) scale all of them in one multiply,
and nothing is reduced across lanes. Half a byte per weight, as packed; the scales and
zero points (``[tile][block][16]`` float32 and uint8) as many as before.

A prompt's rows of A go ``INT8_ROWS`` at a time through a tile (VNNI and portable bodies):
each chunk's nibbles are split once for all of them, each row keeps its own accumulator,
and each row's result is bitwise what it gives alone.

Activations (accuracy_level 4) are quantized per row and block as onnxruntime's MLAS does:
scale = max |a| / 127, q = round-half-even(a * 127 / max |a|) (0 for an all-zero block);
each block's int32 product less zero point x sum(q) is scaled by the weight's and the
activation's scales and summed in float32, block by block.

Imported only through :func:`plugrt_cpu.kernels._compiled.compiled_module` (``None``
without numba or with ``PLUGRT_NUMBA=0``). Compiled code is cached on disk
(``cache=True``); the bodies a host lacks the instructions for are not compiled
(:func:`bodies`).
"""

from __future__ import annotations

import os
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._host_cpu import host_features
from ._int4_layout import ROWS, pack
from ._numba_parallel import ALONE, float32_pointer, int8_pointer, int32_pointer, int64_pointer

__all__ = [
    "BODIES",
    "ROWS",
    "bodies",
    "choose_body",
    "float_units",
    "gather_rows",
    "int8_units",
    "pack",
    "prepare",
    "prepare_step",
    "CONTEXT_WORDS",
    "FLOAT_BODY",
]

_GROUP = 32  # K values per packed group: four 64-byte chunks of a tile
_CHUNK = 64
#: The int8 bodies, fastest first.
BODIES = ("vnni", "avx2", "portable")

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_I1 = ir.IntType(1)
_F32 = ir.FloatType()
_V32 = ir.VectorType(_I32, ROWS)
_VF = ir.VectorType(_F32, ROWS)
_V8 = ir.VectorType(_I8, ROWS)
_VMASK = ir.VectorType(_I1, ROWS)
_VI64 = ir.VectorType(_I64, ROWS)
_H8 = ir.VectorType(_I8, 32)  # an AVX2 register of bytes
_H16 = ir.VectorType(_I16, 16)
_H32 = ir.VectorType(_I32, 8)




def bodies() -> tuple[str, ...]:
    """The int8 bodies this host runs, fastest first (``portable`` always)."""
    features = host_features()
    found = []
    if all(features.get(f, False) for f in ("avx512f", "avx512bw", "avx512vnni")):
        found.append("vnni")
    if features.get("avx2", False):
        found.append("avx2")
    found.append("portable")
    return tuple(found)


def choose_body(requested: str | None = None) -> str:
    """The int8 body to run: ``requested`` (or ``PLUGRT_INT4_BODY``) when the host has
    it, else the fastest it has. An unknown or unavailable name is a ValueError."""
    name = requested or os.environ.get("PLUGRT_INT4_BODY", "") or None
    available = bodies()
    if name is None:
        return available[0]
    if name not in BODIES:
        raise ValueError(f"unknown int4 body {name!r}: choose one of {', '.join(BODIES)} (PLUGRT_INT4_BODY)")
    if name not in available:
        raise ValueError(f"this CPU has no {name!r} int4 body: it runs {', '.join(available)}")
    return name


# ----------------------------------------------------------------------------- activations

# The context of the job bodies (int64 words).
(
    CTX_WEIGHTS, CTX_SCALES, CTX_ZEROS, CTX_ACTIVATIONS, CTX_ASCALES, CTX_ASUMS, CTX_OUT, CTX_ROWS_M, CTX_N,
    CTX_TILES, CTX_BLOCKS, CTX_GROUPS, CTX_UNITS, CTX_BODY, CTX_PADDED, CTX_SCRATCH,
    # a program's step (``prepare_step``): A's address and width, and whether to split
    CTX_SOURCE, CTX_K, CTX_SPLIT,
) = range(19)
CONTEXT_WORDS = 19
#: Rows of A the float tiles take together once a tile's weights are dequantized (accumulators)
MULTI_ROWS = 8
# CTX_BODY: an int8 body's code (``body_code``), or FLOAT_BODY for the float tiles.
FLOAT_BODY = -1

_FLAGS: dict[str, Any] = dict(nogil=True, boundscheck=False, error_model="numpy", cache=True)
_IN2 = types.Array(types.float32, 2, "A", readonly=True)


@numba.njit(**_FLAGS)
def _quantize(a, block_size, quantized, scales, sums):  # pragma: no cover  (compiled)
    """Each row of ``a`` (M, K) in int8 per block of ``block_size``: ``quantized`` (M,
    blocks * block_size; zeros past K), the blocks' ``scales`` and the ``sums`` of their
    int8 values (M, blocks)."""
    rows, k = a.shape
    blocks = scales.shape[1]
    for m in range(rows):
        for b in range(blocks):
            start = b * block_size
            stop = min(k, start + block_size)
            peak = np.float32(0.0)
            for i in range(start, stop):
                peak = max(peak, abs(a[m, i]))
            scale = peak / np.float32(127.0)
            inverse = np.float32(127.0) / peak if peak != 0 else np.float32(0.0)
            total = 0
            for i in range(start, stop):
                value = np.rint(a[m, i] * inverse)
                value = min(max(value, np.float32(-128.0)), np.float32(127.0))
                quantized[m, i] = np.int8(value)
                total += np.int32(value)
            for i in range(stop, start + block_size):
                quantized[m, i] = 0
            scales[m, b] = scale
            sums[m, b] = total


# ----------------------------------------------------------------------------- tile bodies (LLVM IR)


def _c(value: int, kind: ir.IntType = _I64) -> ir.Constant:
    return ir.Constant(kind, value)


def _splat(builder, value, vector_type):  # type: ignore[no-untyped-def]
    undefined = ir.Constant(vector_type, ir.Undefined)
    one = builder.insert_element(undefined, value, _c(0, _I32))
    return builder.shuffle_vector(one, undefined, ir.Constant(ir.VectorType(_I32, vector_type.count), [0] * vector_type.count))


def _pointer(builder, address, kind):  # type: ignore[no-untyped-def]
    return builder.inttoptr(address, kind.as_pointer())


def _load(builder, address, kind):  # type: ignore[no-untyped-def]
    return builder.load(_pointer(builder, address, kind), align=1)


def _store_rows(builder, value, out, rows):  # type: ignore[no-untyped-def]
    """Store the 16 floats of ``value`` at ``out``, those below ``rows`` only."""
    masked_store = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [_VF, _VF.as_pointer(), _I32, _VMASK]), "llvm.masked.store.v16f32.p0"
    )
    lanes = ir.Constant(_VI64, list(range(ROWS)))
    mask = builder.icmp_signed("<", lanes, _splat(builder, rows, _VI64))
    builder.call(masked_store, [value, _pointer(builder, out, _VF), _c(4, _I32), mask])


def _zero_lanes(builder, zeros, block):  # type: ignore[no-untyped-def]
    """The block's zero points as int32 lanes: from ``zeros`` (uint8 [block][16]), or 8 where it is 0."""
    has = builder.icmp_signed("!=", zeros, _c(0))
    before = builder.block
    with builder.if_then(has):
        loaded = builder.zext(_load(builder, builder.add(zeros, builder.mul(block, _c(ROWS))), _V8), _V32)
        loaded_end = builder.block
    lanes = builder.phi(_V32)
    lanes.add_incoming(loaded, loaded_end)
    lanes.add_incoming(ir.Constant(_V32, [8] * ROWS), before)
    return lanes


# How far ahead of the chunk it reads a tile asks for the weights' and scales' lines. A
# decode step reads each weight once from memory; the hardware streamer stops at each 4 KiB
# page, and a tile of a 576-wide weight is 4.5 KiB.
_PREFETCH_WEIGHTS = 2048
_PREFETCH_SCALES = 512


def _prefetch(builder, address, ahead):  # type: ignore[no-untyped-def]
    """Ask for the cache line ``ahead`` bytes past ``address`` (a hint: never faults)."""
    hint = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0"
    )
    builder.call(hint, [_pointer(builder, builder.add(address, _c(ahead)), _I8), _c(0, _I32), _c(3, _I32), _c(1, _I32)])


def _group_chunks(builder, w, block, groups, index):  # type: ignore[no-untyped-def]
    """Group ``index`` of ``block``: its number among the tile's groups and the address of
    its four chunks, the lines ahead of them asked for."""
    group = builder.add(builder.mul(block, groups), index)
    base = builder.add(w, builder.mul(group, _c(4 * _CHUNK)))
    for c in range(4):
        _prefetch(builder, builder.add(base, _c(c * _CHUNK)), _PREFETCH_WEIGHTS)
    return group, base


def _generic_dot(builder, sums, nibbles, activation):  # type: ignore[no-untyped-def]
    """``sums`` plus, per int32 lane, the four u8 ``nibbles`` of the lane times the four
    s8 bytes of ``activation`` (what ``vpdpbusd`` does), in generic vector code."""
    v64 = ir.VectorType(_I32, _CHUNK)
    bytes_ = builder.bitcast(_splat(builder, activation, _V32), ir.VectorType(_I8, _CHUNK))
    products = builder.mul(builder.zext(nibbles, v64), builder.sext(bytes_, v64))
    for j in range(4):
        picked = ir.Constant(ir.VectorType(_I32, ROWS), [4 * r + j for r in range(ROWS)])
        sums = builder.add(sums, builder.shuffle_vector(products, products, picked))
    return sums


def _int8_codegen(body: str):  # type: ignore[no-untyped-def]
    """The code of one int8 tile: ``out[r] = sum_b s_w[b, r] * s_a[b] * (sum_k q_w[r, k]
    q_a[k] - z[b, r] * sum_k q_a[k])`` over the ``blocks`` blocks of ``groups`` packed
    groups each, for the tile rows ``r < rows``. A body the host has no instructions for
    is emitted as the generic one (never run: ``choose_body`` refuses it), so that
    compiling the module never asks LLVM for instructions it cannot select."""
    if body not in bodies():
        body = "portable"

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        w, scales, zeros, aq, ascale, asum, blocks, groups, out, rows = args
        module = builder.module
        fma = cgutils.get_or_insert_function(module, ir.FunctionType(_VF, [_VF, _VF, _VF]), "llvm.fma.v16f32")
        if body == "vnni":
            dot = cgutils.get_or_insert_function(module, ir.FunctionType(_V32, [_V32, _V32, _V32]), "llvm.x86.avx512.vpdpbusd.512")
        elif body == "avx2":
            madd_bytes = cgutils.get_or_insert_function(module, ir.FunctionType(_H16, [_H8, _H8]), "llvm.x86.avx2.pmadd.ub.sw")
            madd_words = cgutils.get_or_insert_function(module, ir.FunctionType(_H32, [_H16, _H16]), "llvm.x86.avx2.pmadd.wd")
            ones = ir.Constant(_H16, [1] * 16)
        v64 = ir.VectorType(_I8, _CHUNK)
        low_bits = ir.Constant(v64, [0x0F] * _CHUNK)
        four = ir.Constant(v64, [4] * _CHUNK)
        total = cgutils.alloca_once_value(builder, ir.Constant(_VF, [0.0] * ROWS))
        acc = cgutils.alloca_once(builder, _V32)
        with cgutils.for_range(builder, blocks) as block_loop:
            block = block_loop.index
            builder.store(ir.Constant(_V32, [0] * ROWS), acc)
            _prefetch(builder, builder.add(scales, builder.mul(block, _c(4 * ROWS))), _PREFETCH_SCALES)
            with cgutils.for_range(builder, groups) as group_loop:
                group, base = _group_chunks(builder, w, block, groups, group_loop.index)
                activations = builder.add(aq, builder.mul(group, _c(_GROUP)))
                sums = builder.load(acc)
                halves = []
                for c in range(4):
                    chunk = _load(builder, builder.add(base, _c(c * _CHUNK)), v64)
                    low = builder.and_(chunk, low_bits)
                    high = builder.and_(builder.lshr(chunk, four), low_bits)
                    a_low = _load(builder, builder.add(activations, _c(4 * c)), _I32)
                    a_high = _load(builder, builder.add(activations, _c(16 + 4 * c)), _I32)
                    if body == "vnni":
                        sums = builder.call(dot, [sums, builder.bitcast(low, _V32), _splat(builder, a_low, _V32)])
                        sums = builder.call(dot, [sums, builder.bitcast(high, _V32), _splat(builder, a_high, _V32)])
                    elif body == "portable":
                        sums = _generic_dot(builder, sums, low, a_low)
                        sums = _generic_dot(builder, sums, high, a_high)
                    else:
                        halves.append((low, high, a_low, a_high))
                if body == "avx2":
                    # each chunk's two 32-byte halves (rows 0-7, 8-15): u8 x s8 pairs summed to
                    # int16 (at most 4 x 15 x 128 = 7,680 a chunk; four chunks 30,720: no
                    # saturation), then to int32
                    parts = []
                    for half in range(2):
                        lanes = ir.Constant(ir.VectorType(_I32, 32), list(range(32 * half, 32 * half + 32)))
                        words = None
                        for low, high, a_low, a_high in halves:
                            for nibbles, activation in ((low, a_low), (high, a_high)):
                                part = builder.shuffle_vector(nibbles, nibbles, lanes)
                                broadcast = builder.bitcast(_splat(builder, activation, _H32), _H8)
                                pair = builder.call(madd_bytes, [part, broadcast])
                                words = pair if words is None else builder.add(words, pair)
                        parts.append(builder.call(madd_words, [words, ones]))
                    joined = builder.shuffle_vector(parts[0], parts[1], ir.Constant(ir.VectorType(_I32, ROWS), list(range(ROWS))))
                    sums = builder.add(sums, joined)
                builder.store(sums, acc)
            products = builder.load(acc)
            block_sum = _load(builder, builder.add(asum, builder.mul(block, _c(4))), _I32)
            corrected = builder.sub(products, builder.mul(_zero_lanes(builder, zeros, block), _splat(builder, block_sum, _V32)))
            scale = _load(builder, builder.add(scales, builder.mul(block, _c(4 * ROWS))), _VF)
            a_scale = _load(builder, builder.add(ascale, builder.mul(block, _c(4))), _F32)
            combined = builder.fmul(scale, _splat(builder, a_scale, _VF))
            builder.store(builder.call(fma, [builder.sitofp(corrected, _VF), combined, builder.load(total)]), total)
        _store_rows(builder, builder.load(total), out, rows)
        return context.get_dummy_value()

    return codegen


_TILE_SIGNATURE = types.void(*([types.int64] * 10))

#: Rows of A the multi-row int8 tiles take at once: each chunk's nibbles are split once
#: for all of them (a prompt's rows), one int32 accumulator a row.
INT8_ROWS = 8


def _int8_rows_codegen(body: str):  # type: ignore[no-untyped-def]
    """``INT8_ROWS`` rows of A by one tile, as ``_int8_codegen`` computes each row: the
    same products and per-block corrections and scaling, in the same order, so each row's
    result is bitwise the one-row tile's. Row ``i`` of A's buffers is at ``aq + i * width``
    (its scales and sums at ``+ i * blocks * 4``) and its output at ``out + i * ldo * 4``.
    Bodies: ``vnni`` and ``portable`` (what the host lacks is emitted as ``portable``)."""
    if body not in bodies():
        body = "portable"

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        w, scales, zeros, aq, ascale, asum, blocks, groups, out, rows, width, ldo = args
        module = builder.module
        fma = cgutils.get_or_insert_function(module, ir.FunctionType(_VF, [_VF, _VF, _VF]), "llvm.fma.v16f32")
        if body == "vnni":
            dot = cgutils.get_or_insert_function(module, ir.FunctionType(_V32, [_V32, _V32, _V32]), "llvm.x86.avx512.vpdpbusd.512")
        v64 = ir.VectorType(_I8, _CHUNK)
        low_bits = ir.Constant(v64, [0x0F] * _CHUNK)
        four = ir.Constant(v64, [4] * _CHUNK)
        totals = [cgutils.alloca_once_value(builder, ir.Constant(_VF, [0.0] * ROWS)) for _ in range(INT8_ROWS)]
        accs = [cgutils.alloca_once(builder, _V32) for _ in range(INT8_ROWS)]
        row_aq = [builder.add(aq, builder.mul(width, _c(i))) for i in range(INT8_ROWS)]
        row_stats = [builder.mul(builder.mul(blocks, _c(4)), _c(i)) for i in range(INT8_ROWS)]
        with cgutils.for_range(builder, blocks) as block_loop:
            block = block_loop.index
            for acc in accs:
                builder.store(ir.Constant(_V32, [0] * ROWS), acc)
            _prefetch(builder, builder.add(scales, builder.mul(block, _c(4 * ROWS))), _PREFETCH_SCALES)
            with cgutils.for_range(builder, groups) as group_loop:
                group, base = _group_chunks(builder, w, block, groups, group_loop.index)
                nibbles = []
                for c in range(4):
                    chunk = _load(builder, builder.add(base, _c(c * _CHUNK)), v64)
                    nibbles.append((builder.and_(chunk, low_bits), builder.and_(builder.lshr(chunk, four), low_bits)))
                offset = builder.mul(group, _c(_GROUP))
                for i in range(INT8_ROWS):
                    activations = builder.add(row_aq[i], offset)
                    sums = builder.load(accs[i])
                    for c, (low, high) in enumerate(nibbles):
                        a_low = _load(builder, builder.add(activations, _c(4 * c)), _I32)
                        a_high = _load(builder, builder.add(activations, _c(16 + 4 * c)), _I32)
                        if body == "vnni":
                            sums = builder.call(dot, [sums, builder.bitcast(low, _V32), _splat(builder, a_low, _V32)])
                            sums = builder.call(dot, [sums, builder.bitcast(high, _V32), _splat(builder, a_high, _V32)])
                        else:
                            sums = _generic_dot(builder, sums, low, a_low)
                            sums = _generic_dot(builder, sums, high, a_high)
                    builder.store(sums, accs[i])
            zero_lanes = _zero_lanes(builder, zeros, block)
            scale = _load(builder, builder.add(scales, builder.mul(block, _c(4 * ROWS))), _VF)
            for i in range(INT8_ROWS):
                stat = builder.add(row_stats[i], builder.mul(block, _c(4)))
                block_sum = _load(builder, builder.add(asum, stat), _I32)
                corrected = builder.sub(builder.load(accs[i]), builder.mul(zero_lanes, _splat(builder, block_sum, _V32)))
                a_scale = _load(builder, builder.add(ascale, stat), _F32)
                combined = builder.fmul(scale, _splat(builder, a_scale, _VF))
                builder.store(builder.call(fma, [builder.sitofp(corrected, _VF), combined, builder.load(totals[i])]), totals[i])
        for i in range(INT8_ROWS):
            _store_rows(builder, builder.load(totals[i]), builder.add(out, builder.mul(builder.mul(ldo, _c(4)), _c(i))), rows)
        return context.get_dummy_value()

    return codegen


_ROWS_SIGNATURE = types.void(*([types.int64] * 12))


@intrinsic
def _vnni_rows(typingctx, w, scales, zeros, aq, ascale, asum, blocks, groups, out, rows, width, ldo):  # type: ignore[no-untyped-def]
    """``INT8_ROWS`` rows of A by one tile, ``vpdpbusd`` (AVX-512 VNNI)."""
    return _ROWS_SIGNATURE, _int8_rows_codegen("vnni")


@intrinsic
def _portable_rows(typingctx, w, scales, zeros, aq, ascale, asum, blocks, groups, out, rows, width, ldo):  # type: ignore[no-untyped-def]
    """``INT8_ROWS`` rows of A by one tile in generic vector code."""
    return _ROWS_SIGNATURE, _int8_rows_codegen("portable")


@intrinsic
def _vnni_tile(typingctx, w, scales, zeros, aq, ascale, asum, blocks, groups, out, rows):  # type: ignore[no-untyped-def]
    """One int8 tile by ``vpdpbusd`` (AVX-512 VNNI): weights u8, activations s8."""
    return _TILE_SIGNATURE, _int8_codegen("vnni")


@intrinsic
def _avx2_tile(typingctx, w, scales, zeros, aq, ascale, asum, blocks, groups, out, rows):  # type: ignore[no-untyped-def]
    """One int8 tile by ``vpmaddubsw`` / ``vpmaddwd`` (AVX2)."""
    return _TILE_SIGNATURE, _int8_codegen("avx2")


def _float_codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
    """One float tile: ``out[r] = sum_b s_w[b, r] * sum_k (q_w[r, k] - z[b, r]) * a[k]``,
    each weight dequantized in registers (generic vectors: any host)."""
    w, scales, zeros, a, blocks, groups, out, rows = args
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF, _VF, _VF]), "llvm.fma.v16f32")
    low_bits = ir.Constant(_V32, [0x0F] * ROWS)
    zero = ir.Constant(_VF, [0.0] * ROWS)
    total = cgutils.alloca_once_value(builder, zero)
    acc = cgutils.alloca_once(builder, _VF)
    floats = _pointer(builder, a, _F32)
    with cgutils.for_range(builder, blocks) as block_loop:
        block = block_loop.index
        builder.store(zero, acc)
        offsets = builder.sitofp(_zero_lanes(builder, zeros, block), _VF)
        _prefetch(builder, builder.add(scales, builder.mul(block, _c(4 * ROWS))), _PREFETCH_SCALES)
        with cgutils.for_range(builder, groups) as group_loop:
            group, base = _group_chunks(builder, w, block, groups, group_loop.index)
            first = builder.mul(group, _c(_GROUP))
            sums = builder.load(acc)
            for c in range(4):
                chunk = _load(builder, builder.add(base, _c(c * _CHUNK)), _V32)
                for j in range(4):
                    for nibble in range(2):
                        shift = ir.Constant(_V32, [8 * j + 4 * nibble] * ROWS)
                        value = builder.and_(builder.lshr(chunk, shift), low_bits)
                        weight = builder.fsub(builder.sitofp(value, _VF), offsets)
                        index = builder.add(first, _c(16 * nibble + 4 * c + j))
                        activation = _splat(builder, builder.load(builder.gep(floats, [index])), _VF)
                        sums = builder.call(fma, [weight, activation, sums])
            builder.store(sums, acc)
        scale = _load(builder, builder.add(scales, builder.mul(block, _c(4 * ROWS))), _VF)
        builder.store(builder.call(fma, [builder.load(acc), scale, builder.load(total)]), total)
    _store_rows(builder, builder.load(total), out, rows)
    return context.get_dummy_value()


def _float_rows_codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
    """Several rows of A by one tile: its weights dequantized once, ``(q - z) * s``, into
    ``scratch`` (K x 16 floats), then ``MULTI_ROWS`` rows of A at a time, each step one
    vector of the tile's 16 rows by a broadcast activation per row (independent
    accumulators, so the fused multiply-adds do not wait on each other)."""
    w, scales, zeros, a, lda, m_rows, blocks, groups, out, ldo, rows, scratch = args
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF, _VF, _VF]), "llvm.fma.v16f32")
    low_bits = ir.Constant(_V32, [0x0F] * ROWS)
    zero = ir.Constant(_VF, [0.0] * ROWS)
    table = _pointer(builder, scratch, _VF)
    with cgutils.for_range(builder, blocks) as block_loop:
        block = block_loop.index
        offsets = builder.sitofp(_zero_lanes(builder, zeros, block), _VF)
        scale = _load(builder, builder.add(scales, builder.mul(block, _c(4 * ROWS))), _VF)
        with cgutils.for_range(builder, groups) as group_loop:
            group = builder.add(builder.mul(block, groups), group_loop.index)
            base = builder.add(w, builder.mul(group, _c(4 * _CHUNK)))
            first = builder.mul(group, _c(_GROUP))
            for c in range(4):
                chunk = _load(builder, builder.add(base, _c(c * _CHUNK)), _V32)
                for j in range(4):
                    for nibble in range(2):
                        shift = ir.Constant(_V32, [8 * j + 4 * nibble] * ROWS)
                        value = builder.and_(builder.lshr(chunk, shift), low_bits)
                        weight = builder.fmul(builder.fsub(builder.sitofp(value, _VF), offsets), scale)
                        index = builder.add(first, _c(16 * nibble + 4 * c + j))
                        builder.store(weight, builder.gep(table, [index]), align=64)
    width = builder.mul(builder.mul(blocks, groups), _c(_GROUP))
    floats = _pointer(builder, a, _F32)
    accumulators = [cgutils.alloca_once(builder, _VF) for _ in range(MULTI_ROWS)]
    passes = builder.sdiv(builder.add(m_rows, _c(MULTI_ROWS - 1)), _c(MULTI_ROWS))
    last = builder.sub(m_rows, _c(1))
    with cgutils.for_range(builder, passes) as pass_loop:
        m0 = builder.mul(pass_loop.index, _c(MULTI_ROWS))
        starts = []
        for i in range(MULTI_ROWS):  # rows past the last read the last one and are not stored
            row = builder.add(m0, _c(i))
            row = builder.select(builder.icmp_signed("<", row, m_rows), row, last)
            starts.append(builder.mul(row, lda))
            builder.store(zero, accumulators[i])
        with cgutils.for_range(builder, width) as k_loop:
            k = k_loop.index
            weight = builder.load(builder.gep(table, [k]), align=64)
            for i in range(MULTI_ROWS):
                activation = _splat(builder, builder.load(builder.gep(floats, [builder.add(starts[i], k)])), _VF)
                builder.store(builder.call(fma, [weight, activation, builder.load(accumulators[i])]), accumulators[i])
        for i in range(MULTI_ROWS):
            row = builder.add(m0, _c(i))
            with builder.if_then(builder.icmp_signed("<", row, m_rows)):
                _store_rows(builder, builder.load(accumulators[i]), builder.add(out, builder.mul(row, builder.mul(ldo, _c(4)))), rows)
    return context.get_dummy_value()


@intrinsic
def _float_rows(typingctx, w, scales, zeros, a, lda, m_rows, blocks, groups, out, ldo, rows, scratch):  # type: ignore[no-untyped-def]
    """Float tiles for several rows of A (prompts), the tile dequantized once."""
    return types.void(*([types.int64] * 12)), _float_rows_codegen


@intrinsic
def _float_tile(typingctx, w, scales, zeros, a, blocks, groups, out, rows):  # type: ignore[no-untyped-def]
    """One float tile (accuracy levels 0-3)."""
    return types.void(*([types.int64] * 8)), _float_codegen


@intrinsic
def _portable_tile(typingctx, w, scales, zeros, aq, ascale, asum, blocks, groups, out, rows):  # type: ignore[no-untyped-def]
    """One int8 tile in generic vector code (any host; LLVM picks the instructions)."""
    return _TILE_SIGNATURE, _int8_codegen("portable")


# ----------------------------------------------------------------------------- jobs over tiles

_BODY_CODES = {"vnni": 0, "avx2": 1, "portable": 2}


@numba.njit(**_FLAGS)
def _int8_span(context, first, last):  # pragma: no cover  (compiled)
    m_rows, n = context[CTX_ROWS_M], context[CTX_N]
    blocks, groups = context[CTX_BLOCKS], context[CTX_GROUPS]
    tile_bytes = blocks * groups * 4 * _CHUNK
    padded = blocks * groups * _GROUP
    body = context[CTX_BODY]
    for t in range(first, last):
        w = context[CTX_WEIGHTS] + t * tile_bytes
        scales = context[CTX_SCALES] + t * blocks * ROWS * 4
        zeros = context[CTX_ZEROS] + t * blocks * ROWS if context[CTX_ZEROS] != 0 else 0
        rows = min(ROWS, n - t * ROWS)
        m0 = 0
        if body != 1:  # vnni, portable: the rows of A INT8_ROWS at a time while they last
            while m0 + INT8_ROWS <= m_rows:
                aq = context[CTX_ACTIVATIONS] + m0 * padded
                ascale = context[CTX_ASCALES] + m0 * blocks * 4
                asum = context[CTX_ASUMS] + m0 * blocks * 4
                out = context[CTX_OUT] + (m0 * n + t * ROWS) * 4
                if body == 0:
                    _vnni_rows(w, scales, zeros, aq, ascale, asum, blocks, groups, out, rows, padded, n)
                else:
                    _portable_rows(w, scales, zeros, aq, ascale, asum, blocks, groups, out, rows, padded, n)
                m0 += INT8_ROWS
        for m in range(m0, m_rows):
            aq = context[CTX_ACTIVATIONS] + m * padded
            ascale = context[CTX_ASCALES] + m * blocks * 4
            asum = context[CTX_ASUMS] + m * blocks * 4
            out = context[CTX_OUT] + (m * n + t * ROWS) * 4
            if body == 0:
                _vnni_tile(w, scales, zeros, aq, ascale, asum, blocks, groups, out, rows)
            elif body == 1:
                _avx2_tile(w, scales, zeros, aq, ascale, asum, blocks, groups, out, rows)
            else:
                _portable_tile(w, scales, zeros, aq, ascale, asum, blocks, groups, out, rows)


@numba.njit(**_FLAGS)
def _float_span(context, first, last, slot):  # pragma: no cover  (compiled)
    m_rows, n = context[CTX_ROWS_M], context[CTX_N]
    blocks, groups = context[CTX_BLOCKS], context[CTX_GROUPS]
    tile_bytes = blocks * groups * 4 * _CHUNK
    padded = blocks * groups * _GROUP
    for t in range(first, last):
        w = context[CTX_WEIGHTS] + t * tile_bytes
        scales = context[CTX_SCALES] + t * blocks * ROWS * 4
        zeros = context[CTX_ZEROS] + t * blocks * ROWS if context[CTX_ZEROS] != 0 else 0
        rows = min(ROWS, n - t * ROWS)
        out = context[CTX_OUT] + t * ROWS * 4
        if m_rows > 1 and context[CTX_SCRATCH] != 0:
            scratch = context[CTX_SCRATCH] + slot * padded * ROWS * 4
            _float_rows(w, scales, zeros, context[CTX_ACTIVATIONS], padded, m_rows, blocks, groups, out, n, rows, scratch)
            continue
        for m in range(m_rows):
            a = context[CTX_ACTIVATIONS] + m * padded * 4
            _float_tile(w, scales, zeros, a, blocks, groups, out + m * n * 4, rows)


@numba.cfunc(types.void(types.int64, types.int64, types.int64, types.int64), nogil=True, cache=True)
def int8_units(c, start, stop, slot):  # pragma: no cover  (compiled)
    """Units of tiles for ``_compiled_parallel``'s pool: unit ``u`` computes tiles
    ``[u * T // units, (u + 1) * T // units)`` of every row of A with the int8 body the
    context names."""
    context = numba.carray(int64_pointer(c), CONTEXT_WORDS)
    tiles, units = context[CTX_TILES], context[CTX_UNITS]
    for unit in range(start, stop):
        _int8_span(context, unit * tiles // units, (unit + 1) * tiles // units)


@numba.cfunc(types.void(types.int64, types.int64, types.int64, types.int64), nogil=True, cache=True)
def float_units(c, start, stop, slot):  # pragma: no cover  (compiled)
    """As ``int8_units``, with the float tile (A padded to whole blocks, float32)."""
    context = numba.carray(int64_pointer(c), CONTEXT_WORDS)
    tiles, units = context[CTX_TILES], context[CTX_UNITS]
    for unit in range(start, stop):
        _float_span(context, unit * tiles // units, (unit + 1) * tiles // units, slot)


@numba.njit(**_FLAGS)
def _prepare(a, out, context):  # pragma: no cover  (compiled)
    """``prepare`` without the product; ``out`` is the output's address."""
    rows, k = a.shape
    blocks, block_size = context[CTX_BLOCKS], context[CTX_GROUPS] * _GROUP
    width = blocks * block_size
    if context[CTX_BODY] != FLOAT_BODY:
        quantized = numba.carray(int8_pointer(context[CTX_ACTIVATIONS]), (rows, width))
        scales = numba.carray(float32_pointer(context[CTX_ASCALES]), (rows, blocks))
        sums = numba.carray(int32_pointer(context[CTX_ASUMS]), (rows, blocks))
        _quantize(a, block_size, quantized, scales, sums)
    elif context[CTX_PADDED] != 0:
        padded = numba.carray(float32_pointer(context[CTX_PADDED]), (rows, width))
        for m in range(rows):
            for i in range(k):
                padded[m, i] = a[m, i]
            for i in range(k, width):
                padded[m, i] = 0.0
        context[CTX_ACTIVATIONS] = context[CTX_PADDED]
    else:
        context[CTX_ACTIVATIONS] = a.ctypes.data
    context[CTX_OUT] = out
    context[CTX_ROWS_M] = rows


@numba.njit([types.void(_IN2, types.float32[:, ::1], types.int64[::1], types.boolean)], **_FLAGS)
def prepare(a, out, context, run):  # pragma: no cover  (compiled)
    """Make ``context`` ready for the product of ``a`` (M, K) into ``out`` (M, N), and
    with ``run`` compute it on this thread. The context names the buffers (M rows each):
    int8 bodies quantize ``a`` per block into its activation, scale and sum buffers; the
    float tiles read ``a`` itself, or a copy in the padded buffer (zeros past K) when that
    is named. One call: a decode step's products are small enough that each Python-level
    dispatch counts."""
    _prepare(a, out.ctypes.data, context)
    if run:
        if context[CTX_BODY] == FLOAT_BODY:
            _float_span(context, 0, context[CTX_TILES], 0)
        else:
            _int8_span(context, 0, context[CTX_TILES])


@numba.cfunc(types.int64(types.int64), nogil=True, cache=True)
def prepare_step(c):  # pragma: no cover  (compiled)
    """A program's step (``_numba_parallel.run_program``): ``prepare`` of the context's
    source rows (``CTX_SOURCE``, ``CTX_ROWS_M`` x ``CTX_K``) into its output; answers the
    units of the job (``int8_units`` or ``float_units``), on this thread alone unless
    ``CTX_SPLIT``."""
    context = numba.carray(int64_pointer(c), CONTEXT_WORDS)
    a = numba.carray(float32_pointer(context[CTX_SOURCE]), (context[CTX_ROWS_M], context[CTX_K]))
    _prepare(a, context[CTX_OUT], context)
    units = context[CTX_UNITS]
    return units if context[CTX_SPLIT] != 0 else units | ALONE


@numba.njit(
    [types.void(
        types.Array(types.uint8, 4, "C", readonly=True), types.Array(types.float32, 3, "C", readonly=True),
        types.Array(types.uint8, 3, "C", readonly=True), types.Array(types.int64, 1, "C", readonly=True),
        types.float32[:, ::1],
    )],
    **_FLAGS,
)
def gather_rows(weights, scales, zeros, rows, out):  # pragma: no cover  (compiled)
    """Rows ``rows`` (in range) of a repacked weight dequantized into ``out`` (len(rows),
    blocks * block_size): ``(q - z) * s`` in float32, as ``contrib_quantization._packed_rows``
    computes them (z 8 where ``zeros`` is empty). A tied embedding's lookup of a few rows."""
    blocks, groups = weights.shape[1], weights.shape[2] // 4
    block_size = groups * _GROUP
    for i in range(rows.shape[0]):
        tile, lane = rows[i] // ROWS, rows[i] % ROWS
        for b in range(blocks):
            zero = np.float32(8.0) if zeros.shape[0] == 0 else np.float32(zeros[tile, b, lane])
            scale = scales[tile, b, lane]
            for g in range(groups):
                base = b * block_size + g * _GROUP
                for q in range(16):
                    byte = weights[tile, b, g * 4 + q // 4, lane * 4 + q % 4]
                    out[i, base + q] = (np.float32(byte & 15) - zero) * scale
                    out[i, base + 16 + q] = (np.float32(byte >> 4) - zero) * scale


def body_code(name: str) -> int:
    """The context's code for body ``name``."""
    return _BODY_CODES[name]


