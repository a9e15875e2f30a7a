"""The tiled layout of a 4-bit MatMulNBits weight that ``_numba_int4``'s kernels read
(see there), made once from the initializer with numpy."""

from __future__ import annotations

import numpy as np

__all__ = ["ROWS", "pack"]

ROWS = 16  # output columns (rows of B) per tile: the int32 / float32 lanes of a vector
_GROUP = 32  # K values per packed group: four 64-byte chunks of a tile
_CHUNK = 64


def pack(
    b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, n: int, k: int, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """MatMulNBits' 4-bit ``B`` (N, blocks, block_size / 2), ``scales`` (N x blocks) and
    packed uint8 ``zero_points`` (N, ceil(blocks / 2)) or None, as the kernels read them:
    weights uint8 (tiles, blocks, block_size / 8, 64), scales float32 (tiles, blocks, 16),
    zero points uint8 (tiles, blocks, 16) or None. Rows past N are zero (scale 0)."""
    blocks = -(-k // block_size)
    tiles = -(-n // ROWS)
    padded = tiles * ROWS
    groups = block_size // _GROUP
    packed = b.reshape(n, blocks * block_size // 2)
    weights = np.empty((tiles, blocks, groups * 4, _CHUNK), np.uint8)
    # a slab of tiles at a time: the unpacked values (a byte each) of a slab, not of the
    # whole weight, are what the repacking adds to the peak memory
    step = max(1, (1 << 21) // (ROWS * blocks * block_size))
    for t0 in range(0, tiles, step):
        t1 = min(tiles, t0 + step)
        r0, r1 = t0 * ROWS, min(n, t1 * ROWS)
        q = np.zeros(((t1 - t0) * ROWS, blocks * block_size), np.uint8)
        q[: r1 - r0, 0::2] = packed[r0:r1] & 0x0F
        q[: r1 - r0, 1::2] = packed[r0:r1] >> 4
        # (tile, r, block, group, half, c, j) -> (tile, block, group, c, r, j), low | high << 4
        q = q.reshape(t1 - t0, ROWS, blocks, groups, 2, 4, 4)
        slab = (q[:, :, :, :, 0] | (q[:, :, :, :, 1] << 4)).transpose(0, 2, 3, 4, 1, 5)
        weights[t0:t1] = slab.reshape(t1 - t0, blocks, groups * 4, _CHUNK)
    scale = np.zeros((padded, blocks), np.float32)
    scale[:n] = scales.reshape(n, blocks)
    scale = np.ascontiguousarray(scale.reshape(tiles, ROWS, blocks).transpose(0, 2, 1))
    zeros = None
    if zero_points is not None:
        per_row = -(-blocks // 2)
        zp = zero_points.reshape(n, per_row)
        z = np.zeros((padded, 2 * per_row), np.uint8)
        z[:n, 0::2] = zp & 0x0F
        z[:n, 1::2] = zp >> 4
        zeros = np.ascontiguousarray(z[:, :blocks].reshape(tiles, ROWS, blocks).transpose(0, 2, 1))
    return weights, scale, zeros
