"""Signal kernels (DFT, STFT, windows, MelWeightMatrix), checked against explicit DFT
matrices, textbook window formulas and onnx.reference."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from helpers import reference_node, run_node


def _dft_matrix(n_out: int, n_in: int, inverse: bool = False) -> np.ndarray:
    """exp(-+2 pi i k n / N) with N = n_in, rows k < n_out (the unnormalised transform)."""
    sign = 1 if inverse else -1
    k = np.arange(n_out)[:, None]
    n = np.arange(n_in)[None, :]
    length = max(n_in, 1)
    return np.exp(sign * 2j * np.pi * k * n / length)


def _explicit_dft(signal: np.ndarray, axis: int, length: int, inverse: bool = False) -> np.ndarray:
    """The DFT of a complex signal along ``axis`` after zero-padding / trimming to ``length``."""
    moved = np.moveaxis(signal, axis, -1)
    fitted = np.zeros(moved.shape[:-1] + (length,), dtype=np.complex128)
    keep = min(length, moved.shape[-1])
    fitted[..., :keep] = moved[..., :keep]
    result = fitted @ _dft_matrix(length, length, inverse).T
    if inverse:
        result /= length
    return np.moveaxis(result, -1, axis)


def _as_pairs(values: np.ndarray) -> np.ndarray:
    return np.stack([values.real, values.imag], axis=-1)


def _random(shape, seed=0, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("axis", [0, 1, 2, -2, -3])
@pytest.mark.parametrize("length", [None, 4, 9])
def test_complex_dft_matches_the_dft_matrix_on_any_axis(axis, length):
    x = _random((3, 6, 7, 2), seed=1)
    signal = x[..., 0] + 1j * x[..., 1]
    dft_length = None if length is None else np.array(length, dtype=np.int64)
    got = run_node("DFT", {"x": x, "dft_length": dft_length, "axis": np.array(axis, dtype=np.int64)}, 20)[0]
    expected = _explicit_dft(signal, axis % 4, length or x.shape[axis % 4])
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, _as_pairs(expected), rtol=1e-4, atol=1e-4)


def test_opset17_dft_reads_axis_from_the_attribute():
    x = _random((2, 5, 3, 1), seed=2)
    got = run_node("DFT", {"x": x}, 17, axis=2)[0]
    expected = _explicit_dft(x[..., 0].astype(np.complex128), 2, 3)
    np.testing.assert_allclose(got, _as_pairs(expected), rtol=1e-5, atol=1e-5)


def test_opset17_dft_defaults_to_axis_one():
    x = _random((2, 5, 3, 1), seed=3)
    got = run_node("DFT", {"x": x}, 17)[0]
    np.testing.assert_allclose(got, _as_pairs(_explicit_dft(x[..., 0], 1, 5)), rtol=1e-5, atol=1e-5)


def test_onesided_real_dft_keeps_the_non_redundant_bins():
    x = _random((2, 10, 1), seed=4)
    got = run_node("DFT", {"x": x}, 20, onesided=1)[0]
    full = _explicit_dft(x[..., 0], 1, 10)
    assert got.shape == (2, 6, 2)
    np.testing.assert_allclose(got, _as_pairs(full[:, :6]), rtol=1e-5, atol=1e-5)


def test_inverse_dft_is_normalised_by_the_length():
    x = _random((4, 8, 2), seed=5)
    signal = x[..., 0] + 1j * x[..., 1]
    got = run_node("DFT", {"x": x}, 20, inverse=1)[0]
    np.testing.assert_allclose(got, _as_pairs(_explicit_dft(signal, 1, 8, inverse=True)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", [None, 9])
def test_inverse_onesided_dft_restores_a_real_signal(length):
    signal = _random((3, 10), seed=6)
    n = length or 10
    spectrum = _explicit_dft(signal, 1, n)[:, : n // 2 + 1]
    x = _as_pairs(spectrum).astype(np.float32)
    dft_length = None if length is None else np.array(length, dtype=np.int64)
    got = run_node("DFT", {"x": x, "dft_length": dft_length}, 20, inverse=1, onesided=1)[0]
    assert got.shape == (3, n, 1)
    np.testing.assert_allclose(got[..., 0], signal[:, :n], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_dft_keeps_the_input_dtype(dtype):
    x = _random((2, 8, 1), seed=7, dtype=dtype)
    got = run_node("DFT", {"x": x}, 20)[0]
    assert got.dtype == dtype
    expected = _as_pairs(_explicit_dft(x[..., 0].astype(np.float64), 1, 8))
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=1e-2 if dtype == np.float16 else 1e-10, atol=1e-2 if dtype == np.float16 else 1e-10)


def test_dft_rejects_the_complex_axis():
    x = _random((2, 8, 1), seed=8)
    with pytest.raises(Exception, match="axis"):
        run_node("DFT", {"x": x, "dft_length": None, "axis": np.array(-1, dtype=np.int64)}, 20)[0]


def _explicit_stft(signal: np.ndarray, step: int, window: np.ndarray, onesided: bool) -> np.ndarray:
    length = window.shape[0]
    frames = 1 + (signal.shape[1] - length) // step
    starts = np.arange(frames) * step
    framed = signal[:, starts[:, None] + np.arange(length)] * window  # (batch, frames, length)
    spectrum = framed @ _dft_matrix(length, length).T
    if onesided:
        spectrum = spectrum[..., : length // 2 + 1]
    return _as_pairs(spectrum)


@pytest.mark.parametrize("onesided", [0, 1])
def test_stft_of_a_real_signal_matches_framed_dfts(onesided):
    x = _random((2, 64, 1), seed=9)
    window = np.hanning(16).astype(np.float32)
    got = run_node("STFT", {"x": x, "step": np.array(5, dtype=np.int64), "window": window}, 17, onesided=onesided)[0]
    np.testing.assert_allclose(got, _explicit_stft(x[..., 0], 5, window, bool(onesided)), rtol=1e-4, atol=1e-4)


def test_stft_of_a_complex_signal_uses_the_full_spectrum():
    x = _random((1, 40, 2), seed=10)
    signal = x[..., 0] + 1j * x[..., 1]
    length = np.array(8, dtype=np.int64)
    got = run_node("STFT", {"x": x, "step": np.array(4, dtype=np.int64), "window": None, "frame_length": length}, 17, onesided=0)[0]
    np.testing.assert_allclose(got, _explicit_stft(signal, 4, np.ones(8), False), rtol=1e-4, atol=1e-4)


def test_stft_rejects_a_window_that_disagrees_with_frame_length():
    x = _random((1, 40, 1), seed=11)
    inputs = {"x": x, "step": np.array(4, dtype=np.int64), "window": np.ones(6, np.float32), "frame_length": np.array(8, dtype=np.int64)}
    with pytest.raises(Exception, match="frame_length"):
        run_node("STFT", inputs, 17)[0]


def _cosine_sum(size: int, periodic: bool, coefficients) -> np.ndarray:
    period = size if periodic else size - 1
    n = np.arange(size)
    return sum((-1) ** k * a * np.cos(2 * np.pi * k * n / period) for k, a in enumerate(coefficients))


@pytest.mark.parametrize(
    ("op", "coefficients"),
    [("HannWindow", (0.5, 0.5)), ("HammingWindow", (25 / 46, 21 / 46)), ("BlackmanWindow", (0.42, 0.5, 0.08))],
)
@pytest.mark.parametrize("periodic", [0, 1])
def test_windows_follow_their_cosine_sums(op, coefficients, periodic):
    got = run_node(op, {"size": np.array(33, dtype=np.int64)}, 17, periodic=periodic)[0]
    assert got.dtype == np.float32 and got.shape == (33,)
    np.testing.assert_allclose(got, _cosine_sum(33, bool(periodic), coefficients), rtol=1e-6, atol=1e-6)


def test_symmetric_hann_matches_numpy():
    got = run_node("HannWindow", {"size": np.array(20, dtype=np.int32)}, 17, periodic=0)[0]
    np.testing.assert_allclose(got, np.hanning(20), rtol=1e-6, atol=1e-6)


def test_window_honours_output_datatype():
    got = run_node("BlackmanWindow", {"size": np.array(10, dtype=np.int64)}, 17, output_datatype=onnx.TensorProto.DOUBLE)[0]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, np.blackman(11)[:-1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("bins", "dft_length", "rate", "low", "high"),
    [(8, 256, 16000, 0.0, 8000.0), (20, 512, 22050, 100.0, 9000.0), (40, 1024, 44100, 0.0, 22050.0)],
)
def test_mel_weight_matrix_matches_onnx_reference(bins, dft_length, rate, low, high):
    inputs = {
        "bins": np.array(bins, dtype=np.int64),
        "length": np.array(dft_length, dtype=np.int64),
        "rate": np.array(rate, dtype=np.int64),
        "low": np.array(low, dtype=np.float32),
        "high": np.array(high, dtype=np.float32),
    }
    got = run_node("MelWeightMatrix", inputs, 17)[0]
    expected = reference_node("MelWeightMatrix", inputs, 17)[0]
    assert got.shape == (dft_length // 2 + 1, bins) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
