"""Signal kernels: DFT, STFT, window functions, MelWeightMatrix."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .._dtypes import numpy_dtype
from .._registry import kernel

_FLOAT = 1  # TensorProto.FLOAT, the default output_datatype


def _fft_dtype(dtype: np.dtype) -> np.dtype:
    """np.fft works in float32/float64; narrower floats go through float32."""
    return dtype if dtype in (np.float32, np.float64) else np.dtype(np.float32)


def _as_signal(x: np.ndarray) -> tuple[np.ndarray, bool]:
    """Split the trailing [1] (real) or [2] (real, imaginary) axis: (signal, is_complex)."""
    work = x.astype(_fft_dtype(x.dtype), copy=False)
    if x.shape[-1] == 1:
        return work[..., 0], False
    if x.shape[-1] == 2:
        complex_dtype = np.result_type(work.dtype, np.complex64)
        return np.ascontiguousarray(work).view(complex_dtype)[..., 0], True
    raise ValueError(f"the last dimension must be 1 (real) or 2 (complex), got {x.shape[-1]}")


def _as_output(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Complex values as a trailing [2] axis (real values as [1]) in ``dtype``."""
    if np.iscomplexobj(values):
        values = np.stack([values.real, values.imag], axis=-1)
    else:
        values = values[..., None]
    return values.astype(dtype, copy=False)


def _scalar(value, name: str) -> int:
    array = np.asarray(value)
    if array.size != 1:
        raise ValueError(f"{name} must be a scalar, got shape {array.shape}")
    return int(array.reshape(()))


def _dft(x: np.ndarray, dft_length, axis: int, inverse: int, onesided: int) -> np.ndarray:
    rank = x.ndim
    if not (-rank <= axis <= rank - 2) or axis == -1:
        raise ValueError(f"DFT axis {axis} is out of range for rank {rank}: the last axis holds real/imaginary parts")
    axis %= rank
    signal, is_complex = _as_signal(x)
    if dft_length is None:
        length = 2 * (x.shape[axis] - 1) if inverse and onesided else x.shape[axis]
    else:
        length = _scalar(dft_length, "dft_length")
    if length < 1:
        raise ValueError(f"dft_length must be positive, got {length}")
    result: np.ndarray
    if inverse and onesided:
        result = np.fft.irfft(signal, n=length, axis=axis)
    elif inverse:
        result = np.fft.ifft(signal, n=length, axis=axis)
    elif onesided and not is_complex:
        result = np.fft.rfft(signal, n=length, axis=axis)
    else:
        result = np.fft.fft(signal, n=length, axis=axis)
        if onesided:
            result = np.take(result, np.arange(length // 2 + 1), axis=axis)
    return _as_output(result, x.dtype)


@kernel("DFT", 17)
def dft_17(x, dft_length=None, *, axis=1, inverse=0, onesided=0):
    return _dft(x, dft_length, axis, inverse, onesided)


@kernel("DFT", 20)
def dft_20(x, dft_length=None, axis=None, *, inverse=0, onesided=0):
    return _dft(x, dft_length, -2 if axis is None else _scalar(axis, "axis"), inverse, onesided)


@kernel("STFT", 17)
def stft(signal, frame_step, window=None, frame_length=None, *, onesided=1):
    if signal.ndim != 3:
        raise ValueError(f"STFT expects a signal of rank 3 [batch, length, 1 or 2], got rank {signal.ndim}")
    values, is_complex = _as_signal(signal)
    step = _scalar(frame_step, "frame_step")
    if frame_length is not None:
        length = _scalar(frame_length, "frame_length")
        if window is not None and window.shape[0] != length:
            raise ValueError(f"window has {window.shape[0]} entries but frame_length is {length}")
    else:
        length = values.shape[1] if window is None else window.shape[0]
    if step < 1 or not 1 <= length <= values.shape[1]:
        raise ValueError(f"invalid STFT framing: frame_step={step}, frame_length={length}, signal length {values.shape[1]}")
    frames = sliding_window_view(values, length, axis=1)[:, ::step]  # [batch, frames, length]
    if window is not None:
        frames = frames * window.astype(values.real.dtype, copy=False)
    if onesided and not is_complex:
        result = np.fft.rfft(frames, axis=-1)
    else:
        result = np.fft.fft(frames, axis=-1)
        if onesided:
            result = result[..., : length // 2 + 1]
    return _as_output(result, signal.dtype)


def _window_positions(size, periodic: int) -> tuple[np.ndarray, int]:
    """Sample indices 0..size-1 and the period: size when periodic, else size - 1."""
    n = _scalar(size, "size")
    if n < 0:
        raise ValueError(f"window size must be non-negative, got {n}")
    return np.arange(n, dtype=np.float64), n if periodic else n - 1


def _cosine_window(size, periodic: int, output_datatype: int, coefficients: tuple[float, ...]) -> np.ndarray:
    """sum_k (-1)^k a_k cos(2 pi k n / N): the Hann, Hamming and Blackman family."""
    positions, period = _window_positions(size, periodic)
    if period == 0:  # a symmetric window of one sample is its peak
        values = np.ones_like(positions)
    else:
        phase = positions * (2 * np.pi / period)
        values = np.zeros_like(positions)
        for k, a in enumerate(coefficients):
            values += (-1) ** k * a * np.cos(k * phase)
    return values.astype(numpy_dtype(output_datatype))


@kernel("HannWindow", 17)
def hann_window(size, *, output_datatype=_FLOAT, periodic=1):
    return _cosine_window(size, periodic, output_datatype, (0.5, 0.5))


@kernel("HammingWindow", 17)
def hamming_window(size, *, output_datatype=_FLOAT, periodic=1):
    alpha = 25.0 / 46.0
    return _cosine_window(size, periodic, output_datatype, (alpha, 1 - alpha))


@kernel("BlackmanWindow", 17)
def blackman_window(size, *, output_datatype=_FLOAT, periodic=1):
    return _cosine_window(size, periodic, output_datatype, (0.42, 0.5, 0.08))


@kernel("MelWeightMatrix", 17)
def mel_weight_matrix(num_mel_bins, dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz, *, output_datatype=_FLOAT):
    mel_bins = _scalar(num_mel_bins, "num_mel_bins")
    length = _scalar(dft_length, "dft_length")
    rate = _scalar(sample_rate, "sample_rate")
    num_spectrogram_bins = length // 2 + 1
    # The band edges follow onnx.reference's arithmetic step by step (including the
    # inputs' own precision), because they are floored to integer bins afterwards.
    low_mel = 2595 * np.log1p(lower_edge_hertz / 700) / np.log(10)
    high_mel = 2595 * np.log1p(upper_edge_hertz / 700) / np.log(10)
    edges = np.arange(0, mel_bins + 2)
    mel_step = (high_mel - low_mel) / edges.shape[0]
    hertz = 700 * np.expm1((edges * mel_step + low_mel) / 2595 * np.log(10))
    edges = (((length + 1) * hertz) // rate).astype(np.int64)
    left, center, right = edges[:-2], edges[1:-1], edges[2:]
    bins = np.arange(num_spectrogram_bins)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        rising = (bins - left) / (center - left)
        falling = (right - bins) / (right - center)
    weights = np.where((bins >= left) & (bins < center), rising, 0.0)
    weights = np.where((bins > center) & (bins < right), falling, weights)
    weights = np.where(bins == center, 1.0, weights)
    return weights.astype(numpy_dtype(output_datatype))
