"""CUDA C of the decoder's kernels (over the storage type ``T`` of ``_sources``' prelude):
MatMulNBits computing from the packed 4-bit weight."""

from __future__ import annotations

from ._sources import KernelSource

__all__ = ["DECODER_SOURCES", "NBITS_COLUMNS_PER_BLOCK"]

#: output columns one block of 256 threads computes (one warp per column)
NBITS_COLUMNS_PER_BLOCK = 8

# Y[m, n] = sum_k A[m, k] * (q[n, k] - zero[n, k / block]) * scale[n, k / block] (+ bias[n]).
# One warp per output column n and row m: its lanes walk the column's packed bytes (two
# 4-bit values each, low nibble first), dequantize them in registers with the block's
# scale and zero point and multiply them with A, then reduce across the warp. The weight
# is read once per row in its packed form (a quarter of float16's bytes); no float copy
# of it exists anywhere. Zero points: 0 none (8, the midpoint), 1 packed uint8 nibbles
# (N, ceil(blocks / 2)), 2 one T per block (N, blocks). Accumulation is float32.
_MATMUL_NBITS = r"""
extern "C" __global__ void matmul_nbits4(
    const T* __restrict__ A, const unsigned char* __restrict__ B, const T* __restrict__ scales,
    const unsigned char* __restrict__ zero_packed, const T* __restrict__ zero_float, const T* __restrict__ bias,
    T* __restrict__ Y, int M, int N, int K, int block_size, int blocks, int zero_kind, int has_bias)
{
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int m = blockIdx.y;
    if (n >= N || m >= M) return;
    const int blob = block_size >> 1;  // bytes per block of K
    const long long column = (long long)n * blocks * blob;
    const int zero_row = (blocks + 1) >> 1;
    const T* a = A + (long long)m * K;
    float acc = 0.f;
    for (int j = lane; j < blocks * blob; j += 32) {
        const int block = j / blob;
        const int k = block * block_size + 2 * (j - block * blob);
        if (k >= K) continue;
        const float scale = ld(scales[(long long)n * blocks + block]);
        float zero = 8.f;
        if (zero_kind == 1) {
            const unsigned char packed = zero_packed[(long long)n * zero_row + (block >> 1)];
            zero = (float)((block & 1) ? (packed >> 4) : (packed & 15));
        } else if (zero_kind == 2) {
            zero = ld(zero_float[(long long)n * blocks + block]);
        }
        const unsigned char byte = B[column + j];
        acc += ((float)(byte & 15) - zero) * scale * ld(a[k]);
        if (k + 1 < K) acc += ((float)(byte >> 4) - zero) * scale * ld(a[k + 1]);
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
    if (lane == 0) {
        if (has_bias) acc += ld(bias[n]);
        st(&Y[(long long)m * N + n], acc);
    }
}
"""

DECODER_SOURCES = (KernelSource("matmul_nbits", _MATMUL_NBITS, ("matmul_nbits4",), 32 * NBITS_COLUMNS_PER_BLOCK),)
