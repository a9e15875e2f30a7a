"""Tensor shape and indexing kernels: reshape, transpose, concat, gather/scatter, slice, pad, and kin."""

from __future__ import annotations

import math

import numpy as np

from .._registry import KernelContext, kernel, kernel_builder, declare_into
from ._compiled import TRANSPOSE_LOOPS, compiled_module
from .elementwise import scratch, with_small_buffers

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _axis(axis: int, rank: int) -> int:
    """A possibly negative axis as a non-negative one, checked against ``rank``."""
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} is out of range for a tensor of rank {rank}")
    return axis + rank if axis < 0 else axis


def _ints(value) -> list[int]:
    """An int64 shape/axes input (numpy array, scalar or list) as a list of Python ints."""
    if isinstance(value, np.ndarray):
        return value.reshape(-1).tolist()
    if isinstance(value, (list, tuple)):
        return list(value)
    return [int(value)]


def _scalar_int(value) -> int:
    """A one-element tensor (rank 0 or 1) as a Python int."""
    return int(np.asarray(value).reshape(-1)[0])


def _zero(dtype: np.dtype):
    """The fill value ONNX uses for padding a tensor of ``dtype``: 0, False or ''."""
    return "" if dtype.kind == "O" else np.zeros((), dtype)


def _element_index(indices: np.ndarray, axis: int) -> tuple:
    """The fancy index selecting ``data[i0, .., indices[i], .., in]`` for each position i of
    ``indices`` (GatherElements / ScatterElements): aranges on every axis but ``axis``."""
    rank = indices.ndim
    index = []
    for dim, size in enumerate(indices.shape):
        if dim == axis:
            index.append(indices)
        else:
            shape = [1] * rank
            shape[dim] = size
            index.append(np.arange(size).reshape(shape))
    return tuple(index)


_SCATTER_REDUCTIONS = {
    "add": np.add,
    "mul": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
}


def _scatter(data: np.ndarray, index: tuple, updates: np.ndarray, reduction: str, out=None) -> np.ndarray:
    if out is None:
        out = data.copy()
    else:
        np.copyto(out, data)
    if reduction == "none":
        out[index] = updates
        return out
    ufunc = _SCATTER_REDUCTIONS.get(reduction)
    if ufunc is None:
        raise NotImplementedError(f"scatter reduction {reduction!r} is not supported (none, add, mul, max, min)")
    ufunc.at(out, index, updates)
    return out


# ---------------------------------------------------------------------------
# views: reshape, transpose, squeeze, unsqueeze, flatten, expand, identity, shape
# ---------------------------------------------------------------------------

# A reshape is a view of a contiguous input; of any other (a transposed view, a broadcast
# Expand) it copies, and capture then calls the kernel's `into`: the same elements in C
# order, written through a view of `out` shaped like the input.


def _view_into(kernel_fn):
    """The into of a kernel that returns views: its views copied. Capture needs it only
    where a view shares no memory with the input (an empty one)."""

    def into(out, *inputs, **attributes):
        result = kernel_fn(*inputs, **attributes)
        for buffer, view in zip(out, result) if isinstance(out, tuple) else [(out, result)]:
            np.copyto(buffer, view)

    return into


# A view whose last axis is not contiguous (a transposition) is copied by tiles
# transposed in registers (``kernels._numba_transpose``) where the compiled loops are
# ready: numpy reads such a view a value at a time (~1-3 ns a value against ~0.2-0.5).

#: views smaller than this many values are left to numpy (its fixed cost is lower)
TRANSPOSED_COPY_MIN = 1024
_PLANS: dict[tuple, tuple | None] = {}
_PLANS_KEPT = 512  # distinct view layouts remembered (a model has a few dozen)


def transposition_plan(shape: tuple[int, ...], strides: tuple[int, ...], size: int) -> tuple | None:
    """How :mod:`._numba_transpose` copies a view of ``shape`` and ``strides`` (bytes) of
    ``size``-byte values in C order: (value size it moves, geometry, row offsets, column
    offsets; see its geometry array), or None where the view is not a transposition it
    takes (its last axis contiguous, no contiguous axis, negative strides, more than
    three other axes)."""
    axes: list[list[int]] = []  # [extent, source stride], axes merged where the source allows
    for n, stride in zip(shape, strides):
        if n == 1:
            continue
        if stride < 0:
            return None
        if axes and axes[-1][1] == stride * n:
            axes[-1] = [axes[-1][0] * n, stride]
        else:
            axes.append([n, stride])
    if size == 4 and len(axes) >= 2 and axes[-1] == [2, 4]:
        axes.pop()  # pairs of 4-byte values that stay together move as 8-byte values
        size = 8
    if size not in (4, 8) or len(axes) < 2 or axes[-1][1] == size:
        return None
    last = len(axes) - 1
    inner = next((a for a in range(last) if axes[a][1] == size), None)
    if inner is None:
        return None
    lanes = 16 if size == 4 else 8
    output = [0] * len(axes)
    step = size
    for a in range(last, -1, -1):
        output[a] = step
        step *= axes[a][0]
    # rows: the output's last axis, with the one before it when short; columns: the
    # source's contiguous axis, with the one after it in the source when short. An axis
    # both could take goes to the side whose shorter space it lengthens more.
    row_outer = last - 1 if axes[last][0] < lanes and last - 1 != inner else None
    column_outer = next((a for a in range(len(axes)) if a not in (inner, last) and axes[a][1] == axes[inner][0] * size), None)
    if axes[inner][0] >= lanes:
        column_outer = None
    if row_outer is not None and row_outer == column_outer:
        with_rows = min(axes[last][0] * axes[row_outer][0], axes[inner][0])
        with_columns = min(axes[last][0], axes[inner][0] * axes[column_outer][0])
        if with_rows >= with_columns:
            column_outer = None
        else:
            row_outer = None
    row_outer_n, row_outer_stride = (axes[row_outer][0], axes[row_outer][1]) if row_outer is not None else (1, 0)
    column_outer_n, column_outer_stride = (axes[column_outer][0], output[column_outer]) if column_outer is not None else (1, 0)
    rows = _offsets(axes[last][0], axes[last][1], row_outer_n, row_outer_stride, lanes)
    columns = _offsets(axes[inner][0], output[inner], column_outer_n, column_outer_stride, lanes)
    batch = [a for a in range(len(axes)) if a not in (inner, last, row_outer, column_outer)]
    if len(batch) > 3:
        return None
    geometry = [axes[last][0] * row_outer_n, axes[inner][0] * column_outer_n] + [1, 0, 0] * (3 - len(batch))
    for a in batch:
        geometry += [axes[a][0], axes[a][1], output[a]]
    return size, np.array(geometry, np.int64), rows, columns


def _offsets(inner_n: int, inner_stride: int, outer_n: int, outer_stride: int, lanes: int) -> np.ndarray:
    """The byte offsets of an index space of ``outer_n`` x ``inner_n`` (strides in bytes),
    padded with zeros to a whole number of tiles."""
    n = outer_n * inner_n
    index = np.arange(-(-n // lanes) * lanes, dtype=np.int64)
    table = (index // inner_n) * outer_stride + (index % inner_n) * inner_stride
    table[n:] = 0
    return table


def _plan(view: np.ndarray) -> tuple | None:
    """:func:`transposition_plan` for ``view``, remembered by its layout."""
    key = (view.shape, view.strides, view.itemsize)
    try:
        return _PLANS[key]
    except KeyError:
        plan = transposition_plan(view.shape, view.strides, view.itemsize)
        if len(_PLANS) >= _PLANS_KEPT:
            _PLANS.clear()
        _PLANS[key] = plan
        return plan


def transposed_copy(view: np.ndarray, out: np.ndarray) -> bool:
    """Copy ``view`` into ``out`` (C-contiguous, its shape and dtype) by transposed tiles
    and return True; False, with nothing written, where the compiled loops are not ready
    or the view is not a transposition they take (the caller copies with numpy)."""
    if view.size < TRANSPOSED_COPY_MIN or view.dtype.kind not in "fiuc" or not out.flags.c_contiguous:
        return False
    loops = compiled_module("_numba_transpose")
    if loops is None:
        return False
    plan = _plan(view)
    if plan is None:
        return False
    size, geometry, rows, columns = plan
    loops.transposed(view.ctypes.data, out.ctypes.data, geometry, rows, columns, size)
    return True


def contiguous(data: np.ndarray) -> np.ndarray:
    """``data`` in C order: itself when it is, else a copy (by transposed tiles where
    :func:`transposed_copy` takes it)."""
    if data.flags.c_contiguous:
        return data
    out = np.empty(data.shape, data.dtype)
    if not transposed_copy(data, out):
        np.copyto(out, data)
    return out


def _copy_into(out: np.ndarray, view: np.ndarray) -> None:
    if not transposed_copy(view, out):
        np.copyto(out, view)


def _reshaped_into(out: np.ndarray, data: np.ndarray, *_inputs, **_attributes) -> None:
    if out.flags.c_contiguous:
        _copy_into(out.reshape(data.shape), data)
    else:
        np.copyto(out, data.reshape(out.shape))


def _reshape(data: np.ndarray, dims: list[int], allowzero: int) -> np.ndarray:
    if not allowzero and 0 in dims:
        in_shape = data.shape
        dims = [in_shape[i] if d == 0 else d for i, d in enumerate(dims)]
    if not data.flags.c_contiguous and data.size >= TRANSPOSED_COPY_MIN and data.dtype.kind in "fiuc" and _plan(data) is not None:
        data = contiguous(data)  # a transposed view: numpy's reshape would copy it a value at a time
    return data.reshape(dims)


@kernel("Reshape", 1, compiled=TRANSPOSE_LOOPS)
def reshape_1(data, *, shape=None):
    if shape is None:
        raise ValueError("Reshape-1 needs its 'shape' attribute")
    return _reshape(data, list(shape), 0)


@kernel("Reshape", 5, 14, compiled=TRANSPOSE_LOOPS)
def reshape(data, shape, *, allowzero=0):
    return _reshape(data, shape.tolist(), allowzero)


declare_into(_reshaped_into, reshape_1, reshape)

#: ops that read a transposed matrix (the last two axes swapped) as it is: BLAS takes it
#: with a transpose flag
_MATRIX_READERS = frozenset({"MatMul", "Gemm", "FusedMatMul", "FusedMatMulGelu", "ScaledDotProductAttention"})
#: ops that take any transposed view their own way: a depthwise Conv reads a channels-last
#: input as it lies (ConvNeXt's), others copy what they need
_VIEW_READERS = frozenset({"Conv", "FusedConv"})


def _readers(node) -> frozenset[str]:
    """The op types reading ``node``'s output (an onnx_ir node's); empty when unknown or
    when the output is also a graph output."""
    value = next(iter(getattr(node, "outputs", None) or ()), None)
    if value is None or not hasattr(value, "uses") or value.is_graph_output():
        return frozenset()
    return frozenset(use.node.op_type for use in value.uses())


@kernel_builder("Transpose", 1, compiled=TRANSPOSE_LOOPS)
def transpose(ctx: KernelContext):
    """A view where the last axis stays contiguous, where only Convs read it, or where only
    Convs and matrix products read a swap of the last two axes; otherwise the values in C
    order, copied by transposed tiles (every reader then streams them, where a view would
    be read a value at a time). The numpy path (no compiled loops) returns the view."""
    perm = ctx.attributes.get("perm")
    perm = None if perm is None else tuple(perm)
    readers = _readers(ctx.node)
    views = bool(readers) and readers <= _VIEW_READERS
    matrices = bool(readers) and readers <= _VIEW_READERS | _MATRIX_READERS

    def run(data):
        view = data.transpose(perm)
        strides = view.strides
        if views or view.ndim < 2 or strides[-1] == view.itemsize or view.size < TRANSPOSED_COPY_MIN:
            return view
        if matrices and strides[-2] == view.itemsize:
            return view
        out = np.empty(view.shape, view.dtype)
        return out if transposed_copy(view, out) else view

    def run_into(out, data):
        _copy_into(out, data.transpose(perm))

    declare_into(run_into, run)
    return run


# Squeeze treats empty axes like absent ones (every size-1 axis goes), as onnxruntime does.


@kernel("Squeeze", 1)
def squeeze_1(data, *, axes=None):
    return np.squeeze(data, axis=tuple(axes)) if axes else np.squeeze(data)


@kernel("Squeeze", 13)
def squeeze(data, axes=None):
    return np.squeeze(data) if axes is None or axes.size == 0 else np.squeeze(data, axis=tuple(axes.tolist()))


def _unsqueeze(data: np.ndarray, axes: list[int]) -> np.ndarray:
    inserted = [False] * (data.ndim + len(axes))
    try:
        for axis in axes:
            inserted[axis] = True  # list indexing resolves negative axes as the spec does
    except IndexError:
        raise ValueError(f"Unsqueeze axes {axes} are out of range for output rank {len(inserted)}") from None
    if inserted.count(True) != len(axes):
        raise ValueError(f"Unsqueeze axes {axes} repeat an axis")
    dims = iter(data.shape)
    return data.reshape([1 if new else next(dims) for new in inserted])


@kernel("Unsqueeze", 1)
def unsqueeze_1(data, *, axes=None):
    if axes is None:
        raise ValueError("Unsqueeze-1 needs its 'axes' attribute")
    return _unsqueeze(data, list(axes))


@kernel("Unsqueeze", 13)
def unsqueeze(data, axes):
    # onnxruntime and onnx.reference accept a 0-d axes tensor as one axis
    return _unsqueeze(data, np.atleast_1d(axes).tolist())


@kernel("Flatten", 1)
def flatten(data, *, axis=1):
    shape = data.shape
    if axis < 0:
        axis += data.ndim
    if not 0 <= axis <= data.ndim:
        raise ValueError(f"Flatten axis {axis} is out of range for a tensor of rank {data.ndim}")
    return data.reshape(math.prod(shape[:axis]), math.prod(shape[axis:]))


declare_into(_reshaped_into, squeeze_1, squeeze, unsqueeze_1, unsqueeze, flatten)


@kernel("Expand", 8)
def expand(data, shape):
    dims = shape.tolist()
    in_shape = data.shape
    rank = max(len(dims), len(in_shape))
    out_shape = []
    for have, want in zip((1,) * (rank - len(in_shape)) + in_shape, [1] * (rank - len(dims)) + dims):
        if have == want or want == 1:
            out_shape.append(have)
        elif have == 1:
            out_shape.append(want)
        else:
            raise ValueError(f"Expand cannot broadcast shape {in_shape} to {dims}")
    if len(out_shape) == len(in_shape) and tuple(out_shape) == in_shape:
        return data
    # A read-only broadcast view: Expand never needs its own memory.
    return np.broadcast_to(data, out_shape)


declare_into(_view_into(expand), expand)


@kernel("Identity", 1)
def identity(data):
    return data


declare_into(_view_into(identity), identity)


@kernel("Shape", 1)
def shape_1(data):
    return np.array(data.shape, dtype=np.int64)


def _shape_1_into(out, data):
    out[...] = data.shape


declare_into(_shape_1_into, shape_1)


@kernel("Shape", 15)
def shape(data, *, start=0, end=None):
    # Python slicing clamps out-of-range and negative bounds exactly as the spec asks.
    return np.array(data.shape[start:end], dtype=np.int64)


def _shape_into(out, data, *, start=0, end=None):
    out[...] = data.shape[start:end]


declare_into(_shape_into, shape)


@kernel("Size", 1)
def size(data):
    return np.array(data.size, dtype=np.int64)


def _size_into(out, data):
    out[...] = data.size


declare_into(_size_into, size)


# ---------------------------------------------------------------------------
# concat, split, slice, tile, pad
# ---------------------------------------------------------------------------


@kernel("Concat", 1)
def concat_1(*inputs, axis=1):
    return concat(*inputs, axis=axis)


@kernel("Concat", 4)
def concat(*inputs, axis):
    if len(inputs) == 1:
        _axis(axis, inputs[0].ndim)
        return inputs[0]
    return np.concatenate(inputs, axis=axis)


def _concat_into(out, *inputs, axis):
    if len(inputs) == 1:
        np.copyto(out, inputs[0])
    else:
        np.concatenate(inputs, axis=axis, out=out)


def _concat_1_into(out, *inputs, axis=1):
    _concat_into(out, *inputs, axis=axis)


declare_into(_concat_into, concat)
declare_into(_concat_1_into, concat_1)


def _split_sizes(dim: int, parts: int) -> list[int]:
    """Equal parts of ``dim``, the last one smaller when it does not divide (Split-18)."""
    if parts <= 0:
        raise ValueError(f"Split needs at least one output, got {parts}")
    chunk = -(-dim // parts)
    last = dim - chunk * (parts - 1)
    if last < 0:
        raise ValueError(f"cannot split a dimension of {dim} into {parts} parts")
    return [chunk] * (parts - 1) + [last]


def _split(data: np.ndarray, sizes: list[int], axis: int) -> tuple[np.ndarray, ...]:
    axis = _axis(axis, data.ndim)
    if sum(sizes) != data.shape[axis]:
        raise ValueError(f"Split sizes {sizes} do not add up to dimension {data.shape[axis]} of axis {axis}")
    index = [slice(None)] * data.ndim
    parts = []
    start = 0
    for length in sizes:
        index[axis] = slice(start, start + length)
        parts.append(data[tuple(index)])
        start += length
    return tuple(parts)


@kernel_builder("Split", 1, 13, 18, multi_output=True)
def split(ctx: KernelContext):
    """Split at every opset: sizes come from the ``split`` input (v1, v13+), the ``split``
    attribute (v1-v11), ``num_outputs`` (v18) or else the node's number of outputs."""
    axis = ctx.attributes.get("axis", 0)
    split_attribute = ctx.attributes.get("split") if ctx.opset < 13 else None
    parts = ctx.attributes.get("num_outputs") or ctx.num_outputs

    def run(data, split_input=None):
        if split_input is not None and split_input.size:
            sizes = split_input.tolist()
        elif split_attribute:
            sizes = list(split_attribute)
        else:
            sizes = _split_sizes(data.shape[_axis(axis, data.ndim)], parts)
        return _split(data, sizes, axis)

    declare_into(_view_into(run), run)
    return run


def _slice(data: np.ndarray, starts: list[int], ends: list[int], axes, steps) -> np.ndarray:
    """Slice with the spec's clamping: starts/ends below -dim or above dim are clamped,
    and for negative steps an end before index 0 becomes ``None``."""
    rank = data.ndim
    count = len(starts)
    if axes is None:
        axes = range(count)
    if steps is None:
        steps = (1,) * count
    if not len(ends) == len(axes) == len(steps) == count:
        raise ValueError("Slice starts, ends, axes and steps must have the same length")
    shape = data.shape
    index = [slice(None)] * rank
    for start, end, axis, step in zip(starts, ends, axes, steps):
        dim = shape[axis]  # a negative axis indexes from the back, as the spec asks
        if start < 0:
            start += dim
        if end < 0:
            end += dim
        if step > 0:
            index[axis] = slice(min(max(start, 0), dim), min(max(end, 0), dim), step)
        elif step < 0:
            end = min(end, dim - 1)
            index[axis] = slice(min(max(start, 0), dim - 1), end if end >= 0 else None, step)
        else:
            raise ValueError("Slice step cannot be 0")
    return data[tuple(index)]


@kernel("Slice", 1)
def slice_1(data, *, starts=None, ends=None, axes=None):
    if starts is None or ends is None:
        raise ValueError("Slice-1 needs its 'starts' and 'ends' attributes")
    return _slice(data, list(starts), list(ends), list(axes) if axes else None, None)


declare_into(_view_into(slice_1), slice_1)


@kernel("Slice", 10)
def slice_(data, starts, ends, axes=None, steps=None):
    return _slice(
        data,
        starts.tolist(),
        ends.tolist(),
        None if axes is None else axes.tolist(),
        None if steps is None else steps.tolist(),
    )


declare_into(_view_into(slice_), slice_)


def _tile_into(out: np.ndarray, data: np.ndarray) -> None:
    """np.tile into ``out``: out viewed as (repeat, size) pairs per axis takes ``data``
    broadcast over the repeats."""
    pairs, spread = [], []
    for size, total in zip(data.shape, out.shape):
        pairs += [total // size if size else 0, size]
        spread += [1, size]
    if out.flags.c_contiguous and out.size:
        np.copyto(out.reshape(pairs), data.reshape(spread))
    else:
        np.copyto(out, np.tile(data, [p for p in pairs[::2]]))


@kernel("Tile", 1)
def tile_1(data, tiles, axis):
    repeats = [1] * data.ndim
    repeats[_axis(_scalar_int(axis), data.ndim)] = _scalar_int(tiles)
    return np.tile(data, repeats)


declare_into(lambda out, data, tiles, axis: _tile_into(out, data), tile_1)


@kernel("Tile", 6)
def tile(data, repeats):
    reps = repeats.tolist()
    if len(reps) != data.ndim:
        raise ValueError(f"Tile repeats {reps} must have one entry per axis of the rank-{data.ndim} input")
    return np.tile(data, reps)


declare_into(lambda out, data, repeats: _tile_into(out, data), tile)


def _pad(data: np.ndarray, pads: list[int], mode: str, value, axes: list[int] | None, out=None) -> np.ndarray:
    """Pad ``data`` (into ``out`` when given: an ``into`` variant)."""
    rank = data.ndim
    axes = list(range(rank)) if axes is None else [_axis(a, rank) for a in axes]
    count = len(axes)
    if len(pads) != 2 * count:
        raise ValueError(f"Pad expects {2 * count} pads for {count} axes, got {len(pads)}")
    begin = [0] * rank
    end = [0] * rank
    for i, axis in enumerate(axes):
        begin[axis] = pads[i]
        end[axis] = pads[count + i]
    if any(p < 0 for p in pads):  # negative pads remove elements
        data = data[tuple(slice(max(-b, 0), dim - max(-e, 0)) for b, e, dim in zip(begin, end, data.shape))]
        begin = [max(b, 0) for b in begin]
        end = [max(e, 0) for e in end]
    if not any(begin) and not any(end):
        if out is not None:
            np.copyto(out, data)
        return data
    if mode == "constant":
        fill = _zero(data.dtype) if value is None else value
        if out is None:
            out_shape = tuple(d + b + e for d, b, e in zip(data.shape, begin, end))
            out = np.full(out_shape, fill, dtype=data.dtype)
        else:
            out.fill(fill)
        out[tuple(slice(b, b + d) for b, d in zip(begin, data.shape))] = data
        return out
    if mode not in ("reflect", "edge", "wrap"):  # numpy.pad's modes of the same names
        raise NotImplementedError(f"Pad mode {mode!r} is not supported (constant, reflect, edge, wrap)")
    if data.size == 0:
        raise ValueError(f"Pad mode {mode!r} cannot pad an empty tensor")
    padded = np.pad(data, list(zip(begin, end)), mode=mode)  # type: ignore[call-overload]  # mode checked above
    if out is not None:
        np.copyto(out, padded)  # numpy.pad has no out=: these modes allocate on replay too
    return padded


def _pad_1_into(out, data, *, paddings=None, mode="constant", value=0.0):
    if paddings is None:
        raise ValueError("Pad-1 needs its 'paddings' attribute")
    return _pad(data, list(paddings), mode, value, None, out)


@kernel("Pad", 1)
def pad_1(data, *, paddings=None, mode="constant", value=0.0):
    return _pad_1_into(None, data, paddings=paddings, mode=mode, value=value)


def _pad_2_into(out, data, *, pads=None, mode="constant", value=0.0):
    if pads is None:
        raise ValueError("Pad-2 needs its 'pads' attribute")
    return _pad(data, list(pads), mode, value, None, out)


@kernel("Pad", 2)
def pad_2(data, *, pads=None, mode="constant", value=0.0):
    return _pad_2_into(None, data, pads=pads, mode=mode, value=value)


def _pad_into(out, data, pads, constant_value=None, axes=None, *, mode="constant"):
    value = None if constant_value is None or constant_value.size == 0 else constant_value.reshape(-1)[0]
    return _pad(data, pads.tolist(), mode, value, None if axes is None else axes.tolist(), out)


@kernel("Pad", 11, 18)
def pad(data, pads, constant_value=None, axes=None, *, mode="constant"):
    return _pad_into(None, data, pads, constant_value, axes, mode=mode)


declare_into(_pad_1_into, pad_1)
declare_into(_pad_2_into, pad_2)
declare_into(_pad_into, pad)


@kernel("CenterCropPad", 18)
def center_crop_pad(input_data, shape, *, axes=None):
    rank = input_data.ndim
    axes = list(range(rank)) if axes is None else [_axis(a, rank) for a in axes]
    target = _ints(shape)
    if len(target) != len(axes):
        raise ValueError(f"CenterCropPad shape {target} must have one entry per axis {axes}")
    crop = [slice(None)] * rank
    place = [slice(None)] * rank
    out_shape = list(input_data.shape)
    padded = False
    for axis, size in zip(axes, target):
        dim = input_data.shape[axis]
        if size < dim:
            start = (dim - size) // 2
            crop[axis] = slice(start, start + size)
        elif size > dim:
            start = (size - dim) // 2
            place[axis] = slice(start, start + dim)
            padded = True
        out_shape[axis] = size
    cropped = input_data[tuple(crop)]
    if not padded:
        return cropped
    out = np.full(out_shape, _zero(input_data.dtype), dtype=input_data.dtype)
    out[tuple(place)] = cropped
    return out


# ---------------------------------------------------------------------------
# gather and scatter
# ---------------------------------------------------------------------------


def _one_index(data, indices, axis):
    """``data``'s slab at the single index ``indices`` (a 0-d array) along ``axis``, as a
    view (numpy's basic indexing: an index out of range raises IndexError, a negative one
    counts from the end). np.take gathers element by element: ViT's query/key/value split,
    a scalar Gather of a transposed (3, 197, 1, 768), took 175 us where copying the view
    takes 16."""
    return data[(slice(None),) * _axis(axis, data.ndim) + (int(indices),)]


@kernel("Gather", 1)
def gather(data, indices, *, axis=0):
    """A single index gives the slab as a view where its last axis stays contiguous (ViT's
    query/key/value split: the attention step then reads each head where it lies, and the
    three copies of 197 x 768 went, 70-120 us each in the model); any other slab is copied
    (its readers would read it a value at a time)."""
    if indices.ndim == 0 and indices.dtype.kind in "iu":
        slab = _one_index(data, indices, axis)
        return slab if slab.ndim and slab.strides[-1] == slab.itemsize else slab.copy()
    return np.take(data, indices, axis=axis)


def _gather_into(out, data, indices, *, axis=0):
    if indices.ndim == 0 and indices.dtype.kind in "iu":
        np.copyto(out, _one_index(data, indices, axis))
        return
    # np.take(out=) in its default mode="raise" copies `out` first; "wrap" writes in place and
    # reads in-range indices (negative ones included) alike, so the range is checked here.
    if indices.size:
        count = data.shape[_axis(axis, data.ndim)]
        if indices.min() < -count or indices.max() >= count:
            raise IndexError(f"Gather index out of range for an axis of size {count}")
    np.take(data, indices, axis=axis, out=out, mode="wrap")


declare_into(_gather_into, gather)


@kernel("GatherElements", 11)
def gather_elements(data, indices, *, axis=0):
    axis = _axis(axis, data.ndim)
    if indices.ndim != data.ndim:
        raise ValueError(f"GatherElements indices have rank {indices.ndim}, data rank {data.ndim}")
    return data[_element_index(indices, axis)]


def _gather_elements_into(out, data, indices, *, axis=0):
    # integer work only (no sums whose rounding could depend on the buffer size)
    with_small_buffers(_gather_elements_flat, out, data, indices, axis)


def _gather_elements_flat(out, data, indices, axis):
    # The same elements by flat position: np.take(out=) from the contiguous data, at
    # indices[i] * stride(axis) + (position i on the other axes), built in a work array.
    axis = _axis(axis, data.ndim)
    if indices.ndim != data.ndim or not data.flags.c_contiguous or not indices.size:
        np.copyto(out, gather_elements(data, indices, axis=axis))
        return
    count = data.shape[axis]
    if indices.min() < -count or indices.max() >= count:
        raise IndexError(f"GatherElements index out of range for an axis of size {count}")
    strides = [step // data.itemsize for step in data.strides]
    flat = scratch(out, "flat", indices.shape, np.intp)
    negative = np.less(indices, 0, out=scratch(out, "negative", indices.shape, np.bool_))
    np.add(indices, count, out=flat, where=negative, casting="unsafe")
    np.logical_not(negative, out=negative)
    np.copyto(flat, indices, where=negative, casting="unsafe")
    flat *= strides[axis]
    for dim, size in enumerate(indices.shape):
        if dim != axis:
            shape = [1] * indices.ndim
            shape[dim] = size
            offsets = scratch(
                out, ("offsets", dim), tuple(shape), np.intp,
                lambda a, size=size, dim=dim: np.copyto(a, (np.arange(size) * strides[dim]).reshape(a.shape)),
            )
            flat += offsets
    np.take(data.reshape(-1), flat, out=out, mode="wrap")


declare_into(_gather_elements_into, gather_elements)


def _nd_index(indices: np.ndarray) -> tuple:
    """``indices[..., k]`` for each k, the fancy index of a GatherND / ScatterND lookup."""
    return tuple(indices[..., k] for k in range(indices.shape[-1]))


@kernel("GatherND", 11)
def gather_nd(data, indices, *, batch_dims=0):
    depth = indices.shape[-1]
    if batch_dims + depth > data.ndim:
        raise ValueError(
            f"GatherND indices address {depth} axes after {batch_dims} batch axes of a rank-{data.ndim} tensor"
        )
    if batch_dims == 0 and depth:
        return data[_nd_index(indices)]
    batch_shape = data.shape[:batch_dims]
    if indices.shape[:batch_dims] != batch_shape:
        raise ValueError(f"GatherND batch dims differ: data {batch_shape}, indices {indices.shape[:batch_dims]}")
    batch = math.prod(batch_shape)
    flat_data = data.reshape((batch, *data.shape[batch_dims:]))
    flat_indices = indices.reshape(batch, math.prod(indices.shape[batch_dims:-1]), depth)
    rows = np.broadcast_to(np.arange(batch)[:, None], flat_indices.shape[:2])
    gathered = flat_data[(rows,) + tuple(_nd_index(flat_indices))]
    return gathered.reshape(batch_shape + indices.shape[batch_dims:-1] + data.shape[batch_dims + depth :])


def _scatter_into(out, data, indices, updates, *, axis=0):
    return _scatter(data, _element_index(indices, _axis(axis, data.ndim)), updates, "none", out)


@kernel("Scatter", 9)
def scatter(data, indices, updates, *, axis=0):
    return _scatter_into(None, data, indices, updates, axis=axis)


def _scatter_elements_into(out, data, indices, updates, *, axis=0, reduction="none"):
    if indices.shape != updates.shape:
        raise ValueError(f"ScatterElements indices {indices.shape} and updates {updates.shape} differ in shape")
    return _scatter(data, _element_index(indices, _axis(axis, data.ndim)), updates, reduction, out)


@kernel("ScatterElements", 11, 16, 18)
def scatter_elements(data, indices, updates, *, axis=0, reduction="none"):
    return _scatter_elements_into(None, data, indices, updates, axis=axis, reduction=reduction)


def _scatter_nd_into(out, data, indices, updates, *, reduction="none"):
    return _scatter(data, _nd_index(indices), updates, reduction, out)


@kernel("ScatterND", 11, 16, 18)
def scatter_nd(data, indices, updates, *, reduction="none"):
    return _scatter_nd_into(None, data, indices, updates, reduction=reduction)


declare_into(_scatter_into, scatter)
declare_into(_scatter_elements_into, scatter_elements)
declare_into(_scatter_nd_into, scatter_nd)


@kernel("TensorScatter", 24)
def tensor_scatter(past_cache, update, write_indices=None, *, mode="linear", axis=-2):
    return _tensor_scatter_into(None, past_cache, update, write_indices, mode=mode, axis=axis)


def _tensor_scatter_into(out, past_cache, update, write_indices=None, *, mode="linear", axis=-2):
    axis = _axis(axis, past_cache.ndim)
    if axis == 0:
        raise ValueError("TensorScatter axis cannot be the batch axis 0")
    if mode not in ("linear", "circular"):
        raise NotImplementedError(f"TensorScatter mode {mode!r} is not supported (linear, circular)")
    batch = past_cache.shape[0]
    max_length = past_cache.shape[axis]
    length = update.shape[axis]
    if write_indices is None:
        write_indices = np.zeros(batch, dtype=np.int64)
    positions = write_indices.reshape(batch, 1) + np.arange(length)
    if mode == "circular":
        positions %= max_length
    elif length and int((write_indices + length).max()) > max_length:
        raise ValueError("TensorScatter linear mode writes past max_sequence_length")
    if out is None:
        out = past_cache.copy()
    else:
        np.copyto(out, past_cache)
    # Put the sequence axis next to the batch axis (views) and write all rows at once.
    np.moveaxis(out, axis, 1)[np.arange(batch)[:, None], positions] = np.moveaxis(update, axis, 1)
    return out


declare_into(_tensor_scatter_into, tensor_scatter)


# ---------------------------------------------------------------------------
# data rearrangement
# ---------------------------------------------------------------------------


@kernel("Compress", 9, data_dependent=True)
def compress(data, condition, *, axis=None):
    return np.compress(condition.reshape(-1), data, axis=axis)


def _depth_to_space(data, blocksize: int, mode: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """DepthToSpace as a transposed view of ``data`` and the output shape it reshapes to."""
    if data.ndim != 4:
        raise ValueError(f"DepthToSpace expects a rank-4 NCHW tensor, got rank {data.ndim}")
    b, c, h, w = data.shape
    depth = c // (blocksize * blocksize)
    if mode == "DCR":
        tmp = data.reshape(b, blocksize, blocksize, depth, h, w).transpose(0, 3, 4, 1, 5, 2)
    elif mode == "CRD":
        tmp = data.reshape(b, depth, blocksize, blocksize, h, w).transpose(0, 1, 4, 2, 5, 3)
    else:
        raise NotImplementedError(f"DepthToSpace mode {mode!r} is not supported (DCR, CRD)")
    return tmp, (b, depth, h * blocksize, w * blocksize)


@kernel("DepthToSpace", 1, 11)
def depth_to_space(data, *, blocksize, mode="DCR"):
    tmp, shape = _depth_to_space(data, blocksize, mode)
    return tmp.reshape(shape)


def _depth_to_space_into(out, data, *, blocksize, mode="DCR"):
    _reshaped_into(out, _depth_to_space(data, blocksize, mode)[0])


declare_into(_depth_to_space_into, depth_to_space)


def _space_to_depth(data, blocksize: int, mode: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """SpaceToDepth as a transposed view of ``data`` and the output shape it reshapes to."""
    if data.ndim != 4:
        raise ValueError(f"SpaceToDepth expects a rank-4 NCHW tensor, got rank {data.ndim}")
    b, c, h, w = data.shape
    tmp = data.reshape(b, c, h // blocksize, blocksize, w // blocksize, blocksize)
    if mode == "DCR":
        tmp = tmp.transpose(0, 3, 5, 1, 2, 4)
    elif mode == "CRD":
        tmp = tmp.transpose(0, 1, 3, 5, 2, 4)
    else:
        raise NotImplementedError(f"SpaceToDepth mode {mode!r} is not supported (DCR, CRD)")
    return tmp, (b, c * blocksize * blocksize, h // blocksize, w // blocksize)


@kernel("SpaceToDepth", 1, 28)
def space_to_depth(data, *, blocksize, mode="DCR"):
    tmp, shape = _space_to_depth(data, blocksize, mode)
    return tmp.reshape(shape)


def _space_to_depth_into(out, data, *, blocksize, mode="DCR"):
    _reshaped_into(out, _space_to_depth(data, blocksize, mode)[0])


declare_into(_space_to_depth_into, space_to_depth)


@kernel("Trilu", 14)
def trilu(data, k=None, *, upper=1):
    offset = 0 if k is None else _scalar_int(k)
    return np.triu(data, offset) if upper else np.tril(data, offset)


def _trilu_into(out, data, k=None, *, upper=1):
    # np.triu / np.tril zero the positions of a boolean np.tri mask: the same mask, made
    # once per offset, and the zeros written through it.
    offset = 0 if k is None else _scalar_int(k)
    rows, columns = data.shape[-2:]

    def make(mask):
        below = np.tri(rows, columns, offset - 1 if upper else offset, dtype=bool)
        np.copyto(mask, below if upper else ~below)

    zeroed = scratch(out, ("trilu", offset, upper), (rows, columns), np.bool_, make)
    np.copyto(out, data)
    np.copyto(out, 0, where=zeroed)


declare_into(_trilu_into, trilu)


@kernel("ReverseSequence", 10)
def reverse_sequence(data, sequence_lens, *, batch_axis=1, time_axis=0):
    if {batch_axis, time_axis} != {0, 1}:
        raise ValueError(f"ReverseSequence batch_axis {batch_axis} / time_axis {time_axis} must be 0 and 1")
    steps = data.shape[time_axis]
    time = np.arange(steps)[:, None]  # (time, batch)
    lens = sequence_lens.astype(np.int64, copy=False)[None, :]
    source = np.where(time < lens, lens - 1 - time, time)
    if batch_axis == 0:
        source = source.T
    source = source.reshape(source.shape + (1,) * (data.ndim - 2))
    return np.take_along_axis(data, source, axis=time_axis)


def _cumulative(x, axis, exclusive: int, reverse: int, ufunc: np.ufunc, identity: int, out=None) -> np.ndarray:
    """The running ``ufunc`` along ``axis`` (into ``out`` when given: an ``into`` variant)."""
    axis = _axis(_scalar_int(axis), x.ndim)
    index = [slice(None)] * x.ndim
    if reverse:
        index[axis] = slice(None, None, -1)
        x = x[tuple(index)]
        if out is not None:
            out = out[tuple(index)]
    if exclusive:
        if out is None:
            out = np.empty_like(x)
        index[axis] = slice(0, 1)
        out[tuple(index)] = identity
        index[axis] = slice(1, None)
        shifted = [slice(None)] * x.ndim
        shifted[axis] = slice(0, -1)
        ufunc.accumulate(x[tuple(shifted)], axis=axis, dtype=x.dtype, out=out[tuple(index)])
    else:
        out = ufunc.accumulate(x, axis=axis, dtype=x.dtype, out=out)
    if reverse:
        index[axis] = slice(None, None, -1)
        out = out[tuple(index)]
    return out


@kernel("CumSum", 11)
def cumsum(x, axis, *, exclusive=0, reverse=0):
    return _cumulative(x, axis, exclusive, reverse, np.add, 0)


def _cumsum_into(out, x, axis, *, exclusive=0, reverse=0):
    _cumulative(x, axis, exclusive, reverse, np.add, 0, out)


declare_into(_cumsum_into, cumsum)


@kernel("CumProd", 26)
def cumprod(x, axis, *, exclusive=0, reverse=0):
    return _cumulative(x, axis, exclusive, reverse, np.multiply, 1)


def _cumprod_into(out, x, axis, *, exclusive=0, reverse=0):
    _cumulative(x, axis, exclusive, reverse, np.multiply, 1, out)


declare_into(_cumprod_into, cumprod)


# ---------------------------------------------------------------------------
# index-producing ops: OneHot, NonZero, Unique, TopK
# ---------------------------------------------------------------------------


@kernel("OneHot", 9)
def one_hot(indices, depth, values, *, axis=-1):
    depth = int(np.asarray(depth).reshape(-1)[0])
    rank = indices.ndim + 1
    axis = _axis(axis, rank)
    index = indices.astype(np.int64, copy=False)
    index = np.where(index < 0, index + depth, index)
    # Compare against 0..depth-1 laid along the new axis; out-of-range indices match nothing.
    positions = np.arange(depth).reshape((depth,) + (1,) * (rank - 1 - axis))
    hot = np.expand_dims(index, axis) == positions
    off_value, on_value = values.reshape(-1)[0], values.reshape(-1)[1]
    return np.where(hot, on_value, off_value).astype(values.dtype, copy=False)


@kernel("NonZero", 9, data_dependent=True)
def non_zero(x):
    if x.ndim == 0:
        return np.zeros((0, int(bool(x))), dtype=np.int64)
    return np.stack(np.nonzero(x)).astype(np.int64, copy=False)


@kernel("Unique", 11, multi_output=True, data_dependent=True)
def unique(x, *, axis=None, sorted=1):  # noqa: A002 - the ONNX attribute is called sorted
    if axis is None:
        values, first, inverse, counts = np.unique(
            x.reshape(-1), return_index=True, return_inverse=True, return_counts=True
        )
        take_axis = 0
    else:
        take_axis = _axis(axis, x.ndim)
        values, first, inverse, counts = np.unique(
            x, return_index=True, return_inverse=True, return_counts=True, axis=take_axis
        )
    inverse = inverse.reshape(-1)
    if not sorted:
        order = np.argsort(first, kind="stable")  # by first occurrence
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        values = np.take(values, order, axis=take_axis)
        first = first[order]
        counts = counts[order]
        inverse = rank[inverse]
    return (
        values,
        first.astype(np.int64, copy=False),
        inverse.astype(np.int64, copy=False),
        counts.astype(np.int64, copy=False),
    )


def _sorted_order(values: np.ndarray, largest: int) -> np.ndarray:
    """Positions that sort ``values`` along the last axis, descending when ``largest``,
    ties kept in increasing position (the spec's tie-break: lower index first)."""
    if not largest:
        return np.argsort(values, axis=-1, kind="stable")
    # A stable ascending sort of the reversed axis, read backwards, orders values
    # descending while keeping tied values in increasing position.
    reversed_order = np.argsort(values[..., ::-1], axis=-1, kind="stable")
    return (values.shape[-1] - 1) - reversed_order[..., ::-1]


def _top_k_candidates(rows: np.ndarray, k: int, largest: int) -> np.ndarray:
    """The positions of each row's top k, in increasing position, in O(n): a partition
    finds the k-th value; ties at that value go to the lowest positions."""
    n = rows.shape[-1]
    if largest:
        threshold = np.partition(rows, n - k, axis=-1)[:, n - k : n - k + 1]
        chosen = rows >= threshold
    else:
        threshold = np.partition(rows, k - 1, axis=-1)[:, k - 1 : k]
        chosen = rows <= threshold
    if (np.count_nonzero(chosen, axis=-1) != k).any():  # more ties at the threshold than room
        tied = rows == threshold
        beyond = chosen & ~tied
        room = k - np.count_nonzero(beyond, axis=-1, keepdims=True)
        chosen = beyond | (tied & (np.cumsum(tied, axis=-1) <= room))
    return np.nonzero(chosen)[1].reshape(rows.shape[0], k)


def _top_k(x: np.ndarray, k: int, axis: int, largest: int) -> tuple[np.ndarray, np.ndarray]:
    axis = _axis(axis, x.ndim)
    n = x.shape[axis]
    if not 0 <= k <= n:
        raise ValueError(f"TopK k={k} is out of range for an axis of size {n}")
    moved = np.moveaxis(x, axis, -1)
    rows = moved.reshape(math.prod(moved.shape[:-1]), n)  # -1 is ambiguous for an empty axis
    # Partitioning beats a full sort for small k; NaN defeats its comparisons, so inputs
    # holding NaN take the full sort (which orders NaN above every number, as onnx.reference).
    if 0 < k and 2 * k <= n and rows.size and not (x.dtype.kind == "f" and np.isnan(rows).any()):
        candidates = _top_k_candidates(rows, k, largest)
        order = np.take_along_axis(candidates, _sorted_order(np.take_along_axis(rows, candidates, -1), largest), -1)
    else:
        order = _sorted_order(rows, largest)[:, :k]
    values = np.take_along_axis(rows, order, -1)
    out_shape = moved.shape[:-1] + (k,)
    return (
        np.moveaxis(values.reshape(out_shape), -1, axis),
        np.moveaxis(order.astype(np.int64, copy=False).reshape(out_shape), -1, axis),
    )


@kernel("TopK", 1, multi_output=True)
def top_k_1(x, *, k, axis=-1):
    return _top_k(x, k, axis, 1)


@kernel("TopK", 10, multi_output=True)
def top_k_10(x, k, *, axis=-1):
    return _top_k(x, _scalar_int(k), axis, 1)


@kernel("TopK", 11, multi_output=True)
def top_k(x, k, *, axis=-1, largest=1, sorted=1):  # noqa: A002 - sorted=0 allows any order; sorted is one
    return _top_k(x, _scalar_int(k), axis, largest)
