"""Normalisation kernels (batch, instance, layer, group, RMS, Lp, mean-variance), checked
against onnx.reference and independently written numpy."""

from __future__ import annotations

import numpy as np
import pytest
from onnx.reference import ReferenceEvaluator

import plugrt
from helpers import run_model, text_model


def _random(*shape, dtype=np.float32, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _vector_text(name: str, array: np.ndarray) -> str:
    """A float initializer in ONNX text, so the kernel sees the input as a constant."""
    return f"float[{array.size}] {name} = {{{', '.join(repr(float(v)) for v in array)}}}"


def _batch_norm_numpy(x, scale, bias, mean, var, epsilon):
    shape = (-1,) + (1,) * (x.ndim - 2)
    x64 = x.astype(np.float64)
    normalized = (x64 - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + epsilon)
    return normalized * scale.reshape(shape) + bias.reshape(shape)


BATCH_NORM_INPUTS = {
    "x": _random(2, 3, 4, 5),
    "s": _random(3, seed=1),
    "b": _random(3, seed=2),
    "m": _random(3, seed=3),
    "v": np.abs(_random(3, seed=4)) + 0.5,
}
BATCH_NORM_SIGNATURE = "float[2,3,4,5] x, float[3] s, float[3] b, float[3] m, float[3] v"


@pytest.mark.parametrize("opset", [6, 7, 9, 14, 15])
@pytest.mark.parametrize("constant_statistics", [False, True])
def test_batch_normalization_inference(opset, constant_statistics):
    feeds = dict(BATCH_NORM_INPUTS)
    is_test = ", is_test=1" if opset < 7 else ""
    if constant_statistics:
        constants = ", ".join(_vector_text(name, feeds.pop(name)) for name in "sbmv")
        graph = f"g (float[2,3,4,5] x) => (y) <{constants}>"
    else:
        graph = f"g ({BATCH_NORM_SIGNATURE}) => (y)"
    model = text_model(f'<ir_version: 8, opset_import: ["" : {opset}]> {graph}'
        f" {{ y = BatchNormalization<epsilon=0.01{is_test}>(x, s, b, m, v) }}", check=False)
    (got,) = run_model(model, feeds)
    inputs = BATCH_NORM_INPUTS
    expected = _batch_norm_numpy(inputs["x"], inputs["s"], inputs["b"], inputs["m"], inputs["v"], 0.01)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opset", [14, 15])
def test_batch_normalization_training_mode_matches_reference(opset):
    model = text_model(f'<ir_version: 8, opset_import: ["" : {opset}]> g ({BATCH_NORM_SIGNATURE}) => (y, running_mean, running_var)'
        " { y, running_mean, running_var = BatchNormalization<training_mode=1, momentum=0.8>(x, s, b, m, v) }", check=False)
    got = run_model(model, BATCH_NORM_INPUTS)
    expected = ReferenceEvaluator(model).run(None, BATCH_NORM_INPUTS)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_batch_normalization_v9_with_extra_outputs_trains_and_saves_batch_statistics():
    model = text_model(f'<ir_version: 8, opset_import: ["" : 9]> g ({BATCH_NORM_SIGNATURE}) => (y, rm, rv, sm, sv)'
        " { y, rm, rv, sm, sv = BatchNormalization<momentum=0.7>(x, s, b, m, v) }", check=False)
    inputs = BATCH_NORM_INPUTS
    y, running_mean, running_var, saved_mean, saved_var = run_model(model, inputs)
    batch_mean = inputs["x"].mean(axis=(0, 2, 3))
    batch_var = inputs["x"].var(axis=(0, 2, 3))
    expected_y = _batch_norm_numpy(inputs["x"], inputs["s"], inputs["b"], batch_mean, batch_var, 1e-5)
    np.testing.assert_allclose(y, expected_y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(running_mean, inputs["m"] * 0.7 + batch_mean * 0.3, rtol=1e-5)
    np.testing.assert_allclose(running_var, inputs["v"] * 0.7 + batch_var * 0.3, rtol=1e-5)
    np.testing.assert_allclose(saved_mean, batch_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(saved_var, batch_var, rtol=1e-5)


def test_batch_normalization_v6_without_is_test_uses_batch_statistics():
    model = text_model(f'<ir_version: 8, opset_import: ["" : 6]> g ({BATCH_NORM_SIGNATURE}) => (y)'
        " { y = BatchNormalization(x, s, b, m, v) }", check=False)
    inputs = BATCH_NORM_INPUTS
    (got,) = run_model(model, inputs)
    mean, var = inputs["x"].mean(axis=(0, 2, 3)), inputs["x"].var(axis=(0, 2, 3))
    expected = _batch_norm_numpy(inputs["x"], inputs["s"], inputs["b"], mean, var, 1e-5)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_batch_normalization_spatial_0_normalises_per_activation():
    x = _random(2, 3, 4)
    scale, bias, mean = _random(3, 4, seed=1), _random(3, 4, seed=2), _random(3, 4, seed=3)
    var = np.abs(_random(3, 4, seed=4)) + 0.5
    model = text_model('<ir_version: 8, opset_import: ["" : 7]> g (float[2,3,4] x, float[3,4] s, float[3,4] b, float[3,4] m,'
        " float[3,4] v) => (y) { y = BatchNormalization<spatial=0>(x, s, b, m, v) }", check=False)
    (got,) = run_model(model, {"x": x, "s": scale, "b": bias, "m": mean, "v": var})
    np.testing.assert_allclose(got, (x - mean) / np.sqrt(var + 1e-5) * scale + bias, rtol=1e-5, atol=1e-5)


def test_batch_normalization_v15_accepts_statistics_of_another_type():
    inputs = BATCH_NORM_INPUTS
    feeds = {"x": inputs["x"].astype(np.float16), "s": inputs["s"], "b": inputs["b"],
             "m": inputs["m"].astype(np.float64), "v": inputs["v"].astype(np.float64)}
    model = text_model('<ir_version: 8, opset_import: ["" : 15]> g (float16[2,3,4,5] x, float[3] s, float[3] b, double[3] m,'
        " double[3] v) => (y) { y = BatchNormalization(x, s, b, m, v) }", check=False)
    (got,) = run_model(model, feeds)
    assert got.dtype == np.float16
    expected = _batch_norm_numpy(feeds["x"], inputs["s"], inputs["b"], inputs["m"], inputs["v"], 1e-5)
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("opset", [1, 6, 22])
def test_instance_normalization_matches_reference(opset):
    model = text_model(f'<ir_version: 8, opset_import: ["" : {opset}]> g (float[2,3,4,5] x, float[3] s, float[3] b) => (y)'
        " { y = InstanceNormalization<epsilon=0.001>(x, s, b) }", check=False)
    feeds = {"x": _random(2, 3, 4, 5), "s": _random(3, seed=1), "b": _random(3, seed=2)}
    (got,) = run_model(model, feeds)
    (expected,) = ReferenceEvaluator(model).run(None, feeds)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def _group_norm_numpy(x, groups, epsilon):
    rows = x.astype(np.float64).reshape(x.shape[0], groups, -1)
    rows = (rows - rows.mean(-1, keepdims=True)) / np.sqrt(rows.var(-1, keepdims=True) + epsilon)
    return rows.reshape(x.shape)


def test_group_normalization_v18_scales_per_group():
    x, scale, bias = _random(2, 6, 4), _random(3, seed=1), _random(3, seed=2)
    model = text_model('<ir_version: 8, opset_import: ["" : 18]> g (float[2,6,4] x, float[3] s, float[3] b) => (y)'
        " { y = GroupNormalization<num_groups=3>(x, s, b) }", check=False)
    (got,) = run_model(model, {"x": x, "s": scale, "b": bias})
    expected = _group_norm_numpy(x, 3, 1e-5) * np.repeat(scale, 2)[:, None] + np.repeat(bias, 2)[:, None]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_group_normalization_v21_scales_per_channel():
    x, scale, bias = _random(2, 6, 4), _random(6, seed=1), _random(6, seed=2)
    model = text_model('<ir_version: 8, opset_import: ["" : 21]> g (float[2,6,4] x, float[6] s, float[6] b) => (y)'
        " { y = GroupNormalization<num_groups=2, epsilon=0.01>(x, s, b) }", check=False)
    (got,) = run_model(model, {"x": x, "s": scale, "b": bias})
    expected = _group_norm_numpy(x, 2, 0.01) * scale[:, None] + bias[:, None]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def _layer_norm_numpy(x, axis, epsilon=1e-5):
    x64 = x.astype(np.float64)
    axes = tuple(range(axis % x.ndim, x.ndim))
    mean = x64.mean(axis=axes, keepdims=True)
    inv_std = 1 / np.sqrt(x64.var(axis=axes, keepdims=True) + epsilon)
    return (x64 - mean) * inv_std, mean, inv_std


@pytest.mark.parametrize("type_name,dtype,tolerance", [("float16", np.float16, 1e-2), ("double", np.float64, 1e-10)])
def test_layer_normalization_statistics_are_float32_and_y_keeps_the_input_type(type_name, dtype, tolerance):
    x, scale, bias = _random(2, 3, 8, dtype=dtype), _random(8, dtype=dtype, seed=1), _random(8, dtype=dtype, seed=2)
    model = text_model(f'<ir_version: 8, opset_import: ["" : 17]> g ({type_name}[2,3,8] x, {type_name}[8] s, {type_name}[8] b)'
        " => (y, mean, inv_std) { y, mean, inv_std = LayerNormalization(x, s, b) }", check=False)
    y, mean, inv_std = run_model(model, {"x": x, "s": scale, "b": bias})
    assert (y.dtype, mean.dtype, inv_std.dtype) == (dtype, np.float32, np.float32)
    normalized, expected_mean, expected_inv_std = _layer_norm_numpy(x, -1)
    np.testing.assert_allclose(y.astype(np.float64), normalized * scale + bias, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(mean, expected_mean, rtol=1e-5, atol=1e-3 if dtype == np.float16 else 1e-6)
    np.testing.assert_allclose(inv_std, expected_inv_std, rtol=1e-3 if dtype == np.float16 else 1e-5)


def test_layer_normalization_is_stable_for_inputs_with_a_large_offset():
    # E[x^2] - E[x]^2 would lose every digit here; the variance about the mean does not.
    x = (1000.0 + _random(4, 512)).astype(np.float32)
    model = text_model('<ir_version: 8, opset_import: ["" : 17]> g (float[4,512] x, float[512] s) => (y)'
        " { y = LayerNormalization(x, s) }", check=False)
    (y,) = run_model(model, {"x": x, "s": np.ones(512, np.float32)})
    np.testing.assert_allclose(y, _layer_norm_numpy(x, -1)[0], atol=1e-3)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_layer_normalization_matches_reference_with_broadcast_scale(axis):
    x = _random(2, 3, 4)
    scale_shape = x.shape[axis % 3 :]
    model = text_model(f'<ir_version: 8, opset_import: ["" : 17]> g (float[2,3,4] x, float{list(scale_shape)} s,'
        f" float{list(scale_shape)} b) => (y, mean, inv_std)"
        f" {{ y, mean, inv_std = LayerNormalization<axis={axis}>(x, s, b) }}", check=False)
    feeds = {"x": x, "s": _random(*scale_shape, seed=1), "b": _random(*scale_shape, seed=2)}
    for got, expected in zip(run_model(model, feeds), ReferenceEvaluator(model).run(None, feeds)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_rms_normalization_in_float16_matches_float64_numpy():
    x, scale = _random(2, 3, 64, dtype=np.float16), _random(64, dtype=np.float16, seed=1)
    model = text_model('<ir_version: 8, opset_import: ["" : 23]> g (float16[2,3,64] x, float16[64] s) => (y)'
        " { y = RMSNormalization(x, s) }", check=False)
    (got,) = run_model(model, {"x": x, "s": scale})
    x64 = x.astype(np.float64)
    expected = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5) * scale
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("p", [1, 2])
def test_lp_normalization_maps_all_zero_slices_to_zero(p):
    x = _random(3, 4)
    x[1] = 0
    model = text_model(f'<ir_version: 8, opset_import: ["" : 1]> g (float[3,4] x) => (y) {{ y = LpNormalization<p={p}, axis=1>(x) }}', check=False)
    (got,) = run_model(model, {"x": x})
    norm = np.linalg.norm(x.astype(np.float64), ord=p, axis=1, keepdims=True)
    expected = np.divide(x, norm, out=np.zeros_like(x, dtype=np.float64), where=norm != 0)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert not np.isnan(got).any()


def test_lp_normalization_rejects_other_orders_when_the_session_is_built():
    model = text_model('<ir_version: 8, opset_import: ["" : 1]> g (float[3,4] x) => (y) { y = LpNormalization<p=3>(x) }', check=False)
    with pytest.raises(plugrt.UnsupportedOpError, match="p=3"):
        plugrt.InferenceSession(model.SerializeToString())


@pytest.mark.parametrize("opset", [9, 13])
def test_mean_variance_normalization_matches_its_function_definition(opset):
    model = text_model(f'<ir_version: 8, opset_import: ["" : {opset}]> g (float[2,3,4,5] x) => (y)'
        " { y = MeanVarianceNormalization<axes=[1, 2]>(x) }", check=False)
    x = _random(2, 3, 4, 5)
    (got,) = run_model(model, {"x": x})
    x64 = x.astype(np.float64)
    expected = (x64 - x64.mean((1, 2), keepdims=True)) / (x64.std((1, 2), keepdims=True) + 1e-9)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_layer_normalization_rejects_other_stash_types_when_the_session_is_built():
    model = text_model('<ir_version: 8, opset_import: ["" : 17]> g (float[2,4] x, float[4] s) => (y)'
        " { y = LayerNormalization<stash_type=16>(x, s) }", check=False)
    with pytest.raises(plugrt.UnsupportedOpError, match="stash_type=16"):
        plugrt.InferenceSession(model.SerializeToString())
