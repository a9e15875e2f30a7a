"""Normalisation kernels: batch, instance, layer, group, RMS, Lp and mean-variance normalisation."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import ml_dtypes
import numpy as np
from plugrt.rewrites import batch_norm_affine
from plugrt.threads import parallel_for

from .._registry import KernelContext, kernel, kernel_builder, declare_into
from ._gemm import epilogue_loops
from ._relu import relu_into
from .elementwise import compiled_loops, scratch, with_small_buffers
from ._compiled import ROW_LOOPS

# Statistics of half-precision inputs are computed in float32 (the spec's stash_type=1).
_HALF_TYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def _stats_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float32) if dtype in _HALF_TYPES else dtype


def _check_stash_type(ctx: KernelContext) -> None:
    stash_type = ctx.attributes.get("stash_type", 1)
    if stash_type != 1:
        raise NotImplementedError(
            f"{ctx.op_type}: stash_type={stash_type} is not supported; only 1 (float32 statistics) is"
        )


def _normalize_rows(
    x2: np.ndarray, epsilon: float, work: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Standardise each row of the 2-D ``x2``: returns (normalised rows, mean, 1/std),
    the variance taken about the mean (not E[x^2] - E[x]^2, which cancels badly).
    ``work`` (for ``into`` variants) holds the arrays to write them into: rows like x2,
    and two (rows, 1) columns."""
    if work is None:
        mean = x2.mean(axis=1, keepdims=True)
        centered = x2 - mean
        variance = np.einsum("ij,ij->i", centered, centered).reshape(-1, 1)
    else:
        centered, mean, variance = work
        x2.mean(axis=1, keepdims=True, out=mean)
        with_small_buffers(np.subtract, x2, mean, centered)  # broadcasts: see with_small_buffers
        np.einsum("ij,ij->i", centered, centered, out=variance.reshape(-1))
    variance /= max(x2.shape[1], 1)
    variance += variance.dtype.type(epsilon)
    inv_std = np.sqrt(variance, out=variance)
    np.reciprocal(inv_std, out=inv_std)
    if work is None:
        centered *= inv_std
    else:
        with_small_buffers(np.multiply, centered, inv_std, centered)
    return centered, mean, inv_std


def _scale_shift(y: np.ndarray, scale: Any, shift: Any = None) -> None:
    """y *= scale; y += shift (in place; shift may be None)."""
    y *= scale
    if shift is not None:
        y += shift


def _rows_target(out: np.ndarray, rows: tuple[int, int], dtype: np.dtype) -> np.ndarray:
    """Where an ``into`` call writing ``out`` puts ``rows`` of ``dtype``: ``out`` itself
    when it has that dtype and layout, else a work array."""
    if out.dtype == dtype and out.flags.c_contiguous:
        return out.reshape(rows)
    return scratch(out, "rows", rows, dtype)


def _rows_work(out: np.ndarray, rows: tuple[int, int], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Work arrays for _normalize_rows in an ``into`` call writing ``out``."""
    column = (rows[0], 1)
    return _rows_target(out, rows, dtype), scratch(out, "mean", column, dtype), scratch(out, "variance", column, dtype)


def _work_copy(out: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x.astype(_stats_dtype(x.dtype), copy=False), in a work array of ``out``'s ``into`` call."""
    dtype = _stats_dtype(x.dtype)
    if x.dtype == dtype:
        return x
    work = scratch(out, "work", x.shape, dtype)
    np.copyto(work, x, casting="unsafe")
    return work


def _rows_of(x: np.ndarray, rows: tuple[int, int]) -> np.ndarray:
    """x as ``rows`` (a view for the contiguous inputs a capture holds)."""
    return x.reshape(rows)


def _channel_shape(x: np.ndarray) -> tuple[int, ...]:
    """The shape that broadcasts a per-channel vector against an (N, C, ...) tensor."""
    return (-1,) + (1,) * (x.ndim - 2)


# --- BatchNormalization


@kernel_builder("BatchNormalization", 1, 7, 9, 14, multi_output=True)
def batch_normalization(ctx: KernelContext):
    """Inference: y = x * multiplier + shift (``channel_affine``), both folded once when
    the statistics are constants. Training (v1/v6 is_test=0, v7/v9 with the extra outputs,
    v14 training_mode=1) normalises with the batch statistics and updates the running ones."""
    attributes = ctx.attributes
    epsilon = float(attributes.get("epsilon", 1e-5))
    momentum = float(attributes.get("momentum", 0.9))
    # spatial=0 (before v9): statistics per activation, i.e. over the batch axis only.
    spatial = bool(attributes.get("spatial", 1)) if ctx.opset < 9 else True
    if ctx.opset < 7:
        training = not attributes.get("is_test", 0)
    elif ctx.opset < 14:
        training = ctx.num_outputs > 1
    else:
        training = bool(attributes.get("training_mode", 0))

    def param_shape(x: np.ndarray) -> tuple[int, ...]:
        return _channel_shape(x) if spatial else x.shape[1:]

    if training:
        return _batch_norm_training(ctx.opset, epsilon, momentum, spatial, param_shape)

    def compute(scale, bias, mean, var) -> tuple[np.ndarray, np.ndarray]:
        return batch_norm_affine(scale, bias, mean, var, epsilon)

    constants = ctx.constant_inputs[1:5]
    affine = AffineCache(compute, constants if len(constants) == 4 else None, param_shape)

    def run(x, scale, bias, mean, var):
        multiplier, shift = affine(x, scale, bias, mean, var)
        y = channel_affine(np.empty_like(x), x, multiplier, shift)
        # In inference v14's optional running statistics pass through unchanged.
        return (y, mean, var) if ctx.opset >= 14 else (y,)

    def run_into(out, x, scale, bias, mean, var):
        multiplier, shift = affine(x, scale, bias, mean, var, out=out)
        with_small_buffers(channel_affine, out[0], x, multiplier, shift)
        if len(out) > 1:
            np.copyto(out[1], mean)
        if len(out) > 2:
            np.copyto(out[2], var)

    declare_into(run_into, run)
    return run


class AffineCache:
    """The (multiplier, shift) of an affine map y = x * multiplier + shift, in x's dtype and
    shaped by ``param_shape(x)``, from the pair ``compute(*inputs)`` gives (BatchNormalization:
    float64, folded from the statistics): computed once when all ``constants`` are there
    and cast once per dtype and rank of x, else every call (into work arrays of the
    ``into`` call writing ``out``)."""

    def __init__(
        self,
        compute: Callable[..., tuple[np.ndarray, np.ndarray]],
        constants: Sequence[np.ndarray | None] | None,
        param_shape: Callable[[np.ndarray], tuple[int, ...]] = _channel_shape,
    ) -> None:
        self.compute = compute
        self.param_shape = param_shape
        self.folded = compute(*constants) if constants and all(c is not None for c in constants) else None
        self.cast: dict[tuple[np.dtype, int], tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, x: np.ndarray, *inputs: Any, out: Any = None) -> tuple[np.ndarray, np.ndarray]:
        if self.folded is None:
            return self._shaped(x, self.compute(*inputs), out)
        pair = self.cast.get((x.dtype, x.ndim))
        if pair is None:
            pair = self.cast[x.dtype, x.ndim] = self._shaped(x, self.folded, None)
        return pair

    def _shaped(self, x: np.ndarray, pair: tuple[np.ndarray, np.ndarray], out: Any) -> tuple[np.ndarray, np.ndarray]:
        shape = self.param_shape(x)
        if out is None:
            return pair[0].astype(x.dtype).reshape(shape), pair[1].astype(x.dtype).reshape(shape)
        return (
            _cast_into(out, "multiplier", pair[0].reshape(shape), x.dtype),
            _cast_into(out, "shift", pair[1].reshape(shape), x.dtype),
        )


def _cast_into(out: np.ndarray, slot: str, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """x.astype(dtype), in a work array of ``out``'s ``into`` call."""
    target = scratch(out, slot, x.shape, dtype)
    np.copyto(target, x, casting="unsafe")
    return target


# --- Per-channel affine maps in blocks

# Bytes of x per block of channel_affine. Measured on a 2-core Zen4 (1 MiB L2 per core,
# 32 MiB L3): each numpy call costs ~1.5 us and the passes stream from L3 about as fast as
# from L2, so L2-sized blocks (64 K float32 values) were up to 35% slower than one block
# per tensor at DenseNet's sizes (0.46 against 0.34 ms on 1x256x56x56, one thread), and
# no faster on 8x256x56x56 (25 MiB). 4 MiB keeps a block of x and of y within a quarter
# of the L3, and the calls' cost per block below 2%.
_AFFINE_BLOCK_BYTES = 4 << 20
# Planes (values per image and channel) from which float32 takes the compiled one-pass
# loop where numba is there; shorter rows cost a loop entry per few values.
_COMPILED_MIN_PLANE = 16
_BLOCKED_TYPES = (np.dtype(np.float32), np.dtype(np.float64))


def channel_affine(
    y: np.ndarray, x: np.ndarray, multiplier: np.ndarray, shift: np.ndarray, relu: bool = False
) -> np.ndarray:
    """y = x * multiplier + shift, then max(y, 0) (``relu_into``: NaN stays NaN) when
    ``relu``; ``y`` may be ``x``. ``multiplier`` and ``shift`` have x's dtype and broadcast
    against it. Where they hold one value per channel (axis 1) and x and y are C-contiguous
    float32 or float64, float32 planes of ``_COMPILED_MIN_PLANE`` values and more take one
    compiled pass where numba is there (``_numba_epilogue``), rows shared out between
    threads by ``parallel_for``; otherwise the three numpy passes run one block at a time
    (whole images, or a range of one image's channels), each block's passes one after the
    other while it is in cache, the blocks shared out likewise. Returns y."""
    per_channel = (x.shape[1],) + (1,) * (x.ndim - 2) if x.ndim >= 2 else None
    if (
        x.dtype not in _BLOCKED_TYPES
        or y.dtype != x.dtype
        or multiplier.shape != per_channel
        or shift.shape != per_channel
        or not (x.flags.c_contiguous and y.flags.c_contiguous)
        or x.size == 0
    ):
        _affine_block(y, x, multiplier, shift, relu)
        return y
    n, c = x.shape[:2]
    plane = x.size // (n * c)
    loops = epilogue_loops() if x.dtype == np.float32 and plane >= _COMPILED_MIN_PLANE else None
    if loops is not None and multiplier.flags.c_contiguous and shift.flags.c_contiguous:
        # one compiled pass: x read once, y written once (numpy's three passes over a
        # block larger than the L2 cache each went out to memory: see _COMPILED_MIN_PLANE)
        x_rows, y_rows = x.reshape(n * c, plane), y.reshape(n * c, plane)
        scales, shifts = multiplier.reshape(c), shift.reshape(c)

        def rows(start: int, stop: int) -> None:
            loops.scale_shift_relu_rows(x_rows, y_rows, scales, shifts, relu, start, stop)

        parallel_for(n * c, rows, x.size * 2)
        return y
    # numpy's buffer size is per thread: the chunks on pool threads take this thread's
    # (an into call's small buffers), capped by _row_buffer_size
    current = np.getbufsize()
    buffer_size = _row_buffer_size(c if plane == 1 else plane, current)
    block_size = _AFFINE_BLOCK_BYTES // x.itemsize
    if x.size <= block_size:
        if buffer_size == current:
            _affine_block(y, x, multiplier, shift, relu)
        else:
            _with_buffer_size(buffer_size, _affine_block, y, x, multiplier, shift, relu)
        return y
    xs: np.ndarray
    ys: np.ndarray
    if plane == 1:  # (N, C): the vectors broadcast along rows of channels
        xs, ys, ms, ss = x.reshape(n, c), y.reshape(n, c), multiplier.reshape(c), shift.reshape(c)
    else:  # (N, C, plane): a column of per-channel values broadcasts along the planes
        xs, ys = x.reshape(n, c, plane), y.reshape(n, c, plane)
        ms, ss = multiplier.reshape(c, 1), shift.reshape(c, 1)
    if c * plane <= block_size:  # whole images per block
        images = block_size // (c * plane)
        count = -(-n // images)

        def block(index: int) -> None:
            part = slice(index * images, (index + 1) * images)
            _affine_block(ys[part], xs[part], ms, ss, relu)

    else:  # a range of one image's channels per block
        channels = max(1, block_size // plane)
        parts = -(-c // channels)
        count = n * parts

        def block(index: int) -> None:
            image, part = divmod(index, parts)
            ch = slice(part * channels, (part + 1) * channels)
            _affine_block(ys[image, ch], xs[image, ch], ms[ch], ss[ch], relu)

    def blocks(start: int, stop: int) -> None:
        for index in range(start, stop):
            block(index)

    def chunk(start: int, stop: int) -> None:
        _with_buffer_size(buffer_size, blocks, start, stop)

    parallel_for(count, chunk, x.size * (3 if relu else 2))  # work: element operations of the passes
    return y


def _row_buffer_size(row: int, current: int) -> int:
    """numpy's ufunc buffer size for broadcasting a vector along rows of ``row`` contiguous
    values, given the ``current`` one: at most one row from 512 values a row up. A buffer
    longer than a row makes numpy copy the operands through its buffers (2-3x slower,
    measured from 784 to 6272 values a row); below 512 those copies cost less than a call
    of the inner loop per short row."""
    return min(current, row // 16 * 16) if row >= 512 else current  # numpy takes multiples of 16


def _with_buffer_size(size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) with numpy's ufunc buffer size (this thread's) set to ``size``."""
    previous = np.setbufsize(size)
    try:
        return fn(*args)
    finally:
        np.setbufsize(previous)


def _affine_block(y: np.ndarray, x: np.ndarray, multiplier: np.ndarray, shift: np.ndarray, relu: bool) -> None:
    np.multiply(x, multiplier, out=y)
    y += shift
    if relu:
        relu_into(y, y)


def _batch_norm_training(opset: int, epsilon: float, momentum: float, spatial: bool, param_shape):
    def run(x, scale, bias, mean, var):
        work = x.astype(_stats_dtype(x.dtype), copy=False)
        axes = (0,) + tuple(range(2, x.ndim)) if spatial else (0,)
        batch_mean = work.mean(axis=axes)
        centered = work - batch_mean.reshape(param_shape(x))
        batch_var = np.mean(np.square(centered), axis=axes)
        multiplier = (np.asarray(scale, batch_var.dtype) / np.sqrt(batch_var + epsilon)).reshape(param_shape(x))
        centered *= multiplier
        centered += np.asarray(bias, centered.dtype).reshape(param_shape(x))
        y = centered.astype(x.dtype, copy=False)
        running_mean = (mean * momentum + batch_mean * (1 - momentum)).astype(mean.dtype, copy=False)
        running_var = (var * momentum + batch_var * (1 - momentum)).astype(var.dtype, copy=False)
        if opset >= 14:
            return y, running_mean, running_var
        # Before v14 the extra outputs are: running mean and variance, then the batch's.
        return y, running_mean, running_var, batch_mean.astype(mean.dtype), batch_var.astype(var.dtype)

    return run


# --- InstanceNormalization, GroupNormalization


def _group_statistics_normalize(x: np.ndarray, groups: int, epsilon: float) -> np.ndarray:
    """x (N, C, ...) normalised over each (instance, group of C/groups channels)."""
    work = x.astype(_stats_dtype(x.dtype), copy=False)
    rows = work.reshape(x.shape[0] * groups, -1)
    normalized, _, _ = _normalize_rows(rows, epsilon)
    return normalized.reshape(x.shape)


def _group_statistics_normalize_into(out: np.ndarray, x: np.ndarray, groups: int, epsilon: float) -> np.ndarray:
    """_group_statistics_normalize into ``out`` (or, for half types, a work array)."""
    work = _work_copy(out, x)
    rows = (x.shape[0] * groups, x.size // max(x.shape[0] * groups, 1))
    normalized, _, _ = _normalize_rows(_rows_of(work, rows), epsilon, _rows_work(out, rows, work.dtype))
    return normalized.reshape(x.shape)


def _affine_channels(normalized: np.ndarray, scale, bias, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    shape = _channel_shape(x)
    affine = (np.asarray(scale).reshape(shape), np.asarray(bias).reshape(shape))
    if out is None:
        _scale_shift(normalized, *affine)
        return normalized.astype(x.dtype, copy=False)
    with_small_buffers(_scale_shift, normalized, *affine)
    if not np.may_share_memory(normalized, out):
        np.copyto(out, normalized, casting="unsafe")
    return out


@kernel("InstanceNormalization", 1)
def instance_normalization(x, scale, bias, *, epsilon=1e-5):
    normalized = _group_statistics_normalize(x, x.shape[1], epsilon)
    return _affine_channels(normalized, scale, bias, x)


def _instance_normalization_into(out, x, scale, bias, *, epsilon=1e-5):
    normalized = _group_statistics_normalize_into(out, x, x.shape[1], epsilon)
    _affine_channels(normalized, scale, bias, x, out)


declare_into(_instance_normalization_into, instance_normalization)


@kernel("GroupNormalization", 18)
def group_normalization_18(x, scale, bias, *, epsilon=1e-5, num_groups):
    # v18: scale and bias hold one value per group.
    normalized = _group_statistics_normalize(x, num_groups, epsilon)
    per_group = x.shape[1] // num_groups
    return _affine_channels(normalized, np.repeat(scale, per_group), np.repeat(bias, per_group), x)


def _group_normalization_18_into(out, x, scale, bias, *, epsilon=1e-5, num_groups):
    normalized = _group_statistics_normalize_into(out, x, num_groups, epsilon)
    per_group = x.shape[1] // num_groups
    _affine_channels(normalized, np.repeat(scale, per_group), np.repeat(bias, per_group), x, out)


declare_into(_group_normalization_18_into, group_normalization_18)


@kernel_builder("GroupNormalization", 21)
def group_normalization_21(ctx: KernelContext):
    # v21: scale and bias hold one value per channel.
    _check_stash_type(ctx)
    epsilon = float(ctx.attributes.get("epsilon", 1e-5))
    num_groups = int(ctx.attributes["num_groups"])

    def run(x, scale, bias):
        normalized = _group_statistics_normalize(x, num_groups, epsilon)
        return _affine_channels(normalized, scale, bias, x)

    def run_into(out, x, scale, bias):
        normalized = _group_statistics_normalize_into(out, x, num_groups, epsilon)
        _affine_channels(normalized, scale, bias, x, out)

    declare_into(run_into, run)
    return run


# --- LayerNormalization, RMSNormalization


def _rows_view(x: np.ndarray, axis: int, out: np.ndarray | None = None) -> tuple[np.ndarray, tuple[int, ...]]:
    """x in its statistics dtype as a 2-D (outer, normalised) array, and the shape of
    the per-row statistics as the spec gives it: x.shape[:axis] + (1, ...). With ``out``
    (an ``into`` call), a cast goes to a work array."""
    if axis < 0:
        axis += x.ndim
    work = x.astype(_stats_dtype(x.dtype), copy=False) if out is None else _work_copy(out, x)
    rows = int(np.prod(x.shape[:axis], dtype=np.int64))
    return work.reshape(rows, -1), x.shape[:axis] + (1,) * (x.ndim - axis)


_ZERO_VECTORS: dict[int, np.ndarray] = {}


def zero_vector(width: int) -> np.ndarray:
    """A read-only float32 zero vector of ``width`` (the shift of a LayerNorm without bias)."""
    zeros = _ZERO_VECTORS.get(width)
    if zeros is None:
        zeros = _ZERO_VECTORS[width] = np.zeros(width, np.float32)
        zeros.flags.writeable = False
    return zeros


@kernel_builder("LayerNormalization", 17, multi_output=True, compiled=ROW_LOOPS)
def layer_normalization(ctx: KernelContext):
    _check_stash_type(ctx)
    axis = int(ctx.attributes.get("axis", -1))
    epsilon = float(ctx.attributes.get("epsilon", 1e-5))

    def compiled(x, scale, b, y, mean, inv_std) -> bool:
        """The one-pass compiled LayerNorm into ``y``, ``mean`` and ``inv_std`` (float32,
        C-contiguous, over the last axis with 1-D parameters); False where it does not apply."""
        if x.dtype != np.float32 or x.ndim == 0 or axis not in (-1, x.ndim - 1):
            return False
        # A strided input (ConvNeXt's Transpose of its Conv's output, a slice) is copied into y
        # and normalised there in place: on (1, 56, 56, 96) read through a Transpose, 0.26 ms
        # for numpy's transposing copy and the compiled rows, against 0.45 for the numpy path.
        strided = not x.flags.c_contiguous
        width = x.shape[-1]
        for p in (scale, b):
            if p is not None and (p.dtype != np.float32 or p.shape != (width,) or not p.flags.c_contiguous):
                return False
        if not all(a.dtype == np.float32 and a.flags.c_contiguous for a in (y, mean, inv_std)):
            return False
        if strided and np.may_share_memory(x, y):  # the copy would overwrite what it reads
            return False
        loops = compiled_loops()
        if loops is None or x.size == 0:
            return False
        shift = b if b is not None else zero_vector(width)
        if strided:
            np.copyto(y, x)
            x = y
        loops.layer_norm_rows(
            x.reshape(-1, width), scale, shift, epsilon, y.reshape(-1, width), mean.reshape(-1), inv_std.reshape(-1)
        )
        return True

    def run(x, scale, b=None):
        if x.dtype == np.float32 and x.ndim:
            stats = x.shape[:-1] + (1,)
            y, mean, inv_std = np.empty(x.shape, np.float32), np.empty(stats, np.float32), np.empty(stats, np.float32)
            if compiled(x, scale, b, y, mean, inv_std):
                return y, mean, inv_std
        rows, stats_shape = _rows_view(x, axis)
        normalized, mean, inv_std = _normalize_rows(rows, epsilon)
        y = normalized.reshape(x.shape)
        y *= scale
        if b is not None:
            y += b
        # Mean and InvStdDev have the stash type (float32), whatever X's type.
        return (
            y.astype(x.dtype, copy=False),
            mean.reshape(stats_shape).astype(np.float32, copy=False),
            inv_std.reshape(stats_shape).astype(np.float32, copy=False),
        )

    def run_into(out, x, scale, b=None):
        y_out = out[0]
        if x.dtype == np.float32 and x.ndim:
            stats = x.shape[:-1] + (1,)
            mean_out = out[1] if len(out) > 1 else scratch(y_out, "mean-out", stats, np.float32)
            inv_out = out[2] if len(out) > 2 else scratch(y_out, "inv-std-out", stats, np.float32)
            if compiled(x, scale, b, y_out, mean_out, inv_out):
                return
        rows, stats_shape = _rows_view(x, axis, y_out)
        work = _rows_work(y_out, rows.shape, rows.dtype)
        normalized, mean, inv_std = _normalize_rows(rows, epsilon, work)
        y = normalized.reshape(x.shape)
        with_small_buffers(_scale_shift, y, scale, b)
        if not np.may_share_memory(y, y_out):
            np.copyto(y_out, y, casting="unsafe")
        if len(out) > 1:
            np.copyto(out[1], mean.reshape(stats_shape), casting="unsafe")
        if len(out) > 2:
            np.copyto(out[2], inv_std.reshape(stats_shape), casting="unsafe")

    declare_into(run_into, run)
    return run


@kernel_builder("RMSNormalization", 23)
def rms_normalization(ctx: KernelContext):
    _check_stash_type(ctx)
    axis = int(ctx.attributes.get("axis", -1))
    epsilon = float(ctx.attributes.get("epsilon", 1e-5))

    def run(x, scale):
        rows, _ = _rows_view(x, axis)
        mean_square = np.einsum("ij,ij->i", rows, rows).reshape(-1, 1)
        mean_square /= max(rows.shape[1], 1)
        mean_square += mean_square.dtype.type(epsilon)
        inv_rms = np.reciprocal(np.sqrt(mean_square, out=mean_square), out=mean_square)
        y = (rows * inv_rms).reshape(x.shape)
        y *= scale
        return y.astype(x.dtype, copy=False)

    def run_into(out, x, scale):
        rows, _ = _rows_view(x, axis, out)
        mean_square = scratch(out, "mean-square", (rows.shape[0], 1), rows.dtype)
        np.einsum("ij,ij->i", rows, rows, out=mean_square.reshape(-1))
        mean_square /= max(rows.shape[1], 1)
        mean_square += mean_square.dtype.type(epsilon)
        inv_rms = np.reciprocal(np.sqrt(mean_square, out=mean_square), out=mean_square)
        y = np.multiply(rows, inv_rms, out=_rows_target(out, rows.shape, rows.dtype))
        y = y.reshape(x.shape)
        y *= scale
        if not np.may_share_memory(y, out):
            np.copyto(out, y, casting="unsafe")

    declare_into(run_into, run)
    return run


# --- LpNormalization, MeanVarianceNormalization


@kernel_builder("LpNormalization", 1)
def lp_normalization(ctx: KernelContext):
    axis = int(ctx.attributes.get("axis", -1))
    p = int(ctx.attributes.get("p", 2))
    if p not in (1, 2):
        raise NotImplementedError(f"LpNormalization: p={p} is not supported; the spec allows 1 or 2")

    def run(x):
        work = x.astype(_stats_dtype(x.dtype), copy=False)
        if p == 1:
            norm = np.sum(np.abs(work), axis=axis, keepdims=True)
        else:
            norm = np.sqrt(np.sum(np.square(work), axis=axis, keepdims=True))
        # An all-zero slice has norm 0 and is defined to normalise to 0.
        norm[norm == 0] = 1
        return (work / norm).astype(x.dtype, copy=False)

    def run_into(out, x):
        work = _work_copy(out, x)
        magnitude = scratch(out, "magnitude", work.shape, work.dtype)
        (np.abs if p == 1 else np.square)(work, out=magnitude)
        norm_shape = list(work.shape)
        norm_shape[axis] = 1
        norm = scratch(out, "norm", tuple(norm_shape), work.dtype)
        np.sum(magnitude, axis=axis, keepdims=True, out=norm)
        if p == 2:
            np.sqrt(norm, out=norm)
        zero = np.equal(norm, 0, out=scratch(out, "zero", norm.shape, np.bool_))
        np.copyto(norm, 1, where=zero)
        if work.dtype == out.dtype:
            np.divide(work, norm, out=out)
        else:
            np.divide(work, norm, out=magnitude)
            np.copyto(out, magnitude, casting="unsafe")

    declare_into(run_into, run)
    return run


@kernel("MeanVarianceNormalization", 9)
def mean_variance_normalization(x, *, axes=(0, 2, 3)):
    work = x.astype(_stats_dtype(x.dtype), copy=False)
    axes = tuple(axes)
    centered = work - work.mean(axis=axes, keepdims=True)
    std = np.sqrt(np.mean(np.square(centered), axis=axes, keepdims=True))
    # The spec's function body adds 1e-9 to the standard deviation, not the variance.
    std += std.dtype.type(1e-9)
    centered /= std
    return centered.astype(x.dtype, copy=False)


def _mean_variance_normalization_into(out, x, *, axes=(0, 2, 3)):
    work = _work_copy(out, x)
    axes = tuple(axes)
    kept = tuple(1 if (d in axes or d - work.ndim in axes) else n for d, n in enumerate(work.shape))
    mean = work.mean(axis=axes, keepdims=True, out=scratch(out, "mean", kept, work.dtype))
    centered = out if out.dtype == work.dtype else scratch(out, "centered", work.shape, work.dtype)
    np.subtract(work, mean, out=centered)
    square = np.square(centered, out=scratch(out, "square", work.shape, work.dtype))
    std = np.mean(square, axis=axes, keepdims=True, out=mean)
    np.sqrt(std, out=std)
    std += std.dtype.type(1e-9)
    centered /= std
    if centered is not out:
        np.copyto(out, centered, casting="unsafe")


declare_into(_mean_variance_normalization_into, mean_variance_normalization)
