"""Image kernels (Resize, Upsample, GridSample, AffineGrid, RoiAlign, NonMaxSuppression,
ImageDecoder), checked against onnx.reference and independently written numpy."""

from __future__ import annotations

import io
import struct
import sys
import zlib

import numpy as np
import pytest

from helpers import reference_node, run_node
from plugrt.errors import PlugrtError


def _random(*shape, dtype=np.float32, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _uniform(low: float, high: float, *shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(low, high, shape).astype(np.float32)


# --------------------------------------------------------------------------- Resize


@pytest.mark.parametrize(
    "attributes",
    [
        {"mode": "linear"},
        {"mode": "cubic"},
        {"mode": "cubic", "cubic_coeff_a": -0.5, "exclude_outside": 1},
        {"mode": "linear", "antialias": 1},
        {"mode": "cubic", "antialias": 1},
        {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
        {"mode": "nearest", "nearest_mode": "round_prefer_ceil", "coordinate_transformation_mode": "asymmetric"},
    ],
)
def test_resize_matches_reference_on_a_large_random_input(attributes):
    inputs = {"x": _random(2, 3, 17, 23), "roi": None, "scales": np.array([1, 1, 0.43, 1.7], np.float32)}
    got = run_node("Resize", inputs, 19, **attributes)[0]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, reference_node("Resize", inputs, 19, **attributes)[0], rtol=1e-5, atol=1e-5)


def test_resize_on_uint8_rounds_and_saturates_like_the_reference():
    image = np.random.default_rng(1).integers(0, 256, (1, 3, 9, 11), dtype=np.uint8)
    inputs = {"x": image, "roi": None, "scales": None, "sizes": np.array([1, 3, 14, 5], np.int64)}
    got = run_node("Resize", inputs, 19, mode="cubic")[0]  # cubic overshoots past 0 and 255
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, reference_node("Resize", inputs, 19, mode="cubic")[0])


def test_resize_nearest_keeps_integer_values_exactly():
    x = np.arange(2 * 5, dtype=np.int64).reshape(2, 5) * (1 << 40)
    got = run_node("Resize", {"x": x, "roi": None, "scales": np.array([1.0, 2.0], np.float32)}, 19, mode="nearest")[0]
    np.testing.assert_array_equal(got, np.repeat(x, 2, axis=1))


def test_resize_with_axes_and_keep_aspect_ratio_resizes_only_those_axes():
    inputs = {"x": _random(2, 4, 6, 3), "roi": None, "scales": None, "sizes": np.array([3, 9], np.int64)}
    attributes = {"mode": "linear", "axes": [1, 2], "keep_aspect_ratio_policy": "not_larger"}
    got = run_node("Resize", inputs, 19, **attributes)[0]
    assert got.shape == (2, 3, 5, 3)  # scale min(3/4, 9/6) = 0.75; 6 * 0.75 rounds half up
    np.testing.assert_allclose(got, reference_node("Resize", inputs, 19, **attributes)[0], rtol=1e-5, atol=1e-6)


def test_resize_10_nearest_rounds_down_upsampling_and_up_downsampling():
    # Resize-10 has no nearest_mode: asymmetric coordinates, floor when upsampling and
    # ceil when downsampling (onnxruntime's rule for the legacy op).
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    down = run_node("Resize", {"x": x, "scales": np.array([1, 0.6], np.float32)}, 10, mode="nearest")[0]
    source = np.ceil(np.arange(4) / np.float32(0.6)).clip(0, 7)
    np.testing.assert_array_equal(down, x[:, source.astype(int)])
    up = run_node("Resize", {"x": x, "scales": np.array([1, 1.5], np.float32)}, 10, mode="nearest")[0]
    np.testing.assert_array_equal(up, x[:, np.floor(np.arange(12) / 1.5).astype(int)])


def test_resize_10_linear_uses_asymmetric_coordinates():
    x = np.array([[0.0, 10.0, 20.0]], np.float32)
    got = run_node("Resize", {"x": x, "scales": np.array([1, 2], np.float32)}, 10, mode="linear")[0]
    np.testing.assert_allclose(got, [[0, 5, 10, 15, 20, 20]])


@pytest.mark.parametrize("opset", [7, 9])
def test_upsample_repeats_pixels_for_integer_scales(opset):
    x = _random(1, 2, 3, 4)
    scales = [1.0, 1.0, 2.0, 3.0]
    inputs = {"x": x} if opset == 7 else {"x": x, "scales": np.array(scales, np.float32)}
    attributes = {"scales": scales} if opset == 7 else {}
    got = run_node("Upsample", inputs, opset, mode="nearest", **attributes)[0]
    np.testing.assert_array_equal(got, np.repeat(np.repeat(x, 2, axis=2), 3, axis=3))


def test_resize_tf_half_pixel_for_nn_is_valid_before_opset_18_only():
    inputs = {"x": _random(1, 4), "roi": None, "scales": np.array([1, 2], np.float32)}
    got = run_node("Resize", inputs, 13, coordinate_transformation_mode="tf_half_pixel_for_nn")[0]
    # x_original = (i + 0.5) / 2, rounded half down
    np.testing.assert_array_equal(got, inputs["x"][:, np.ceil((np.arange(8) + 0.5) / 2 - 0.5).astype(int).clip(0, 3)])
    with pytest.raises(Exception, match="tf_half_pixel_for_nn"):
        run_node("Resize", inputs, 18, coordinate_transformation_mode="tf_half_pixel_for_nn")[0]


def test_resize_rejects_both_scales_and_sizes():
    inputs = {
        "x": _random(1, 4),
        "roi": None,
        "scales": np.array([1, 2], np.float32),
        "sizes": np.array([1, 8], np.int64),
    }
    with pytest.raises(Exception, match="only one of 'scales' and 'sizes'"):
        run_node("Resize", inputs, 19)[0]


# --------------------------------------------------------------------------- GridSample / AffineGrid


@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [0, 1])
def test_grid_sample_matches_reference_including_out_of_range_points(mode, padding_mode, align_corners):
    inputs = {"x": _random(2, 2, 4, 5), "grid": _uniform(-1.6, 1.6, 2, 3, 4, 2, seed=3)}
    attributes = {"mode": mode, "padding_mode": padding_mode, "align_corners": align_corners}
    expected = reference_node("GridSample", inputs, 20, **attributes)[0]
    np.testing.assert_allclose(run_node("GridSample", inputs, 20, **attributes)[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_grid_sample_volumetric_matches_reference(mode):
    inputs = {"x": _random(1, 2, 3, 4, 5), "grid": _uniform(-1.2, 1.2, 1, 2, 3, 2, 3, seed=4)}
    expected = reference_node("GridSample", inputs, 20, mode=mode, padding_mode="border")[0]
    got = run_node("GridSample", inputs, 20, mode=mode, padding_mode="border")[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("old_name", "new_name"), [("bilinear", "linear"), ("bicubic", "cubic"), ("nearest", "nearest")]
)
def test_grid_sample_16_mode_names_mean_the_opset_20_modes(old_name, new_name):
    inputs = {"x": _random(1, 3, 5, 6), "grid": _uniform(-1, 1, 1, 4, 4, 2, seed=5)}
    np.testing.assert_array_equal(
        run_node("GridSample", inputs, 16, mode=old_name)[0], run_node("GridSample", inputs, 20, mode=new_name)[0]
    )


def test_grid_sample_keeps_float64():
    inputs = {"x": _random(1, 1, 3, 3, dtype=np.float64), "grid": np.zeros((1, 1, 1, 2))}
    got = run_node("GridSample", inputs, 20)[0]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got.reshape(()), inputs["x"][0, 0, 1, 1])  # (0, 0) is the centre pixel


def test_grid_sample_reflection_on_a_single_pixel_axis_stays_on_it():
    x = np.array([[[[4.0, 8.0]]]], np.float32)  # H = 1
    grid = np.array([[[[-1.0, 3.0], [1.0, -5.0]]]], np.float32)
    got = run_node("GridSample", {"x": x, "grid": grid}, 20, padding_mode="reflection", align_corners=1)[0]
    np.testing.assert_allclose(got, [[[[4.0, 8.0]]]])


@pytest.mark.parametrize("align_corners", [0, 1])
def test_affine_grid_2d_is_theta_applied_to_pixel_centres(align_corners):
    theta = _random(2, 2, 3)
    height, width = 3, 4
    size = np.array([2, 1, height, width], np.int64)
    got = run_node("AffineGrid", {"theta": theta, "size": size}, 20, align_corners=align_corners)[0]

    def centres(n):
        return np.linspace(-1, 1, n) if align_corners else (np.arange(n) * 2 + 1) / n - 1

    ys, xs = np.meshgrid(centres(height), centres(width), indexing="ij")
    base = np.stack([xs, ys, np.ones_like(xs)], axis=-1)
    np.testing.assert_allclose(got, np.einsum("hwk,nck->nhwc", base, theta), rtol=1e-5, atol=1e-6)


def test_affine_grid_3d_matches_reference():
    inputs = {"theta": _random(2, 3, 4), "size": np.array([2, 1, 2, 3, 4], np.int64)}
    expected = reference_node("AffineGrid", inputs, 20)[0]
    np.testing.assert_allclose(run_node("AffineGrid", inputs, 20)[0], expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- RoiAlign


def _roi_inputs(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    start = rng.uniform(-2, 9, (5, 2))
    rois = np.concatenate([start, start + rng.uniform(0.5, 8, (5, 2))], axis=1).astype(np.float32)
    return {"x": _random(2, 3, 8, 10, seed=seed), "rois": rois, "batch_indices": rng.integers(0, 2, 5)}


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("coordinate_transformation_mode", ["half_pixel", "output_half_pixel"])
@pytest.mark.parametrize("sampling_ratio", [0, 2])
def test_roi_align_matches_reference(mode, coordinate_transformation_mode, sampling_ratio):
    attributes = {
        "mode": mode,
        "coordinate_transformation_mode": coordinate_transformation_mode,
        "sampling_ratio": sampling_ratio,
        "output_height": 2,
        "output_width": 3,
        "spatial_scale": 0.8,
    }
    inputs = _roi_inputs()
    expected = reference_node("RoiAlign", inputs, 16, **attributes)[0]
    np.testing.assert_allclose(run_node("RoiAlign", inputs, 16, **attributes)[0], expected, rtol=1e-5, atol=1e-5)


def test_roi_align_10_has_no_half_pixel_shift():
    inputs = _roi_inputs(seed=1)
    size = {"output_height": 2, "output_width": 2}
    unshifted = run_node("RoiAlign", inputs, 16, coordinate_transformation_mode="output_half_pixel", **size)[0]
    np.testing.assert_array_equal(run_node("RoiAlign", inputs, 10, **size)[0], unshifted)


def test_roi_align_averages_a_constant_image_to_that_constant():
    # A RoI so large that its adaptive sampling grid is 60x60 per output bin.
    x = np.full((1, 2, 130, 130), 3.0, np.float32)
    inputs = {"x": x, "rois": np.array([[1, 1, 121, 121]], np.float32), "batch_indices": np.array([0])}
    got = run_node("RoiAlign", inputs, 16, output_height=2, output_width=2)[0]
    np.testing.assert_allclose(got, 3.0, rtol=1e-6)


# --------------------------------------------------------------------------- NonMaxSuppression


@pytest.mark.parametrize("center_point_box", [0, 1])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_non_max_suppression_matches_reference(center_point_box, seed):
    rng = np.random.default_rng(seed)
    inputs = {
        "boxes": np.round(rng.uniform(0, 10, (2, 40, 4))).astype(np.float32),  # ties and empty boxes
        "scores": np.round(rng.random((2, 3, 40)), 1).astype(np.float32),  # tied scores
        "max_output_boxes_per_class": np.array([6], np.int64),
        "iou_threshold": np.array([0.3], np.float32),
        "score_threshold": np.array([0.2], np.float32),
    }
    expected = reference_node("NonMaxSuppression", inputs, 11, center_point_box=center_point_box)[0]
    np.testing.assert_array_equal(run_node("NonMaxSuppression", inputs, 11, center_point_box=center_point_box)[0], expected)


def test_non_max_suppression_selects_nothing_without_max_output_boxes():
    inputs = {"boxes": np.array([[[0, 0, 1, 1]]], np.float32), "scores": np.array([[[0.9]]], np.float32)}
    got = run_node("NonMaxSuppression", inputs, 11)[0]
    assert got.shape == (0, 3) and got.dtype == np.int64


# --------------------------------------------------------------------------- ImageDecoder


def _png(image: np.ndarray, filters: list[int]) -> bytes:
    """Encode an 8-bit RGB image as PNG with the given filter type on each row."""
    height, width, bpp = image.shape
    raw = image.reshape(height, width * bpp).astype(np.int32)
    up = np.vstack([np.zeros((1, raw.shape[1]), np.int32), raw[:-1]])
    left = np.hstack([np.zeros((height, bpp), np.int32), raw[:, :-bpp]])
    upleft = np.hstack([np.zeros((height, bpp), np.int32), up[:, :-bpp]])
    p = left + up - upleft
    pa, pb, pc = np.abs(p - left), np.abs(p - up), np.abs(p - upleft)
    paeth = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, upleft))
    predictors = [np.zeros_like(raw), left, up, (left + up) // 2, paeth]
    filtered = [((raw[y] - predictors[kind][y]) % 256).astype(np.uint8) for y, kind in enumerate(filters)]
    body = b"".join(bytes([kind]) + row.tobytes() for kind, row in zip(filters, filtered))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(body)) + chunk(b"IEND", b"")


def _decode(data: bytes, pixel_format: str = "RGB") -> np.ndarray:
    return run_node("ImageDecoder", {"encoded": np.frombuffer(data, np.uint8)}, 20, pixel_format=pixel_format)[0]


IMAGE = np.random.default_rng(7).integers(0, 256, (5, 6, 3), dtype=np.uint8)


def test_image_decoder_reads_png_with_every_filter_type():
    np.testing.assert_array_equal(_decode(_png(IMAGE, [0, 1, 2, 3, 4])), IMAGE)


def test_image_decoder_bgr_and_grayscale_from_png():
    data = _png(IMAGE, [4, 3, 2, 1, 0])
    np.testing.assert_array_equal(_decode(data, "BGR"), IMAGE[:, :, ::-1])
    gray = _decode(data, "Grayscale")
    assert gray.shape == (5, 6, 1)
    luma = IMAGE.astype(np.float64) @ np.array([0.299, 0.587, 0.114])
    np.testing.assert_allclose(gray[:, :, 0], np.round(luma), atol=1)


def test_image_decoder_reads_bottom_up_bmp_with_row_padding():
    height, width = IMAGE.shape[:2]
    stride = (width * 3 + 3) & ~3
    rows = b"".join(IMAGE[y, :, ::-1].tobytes().ljust(stride, b"\0") for y in range(height - 1, -1, -1))
    header = struct.pack("<2sIHHI", b"BM", 54 + len(rows), 0, 0, 54)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, len(rows), 0, 0, 0, 0)
    np.testing.assert_array_equal(_decode(header + info + rows), IMAGE)


def test_image_decoder_reads_binary_pgm_as_gray_rgb():
    gray = IMAGE[:, :, 0]
    data = b"P5\n# comment\n6 5\n255\n" + gray.tobytes()
    np.testing.assert_array_equal(_decode(data), np.repeat(gray[:, :, None], 3, axis=2))


def _encoded_with_pillow(image: np.ndarray, format_name: str, **options) -> bytes:
    pil = pytest.importorskip("PIL.Image")
    buffer = io.BytesIO()
    pil.fromarray(image).save(buffer, format=format_name, **options)
    return buffer.getvalue()


@pytest.mark.parametrize(("format_name", "options"), [("JPEG", {"quality": 90}), ("WEBP", {"lossless": True}),
                                                      ("JPEG2000", {})])
@pytest.mark.parametrize("pixel_format", ["RGB", "BGR", "Grayscale"])
def test_image_decoder_decodes_codec_formats_through_pillow_like_the_reference(format_name, options, pixel_format):
    image = np.random.default_rng(3).integers(0, 256, (9, 11, 3), dtype=np.uint8)
    encoded = np.frombuffer(_encoded_with_pillow(image, format_name, **options), np.uint8)
    got = run_node("ImageDecoder", {"encoded": encoded}, 20, pixel_format=pixel_format)[0]
    expected = reference_node("ImageDecoder", {"encoded": encoded}, 20, pixel_format=pixel_format)[0]
    assert got.dtype == np.uint8 and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def test_lossless_webp_decodes_to_the_original_pixels():
    image = np.random.default_rng(4).integers(0, 256, (6, 5, 3), dtype=np.uint8)
    np.testing.assert_array_equal(_decode(_encoded_with_pillow(image, "WEBP", lossless=True)), image)


def test_image_decoder_without_pillow_names_the_package_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)  # makes `import PIL` fail
    with pytest.raises(PlugrtError, match=r"pip install Pillow \(or, from the plugrt checkout, pip install '\.\[image\]'\)") as error:
        _decode(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(20))
    assert isinstance(error.value.__cause__, NotImplementedError)


def test_image_decoder_rejects_a_stream_of_no_known_format():
    with pytest.raises(PlugrtError, match="not a PNG, BMP, TIFF, PNM, JPEG, JPEG 2000 or WebP"):
        _decode(b"GIF89a" + bytes(20))


def test_image_decoder_reports_a_corrupt_jpeg_as_such():
    pytest.importorskip("PIL")
    with pytest.raises(PlugrtError, match="corrupt JPEG"):
        _decode(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(20))
