"""The tiled layout of a 4-bit MatMulNBits weight that ``_numba_int4``'s kernels read
(see there), made once from the initializer with numpy."""

from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = ["ROWS", "pack"]

ROWS = 16  # output columns (rows of B) per tile: the int32 / float32 lanes of a vector
_GROUP = 32  # K values per packed group: four 64-byte chunks of a tile
_CHUNK = 64


_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_HIGH_NIBBLES = np.uint64(0xF0F0F0F0F0F0F0F0)
_FOUR = np.uint64(4)


def _pairs(source: np.ndarray) -> np.ndarray:
    """For each 16-byte group of ``source`` (..., 16) and each byte p < 8 of its halves L
    (bytes 0-7) and H (bytes 8-15): the bytes (L & 15) | H << 4 and L >> 4 | H & 0xF0, side
    by side (..., 16). The nibble arithmetic runs on the halves as 64-bit words, eight
    bytes a lane (the bytes are independent: each mask keeps a shift inside its byte)."""
    words = np.ascontiguousarray(source).reshape(-1, 16).view(np.uint64)
    if not np.little_endian:
        words = words.byteswap()  # byte p of a half as bits 8p..8p+7, as on little-endian hosts
    low, high = words[:, 0], words[:, 1]
    even = (low & _LOW_NIBBLES) | ((high & _LOW_NIBBLES) << _FOUR)
    odd = ((low >> _FOUR) & _LOW_NIBBLES) | (high & _HIGH_NIBBLES)
    if not np.little_endian:
        even, odd = even.byteswap(), odd.byteswap()
    return np.stack((even.view(np.uint8), odd.view(np.uint8)), axis=-1).reshape(source.shape)


def pack(
    b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, n: int, k: int, block_size: int,
    read: Callable[[np.ndarray], None] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """MatMulNBits' 4-bit ``B`` (N, blocks, block_size / 2), ``scales`` (N x blocks) and
    packed uint8 ``zero_points`` (N, ceil(blocks / 2)) or None, as the kernels read them:
    weights uint8 (tiles, blocks, block_size / 8, 64), scales float32 (tiles, blocks, 16),
    zero points uint8 (tiles, blocks, 16) or None. Rows past N are zero (scale 0).
    ``read(view)`` is called with each part of ``B``, the scales and the zero points once
    it is read for the last time."""
    blocks = -(-k // block_size)
    tiles = -(-n // ROWS)
    padded = tiles * ROWS
    groups = block_size // _GROUP
    packed = b.reshape(n, blocks * groups, 16)  # 16 bytes a group of 32 values, two a byte
    weights = np.empty((tiles, blocks, groups * 4, _CHUNK), np.uint8)
    words = weights.reshape(tiles, blocks * groups, 4, ROWS, 4).view(np.uint32)[..., 0]  # (tile, group, c, r)
    # A slab of tiles at a time bounds what repacking adds to the peak memory. Values 4c + j
    # (j < 4) of a group are bytes 2c, 2c + 1 of its first half, values 16 + 4c + j the same
    # bytes of its second: byte p of the first half, L, and of the second, H, make the
    # output bytes (L & 15) | H << 4 (values 2p and 16 + 2p) and L >> 4 | H & 0xF0 (2p + 1).
    step = max(1, (1 << 21) // (ROWS * blocks * block_size))
    for t0 in range(0, tiles, step):
        t1 = min(tiles, t0 + step)
        r0, r1 = t0 * ROWS, min(n, t1 * ROWS)
        if r1 - r0 == (t1 - t0) * ROWS:
            source = packed[r0:r1]
        else:  # the last tile's rows past N are zero
            source = np.zeros(((t1 - t0) * ROWS, blocks * groups, 16), np.uint8)
            source[: r1 - r0] = packed[r0:r1]
        pairs = _pairs(source)
        if read is not None:
            read(packed[r0:r1])
        rows = pairs.view(np.uint8).reshape(t1 - t0, ROWS, blocks * groups, 16).view(np.uint32)  # (tile, r, group, c)
        words[t0:t1] = rows.transpose(0, 2, 3, 1)
    scale = np.zeros((padded, blocks), np.float32)
    scale[:n] = scales.reshape(n, blocks)
    if read is not None:
        read(scales)
    scale = np.ascontiguousarray(scale.reshape(tiles, ROWS, blocks).transpose(0, 2, 1))
    zeros = None
    if zero_points is not None:
        per_row = -(-blocks // 2)
        zp = zero_points.reshape(n, per_row)
        z = np.zeros((padded, 2 * per_row), np.uint8)
        z[:n, 0::2] = zp & 0x0F
        z[:n, 1::2] = zp >> 4
        if read is not None:
            read(zero_points)
        zeros = np.ascontiguousarray(z[:, :blocks].reshape(tiles, ROWS, blocks).transpose(0, 2, 1))
    return weights, scale, zeros
