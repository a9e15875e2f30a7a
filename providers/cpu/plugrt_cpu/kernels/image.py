"""Image kernels: Resize, Upsample, GridSample, AffineGrid, RoiAlign, NonMaxSuppression, ImageDecoder."""

from __future__ import annotations

import io
import itertools
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._registry import kernel

# ---------------------------------------------------------------------------
# Shared numeric helpers
# ---------------------------------------------------------------------------


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """The float type interpolation runs in: the input's own float type where numpy has
    one (float32 stays float32), float32 for narrow types, float64 for wide integers."""
    if dtype in (np.float32, np.float64):
        return dtype
    if np.issubdtype(dtype, np.integer) and dtype.itemsize >= 4:
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def _cast_back(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Cast an interpolated float result to the input type, rounding and saturating integers."""
    if values.dtype == dtype:
        return values
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return np.clip(np.rint(values), info.min, info.max).astype(dtype)
    return values.astype(dtype)


def _keys_cubic(distance: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel (IEEE TASSP 1981, eq. 4) at any distance."""
    d = np.abs(distance)
    d2 = d * d
    d3 = d2 * d
    near = (a + 2) * d3 - (a + 3) * d2 + 1
    far = a * d3 - 5 * a * d2 + 8 * a * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def _cubic_taps(t: np.ndarray, a: float) -> np.ndarray:
    """The four Keys weights for taps at offsets -1, 0, 1, 2 from a base pixel b, t = x - b.

    Written term by term as onnx.reference writes them, so the float rounding agrees too.
    """
    s = 1 - t
    return np.stack(
        [
            ((a * (t + 1) - 5 * a) * (t + 1) + 8 * a) * (t + 1) - 4 * a,
            ((a + 2) * t - (a + 3)) * t * t + 1,
            ((a + 2) * s - (a + 3)) * s * s + 1,
            ((a * (s + 1) - 5 * a) * (s + 1) + 8 * a) * (s + 1) - 4 * a,
        ],
        axis=-1,
    )


def _weighted_take(x: np.ndarray, axis: int, index: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """sum_k weight[:, k] * take(x, index[:, k], axis): a separable 1-D resampling step.

    The loop runs over the kernel taps (2 for linear, 4 for cubic, a few more with
    antialiasing), each a vectorised gather over the whole tensor.
    """
    shape = [1] * x.ndim
    shape[axis] = -1
    out = np.take(x, index[:, 0], axis=axis)
    out *= weight[:, 0].reshape(shape)
    for k in range(1, index.shape[1]):
        term = np.take(x, index[:, k], axis=axis)
        term *= weight[:, k].reshape(shape)
        out += term
    return out


# ---------------------------------------------------------------------------
# Resize / Upsample
# ---------------------------------------------------------------------------

_NEAREST_ROUNDING = {
    "round_prefer_floor": lambda x, scale: np.ceil(x - 0.5),
    "round_prefer_ceil": lambda x, scale: np.floor(x + 0.5),
    "floor": lambda x, scale: np.floor(x),
    "ceil": lambda x, scale: np.ceil(x),
    # Resize-10 and Upsample had no nearest_mode: onnxruntime's legacy rule rounds up
    # when downsampling and truncates when upsampling.
    "legacy": lambda x, scale: np.ceil(x) if scale < 1 else np.floor(x),
}

_COMMON_COORDINATE_MODES = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize")
_RESIZE_COORDINATE_MODES = {
    11: (*_COMMON_COORDINATE_MODES, "tf_half_pixel_for_nn"),
    18: _COMMON_COORDINATE_MODES,
    19: (*_COMMON_COORDINATE_MODES, "half_pixel_symmetric"),
}


def _source_coordinates(
    transform: str, out_len: int, in_len: int, scale: float, out_width: float, roi: tuple[float, float] | None
) -> np.ndarray:
    """Map output indices along one axis to (fractional) input coordinates.

    ``out_width`` is the unrounded output length ``scale * in_len``; like onnx.reference
    (and its test data) align_corners and tf_crop_and_resize divide by it, not by the
    rounded length.
    """
    y = np.arange(out_len, dtype=np.float64)
    if transform == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if transform == "half_pixel_symmetric":
        offset = in_len / 2 * (1 - out_len / out_width)
        return offset + (y + 0.5) / scale - 0.5
    if transform == "pytorch_half_pixel":
        # The spec (and onnxruntime) map a length-1 output to 0.
        return (y + 0.5) / scale - 0.5 if out_len > 1 else np.zeros(out_len)
    if transform == "align_corners":
        return y * (in_len - 1) / (out_width - 1) if out_width != 1 else np.zeros(out_len)
    if transform == "asymmetric":
        return y / scale
    if transform == "tf_half_pixel_for_nn":
        return (y + 0.5) / scale
    if transform == "tf_crop_and_resize":
        assert roi is not None  # resize() refuses tf_crop_and_resize without an roi
        start, end = roi
        if out_width == 1:
            return np.full(out_len, (start + end) / 2 * (in_len - 1))
        return start * (in_len - 1) + y * (end - start) * (in_len - 1) / (out_width - 1)
    raise ValueError(f"Resize: unknown coordinate_transformation_mode {transform!r}")


def _interpolation_taps(
    x_src: np.ndarray, mode: str, scale: float, antialias: bool, cubic_coeff_a: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per output position, the input indices and weights of the interpolation kernel.

    Taps are placed relative to ``base = ceil(x) - 1`` with ``ratio = x - base`` in (0, 1],
    the convention of onnx.reference, so exclude_outside renormalises the same taps.
    """
    base = np.ceil(x_src) - 1
    ratio = x_src - base
    if antialias and scale < 1:
        support = 1.0 if mode == "linear" else 2.0
        first = int(np.floor(-support / scale)) + 1
        offsets = np.arange(first, 2 - first, dtype=np.float64)
        distance = (offsets[None, :] - ratio[:, None]) * scale
        if mode == "linear":
            weight = np.clip(1 - np.abs(distance), 0, 1)
        else:
            weight = _keys_cubic(distance, cubic_coeff_a)
        weight /= weight.sum(axis=1, keepdims=True)
    elif mode == "linear":
        offsets = np.array([0.0, 1.0])
        weight = np.stack([1 - ratio, ratio], axis=1)
    else:
        offsets = np.array([-1.0, 0.0, 1.0, 2.0])
        weight = _cubic_taps(ratio, cubic_coeff_a)
        if antialias:
            # Upsampling with antialias still normalises the kernel.
            weight = weight / weight.sum(axis=1, keepdims=True)
    index = (base[:, None] + offsets[None, :]).astype(np.int64)
    return index, weight


def _resize_axis(
    x: np.ndarray,
    axis: int,
    out_len: int,
    scale: float,
    out_width: float,
    roi: tuple[float, float] | None,
    *,
    mode: str,
    transform: str,
    nearest_mode: str,
    cubic_coeff_a: float,
    exclude_outside: bool,
    extrapolation_value: float,
    antialias: bool,
) -> np.ndarray:
    in_len = x.shape[axis]
    if out_len == 0 or in_len == 0:
        shape = list(x.shape)
        shape[axis] = out_len
        return np.zeros(shape, dtype=x.dtype)
    x_src = _source_coordinates(transform, out_len, in_len, scale, out_width, roi)
    if mode == "nearest":
        index = _NEAREST_ROUNDING[nearest_mode](x_src, scale).astype(np.int64)
        out = np.take(x, np.clip(index, 0, in_len - 1), axis=axis)
        if exclude_outside:
            # The single tap's weight drops to 0 and cannot be renormalised: the sample is 0.
            outside = (index < 0) | (index >= in_len)
            if outside.any():
                shape = [1] * x.ndim
                shape[axis] = -1
                out = np.where(outside.reshape(shape), np.zeros((), dtype=out.dtype), out)
    else:
        index, weight = _interpolation_taps(x_src, mode, scale, antialias, cubic_coeff_a)
        if exclude_outside:
            weight = np.where((index < 0) | (index >= in_len), 0.0, weight)
            total = weight.sum(axis=1, keepdims=True)
            weight = weight / np.where(total == 0, 1.0, total)
        out = _weighted_take(x, axis, np.clip(index, 0, in_len - 1), weight.astype(x.dtype))
    if transform == "tf_crop_and_resize":
        outside = (x_src < 0) | (x_src > in_len - 1)
        if outside.any():
            shape = [1] * x.ndim
            shape[axis] = -1
            out = np.where(outside.reshape(shape), np.asarray(extrapolation_value).astype(out.dtype), out)
    return out


def _present(value: np.ndarray | None) -> bool:
    return value is not None and np.asarray(value).size > 0


def _resize(
    x: np.ndarray,
    roi: np.ndarray | None,
    scales: np.ndarray | None,
    sizes: np.ndarray | None,
    *,
    axes: Sequence[int] | None,
    mode: str,
    transform: str,
    nearest_mode: str,
    cubic_coeff_a: float = -0.75,
    exclude_outside: bool = False,
    extrapolation_value: float = 0.0,
    antialias: bool = False,
    keep_aspect_ratio_policy: str = "stretch",
) -> np.ndarray:
    rank = x.ndim
    axes = list(range(rank)) if axes is None else [a + rank if a < 0 else a for a in axes]
    if mode not in ("nearest", "linear", "cubic"):
        raise ValueError(f"Resize: unknown mode {mode!r}; expected nearest, linear or cubic")
    if nearest_mode not in _NEAREST_ROUNDING:
        raise ValueError(f"Resize: unknown nearest_mode {nearest_mode!r}")
    if _present(scales) and _present(sizes):
        raise ValueError("Resize: only one of 'scales' and 'sizes' may be given")
    if not _present(scales) and not _present(sizes):
        raise ValueError("Resize: one of 'scales' and 'sizes' must be given")

    # Per resized axis: (output length, scale, unrounded output length).
    if _present(scales):
        scale_list = [float(s) for s in np.asarray(scales).reshape(-1)]
        if len(scale_list) != len(axes):
            raise ValueError(f"Resize: 'scales' has {len(scale_list)} values for {len(axes)} axes")
        plan = [(int(np.floor(x.shape[a] * s)), s, x.shape[a] * s) for a, s in zip(axes, scale_list)]
    else:
        size_list = [int(s) for s in np.asarray(sizes).reshape(-1)]
        if len(size_list) != len(axes):
            raise ValueError(f"Resize: 'sizes' has {len(size_list)} values for {len(axes)} axes")
        ratios = [s / x.shape[a] if x.shape[a] else 1.0 for a, s in zip(axes, size_list)]
        if keep_aspect_ratio_policy == "stretch":
            plan = [(s, r, float(s)) for s, r in zip(size_list, ratios)]
        elif keep_aspect_ratio_policy in ("not_larger", "not_smaller"):
            common = min(ratios) if keep_aspect_ratio_policy == "not_larger" else max(ratios)
            plan = [(int(common * x.shape[a] + 0.5), common, common * x.shape[a]) for a in axes]
        else:
            raise ValueError(f"Resize: unknown keep_aspect_ratio_policy {keep_aspect_ratio_policy!r}")

    rois: list[tuple[float, float] | None] = [None] * len(axes)
    if transform == "tf_crop_and_resize":
        if not _present(roi):
            raise ValueError("Resize: coordinate_transformation_mode 'tf_crop_and_resize' needs the 'roi' input")
        flat = [float(v) for v in np.asarray(roi).reshape(-1)]
        if len(flat) != 2 * len(axes):
            raise ValueError(f"Resize: 'roi' has {len(flat)} values; expected {2 * len(axes)}")
        rois = [(flat[i], flat[i + len(axes)]) for i in range(len(axes))]

    if mode == "nearest":
        out = x
    else:
        if x.dtype == np.bool_ or x.dtype.kind in "OUS":
            raise NotImplementedError(f"Resize: mode {mode!r} is not supported for {x.dtype} input")
        out = x.astype(_compute_dtype(x.dtype), copy=False)
    for axis, roi_axis, (out_len, scale, out_width) in sorted(zip(axes, rois, plan), key=lambda item: item[0]):
        if out_len == out.shape[axis] and scale == 1.0 and (roi_axis is None or roi_axis == (0.0, 1.0)):
            continue  # identity along this axis: every mode samples the input exactly
        out = _resize_axis(
            out,
            axis,
            out_len,
            scale,
            out_width,
            roi_axis,
            mode=mode,
            transform=transform,
            nearest_mode=nearest_mode,
            cubic_coeff_a=cubic_coeff_a,
            exclude_outside=exclude_outside,
            extrapolation_value=extrapolation_value,
            antialias=antialias,
        )
    return _cast_back(out, x.dtype) if out is not x else x


def _make_resize(version: int):
    transforms = _RESIZE_COORDINATE_MODES[version]

    def resize(
        x: np.ndarray,
        roi: np.ndarray | None = None,
        scales: np.ndarray | None = None,
        sizes: np.ndarray | None = None,
        *,
        antialias: int = 0,
        axes: list[int] | None = None,
        coordinate_transformation_mode: str = "half_pixel",
        cubic_coeff_a: float = -0.75,
        exclude_outside: int = 0,
        extrapolation_value: float = 0.0,
        keep_aspect_ratio_policy: str = "stretch",
        mode: str = "nearest",
        nearest_mode: str = "round_prefer_floor",
    ) -> np.ndarray:
        if coordinate_transformation_mode not in transforms:
            raise ValueError(
                f"Resize-{version}: coordinate_transformation_mode {coordinate_transformation_mode!r} "
                f"is not valid at this opset; expected one of {', '.join(transforms)}"
            )
        return _resize(
            x,
            roi,
            scales,
            sizes,
            axes=axes,
            mode=mode,
            transform=coordinate_transformation_mode,
            nearest_mode=nearest_mode,
            cubic_coeff_a=cubic_coeff_a,
            exclude_outside=bool(exclude_outside),
            extrapolation_value=extrapolation_value,
            antialias=bool(antialias),
            keep_aspect_ratio_policy=keep_aspect_ratio_policy,
        )

    resize.__name__ = f"resize_{version}"
    return resize


resize_11 = kernel("Resize", 11)(_make_resize(11))  # 13 only made roi/scales optional
resize_18 = kernel("Resize", 18)(_make_resize(18))
resize_19 = kernel("Resize", 19)(_make_resize(19))


def _legacy_upsample(x: np.ndarray, scales: Any, mode: str, op: str) -> np.ndarray:
    """Resize-10 and Upsample: asymmetric coordinates, no nearest_mode attribute."""
    if mode == "bilinear":  # Upsample-1's name for it
        mode = "linear"
    if mode not in ("nearest", "linear"):
        raise ValueError(f"{op}: unknown mode {mode!r}; expected nearest or linear")
    return _resize(x, None, np.asarray(scales, dtype=np.float32), None, axes=None, mode=mode,
                   transform="asymmetric", nearest_mode="legacy")


@kernel("Resize", 10)
def resize_10(x: np.ndarray, scales: np.ndarray, *, mode: str = "nearest") -> np.ndarray:
    return _legacy_upsample(x, scales, mode, "Resize")


@kernel("Upsample", 9)
def upsample_9(x: np.ndarray, scales: np.ndarray, *, mode: str = "nearest") -> np.ndarray:
    return _legacy_upsample(x, scales, mode, "Upsample")


@kernel("Upsample", 7)
def upsample_7(x: np.ndarray, *, mode: str = "nearest", scales: list[float]) -> np.ndarray:
    return _legacy_upsample(x, scales, mode, "Upsample")


@kernel("Upsample", 1)
def upsample_1(x: np.ndarray, *, height_scale: float, width_scale: float, mode: str = "nearest") -> np.ndarray:
    if x.ndim != 4:
        raise ValueError(f"Upsample-1 takes a 4-D NCHW input, got rank {x.ndim}")
    return _legacy_upsample(x, [1.0, 1.0, height_scale, width_scale], mode, "Upsample")


# ---------------------------------------------------------------------------
# GridSample / AffineGrid
# ---------------------------------------------------------------------------


def _reflect(v: np.ndarray, low: float, high: float) -> np.ndarray:
    """Fold coordinates into [low, high] by reflecting at the borders (PyTorch's rule)."""
    span = high - low
    if span <= 0:
        return np.full_like(v, low)
    below = v < low
    dist = np.where(below, low - v, v - high)
    flips = np.trunc(dist / span)
    rest = dist - flips * span
    even = np.fmod(flips, 2) == 0
    folded_low = np.where(even, low + rest, high - rest)
    folded_high = np.where(even, high - rest, low + rest)
    return np.where(below, folded_low, np.where(v > high, folded_high, v))


def _grid_sample(x: np.ndarray, grid: np.ndarray, mode: str, padding_mode: str, align_corners: bool) -> np.ndarray:
    batch, channels, *spatial = x.shape
    rank = len(spatial)
    if grid.shape[0] != batch or grid.shape[-1] != rank:
        raise ValueError(f"GridSample: grid of shape {grid.shape} does not fit input of shape {x.shape}")
    if padding_mode not in ("zeros", "border", "reflection"):
        raise ValueError(f"GridSample: unknown padding_mode {padding_mode!r}")
    out_spatial = grid.shape[1:-1]
    compute = _compute_dtype(x.dtype)
    # onnx.reference denormalises in float32; keep float64 grids exact.
    coord_dtype = np.float64 if grid.dtype == np.float64 else np.float32
    points = grid.reshape(batch, -1, rank).astype(coord_dtype, copy=False)

    taps_per_axis = []  # per spatial axis: (index[N, Q, k], weight[N, Q, k])
    for axis, length in enumerate(spatial):
        # The grid's last dimension lists coordinates innermost axis first (x, y, z).
        norm = points[:, :, rank - 1 - axis]
        if align_corners:
            pos = (norm + 1) / 2 * (length - 1)
            low, high = 0.0, float(length - 1)
        else:
            pos = ((norm + 1) * length - 1) / 2
            low, high = -0.5, length - 0.5
        if mode == "nearest":
            pos = np.rint(pos)  # round half to even, as PyTorch does
        if padding_mode == "border":
            pos = np.where((pos < low) | (pos > high), np.clip(pos, 0, length - 1), pos)
        elif padding_mode == "reflection":
            pos = _reflect(pos, low, high)
        if mode == "nearest":
            index = np.trunc(pos)[..., None]
            weight = np.ones_like(index)
        elif mode == "linear":
            first = np.floor(pos)
            t = pos - first
            index = first[..., None] + np.array([0, 1], dtype=coord_dtype)
            weight = np.stack([1 - t, t], axis=-1)
        else:
            first = np.floor(pos)
            index = first[..., None] + np.array([-1, 0, 1, 2], dtype=coord_dtype)
            weight = _cubic_taps(pos - first, -0.75)
        if padding_mode == "zeros":
            weight = np.where((index < 0) | (index >= length), 0, weight)
        elif padding_mode == "reflection":
            index = np.trunc(_reflect(index, low, high))
        index = np.clip(index, 0, length - 1).astype(np.intp)
        taps_per_axis.append((index, weight.astype(compute)))

    strides = np.cumprod([1, *spatial[::-1]])[:-1][::-1]
    flat_x = x.reshape(batch, channels, -1).astype(compute, copy=False)
    out = np.zeros((batch, channels, points.shape[1]), dtype=compute)
    # One gather per corner of the interpolation cell: 1, 2**rank or 4**rank of them.
    for corner in itertools.product(*(range(idx.shape[-1]) for idx, _ in taps_per_axis)):
        flat_index = sum(taps_per_axis[a][0][..., k] * strides[a] for a, k in enumerate(corner))
        weight = np.prod([taps_per_axis[a][1][..., k] for a, k in enumerate(corner)], axis=0)
        out += np.take_along_axis(flat_x, flat_index[:, None, :], axis=2) * weight[:, None, :]
    out = out.reshape(batch, channels, *out_spatial)
    return out.astype(x.dtype) if out.dtype != x.dtype else out


@kernel("GridSample", 16)
def grid_sample_16(
    x: np.ndarray, grid: np.ndarray, *, align_corners: int = 0, mode: str = "bilinear", padding_mode: str = "zeros"
) -> np.ndarray:
    names = {"bilinear": "linear", "nearest": "nearest", "bicubic": "cubic"}
    if mode not in names:
        raise ValueError(f"GridSample-16: unknown mode {mode!r}; expected bilinear, nearest or bicubic")
    if x.ndim != 4:
        raise ValueError(f"GridSample-16 takes a 4-D input, got rank {x.ndim}; N-D needs opset 20")
    return _grid_sample(x, grid, names[mode], padding_mode, bool(align_corners))


@kernel("GridSample", 20)
def grid_sample_20(
    x: np.ndarray, grid: np.ndarray, *, align_corners: int = 0, mode: str = "linear", padding_mode: str = "zeros"
) -> np.ndarray:
    if mode not in ("linear", "nearest", "cubic"):
        raise ValueError(f"GridSample: unknown mode {mode!r}; expected linear, nearest or cubic")
    return _grid_sample(x, grid, mode, padding_mode, bool(align_corners))


def _base_grid_axis(length: int, align_corners: bool) -> np.ndarray:
    """Normalised pixel-centre positions in [-1, 1] along one axis (0 for length 1)."""
    if length <= 1:
        return np.zeros(length)
    if align_corners:
        return np.linspace(-1.0, 1.0, length)
    return (2 * np.arange(length) + 1) / length - 1


@kernel("AffineGrid", 20)
def affine_grid(theta: np.ndarray, size: np.ndarray, *, align_corners: int = 0) -> np.ndarray:
    spatial = [int(s) for s in np.asarray(size).reshape(-1)[2:]]
    rank = len(spatial)
    if rank not in (2, 3) or theta.shape[1:] != (rank, rank + 1):
        raise ValueError(f"AffineGrid: theta of shape {theta.shape} does not fit size {list(np.asarray(size))}")
    # Homogeneous base coordinates, innermost axis first: (x, y[, z], 1).
    axes = [_base_grid_axis(n, bool(align_corners)) for n in spatial]
    mesh = np.meshgrid(*axes, indexing="ij")
    base = np.stack([*mesh[::-1], np.ones(spatial)], axis=-1).reshape(-1, rank + 1)
    compute = np.float64 if theta.dtype == np.float64 else np.float32
    grid = np.einsum("pk,nck->npc", base.astype(compute), theta.astype(compute, copy=False))
    return grid.reshape(theta.shape[0], *spatial, rank).astype(theta.dtype, copy=False)


# ---------------------------------------------------------------------------
# RoiAlign
# ---------------------------------------------------------------------------

_ROI_CHUNK_ELEMENTS = 1 << 24  # bound on the gathered taps per chunk of output bins


def _roi_axis_samples(
    start: np.ndarray, extent: np.ndarray, bins: int, grid: np.ndarray, length: int
) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps along one axis for every RoI, bin and sample point.

    Returns (index, weight), both shaped [R, bins, G, 2] for the low and high tap, where G
    is the largest sampling grid over the RoIs; samples past a RoI's own grid, and samples
    off the feature map, get weight 0.
    """
    most = int(max(grid.max(initial=0), 0))
    bin_size = extent / bins
    sample = np.arange(most, dtype=np.float64)
    pos = (
        start[:, None, None]
        + np.arange(bins)[None, :, None] * bin_size[:, None, None]
        + (sample[None, None, :] + 0.5) * (bin_size / np.maximum(grid, 1))[:, None, None]
    )
    outside = (pos < -1.0) | (pos > length)
    pos = np.maximum(pos, 0)
    low = np.floor(pos).astype(np.int64)
    at_edge = low >= length - 1
    low = np.where(at_edge, length - 1, low)
    high = np.where(at_edge, length - 1, low + 1)
    pos = np.where(at_edge, low, pos)
    frac = pos - low
    weight = np.stack([1 - frac, frac], axis=-1)
    unused = outside | (sample[None, :] >= grid[:, None])[:, None, :]
    weight = np.where(unused[..., None], 0.0, weight)
    return np.stack([low, high], axis=-1), weight


def _roi_align(
    x: np.ndarray,
    rois: np.ndarray,
    batch_indices: np.ndarray,
    *,
    half_pixel: bool,
    mode: str,
    output_height: int,
    output_width: int,
    sampling_ratio: int,
    spatial_scale: float,
) -> np.ndarray:
    if mode not in ("avg", "max"):
        raise ValueError(f"RoiAlign: unknown mode {mode!r}; expected avg or max")
    _, channels, height, width = x.shape
    count = rois.shape[0]
    if count == 0:
        return np.zeros((0, channels, output_height, output_width), dtype=x.dtype)
    compute = _compute_dtype(x.dtype)
    boxes = rois.astype(np.float64) * spatial_scale - (0.5 if half_pixel else 0.0)
    roi_w = boxes[:, 2] - boxes[:, 0]
    roi_h = boxes[:, 3] - boxes[:, 1]
    if not half_pixel:  # legacy: force malformed RoIs to 1x1
        roi_w = np.maximum(roi_w, 1.0)
        roi_h = np.maximum(roi_h, 1.0)
    if sampling_ratio > 0:
        grid_h = np.full(count, sampling_ratio)
        grid_w = np.full(count, sampling_ratio)
    else:
        grid_h = np.maximum(np.ceil(roi_h / output_height), 0).astype(np.int64)
        grid_w = np.maximum(np.ceil(roi_w / output_width), 0).astype(np.int64)
    y_index, y_weight = _roi_axis_samples(boxes[:, 1], roi_h, output_height, grid_h, height)
    x_index, x_weight = _roi_axis_samples(boxes[:, 0], roi_w, output_width, grid_w, width)
    if y_index.shape[2] == 0 or x_index.shape[2] == 0:  # no RoI has a sample point
        return np.zeros((count, channels, output_height, output_width), dtype=x.dtype)

    # Per output bin, every (y tap, x tap) pair of its sample grid: [R, PH, PW, T] with
    # T = GH * 2 * GW * 2, addressed as rows of the channels-last image.
    image = batch_indices.astype(np.int64).reshape(-1)
    rows = (image[:, None, None, None] * height + y_index)[:, :, None, :, :, None, None]
    flat_index = (rows * width + x_index[:, None, :, None, None, :, :]).reshape(count, output_height, output_width, -1)
    weight = (y_weight[:, :, None, :, :, None, None] * x_weight[:, None, :, None, None, :, :]).reshape(flat_index.shape)
    weight = weight.astype(compute)
    pixels = np.moveaxis(x, 1, -1).reshape(-1, channels).astype(compute, copy=False)
    if mode == "avg":
        weight /= np.maximum(grid_h * grid_w, 1).astype(compute)[:, None, None, None]
    else:
        # Taps of samples past a RoI's own grid repeat its first tap, which leaves the max
        # unchanged; RoIs with no samples at all give 0.
        used_y = np.arange(y_index.shape[2]) < grid_h[:, None]
        used_x = np.arange(x_index.shape[2]) < grid_w[:, None]
        used = used_y[:, None, None, :, None, None, None] & used_x[:, None, None, None, None, :, None]
        used = np.broadcast_to(used, (count, 1, 1, *y_index.shape[2:], *x_index.shape[2:])).reshape(count, 1, 1, -1)
        flat_index = np.where(used, flat_index, flat_index[..., :1])
        weight = np.where(used, weight, weight[..., :1])
        weight[grid_h * grid_w == 0] = 0

    # Work through the output bins in chunks so the gathered taps stay bounded in memory.
    taps = flat_index.shape[-1]
    flat_index = flat_index.reshape(-1, taps)
    weight = weight.reshape(-1, taps)
    pooled = np.empty((flat_index.shape[0], channels), dtype=compute)
    step = max(1, _ROI_CHUNK_ELEMENTS // max(taps * channels, 1))
    for lo in range(0, flat_index.shape[0], step):
        b = slice(lo, lo + step)
        values = np.take(pixels, flat_index[b], axis=0)  # bins, taps, channels
        if mode == "avg":
            pooled[b] = np.matmul(weight[b][:, None, :], values)[:, 0, :]
        else:
            # onnxruntime's (and the reference's) max mode: the max over samples of the
            # largest weighted corner, not of the interpolated value.
            values *= weight[b][..., None]
            pooled[b] = values.max(axis=1)
    out = np.moveaxis(pooled.reshape(count, output_height, output_width, channels), -1, 1)
    return out.astype(x.dtype, copy=False)


@kernel("RoiAlign", 10)
def roi_align_10(
    x: np.ndarray,
    rois: np.ndarray,
    batch_indices: np.ndarray,
    *,
    mode: str = "avg",
    output_height: int = 1,
    output_width: int = 1,
    sampling_ratio: int = 0,
    spatial_scale: float = 1.0,
) -> np.ndarray:
    return _roi_align(x, rois, batch_indices, half_pixel=False, mode=mode, output_height=output_height,
                      output_width=output_width, sampling_ratio=sampling_ratio, spatial_scale=spatial_scale)


@kernel("RoiAlign", 16)
def roi_align_16(
    x: np.ndarray,
    rois: np.ndarray,
    batch_indices: np.ndarray,
    *,
    coordinate_transformation_mode: str = "half_pixel",
    mode: str = "avg",
    output_height: int = 1,
    output_width: int = 1,
    sampling_ratio: int = 0,
    spatial_scale: float = 1.0,
) -> np.ndarray:
    if coordinate_transformation_mode not in ("half_pixel", "output_half_pixel"):
        raise ValueError(
            f"RoiAlign: unknown coordinate_transformation_mode {coordinate_transformation_mode!r}; "
            "expected half_pixel or output_half_pixel"
        )
    return _roi_align(x, rois, batch_indices, half_pixel=coordinate_transformation_mode == "half_pixel", mode=mode,
                      output_height=output_height, output_width=output_width, sampling_ratio=sampling_ratio,
                      spatial_scale=spatial_scale)


# ---------------------------------------------------------------------------
# NonMaxSuppression
# ---------------------------------------------------------------------------


def _box_corners(boxes: np.ndarray, center_point_box: int) -> tuple[np.ndarray, ...]:
    """(y_min, x_min, y_max, x_max) of every box, whatever corner order it was given in."""
    if center_point_box:
        xc, yc, w, h = (boxes[..., i] for i in range(4))
        return yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2
    y1, x1, y2, x2 = (boxes[..., i] for i in range(4))
    return np.minimum(y1, y2), np.minimum(x1, x2), np.maximum(y1, y2), np.maximum(x1, x2)


@kernel("NonMaxSuppression", 10, data_dependent=True)
def non_max_suppression(
    boxes: np.ndarray,
    scores: np.ndarray,
    max_output_boxes_per_class: np.ndarray | None = None,
    iou_threshold: np.ndarray | None = None,
    score_threshold: np.ndarray | None = None,
    *,
    center_point_box: int = 0,
) -> np.ndarray:
    limit = int(np.asarray(max_output_boxes_per_class).reshape(-1)[0]) if _present(max_output_boxes_per_class) else 0
    iou_limit = float(np.asarray(iou_threshold).reshape(-1)[0]) if _present(iou_threshold) else 0.0
    has_score_limit = _present(score_threshold)
    score_limit = np.asarray(score_threshold).reshape(-1)[0] if has_score_limit else None
    num_batches, num_classes = scores.shape[:2]
    if limit <= 0:
        return np.empty((0, 3), dtype=np.int64)
    y0, x0, y1, x1 = _box_corners(boxes, center_point_box)
    area = (y1 - y0) * (x1 - x0)
    selected: list[np.ndarray] = []
    # The greedy selection is sequential: loop over (batch, class) and over kept boxes,
    # each step comparing one box against all remaining candidates at once.
    for b in range(num_batches):
        for c in range(num_classes):
            class_scores = scores[b, c]
            order = np.argsort(-class_scores, kind="stable")  # ties: lower index first
            if has_score_limit:
                order = order[class_scores[order] > score_limit]
            kept: list[int] = []
            while order.size and len(kept) < limit:
                best, rest = order[0], order[1:]
                kept.append(int(best))
                inter_h = np.minimum(y1[b, best], y1[b, rest]) - np.maximum(y0[b, best], y0[b, rest])
                inter_w = np.minimum(x1[b, best], x1[b, rest]) - np.maximum(x0[b, best], x0[b, rest])
                overlap = (inter_h > 0) & (inter_w > 0)
                inter = np.where(overlap, inter_h * inter_w, 0)
                union = area[b, best] + area[b, rest] - inter
                valid = overlap & (area[b, best] > 0) & (area[b, rest] > 0) & (union > 0)
                with np.errstate(divide="ignore", invalid="ignore"):
                    suppressed = valid & (inter / np.where(union > 0, union, 1) > iou_limit)
                order = rest[~suppressed]
            if kept:
                rows = np.empty((len(kept), 3), dtype=np.int64)
                rows[:, 0], rows[:, 1], rows[:, 2] = b, c, kept
                selected.append(rows)
    return np.concatenate(selected) if selected else np.empty((0, 3), dtype=np.int64)


# ---------------------------------------------------------------------------
# ImageDecoder
# ---------------------------------------------------------------------------


def _to_grayscale(rgb: np.ndarray) -> np.ndarray:
    """ITU-R 601-2 luma in 16-bit fixed point, rounded: Pillow's convert('L')."""
    r, g, b = (rgb[..., i].astype(np.uint32) for i in range(3))
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).astype(np.uint8)[..., None]


def _decode_pnm(data: bytes) -> np.ndarray:
    """Binary PPM (P6) / PGM (P5) with 8-bit samples."""
    fields: list[bytes] = []
    pos = 2
    while len(fields) < 3:
        while data[pos : pos + 1].isspace():
            pos += 1
        if data[pos : pos + 1] == b"#":
            pos = data.index(b"\n", pos) + 1
            continue
        end = pos
        while not data[end : end + 1].isspace():
            end += 1
        fields.append(data[pos:end])
        pos = end
    width, height, maxval = (int(f) for f in fields)
    if maxval > 255:
        raise NotImplementedError("ImageDecoder: 16-bit PNM images are not supported")
    channels = 3 if data[:2] == b"P6" else 1
    pixels = np.frombuffer(data, dtype=np.uint8, count=width * height * channels, offset=pos + 1)
    image = pixels.reshape(height, width, channels)
    return np.repeat(image, 3, axis=2) if channels == 1 else image


def _decode_bmp(data: bytes) -> np.ndarray:
    """Uncompressed 24- or 32-bit BMP."""
    offset = struct.unpack_from("<I", data, 10)[0]
    width, height, _, bits, compression = struct.unpack_from("<iiHHI", data, 18)
    if compression not in (0, 3) or bits not in (24, 32):
        raise NotImplementedError(
            f"ImageDecoder: only uncompressed 24/32-bit BMP is supported (got {bits}-bit, compression {compression})"
        )
    step = bits // 8
    stride = (width * step + 3) & ~3
    rows = np.frombuffer(data, dtype=np.uint8, count=stride * abs(height), offset=offset).reshape(abs(height), stride)
    image = rows[:, : width * step].reshape(abs(height), width, step)[:, :, 2::-1]  # BGR(A) -> RGB
    return image[::-1] if height > 0 else image  # positive height: stored bottom-up


def _unfilter_png(raw: np.ndarray, height: int, row_bytes: int, bpp: int) -> np.ndarray:
    rows = raw.reshape(height, row_bytes + 1)
    out = np.zeros((height, row_bytes), dtype=np.uint8)
    prev = np.zeros(row_bytes, dtype=np.uint8)
    for y in range(height):  # rows depend on the row above
        kind, line = rows[y, 0], rows[y, 1:]
        if kind == 0:
            cur = line.copy()
        elif kind == 1:  # Sub: a running sum per channel, modulo 256
            cur = np.cumsum(line.reshape(-1, bpp), axis=0, dtype=np.uint8).reshape(-1)
        elif kind == 2:
            cur = line + prev
        elif kind in (3, 4):
            # Average and Paeth depend on the pixel just decoded to the left; no vectorised
            # form exists, so this loops over the pixels of the row (channels at once).
            cur = line.astype(np.int32)
            up = prev.astype(np.int32)
            left = np.zeros(bpp, dtype=np.int32)
            upleft = np.zeros(bpp, dtype=np.int32)
            for i in range(0, row_bytes, bpp):
                above = up[i : i + bpp]
                if kind == 3:
                    pred = (left + above) // 2
                else:
                    p = left + above - upleft
                    pa, pb, pc = np.abs(p - left), np.abs(p - above), np.abs(p - upleft)
                    pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, above, upleft))
                cur[i : i + bpp] = (cur[i : i + bpp] + pred) & 0xFF
                left, upleft = cur[i : i + bpp], above
            cur = cur.astype(np.uint8)
        else:
            raise ValueError(f"ImageDecoder: corrupt PNG (filter type {kind})")
        out[y] = prev = cur
    return out


def _decode_png(data: bytes) -> np.ndarray:
    """Non-interlaced 8-bit grayscale / RGB / RGBA / gray+alpha PNG."""
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, chunk = struct.unpack_from(">I4s", data, pos)
        body = data[pos + 8 : pos + 8 + length]
        if chunk == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif chunk == b"IDAT":
            idat.append(body)
        elif chunk == b"IEND":
            break
        pos += 12 + length
    if header is None:
        raise ValueError("ImageDecoder: corrupt PNG (no IHDR chunk)")
    width, height, depth, color, _, _, interlace = header
    channels = {0: 1, 2: 3, 4: 2, 6: 4}.get(color)
    if depth != 8 or channels is None or interlace:
        raise NotImplementedError(
            "ImageDecoder: only non-interlaced 8-bit grayscale/RGB(A) PNG is supported "
            f"(got bit depth {depth}, colour type {color}, interlace {interlace})"
        )
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8)
    image = _unfilter_png(raw, height, width * channels, channels).reshape(height, width, channels)
    if channels <= 2:
        return np.repeat(image[:, :, :1], 3, axis=2)
    return image[:, :, :3]


_TIFF_FIELD_FORMATS = {3: "H", 4: "I"}  # SHORT, LONG: the types baseline image tags use


def _decode_tiff(data: bytes) -> np.ndarray:
    """Uncompressed, chunky, 8-bit RGB(A) or grayscale baseline TIFF (first image only)."""
    order = "<" if data[:2] == b"II" else ">"
    ifd = struct.unpack_from(order + "I", data, 4)[0]
    fields: dict[int, list[int]] = {}
    for i in range(struct.unpack_from(order + "H", data, ifd)[0]):
        tag, kind, count = struct.unpack_from(order + "HHI", data, ifd + 2 + 12 * i)
        fmt = _TIFF_FIELD_FORMATS.get(kind)
        if fmt is None:
            continue
        size = struct.calcsize(fmt) * count
        where = ifd + 10 + 12 * i if size <= 4 else struct.unpack_from(order + "I", data, ifd + 10 + 12 * i)[0]
        fields[tag] = list(struct.unpack_from(f"{order}{count}{fmt}", data, where))
    width, height = fields[256][0], fields[257][0]
    bits = fields.get(258, [1])
    compression = fields.get(259, [1])[0]
    photometric = fields.get(262, [None])[0]
    channels = fields.get(277, [1])[0]
    planar = fields.get(284, [1])[0]
    if compression != 1 or set(bits) != {8} or planar != 1 or photometric not in (0, 1, 2):
        raise NotImplementedError(
            "ImageDecoder: only uncompressed, chunky, 8-bit grayscale/RGB TIFF is supported "
            f"(got compression {compression}, bits {bits}, planar {planar}, photometric {photometric})"
        )
    strips = b"".join(data[o : o + n] for o, n in zip(fields[273], fields[279]))
    image = np.frombuffer(strips, dtype=np.uint8, count=width * height * channels).reshape(height, width, channels)
    if photometric == 2:
        return image[:, :, :3]
    gray = image[:, :, :1] if photometric == 1 else 255 - image[:, :, :1]
    return np.repeat(gray, 3, axis=2)


_DECODERS = (
    (b"\x89PNG\r\n\x1a\n", _decode_png),
    (b"II*\x00", _decode_tiff),
    (b"MM\x00*", _decode_tiff),
    (b"BM", _decode_bmp),
    (b"P6", _decode_pnm),
    (b"P5", _decode_pnm),
)


def _codec_format(data: bytes) -> str | None:
    """The name of a format only a codec library decodes (JPEG, JPEG 2000, WebP), or None."""
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith((b"\x00\x00\x00\x0cjP  \r\n\x87\n", b"\xff\x4f\xff\x51")):
        return "JPEG 2000"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    return None


def _decode_with_pillow(data: bytes, format_name: str, pixel_format: str) -> np.ndarray:
    """Decode through Pillow (the ``image`` extra), as onnx.reference does; Grayscale is
    Pillow's own conversion of the decoded image."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise NotImplementedError(
            f"ImageDecoder: {format_name} images decode through Pillow, which is not installed; "
            "install it with: pip install Pillow (or, from the plugrt checkout, pip install '.[image]')"
        ) from exc
    try:
        with Image.open(io.BytesIO(data)) as image:
            converted = image.convert("L" if pixel_format == "Grayscale" else "RGB")
            pixels = np.asarray(converted, dtype=np.uint8)
    except (OSError, ValueError, SyntaxError) as exc:  # Pillow's errors for corrupt streams
        raise ValueError(f"ImageDecoder: corrupt {format_name} stream: {exc}") from exc
    if pixel_format == "Grayscale":
        return np.ascontiguousarray(pixels[..., None])
    return np.ascontiguousarray(pixels[:, :, ::-1]) if pixel_format == "BGR" else np.ascontiguousarray(pixels)


@kernel("ImageDecoder", 20)
def image_decoder(encoded_stream: np.ndarray, *, pixel_format: str = "RGB") -> np.ndarray:
    if pixel_format not in ("RGB", "BGR", "Grayscale"):
        raise ValueError(f"ImageDecoder: unknown pixel_format {pixel_format!r}; expected RGB, BGR or Grayscale")
    data = np.ascontiguousarray(encoded_stream, dtype=np.uint8).tobytes()
    for magic, decode in _DECODERS:
        if data.startswith(magic):
            rgb = decode(data)
            break
    else:
        format_name = _codec_format(data)
        if format_name is not None:
            return _decode_with_pillow(data, format_name, pixel_format)
        raise ValueError(
            "ImageDecoder: the stream is not a PNG, BMP, TIFF, PNM, JPEG, JPEG 2000 or WebP image "
            f"(it starts with {data[:12]!r})"
        )
    if pixel_format == "Grayscale":
        return _to_grayscale(rgb)
    return np.ascontiguousarray(rgb[:, :, ::-1]) if pixel_format == "BGR" else np.ascontiguousarray(rgb)
