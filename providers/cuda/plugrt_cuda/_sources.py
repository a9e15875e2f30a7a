"""Every CUDA C kernel the provider compiles, in one place, and an NVRTC compile that needs no GPU.

Each source is written once over a storage type ``T`` (``float`` or IEEE half stored as
``unsigned short``) and compiled per dtype; arithmetic is always float32. Half values are
converted with PTX ``cvt`` instructions, so no CUDA header (``cuda_fp16.h``) is needed and
the sources compile with NVRTC alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from typing import Any

__all__ = ["KernelSource", "SOURCES", "DTYPES", "module_source", "kernel_names", "compile_cubin", "nvrtc_version",
           "NvrtcUnavailable"]

#: storage types by numpy dtype name
DTYPES = {"float32": "float", "float16": "unsigned short"}

_PRELUDE = r"""
typedef %(T)s T;
#define INFINITY __int_as_float(0x7f800000)
__device__ __forceinline__ float ld(float v) { return v; }
__device__ __forceinline__ float ld(unsigned short v) {
    float f; asm("cvt.f32.f16 %%0, %%1;" : "=f"(f) : "h"(v)); return f;
}
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(unsigned short* p, float v) {
    unsigned short h; asm("cvt.rn.f16.f32 %%0, %%1;" : "=h"(h) : "f"(v)); *p = h;
}
__device__ __forceinline__ float block_sum(float v, float* shared) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < (blockDim.x + 31) / 32; ++w) total += shared[w];
    __syncthreads();
    return total;
}
__device__ __forceinline__ float block_max(float v, float* shared) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float total = -INFINITY;
    for (int w = 0; w < (blockDim.x + 31) / 32; ++w) total = fmaxf(total, shared[w]);
    __syncthreads();
    return total;
}
"""


@dataclasses.dataclass(frozen=True)
class KernelSource:
    """One CUDA C module: its source (over ``T``) and the ``extern "C"`` kernels it defines."""

    name: str
    code: str
    kernels: tuple[str, ...]
    block: int  # threads per block the launcher uses


# Batched GEMM: C[b] = alpha * op(A[b]) @ op(B[b]) (+ bias[n] when has_bias), float
# accumulation. A 64x64 tile per block of 256 threads, each thread a 4x4 micro-tile, K in
# steps of 16 through shared memory. Batch strides may be 0 (a broadcast operand). The
# provider's own GEMM: cupy refuses cuBLAS during stream capture, this one can be captured.
_GEMM = r"""
#define TM 64
#define TN 64
#define TK 16
extern "C" __global__ void gemm(
    const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C, const T* __restrict__ bias,
    int M, int N, int K, int lda, int ldb, int ldc, int transA, int transB,
    long long strideA, long long strideB, long long strideC, float alpha, int has_bias)
{
    __shared__ float As[TK][TM + 1];
    __shared__ float Bs[TK][TN + 1];
    const int batch = blockIdx.z;
    A += batch * strideA; B += batch * strideB; C += batch * strideC;
    const int row0 = blockIdx.y * TM, col0 = blockIdx.x * TN;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[4][4] = {{0.f}};
    for (int k0 = 0; k0 < K; k0 += TK) {
        for (int i = threadIdx.x; i < TK * TM; i += 256) {
            int kk = i / TM, mm = i % TM;
            int r = row0 + mm, k = k0 + kk;
            float v = 0.f;
            if (r < M && k < K) v = ld(transA ? A[(long long)k * lda + r] : A[(long long)r * lda + k]);
            As[kk][mm] = v;
        }
        for (int i = threadIdx.x; i < TK * TN; i += 256) {
            int kk = i / TN, nn = i % TN;
            int c = col0 + nn, k = k0 + kk;
            float v = 0.f;
            if (c < N && k < K) v = ld(transB ? B[(long long)c * ldb + k] : B[(long long)k * ldb + c]);
            Bs[kk][nn] = v;
        }
        __syncthreads();
        #pragma unroll
        for (int kk = 0; kk < TK; ++kk) {
            float a[4], b[4];
            #pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i];
            #pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx + 16 * j];
            #pragma unroll
            for (int i = 0; i < 4; ++i)
                #pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        int r = row0 + ty + 16 * i;
        if (r >= M) continue;
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            int c = col0 + tx + 16 * j;
            if (c >= N) continue;
            float v = alpha * acc[i][j];
            if (has_bias) v += ld(bias[c]);
            st(&C[(long long)r * ldc + c], v);
        }
    }
}
"""

# im2col for 2-D convolution: cols[n][c*KH*KW + i*KW + j][oy*OW + ox], zero outside the input.
_IM2COL = r"""
extern "C" __global__ void im2col2d(
    const T* __restrict__ x, T* __restrict__ cols, int N, int C, int H, int W, int KH, int KW,
    int OH, int OW, int SH, int SW, int PH, int PW, int DH, int DW)
{
    long long total = (long long)N * C * KH * KW * OH * OW;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        int ox = idx % OW; long long t = idx / OW;
        int oy = t % OH; t /= OH;
        int j = t % KW; t /= KW;
        int i = t % KH; t /= KH;
        int c = t % C; int n = t / C;
        int y = oy * SH - PH + i * DH, xx = ox * SW - PW + j * DW;
        float v = 0.f;
        if (y >= 0 && y < H && xx >= 0 && xx < W) v = ld(x[(((long long)n * C + c) * H + y) * W + xx]);
        st(&cols[idx], v);
    }
}
"""

# Depthwise 2-D convolution (group == C == M): one thread per output element.
_DEPTHWISE = r"""
extern "C" __global__ void depthwise_conv2d(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias, T* __restrict__ y,
    int N, int C, int H, int W, int KH, int KW, int OH, int OW, int SH, int SW, int PH, int PW,
    int DH, int DW, int has_bias, int relu)
{
    long long total = (long long)N * C * OH * OW;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        int ox = idx % OW; long long t = idx / OW;
        int oy = t % OH; t /= OH;
        int c = t % C; int n = t / C;
        const T* plane = x + ((long long)n * C + c) * H * W;
        float acc = has_bias ? ld(bias[c]) : 0.f;
        for (int i = 0; i < KH; ++i) {
            int yy = oy * SH - PH + i * DH;
            if (yy < 0 || yy >= H) continue;
            for (int j = 0; j < KW; ++j) {
                int xx = ox * SW - PW + j * DW;
                if (xx < 0 || xx >= W) continue;
                acc += ld(plane[yy * W + xx]) * ld(w[(c * KH + i) * KW + j]);
            }
        }
        if (relu) acc = fmaxf(acc, 0.f);
        st(&y[idx], acc);
    }
}
"""

# 2-D max / average pooling; mode 0 max, 1 average excluding pads, 2 average including
# pads (but not the area ceil_mode adds past the padded input).
_POOL = r"""
extern "C" __global__ void pool2d(
    const T* __restrict__ x, T* __restrict__ y, int N, int C, int H, int W, int KH, int KW,
    int OH, int OW, int SH, int SW, int PH, int PW, int PH_END, int PW_END, int DH, int DW, int mode)
{
    long long total = (long long)N * C * OH * OW;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        int ox = idx % OW; long long t = idx / OW;
        int oy = t % OH; long long nc = t / OH;
        const T* plane = x + nc * H * W;
        float acc = mode == 0 ? -INFINITY : 0.f;
        int count = 0, padded = 0;
        for (int i = 0; i < KH; ++i) {
            int yy = oy * SH - PH + i * DH;
            bool in_pad_y = yy >= -PH && yy < H + PH_END;
            for (int j = 0; j < KW; ++j) {
                int xx = ox * SW - PW + j * DW;
                if (in_pad_y && xx >= -PW && xx < W + PW_END) ++padded;
                if (yy < 0 || yy >= H || xx < 0 || xx >= W) continue;
                float v = ld(plane[yy * W + xx]);
                acc = mode == 0 ? fmaxf(acc, v) : acc + v;
                ++count;
            }
        }
        if (mode == 1) acc /= (float)max(count, 1);
        if (mode == 2) acc /= (float)max(padded, 1);
        st(&y[idx], acc);
    }
}
"""

# Row-wise softmax / log-softmax over the last axis: one block per row.
_SOFTMAX = r"""
extern "C" __global__ void softmax_rows(const T* __restrict__ x, T* __restrict__ y, int cols, int log_mode)
{
    __shared__ float shared[32];
    const T* row = x + (long long)blockIdx.x * cols;
    T* out = y + (long long)blockIdx.x * cols;
    float m = -INFINITY;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, ld(row[i]));
    m = block_max(m, shared);
    float s = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) s += __expf(ld(row[i]) - m);
    s = block_sum(s, shared);
    float log_s = __logf(s);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = ld(row[i]) - m;
        st(&out[i], log_mode ? v - log_s : __expf(v) / s);
    }
}
"""

# Row-wise LayerNormalization over the trailing ``cols`` elements: one block per row,
# float32 statistics (two passes over the row: mean, then variance of the centred values).
_LAYERNORM = r"""
extern "C" __global__ void layernorm_rows(
    const T* __restrict__ x, const T* __restrict__ scale, const T* __restrict__ bias, T* __restrict__ y,
    float* __restrict__ mean_out, float* __restrict__ inv_std_out, int cols, float epsilon, int has_bias)
{
    __shared__ float shared[32];
    const T* row = x + (long long)blockIdx.x * cols;
    T* out = y + (long long)blockIdx.x * cols;
    float s = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) s += ld(row[i]);
    float mean = block_sum(s, shared) / cols;
    float q = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) { float d = ld(row[i]) - mean; q += d * d; }
    float inv_std = rsqrtf(block_sum(q, shared) / cols + epsilon);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = (ld(row[i]) - mean) * inv_std * ld(scale[i]);
        if (has_bias) v += ld(bias[i]);
        st(&out[i], v);
    }
    if (threadIdx.x == 0 && mean_out) { mean_out[blockIdx.x] = mean; inv_std_out[blockIdx.x] = inv_std; }
}
"""

# Fused elementwise chains, one launch each (grid-stride loops over the flat tensor),
# float32 arithmetic: erf and tanh GELU (FastGelu's optional bias added first, broadcast
# over the last axis), SiLU (x * sigmoid(x)), and LRN across channels. erf is the same
# Chebyshev fit as ``_xp.erf`` (~1.2e-7), so the numpy-tested math is what runs here.
_ACTIVATION = r"""
__device__ __forceinline__ float erf_fit(float x) {
    float z = fabsf(x);
    float t = 1.f / (1.f + 0.5f * z);
    float poly = -z * z - 1.26551223f + t * (1.00002368f + t * (0.37409196f + t * (0.09678418f + t * (
        -0.18628806f + t * (0.27886807f + t * (-1.13520398f + t * (1.48851587f + t * (-0.82215223f
        + t * 0.17087277f))))))));
    float v = 1.f - t * __expf(poly);
    return x >= 0.f ? v : -v;
}
extern "C" __global__ void gelu_erf(const T* __restrict__ x, T* __restrict__ y, long long n)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float v = ld(x[i]);
        st(&y[i], 0.5f * v * (1.f + erf_fit(v * 0.70710678118654752f)));
    }
}
extern "C" __global__ void gelu_tanh(
    const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ y, long long n, int hidden)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float v = ld(x[i]);
        if (hidden > 0) v += ld(bias[i % hidden]);
        float inner = 0.79788456080286536f * (v + 0.044715f * v * v * v);
        st(&y[i], 0.5f * v * (1.f + tanhf(inner)));
    }
}
extern "C" __global__ void silu(const T* __restrict__ x, T* __restrict__ y, long long n)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float v = ld(x[i]);
        st(&y[i], v / (1.f + __expf(-v)));
    }
}
extern "C" __global__ void lrn_channels(
    const T* __restrict__ x, T* __restrict__ y, long long n, int channels, long long inner,
    int size, float alpha, float beta, float bias)
{
    const int before = (size - 1) / 2, after = size / 2;  // the spec's floor/ceil split of the window
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long s = i % inner;
        int c = (int)((i / inner) % channels);
        const T* base = x + (i / (inner * channels)) * channels * inner + s;
        int lo = c - before < 0 ? 0 : c - before, hi = c + after >= channels ? channels - 1 : c + after;
        float sum = 0.f;
        for (int k = lo; k <= hi; ++k) { float v = ld(base[k * inner]); sum += v * v; }
        st(&y[i], ld(x[i]) / powf(bias + (alpha / size) * sum, beta));
    }
}
"""

SOURCES: dict[str, KernelSource] = {
    s.name: s
    for s in (
        KernelSource("gemm", _GEMM, ("gemm",), 256),
        KernelSource("im2col", _IM2COL, ("im2col2d",), 256),
        KernelSource("depthwise", _DEPTHWISE, ("depthwise_conv2d",), 256),
        KernelSource("pool", _POOL, ("pool2d",), 256),
        KernelSource("softmax", _SOFTMAX, ("softmax_rows",), 256),
        KernelSource("layernorm", _LAYERNORM, ("layernorm_rows",), 256),
        KernelSource("activation", _ACTIVATION, ("gelu_erf", "gelu_tanh", "silu", "lrn_channels"), 256),
    )
}


def _register_decoder_sources() -> None:
    # the decoder's kernels live in their own module; imported here so that every source
    # is in SOURCES (and compiled by tests/cuda/test_nvrtc.py) whoever imports this module
    from ._decoder_sources import DECODER_SOURCES

    SOURCES.update((s.name, s) for s in DECODER_SOURCES)


_register_decoder_sources()


def module_source(name: str, dtype: str) -> str:
    """The complete CUDA C of module ``name`` for numpy dtype name ``dtype``."""
    try:
        storage = DTYPES[dtype]
    except KeyError:
        raise ValueError(f"CUDA kernels are built for {sorted(DTYPES)}, not {dtype!r}") from None
    return _PRELUDE % {"T": storage} + SOURCES[name].code


def kernel_names(name: str) -> tuple[str, ...]:
    return SOURCES[name].kernels


class NvrtcUnavailable(RuntimeError):
    """NVRTC cannot be loaded (cupy or its NVRTC wheel is missing)."""


def _nvrtc() -> Any:
    try:
        from cupy_backends.cuda.libs import nvrtc  # the low-level binding: needs no device

        nvrtc.getVersion()
    except Exception as exc:
        raise NvrtcUnavailable(
            f"NVRTC cannot be loaded ({type(exc).__name__}: {exc}); pip install './providers/cuda[cuda12]' "
            "(cupy-cuda12x, nvidia-cuda-nvrtc-cu12) or './providers/cuda[cuda13]' (cupy-cuda13x, nvidia-cuda-nvrtc)"
        ) from exc
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC that compiles here; NvrtcUnavailable when there is none."""
    major, minor = _nvrtc().getVersion()
    return int(major), int(minor)


#: cubins compiled in this process, by (source digest, dtype, architecture): a module is
#: compiled once whatever asks for it (loading it, an EPContext export, another session)
_CUBINS: dict[tuple[str, str, str], bytes] = {}
_CUBINS_LOCK = threading.Lock()


def compile_cubin(name: str, dtype: str, arch: str) -> bytes:
    """Compile module ``name`` for ``dtype`` to a cubin for ``arch`` ("sm_90") with NVRTC,
    once per (source, dtype, architecture) in a process.

    Needs no GPU. Raises RuntimeError carrying NVRTC's log when the source does not compile.
    """
    source = module_source(name, dtype)
    key = (hashlib.sha256(source.encode("utf-8")).hexdigest(), dtype, arch)
    with _CUBINS_LOCK:
        found = _CUBINS.get(key)
        if found is None:
            found = _CUBINS[key] = _compile(name, dtype, arch, source)
    return found


def _compile(name: str, dtype: str, arch: str, source: str) -> bytes:
    nvrtc = _nvrtc()
    program = nvrtc.createProgram(source, f"plugrt_{name}_{dtype}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, [f"-arch={arch}", "-std=c++14"])
        except Exception as exc:
            log = nvrtc.getProgramLog(program)
            raise RuntimeError(f"NVRTC could not compile {name} ({dtype}, {arch}):\n{log}") from exc
        return bytes(nvrtc.getCUBIN(program))
    finally:
        nvrtc.destroyProgram(program)
