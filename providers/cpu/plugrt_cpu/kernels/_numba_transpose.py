"""numba-compiled transposed copies: a strided view of 4- or 8-byte values written out in C order by square tiles transposed in registers.

Imported only through :func:`plugrt_cpu.kernels.tensor.transposed_copy`, which returns
False (the caller copies with numpy) when numba is missing, ``PLUGRT_NUMBA=0`` or the
view is not a transposition it plans. The copy moves bits, so every 4- or 8-byte dtype
(float32, int32, int64, float64) gives exactly numpy's result.

A view whose last axis is not contiguous (an NCHW tensor seen as NHWC, a sequence of
channels seen as channels of a sequence) is read by numpy one value at a time, across
the whole row: ~1-3 ns a value, where ConvNeXt's 96 x 3136 plane takes ~45 us by tiles
(numpy 140-180 us). A tile is LANES rows of LANES values: LANES masked vector loads
along the source's contiguous axis, one transpose in registers, LANES masked vector
stores along the output's. Its rows and columns may each run over two axes (an index
``i`` is ``(i // inner_n) * outer_stride + (i % inner_n) * inner_stride``), so that a
short axis (MobileViT's 2 x 2 patches, a pixel shuffle's factors) still fills the tile.
"""

from __future__ import annotations

from typing import Any

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._numba_parallel import transpose_vectors

__all__ = ["LANES", "transposed"]

_FLAGS: dict[str, Any] = dict(nogil=True, boundscheck=False, error_model="numpy", cache=True)

#: values a tile row, by value size in bytes: one 512-bit vector (two 256-bit ones)
LANES = {4: 16, 8: 8}
LANES_4, LANES_8 = LANES[4], LANES[8]

# The geometry array (int64): the tile rows and columns in all (rows_n, columns_n), then
# three batch axes (size, source stride, output stride in bytes each; size 1 where there
# are fewer). Two tables give each row's offset in the source and each column's in the
# output (bytes; padded with zeros to a whole tile): a row is consecutive values in the
# output, a column in the source.


def _splat(builder, value, vector_type):  # type: ignore[no-untyped-def]
    lanes = vector_type.count
    first = builder.insert_element(ir.Constant(vector_type, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(first, first, ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))


def _tile_intrinsic(size: int):  # type: ignore[no-untyped-def]
    lanes = LANES[size]
    i64 = ir.IntType(64)
    vector = ir.VectorType(ir.IntType(8 * size), lanes)
    mask_type = ir.VectorType(ir.IntType(1), lanes)
    suffix = f"v{lanes}i{8 * size}.p0"

    def tile(typingctx, dst, src, first_row, rows, row_table, first_column, columns, column_table):  # type: ignore[no-untyped-def]
        """One tile: rows ``first_row`` + r (r < ``rows``), columns ``first_column`` + c
        (c < ``columns``); ``row_table``/``column_table`` point at the offset tables.
        Addresses in bytes."""
        signature = types.void(*([types.int64] * 8))

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            dst, src, first_row, rows, row_table, first_column, columns, column_table = args
            load = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vector, [vector.as_pointer(), ir.IntType(32), mask_type, vector]),
                f"llvm.masked.load.{suffix}",
            )
            store = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [vector, vector.as_pointer(), ir.IntType(32), mask_type]),
                f"llvm.masked.store.{suffix}",
            )

            def offsets(table, first):  # type: ignore[no-untyped-def]
                pointer = builder.gep(builder.inttoptr(table, i64.as_pointer()), [first])
                return [builder.load(builder.gep(pointer, [ir.Constant(i64, lane)])) for lane in range(lanes)]

            lane_index = ir.Constant(ir.VectorType(i64, lanes), list(range(lanes)))
            column_mask = builder.icmp_signed("<", lane_index, _splat(builder, columns, ir.VectorType(i64, lanes)))
            row_mask = builder.icmp_signed("<", lane_index, _splat(builder, rows, ir.VectorType(i64, lanes)))
            align = ir.Constant(ir.IntType(32), 1)
            undefined = ir.Constant(vector, ir.Undefined)
            source = builder.add(src, builder.mul(first_column, ir.Constant(i64, size)))
            target = builder.add(dst, builder.mul(first_row, ir.Constant(i64, size)))
            loaded = []
            for r, offset in enumerate(offsets(row_table, first_row)):
                present = builder.icmp_signed("<", ir.Constant(i64, r), rows)
                keep = builder.and_(column_mask, _splat(builder, present, mask_type))  # past ``rows``: nothing read
                address = builder.add(source, offset)
                loaded.append(builder.call(load, [builder.inttoptr(address, vector.as_pointer()), align, keep, undefined]))
            column_offsets = offsets(column_table, first_column)
            for c, value in enumerate(transpose_vectors(builder, loaded)):
                with builder.if_then(builder.icmp_signed("<", ir.Constant(i64, c), columns)):
                    address = builder.add(target, column_offsets[c])
                    builder.call(store, [value, builder.inttoptr(address, vector.as_pointer()), align, row_mask])

        return signature, codegen

    tile.__name__ = tile.__qualname__ = f"_tile{size}"
    return intrinsic(tile)


_tile4 = _tile_intrinsic(4)
_tile8 = _tile_intrinsic(8)


@numba.njit(types.void(types.int64, types.int64, types.int64[::1], types.int64[::1], types.int64[::1], types.int64), **_FLAGS)
def transposed(src, dst, geometry, row_table, column_table, size):  # pragma: no cover  (compiled)
    """The view at ``src`` of ``size``-byte values (4 or 8) in C order at ``dst``, as the
    geometry array and the tables describe it (see above). The batch loops run inside the
    tile loops: a batch axis is typically a short step in the source (a patch's next
    column), so that consecutive tiles share cache lines."""
    lanes = LANES_4 if size == 4 else LANES_8
    rows_n, columns_n = geometry[0], geometry[1]
    n0, s0, d0 = geometry[2], geometry[3], geometry[4]
    n1, s1, d1 = geometry[5], geometry[6], geometry[7]
    n2, s2, d2 = geometry[8], geometry[9], geometry[10]
    rows_at, columns_at = row_table.ctypes.data, column_table.ctypes.data
    for row in range(0, rows_n, lanes):
        rows = min(lanes, rows_n - row)
        for column in range(0, columns_n, lanes):
            columns = min(lanes, columns_n - column)
            for b0 in range(n0):
                for b1 in range(n1):
                    for b2 in range(n2):
                        to, at = dst + b0 * d0 + b1 * d1 + b2 * d2, src + b0 * s0 + b1 * s1 + b2 * s2
                        if size == 4:
                            _tile4(to, at, row, rows, rows_at, column, columns, columns_at)
                        else:
                            _tile8(to, at, row, rows, rows_at, column, columns, columns_at)
