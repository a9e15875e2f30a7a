"""com.microsoft block-quantized kernels: MatMulNBits, GatherBlockQuantized, QuantizeLinear, DequantizeLinear."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import contextlib
import logging
import mmap
import os
import threading
import weakref
from typing import Any

from plugrt.provider import shared_transform
from plugrt.threads import PARALLEL_MIN_WORK, blas_threads, threads_for

from .._registry import KernelContext, declare_into, kernel, kernel_builder
from ._compiled import compiled_enabled, compiled_module
from ._compiled_parallel import compiled_pool
from ._host_cpu import data_cache_bytes
from .quantization import _dequantize, _quantize

_MS = "com.microsoft"
_PACKABLE_BITS = (2, 4, 8)  # widths that tile a byte exactly (low-order bits first)
_FLOAT_DATA = frozenset(
    np.dtype(t)
    for t in (
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e4m3fnuz,
        ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e5m2fnuz,
        ml_dtypes.float4_e2m1fn,
    )
)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 (..., n) holding 8/bits values per byte, low-order bits first -> uint8 (..., n * 8 / bits)."""
    if bits == 8:
        return packed
    per_byte = 8 // bits
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8)
    values = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return values.reshape(packed.shape[:-1] + (packed.shape[-1] * per_byte,))


def _work_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(dtype) if dtype in (np.float32, np.float64) else np.dtype(np.float32)


# ----------------------------------------------------------------------------- MatMulNBits


def _nbits_rows(
    b: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    g_idx: np.ndarray | None,
    n: int,
    k: int,
    bits: int,
    block_size: int,
    work: np.dtype,
    rows: slice = slice(None),
    scratch: np.ndarray | None = None,
) -> np.ndarray:
    """Rows ``rows`` of the dequantized weight (output columns of the product) as an
    (rows, K) array of ``work`` type, one vectorised pass over only those rows (4-bit
    float32 ones into ``scratch`` when it is given and large enough)."""
    blocks = -(-k // block_size)
    blob = block_size * bits // 8
    if b.dtype != np.uint8 or b.size != n * blocks * blob:
        raise ValueError(f"B must be uint8 of shape ({n}, {blocks}, {blob}) for N={n}, K={k}, got {b.dtype} {b.shape}")
    if scales.size != n * blocks:
        raise ValueError(f"scales must hold N x k_blocks = {n} x {blocks} values, got shape {scales.shape}")
    if bits == 4 and g_idx is None and work == np.float32:
        return _four_bit_rows(b.reshape(n, blocks * blob)[rows], scales, zero_points, n, k, block_size, rows, scratch)
    q = _unpack(b.reshape(n, blocks, blob)[rows], bits).reshape(-1, blocks * block_size)[:, :k]
    count = q.shape[0]
    scale = scales.reshape(n, blocks)[rows].astype(work, copy=False)
    if zero_points is None:
        zero = np.full((count, blocks), 1 << (bits - 1), dtype=work)
    elif zero_points.dtype == np.uint8:
        per_row = -(-blocks * bits // 8)
        if zero_points.size != n * per_row:
            raise ValueError(f"packed zero_points must have shape ({n}, {per_row}), got {zero_points.shape}")
        zero = _unpack(zero_points.reshape(n, per_row)[rows], bits)[:, :blocks].astype(work)
    else:
        if zero_points.size != n * blocks:
            raise ValueError(f"float zero_points must have shape ({n}, {blocks}), got {zero_points.shape}")
        zero = zero_points.reshape(n, blocks)[rows].astype(work, copy=False)
    if g_idx is not None:
        # deprecated act-order layout: column k belongs to block g_idx[k]
        groups = np.asarray(g_idx, dtype=np.int64).reshape(-1)
        if groups.shape != (k,) or groups.min(initial=0) < 0 or groups.max(initial=0) >= blocks:
            raise ValueError(f"g_idx must hold {k} block indices in [0, {blocks}), got shape {groups.shape}")
        return (q.astype(work) - zero[:, groups]) * scale[:, groups]
    padded = blocks * block_size
    full = np.empty((count, padded), work)
    full[:, :k] = q
    full[:, k:] = 0
    full = full.reshape(count, blocks, block_size)
    full -= zero[..., None]
    full *= scale[..., None]
    return full.reshape(count, padded)[:, :k]


def _byte_table(offset: float) -> np.ndarray:
    """Each byte's two 4-bit values (low, high) less ``offset`` as float32 pairs, one
    uint64 per byte: one ``take`` then unpacks and converts a packed row."""
    values = np.arange(256)
    pairs = np.stack([values & 15, values >> 4], axis=1).astype(np.float32) - np.float32(offset)
    return np.ascontiguousarray(pairs).view(np.uint64).reshape(256)


_BYTE_PAIRS = _byte_table(0.0)
_CENTERED_PAIRS = _byte_table(8.0)  # the default zero point folded in


def _four_bit_rows(
    packed: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    n: int,
    k: int,
    block_size: int,
    rows: slice,
    scratch: np.ndarray | None,
) -> np.ndarray:
    """``_nbits_rows`` for 4-bit weights and float32: a table look-up per byte gives its
    two values as floats (0.3 ns a weight, where unpacking by shifts and converting took
    4), then the zero points and scales per block."""
    count, half = packed.shape
    blocks = -(-k // block_size)
    if scratch is None or scratch.size < count * half:
        scratch = np.empty(count * half, np.uint64)
    pairs = scratch[: count * half].reshape(count, half)
    np.take(_BYTE_PAIRS if zero_points is not None else _CENTERED_PAIRS, packed, out=pairs, mode="wrap")
    weight = pairs.view(np.float32).reshape(count, blocks, block_size)
    if zero_points is not None:
        if zero_points.dtype == np.uint8:
            per_row = -(-blocks // 2)
            if zero_points.size != n * per_row:
                raise ValueError(f"packed zero_points must have shape ({n}, {per_row}), got {zero_points.shape}")
            zero = _unpack(zero_points.reshape(n, per_row)[rows], 4)[:, :blocks].astype(np.float32)
        else:
            if zero_points.size != n * blocks:
                raise ValueError(f"float zero_points must have shape ({n}, {blocks}), got {zero_points.shape}")
            zero = zero_points.reshape(n, blocks)[rows].astype(np.float32, copy=False)
        weight -= zero[..., None]
    weight *= scales.reshape(n, blocks)[rows].astype(np.float32, copy=False)[..., None]
    return weight.reshape(count, blocks * block_size)[:, :k]


def _slab_bytes() -> int:
    """Bytes of weight rows the numpy path dequantizes at a time: the host's L2 cache (1 MiB
    where sysfs does not say), so that a slab stays there while BLAS multiplies it and no
    float copy of the whole weight is made."""
    return data_cache_bytes(2, 1 << 20)


def _int8_blocks(a: np.ndarray, block_size: int) -> np.ndarray:
    """A quantized to int8 and back, symmetrically per block of ``block_size`` along K
    (scale = max |a| / 127 over the block), the activations of an int8 matmul."""
    k = a.shape[-1]
    blocks = -(-k // block_size)
    if k == blocks * block_size:
        padded = a
    else:  # a partial last block: zeros change neither its peak nor the products
        padded = np.zeros(a.shape[:-1] + (blocks * block_size,), a.dtype)
        padded[..., :k] = a
    grouped = padded.reshape(a.shape[:-1] + (blocks, block_size))
    peak = np.max(np.abs(grouped), axis=-1, keepdims=True)
    scale = peak / a.dtype.type(127)
    inverse = np.divide(a.dtype.type(127), peak, out=np.zeros_like(peak), where=peak != 0)
    quantized = np.multiply(grouped, inverse)
    np.rint(quantized, out=quantized)
    np.clip(quantized, -128, 127, out=quantized)
    quantized *= scale
    return quantized.reshape(padded.shape)[..., :k]


class _Packed:
    """A 4-bit weight as the compiled kernels read it (``_numba_int4.pack``)."""

    __slots__ = ("weights", "scales", "zeros", "tiles", "blocks", "groups", "__weakref__")

    def __init__(self, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, n: int, k: int, block_size: int):
        from ._int4_layout import pack

        # each slab of the source is let go of as soon as it is repacked: a source held resident
        # until the end was SmolLM2's peak, its 14 MiB LM head beside its copy at the end of the build
        self.weights, self.scales, self.zeros = pack(b, scales, zero_points, n, k, block_size, read=_release_range)
        self.tiles, self.blocks = self.weights.shape[:2]
        self.groups = block_size // 32
        for source in (b, scales, zero_points):  # read once to repack: not held resident beside the copy
            if source is not None:
                _release_pages(source)

    @property
    def nbytes(self) -> int:
        """What the repacked form holds (a WeightStore counts it in ``transform_bytes``)."""
        return sum(int(a.nbytes) for a in (self.weights, self.scales, self.zeros) if a is not None)


# Each repacked 4-bit weight by the memory it was made from: an embedding table tied to an
# LM head (its bytes, reshaped) reads its rows from there instead of from the file. Weak
# references only, so an entry never keeps a weight alive, and one whose arrays are gone is
# never matched (their memory may hold other bytes by then).
_MemoryKey = tuple[int, int, str]
_PACKED_BY_SOURCE: dict[tuple[Any, ...], tuple[weakref.ref[_Packed], tuple[weakref.ref[np.ndarray], ...]]] = {}


def _memory_key(array: np.ndarray | None) -> _MemoryKey | None:
    """Where ``array``'s bytes lie, how many and of what type; None for an absent input."""
    return None if array is None else (int(array.ctypes.data), int(array.nbytes), array.dtype.str)


def _remember_packed(packed: _Packed, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, block_size: int) -> None:
    """Record ``packed`` as made from these arrays' memory (``_packed_from``)."""
    sources = [a for a in (b, scales, zero_points) if a is not None]
    if not all(a.flags.c_contiguous for a in sources):
        return  # the same address and size need not mean the same bytes in the same order
    for key, (packed_ref, source_refs) in list(_PACKED_BY_SOURCE.items()):  # the records of weights gone
        if packed_ref() is None or any(ref() is None for ref in source_refs):
            _PACKED_BY_SOURCE.pop(key, None)
    key = (_memory_key(b), _memory_key(scales), _memory_key(zero_points), block_size)
    _PACKED_BY_SOURCE[key] = (weakref.ref(packed), tuple(weakref.ref(a) for a in sources))


def _packed_from(data: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, block_size: int) -> _Packed | None:
    """The repacked 4-bit weight made from the very memory of a 2-D table ``data`` (N x K/2
    bytes), its ``scales`` (N x blocks) and packed ``zero_points`` (N x blocks/2 bytes) or
    none, with this ``block_size``; None when no live one was."""
    if data.ndim != 2 or scales.ndim != 2 or (zero_points is not None and zero_points.ndim != 2):
        return None
    if not all(a.flags.c_contiguous for a in (data, scales, zero_points) if a is not None):
        return None
    entry = _PACKED_BY_SOURCE.get((_memory_key(data), _memory_key(scales), _memory_key(zero_points), block_size))
    if entry is None or any(ref() is None for ref in entry[1]):
        return None
    packed = entry[0]()
    if packed is None:
        return None
    n, blocks = data.shape[0], packed.blocks
    if data.shape[1] * 2 != blocks * block_size or scales.shape != (n, blocks):
        return None
    if zero_points is not None and zero_points.shape != (n, -(-blocks // 2)):
        return None
    return packed


def _same_memory(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Whether two inputs are the same array, or views of the same bytes alike."""
    if a is b:
        return True
    if a is None or b is None:
        return False
    return a.shape == b.shape and a.strides == b.strides and _memory_key(a) == _memory_key(b)


def _packed_rows(packed: _Packed, rows: np.ndarray, block_size: int) -> np.ndarray:
    """Rows ``rows`` (int64, in range) of a repacked 4-bit weight, dequantized as the
    numpy path does: float32 (rows.size, blocks * block_size). Only those rows' bytes are
    read, from the copy in memory rather than the file."""
    from ._int4_layout import ROWS

    flat = rows.reshape(-1)
    tile, lane = np.divmod(flat, ROWS)
    count, blocks, groups = flat.size, packed.blocks, block_size // 32
    # A tile's 64-byte line holds 4 bytes of each of its 16 rows; byte q of a row's group of
    # 32 values holds value q in its low nibble and value 16 + q in its high one.
    line = packed.weights.reshape(packed.tiles, blocks, groups * 4, ROWS, 4)[tile, :, :, lane, :]
    line = line.reshape(count, blocks, groups, 16)
    values = np.empty((count, blocks, groups, 2, 16), np.float32)
    values[..., 0, :] = line & np.uint8(15)
    values[..., 1, :] = line >> np.uint8(4)
    weight = values.reshape(count, blocks, block_size)
    if packed.zeros is None:
        weight -= np.float32(8)
    else:
        weight -= packed.zeros[tile, :, lane][..., None]
    weight *= packed.scales[tile, :, lane][..., None]
    return weight.reshape(count, blocks * block_size)


def _read_only_map(array: np.ndarray) -> mmap.mmap | None:
    """The read-only memory map of a file that ``array`` views, or None (anonymous memory,
    a closed map, or a copy-on-write map, which could hold changes of its own)."""
    owner: Any = array
    while owner is not None and not isinstance(owner, mmap.mmap):
        owner = owner.obj if isinstance(owner, memoryview) else getattr(owner, "base", None)
    if not isinstance(owner, mmap.mmap) or owner.closed or not hasattr(owner, "madvise"):
        return None
    with contextlib.suppress(ValueError):
        if memoryview(owner).readonly:
            return owner
    return None


def _release_pages(array: np.ndarray) -> None:
    """Let the kernel drop from this process's resident memory the pages of the read-only
    memory map of a file (external data) that ``array`` views: they are read back from
    the file if they are read again. The whole map, not only ``array``'s pages: onnx_ir
    maps the file once per tensor, and the kernel's fault-around keeps up to 64 KiB of
    neighbouring pages resident in each map (24 MiB over a 135M decoder's 365 tensors).
    Arrays in anonymous memory are left alone."""
    owner = _read_only_map(array)
    if owner is not None:
        with contextlib.suppress(OSError, ValueError):
            owner.madvise(mmap.MADV_DONTNEED)


def _release_range(array: np.ndarray) -> None:
    """``_release_pages`` for the pages ``array`` (a contiguous view) spans alone, rounded
    out to whole pages: for a source read a slab at a time."""
    owner = _read_only_map(array)
    if owner is None or not array.flags.c_contiguous or array.nbytes == 0:
        return
    with contextlib.suppress(OSError, ValueError):
        base = int(np.frombuffer(owner, np.uint8).ctypes.data)
        start = int(array.ctypes.data) - base
        first = start - start % mmap.PAGESIZE
        owner.madvise(mmap.MADV_DONTNEED, first, min(len(owner), start + array.nbytes) - first)


def _compiled_kinds(bits: int, block_size: int, scales: np.ndarray | None, zero_points: np.ndarray | None, g_idx: np.ndarray | None) -> bool:
    """Whether the compiled 4-bit kernels take this weight: 4 bits in whole groups of 32,
    float scales, packed zero points or none, no act-order ``g_idx``."""
    return (
        bits == 4
        and block_size % 32 == 0
        and g_idx is None
        and scales is not None
        and scales.dtype in (np.float32, np.float16)
        and (zero_points is None or zero_points.dtype == np.uint8)
    )


def _job_buffers(rows: int, width: int, blocks: int, int8: bool, padded: bool) -> tuple[np.ndarray, ...]:
    """A product's buffers for ``rows`` rows of A: A quantized to int8 with its block
    scales and sums, A padded to whole blocks, the float tiles' dequantized tables."""
    return (
        np.zeros((rows, width) if int8 else 0, np.int8),
        np.zeros((rows, blocks) if int8 else 0, np.float32),
        np.zeros((rows, blocks) if int8 else 0, np.int32),
        np.zeros((rows, width) if padded else 0, np.float32),
        # the float tiles of several rows dequantize a tile here first: K x 16 floats a thread,
        # on a 64-byte boundary
        np.zeros(_SLOTS * width * 16 + 16 if not int8 and rows > 1 else 0, np.float32),
    )


# Each thread's product buffers by shape, shared by every MatMulNBits it runs eagerly: a
# product fills them and is done with them before the next starts on that thread. One set a
# node held 9 MiB for a 64-token prompt through SmolLM2-135M's 151 products, and grows
# with the prompt (rows x K bytes a node and thread).
_SHARED_BUFFERS = threading.local()


class _Job:
    """The buffers and context for compiled products of ``rows`` rows of A: made once,
    reused by every call of that many rows (a decode step's 1, a prompt's). ``shared``:
    the buffers are the calling thread's, shared with its other products (an eager
    product); else its own (a bound replay, which may run on any thread)."""

    __slots__ = ("buffers", "context", "address")

    def __init__(
        self, loops: Any, packed: _Packed, rows: int, n: int, block_size: int, body: int, padded: bool,
        shared: bool = False,
    ) -> None:
        width = packed.blocks * block_size
        int8 = body != loops.FLOAT_BODY
        key = (rows, width, packed.blocks, int8, padded)
        if shared:
            by_shape = getattr(_SHARED_BUFFERS, "by_shape", None)
            if by_shape is None:
                by_shape = _SHARED_BUFFERS.by_shape = {}
            buffers = by_shape.get(key)
            if buffers is None:
                buffers = by_shape[key] = _job_buffers(*key)
            self.buffers = buffers
        else:
            self.buffers = _job_buffers(*key)
        quantized, scales, sums, padding, tables = self.buffers
        table = tables.ctypes.data + (-tables.ctypes.data % 64) if tables.size else 0
        zeros = packed.zeros
        words = [0] * loops.CONTEXT_WORDS
        for index, value in (
            (loops.CTX_WEIGHTS, packed.weights.ctypes.data),
            (loops.CTX_SCALES, packed.scales.ctypes.data),
            (loops.CTX_ZEROS, 0 if zeros is None else zeros.ctypes.data),
            (loops.CTX_ACTIVATIONS, quantized.ctypes.data if int8 else 0),
            (loops.CTX_ASCALES, scales.ctypes.data if int8 else 0),
            (loops.CTX_ASUMS, sums.ctypes.data if int8 else 0),
            (loops.CTX_ROWS_M, rows),
            (loops.CTX_N, n),
            (loops.CTX_TILES, packed.tiles),
            (loops.CTX_BLOCKS, packed.blocks),
            (loops.CTX_GROUPS, packed.groups),
            (loops.CTX_UNITS, 1),
            (loops.CTX_BODY, body),
            (loops.CTX_PADDED, padding.ctypes.data if padded else 0),
            (loops.CTX_SCRATCH, table),
        ):
            words[index] = value
        self.context = np.array(words, np.int64)
        self.address = int(self.context.ctypes.data)


class _Jobs(threading.local):
    """Each thread's ``_Job``s by row count and layout."""

    def __init__(self) -> None:
        self.by_rows: dict[tuple[int, bool], _Job] = {}


# Each thread's slab of dequantized weight rows for the numpy path, shared by every
# MatMulNBits (one a node would hold a megabyte for each of a decoder's hundreds).
_SLABS = threading.local()


# Multiply-adds from which a compiled product shares its tiles out over the free cores (the
# compiled pool's workers spin between jobs: a split pays off from tens of microseconds),
# and units of tiles per thread.
_COMPILED_MIN_WORK = 1 << 18
_SLOTS = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
_UNITS_PER_THREAD = 4


_HINTED: list[bool] = []


def _hint_without_numba() -> None:
    """Say once per process that 4-bit products run on their numpy path: about 17x slower
    a decode step than the compiled kernels (benchmarks/RESULTS.md), in bounded memory."""
    if _HINTED:
        return
    _HINTED.append(True)
    reason = "PLUGRT_NUMBA=0 is set" if os.environ.get("PLUGRT_NUMBA") == "0" else "numba is not installed"
    logging.getLogger("plugrt").warning(
        "MatMulNBits: %s, so 4-bit weights are dequantized slab by slab and multiplied in numpy, many times "
        "slower than the compiled int4 kernels; for LLM decoders install them: pip install 'plugrt[accelerate]'",
        reason,
    )


@kernel_builder("MatMulNBits", 1, domain=_MS)
def matmul_nbits(ctx: KernelContext):
    attrs = ctx.attributes
    try:
        n, k, block_size = int(attrs["N"]), int(attrs["K"]), int(attrs["block_size"])
    except KeyError as e:
        raise NotImplementedError(f"MatMulNBits needs the {e.args[0]} attribute") from e
    bits = int(attrs.get("bits", 4))
    if bits not in _PACKABLE_BITS:
        raise NotImplementedError(f"MatMulNBits with bits={bits} is not supported on the CPU provider (2, 4 or 8)")
    if block_size < 16 or block_size & (block_size - 1):
        raise NotImplementedError(f"MatMulNBits' block_size must be a power of 2 of at least 16, got {block_size}")
    if int(attrs.get("weight_prepacked", 0)):
        raise NotImplementedError("MatMulNBits with weight_prepacked=1 is specific to another provider's layout")
    # accuracy_level 4 asks for int8 activations: A is quantized symmetrically per block
    # of K as onnxruntime does, so greedy decoding picks the same tokens as it. Lower
    # levels multiply in float32 (float64 for float64 A).
    int8_activations = int(attrs.get("accuracy_level", 0)) == 4
    blocks = -(-k // block_size)
    constants = list(ctx.constant_inputs) + [None] * (5 - len(ctx.constant_inputs))
    jobs = _Jobs()

    def fixed(i: int) -> bool:  # absent, or an initializer
        if i >= ctx.num_inputs or constants[i] is not None:
            return True
        return ctx.node is not None and ctx.node.inputs[i] is None

    packed: _Packed | None = None
    if (
        all(fixed(i) for i in range(1, 5))
        and constants[1] is not None
        and constants[1].size
        and _compiled_kinds(bits, block_size, constants[2], constants[3], constants[4])
        and compiled_enabled()
    ):
        # The weight is an initializer: repacked once for the compiled kernels, half a byte
        # a weight as it came, one copy for every session of a WeightStore (a prefill and a
        # decode graph). Nothing is dequantized ahead of a call.
        packed = shared_transform(
            tuple(constants[1:5]),
            ("MatMulNBits.int4", n, k, block_size),
            lambda: _Packed(constants[1], constants[2], constants[3], n, k, block_size),
        )
        _remember_packed(packed, constants[1], constants[2], constants[3], block_size)
        compiled_module("_numba_int4")  # the background build starts now, while the session is still being built
    elif bits == 4 and not compiled_enabled():
        _hint_without_numba()

    def run(a, b, scales, zero_points=None, g_idx=None, bias=None):
        out = np.empty(a.shape[:-1] + (n,), a.dtype)
        into(out, a, b, scales, zero_points, g_idx, bias)
        return out

    def into(out, a, b, scales, zero_points=None, g_idx=None, bias=None):
        """The product written into ``out`` (A's type): by the compiled kernels from the
        repacked weight, else by slabs of weight rows dequantized into a scratch and
        multiplied by BLAS; never a float copy of the whole weight."""
        if a.shape[-1:] != (k,):
            raise ValueError(f"A's last dimension must be K={k}, got shape {a.shape}")
        if out.shape != a.shape[:-1] + (n,):
            raise ValueError(f"MatMulNBits' output must have shape {a.shape[:-1] + (n,)}, got {out.shape}")
        if b.size == 0:  # an omitted projection: zeros, or the bias
            out[...] = 0
        elif not (packed is not None and _compiled_product(a, out)):
            _slab_product(a, out, b, scales, zero_points, g_idx)
        if bias is not None:
            out += bias.astype(out.dtype, copy=False)

    def _compiled_product(a: np.ndarray, out: np.ndarray) -> bool:
        """``out = A @ W`` by ``_numba_int4``; False where it does not apply now (numba
        missing or still building, A or out not float32)."""
        loops = compiled_module("_numba_int4")
        if loops is None or a.dtype != np.float32 or out.dtype != np.float32 or not out.flags.c_contiguous:
            return False
        assert packed is not None
        rows = a.size // k if k else 0
        if rows == 0 or n == 0:
            return True
        a2 = a.reshape(rows, k)
        padded = not int8_activations and (blocks * block_size != k or not a2.flags.c_contiguous)
        job = jobs.by_rows.get((rows, padded))
        if job is None:
            # the body is read once per job: PLUGRT_INT4_BODY forces one (tests), else the fastest here
            body = loops.body_code(loops.choose_body()) if int8_activations else loops.FLOAT_BODY
            job = jobs.by_rows[(rows, padded)] = _Job(loops, packed, rows, n, block_size, body, padded, shared=True)
        y = out.reshape(rows, n)
        count = threads_for(PARALLEL_MIN_WORK) if rows * n * k >= _COMPILED_MIN_WORK else 1
        pool = compiled_pool() if count > 1 else None
        if pool is None:
            loops.prepare(a2, y, job.context, True)
            return True
        loops.prepare(a2, y, job.context, False)
        count = min(count, _SLOTS)  # the float tiles' scratch has a table for this many threads
        units = min(packed.tiles, count * _UNITS_PER_THREAD)
        job.context[loops.CTX_UNITS] = units
        pool.run((loops.int8_units if int8_activations else loops.float_units).address, job.address, units, count)
        return True

    def _slab_product(a, out, b, scales, zero_points, g_idx) -> None:
        """``out = A @ W`` a slab of weight rows at a time (numpy and BLAS)."""
        work = _work_dtype(a.dtype)
        a_work = a.astype(work, copy=False)
        # onnxruntime keeps float activations when the zero points are floats
        if int8_activations and (zero_points is None or zero_points.dtype == np.uint8):
            a_work = _int8_blocks(a_work, block_size)
        rows = int(np.prod(a.shape[:-1], dtype=np.int64))
        a2 = a_work.reshape(rows, k)
        y = out.reshape(rows, n)
        step = max(16, (_slab_bytes() // (k * work.itemsize)) // 16 * 16)
        direct = out.dtype == work and out.flags.c_contiguous and a2.flags.c_contiguous
        scratch = getattr(_SLABS, "slab", None)
        if scratch is None or scratch.size < step * blocks * block_size // 2:
            scratch = _SLABS.slab = np.empty(step * blocks * block_size // 2, np.uint64)
        for n0 in range(0, n, step):
            n1 = min(n, n0 + step)
            slab = _nbits_rows(b, scales, zero_points, g_idx, n, k, bits, block_size, work, slice(n0, n1), scratch)
            blas_threads(rows * (n1 - n0) * k)
            if direct and n1 - n0 == n:
                np.matmul(a2, slab.T, out=y)
            else:
                y[:, n0:n1] = a2 @ slab.T

    def bind(out, a, b, scales, zero_points=None, g_idx=None, bias=None):
        """For a capture: ``into(out, a, ...)`` as one call with no arguments, for these
        arrays (the replay's persistent buffers), when the compiled kernels take them; None
        otherwise. Checked once here, where ``into`` checks on every call; the product gets
        a job of its own (its activation buffers), and still asks for threads each call."""
        loops = compiled_module("_numba_int4")
        if (
            packed is None
            or loops is None
            or bias is not None
            or b.size == 0
            or a.dtype != np.float32
            or out.dtype != np.float32
            or not (a.flags.c_contiguous and out.flags.c_contiguous)  # the views below stay views
            or a.shape[-1:] != (k,)
            or out.shape != a.shape[:-1] + (n,)
            or a.size == 0
            or n == 0
        ):
            return None
        rows = a.size // k
        a2, y = a.reshape(rows, k), out.reshape(rows, n)
        body = loops.body_code(loops.choose_body()) if int8_activations else loops.FLOAT_BODY
        padded = not int8_activations and blocks * block_size != k
        job = _Job(loops, packed, rows, n, block_size, body, padded)
        context, address, prepare = job.context, job.address, loops.prepare
        units_word = loops.CTX_UNITS
        units_body = (loops.int8_units if int8_activations else loops.float_units).address
        split = rows * n * k >= _COMPILED_MIN_WORK

        def replay() -> None:
            count = threads_for(PARALLEL_MIN_WORK) if split else 1
            pool = compiled_pool() if count > 1 else None
            if pool is None:
                prepare(a2, y, context, True)
                return
            prepare(a2, y, context, False)
            count = min(count, _SLOTS)
            units = min(packed.tiles, count * _UNITS_PER_THREAD)
            context[units_word] = units
            pool.run(units_body, address, units, count)

        # as a step of a compiled program (``_capture``): the same prepare and units, the
        # units as many as every usable core would get
        for word, value in (
            (loops.CTX_SOURCE, a2.ctypes.data), (loops.CTX_K, k), (loops.CTX_OUT, y.ctypes.data),
            (loops.CTX_ROWS_M, rows), (loops.CTX_SPLIT, int(split)),
            (units_word, min(packed.tiles, _SLOTS * _UNITS_PER_THREAD)),
        ):
            context[word] = value
        replay.program = (loops.prepare_step.address, units_body, address)  # type: ignore[attr-defined]
        replay.job = job  # type: ignore[attr-defined]  # its buffers live as long as the replay
        return replay

    into.bind = bind  # type: ignore[attr-defined]
    declare_into(into, run)
    return run



# ----------------------------------------------------------------------------- GatherBlockQuantized


def _expand_blocks(value: np.ndarray, axis: int, block_size: int, length: int) -> np.ndarray:
    """Repeat a per-block parameter ``block_size`` times along ``axis`` and trim it to ``length``."""
    if value.shape[axis] == 1 and length != 1:
        return value  # one block (or a broadcast scale) covers the axis
    expanded = np.repeat(value, block_size, axis=axis)
    return expanded.take(np.arange(length), axis=axis) if expanded.shape[axis] != length else expanded


@kernel_builder("GatherBlockQuantized", 1, domain=_MS)
def gather_block_quantized(ctx: KernelContext):
    attrs = ctx.attributes
    bits = int(attrs.get("bits", 4))
    block_size = int(attrs.get("block_size", 128))
    quantize_axis = int(attrs.get("quantize_axis", 1))
    gather_axis = int(attrs.get("gather_axis", 0))
    constants = list(ctx.constant_inputs) + [None] * (4 - len(ctx.constant_inputs))
    for table in constants[:1] + constants[2:4]:
        if table is not None:  # a call reads a few rows of an embedding table: the rest need not stay resident
            _release_pages(table)
    # A table tied to an LM head's 4-bit MatMulNBits weight (its bytes reshaped, the same
    # scales) is read from that weight's repacked copy, already in memory, so that its file
    # pages do not come back into memory row by row. The head is bound after this node:
    # looked up at the first call, then remembered with the inputs it was found for. Only
    # for initializers: a fed input could hold other bytes at the same address next call.
    zero_points_fixed = ctx.num_inputs < 4 or constants[3] is not None or (ctx.node is not None and ctx.node.inputs[3] is None)
    tieable = (
        bits == 4
        and constants[0] is not None
        and constants[2] is not None
        and zero_points_fixed
        and constants[0].ndim == 2
        and constants[0].dtype == np.uint8
        and gather_axis in (0, -2)
        and quantize_axis in (1, -1)
    )
    tied: list[tuple[tuple[Any, ...], _Packed | None]] = []

    def tied_weight(data: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None) -> _Packed | None:
        if not tied:
            found = _packed_from(data, scales, zero_points, block_size) if tieable else None
            tied[:] = [((data, scales, zero_points) if found is not None else (), found)]
        inputs, packed = tied[0]
        if packed is None or not all(_same_memory(a, b) for a, b in zip(inputs, (data, scales, zero_points))):
            return None
        return packed

    def run(data, indices, scales, zero_points=None):
        rank = data.ndim
        q_axis = quantize_axis + rank if quantize_axis < 0 else quantize_axis
        g_axis = gather_axis + rank if gather_axis < 0 else gather_axis
        if not (0 <= q_axis < rank and 0 <= g_axis < rank):
            raise ValueError(f"gather_axis {gather_axis} / quantize_axis {quantize_axis} out of range for rank {rank}")
        if scales.ndim != rank:
            raise ValueError(f"scales must have the data's rank {rank}, got shape {scales.shape}")
        dtype = data.dtype
        packed = dtype == np.uint8 and bits < 8  # values packed along the last axis
        if dtype == np.uint8:
            if bits not in _PACKABLE_BITS:
                raise ValueError(f"uint8 data supports bits 2, 4 or 8, got {bits}")
            if g_axis != 0 or (bits < 8 and q_axis == rank - 1 and g_axis == rank - 1):
                raise ValueError("uint8 data needs gather_axis 0, different from the packed last axis")
            default_zero = float(1 << (bits - 1))
        elif dtype in _FLOAT_DATA:
            if zero_points is not None:
                raise ValueError("float8/float4 data is symmetric: it takes no zero_points")
            default_zero = 0.0
        else:
            default_zero = 0.0
        length = data.shape[q_axis] * (8 // bits if packed and q_axis == rank - 1 else 1)
        if block_size <= 0:
            if dtype not in _FLOAT_DATA:
                raise ValueError(f"block_size must be positive for {dtype} data, got {block_size}")
            size = length
        else:
            size = block_size
        extent = data.shape[g_axis]  # the gather axis is never the packed one
        index = np.asarray(indices, dtype=np.int64)
        valid = (index >= -extent) & (index < extent)
        index = np.where(index < 0, index + extent, index)
        index = np.where(valid, index, 0)  # out of range: zeros, set below
        packed_weight = tied_weight(data, scales, zero_points)
        gather = _compiled_gather(packed_weight, scales, length, block_size)
        if gather is not None:  # one compiled pass over the rows asked, straight into the result
            assert packed_weight is not None
            rows = np.empty((index.size, length), np.float32)
            gather(packed_weight.weights, packed_weight.scales, _zeros_of(packed_weight), index.reshape(-1), rows)
            if not valid.all():
                rows *= valid.reshape(-1, 1)
            return rows.reshape(index.shape + (length,))
        if packed_weight is not None:
            rows = _packed_rows(packed_weight, index, block_size)
            if not valid.all():
                rows *= valid.reshape(-1, 1)
            return rows.reshape(index.shape + (length,)).astype(scales.dtype, copy=False)
        # Only the rows asked are unpacked and dequantized (a decoder's embedding table is
        # ~100 MB: expanding all of it per token cost seconds). Along the gather axis a
        # parameter holds one entry per row, or per block when it is also the quantize axis.
        out_q = q_axis if q_axis < g_axis else q_axis + index.ndim - 1  # q_axis in the result

        def take(array: np.ndarray, blocked: bool = False) -> np.ndarray:
            if array.shape[g_axis] == 1:
                shape = list(array.shape)
                shape[g_axis : g_axis + 1] = [1] * index.ndim
                return array.reshape(shape)
            return np.take(array, index // size if blocked else index, axis=g_axis)

        values = take(data)
        if packed:
            values = _unpack(values, bits)
        work = _work_dtype(scales.dtype)
        gathered = values.astype(work)
        zeros = zero_points
        if zeros is not None:
            zeros = take(zeros, blocked=q_axis == g_axis)
            if packed:
                zeros = _unpack(zeros, bits)
            if q_axis != g_axis:
                zeros = _expand_blocks(zeros, out_q, size, gathered.shape[out_q])
            gathered -= zeros.astype(work)
        elif default_zero:
            gathered -= work.type(default_zero)
        scale = take(scales.astype(work, copy=False), blocked=q_axis == g_axis)
        if q_axis != g_axis:
            scale = _expand_blocks(scale, out_q, size, gathered.shape[out_q])
        gathered *= scale
        if not valid.all():
            shape = (1,) * g_axis + index.shape + (1,) * (rank - g_axis - 1)
            gathered *= valid.reshape(shape)
        return gathered.astype(scales.dtype, copy=False)

    def into(out, data, indices, scales, zero_points=None):
        np.copyto(out, run(data, indices, scales, zero_points))

    def bind(out, data, indices, scales, zero_points=None):
        """For a capture: a tied table's compiled lookup into ``out`` as one call, reading
        the indices at each call (out-of-range ones go through ``run``, which zeroes their
        rows); None where ``into`` is needed."""
        packed_weight = tied_weight(data, scales, zero_points) if isinstance(data, np.ndarray) else None
        if packed_weight is None or not isinstance(indices, np.ndarray) or indices.dtype.kind not in "iu":
            return None
        length = packed_weight.blocks * block_size
        gather = _compiled_gather(packed_weight, scales, length, block_size)
        if gather is None or out.dtype != np.float32 or not out.flags.c_contiguous or out.shape != indices.shape + (length,):
            return None
        extent, flat_indices = data.shape[0], indices.reshape(-1)
        rows, flat_out = np.empty(indices.size, np.int64), out.reshape(indices.size, length)
        weights, table_scales, zeros = packed_weight.weights, packed_weight.scales, _zeros_of(packed_weight)

        def replay() -> None:
            np.copyto(rows, flat_indices, casting="unsafe")
            if rows.size and (int(rows.min()) < -extent or int(rows.max()) >= extent):
                np.copyto(out, run(data, indices, scales, zero_points))
                return
            np.add(rows, extent, out=rows, where=rows < 0)
            gather(weights, table_scales, zeros, rows, flat_out)

        return replay

    into.bind = bind  # type: ignore[attr-defined]
    declare_into(into, run)
    return run


_NO_ZEROS = np.zeros((0, 0, 0), np.uint8)  # gather_rows' "no zero points" (8 for every block)


def _zeros_of(packed: _Packed) -> np.ndarray:
    return _NO_ZEROS if packed.zeros is None else packed.zeros


def _compiled_gather(packed: _Packed | None, scales: np.ndarray, length: int, block_size: int) -> Any:
    """``_numba_int4.gather_rows`` where it gives the rows of a tied table (float32 scales,
    rows of whole blocks), else None."""
    if packed is None or scales.dtype != np.float32 or packed.blocks * block_size != length:
        return None
    loops = compiled_module("_numba_int4")
    return None if loops is None else loops.gather_rows


# ----------------------------------------------------------------------------- QuantizeLinear / DequantizeLinear


@kernel("QuantizeLinear", 1, domain=_MS)
def quantize_linear(x, y_scale, y_zero_point=None, *, axis=1):
    """Per-tensor or per-axis quantization (the blocked form is the ai.onnx op's, opset 21)."""
    return _quantize(x, y_scale, y_zero_point, axis, 1, 0, 0, 0)


@kernel("DequantizeLinear", 1, domain=_MS)
def dequantize_linear(x, x_scale, x_zero_point=None, *, axis=1):
    return _dequantize(x, x_scale, x_zero_point, axis, 0, 0)
