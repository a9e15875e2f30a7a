"""The numba-compiled 2-D MaxPool and AveragePool: match onnxruntime over kernels, strides,
pads, dilations, ceil_mode and count_include_pad (and on every pooling node of onnx's
light models), propagate NaN as the numpy path does, split across threads, replay without
allocating, and step aside for the numpy path with PLUGRT_NUMBA=0."""

from __future__ import annotations

import onnx
import numpy as np
import onnxruntime
import pytest
from onnx import helper

import plugrt
from plugrt.conformance.light_models import light_models
from plugrt_cpu.kernels import _compiled, pooling

from cpu.test_into import check_captured
from helpers import graph_model, reference_model

pytest.importorskip("numba")


@pytest.fixture
def numba_on(monkeypatch):
    """The compiled loops on (whatever PLUGRT_NUMBA the suite runs with), loaded before the test."""
    monkeypatch.setenv("PLUGRT_NUMBA", "wait")
    _compiled._mode.cache_clear()
    assert pooling.compiled_pool() is not None
    yield
    _compiled._mode.cache_clear()


@pytest.fixture
def compiled(numba_on, monkeypatch):
    """The compiled loops on, and the numpy passes they replace made to fail if called."""

    def numpy_pass(*args, **kwargs):
        raise AssertionError("the numpy pooling path ran where the compiled loops apply")

    monkeypatch.setattr(pooling, "_separable_pool", numpy_pass)


@pytest.fixture
def numba_off(monkeypatch):
    monkeypatch.setenv("PLUGRT_NUMBA", "0")
    _compiled._mode.cache_clear()
    yield
    _compiled._mode.cache_clear()


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _model(op: str, x: np.ndarray, attributes: dict, opset: int = 19) -> onnx.ModelProto:
    node = helper.make_node(op, ["x"], ["y"], **attributes)
    return graph_model([node], {"x": x}, ["y"], opset, output_types=[helper.np_dtype_to_tensor_dtype(x.dtype)])


def _plugrt(model: onnx.ModelProto, x: np.ndarray, **options) -> np.ndarray:
    return plugrt.load(model.SerializeToString(), device="cpu", **options).run({"x": x})["y"]


def _onnxruntime(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


# name: (input shape, attributes); every case runs as MaxPool and as AveragePool
CASES = {
    "2x2_stride_2": ((1, 4, 16, 16), dict(kernel_shape=[2, 2], strides=[2, 2])),
    "2x2_stride_2_odd": ((2, 3, 15, 17), dict(kernel_shape=[2, 2], strides=[2, 2])),
    "3x3_stride_2_odd": ((1, 5, 27, 27), dict(kernel_shape=[3, 3], strides=[2, 2])),
    "3x3_stride_2_pad_1": ((2, 3, 14, 13), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "3x3_stride_1_pad_1": ((1, 6, 13, 13), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    "3x3_stride_1": ((2, 2, 9, 11), dict(kernel_shape=[3, 3])),
    "2x2_stride_1_end_pads": ((1, 3, 10, 9), dict(kernel_shape=[2, 2], pads=[0, 0, 1, 1])),
    "3x3_stride_1_pads_2_1": ((2, 2, 8, 12), dict(kernel_shape=[3, 3], pads=[2, 2, 0, 0])),
    "3x3_stride_1_pad_1_one_column": ((1, 2, 6, 1), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    "3x3_stride_3": ((1, 3, 20, 23), dict(kernel_shape=[3, 3], strides=[3, 3])),
    "5x5_stride_3_pad_2": ((2, 3, 23, 17), dict(kernel_shape=[5, 5], strides=[3, 3], pads=[2, 2, 2, 2])),
    "5x5_stride_1_pad_2": ((1, 2, 12, 10), dict(kernel_shape=[5, 5], pads=[2, 2, 2, 2])),
    "1x4_stride_1x2": ((2, 3, 7, 21), dict(kernel_shape=[1, 4], strides=[1, 2], pads=[0, 1, 0, 2])),
    "4x1_stride_2x1": ((1, 3, 19, 8), dict(kernel_shape=[4, 1], strides=[2, 1], pads=[1, 0, 2, 0])),
    "asymmetric_pads": ((1, 4, 14, 14), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[0, 0, 1, 1])),
    "asymmetric_pads_rows_and_columns": ((2, 2, 11, 12), dict(kernel_shape=[3, 2], strides=[2, 1], pads=[2, 0, 0, 1])),
    "ceil_mode_2x2": ((1, 3, 15, 13), dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    "ceil_mode_3x3_pad_1": ((2, 2, 14, 17), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)),
    "ceil_mode_stride_3": ((1, 2, 16, 20), dict(kernel_shape=[3, 3], strides=[3, 3], ceil_mode=1)),
    "same_upper": ((1, 3, 11, 14), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER")),
    "long_rows_in_bands": ((1, 2, 40, 150), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "rows_longer_than_a_band": ((1, 2, 5, 2100), dict(kernel_shape=[2, 3], strides=[1, 2], pads=[0, 1, 1, 1])),
    "one_row": ((2, 3, 3, 30), dict(kernel_shape=[3, 3], strides=[2, 2])),
    "kernel_larger_than_input": ((1, 2, 3, 2), dict(kernel_shape=[5, 5], pads=[2, 2, 2, 2])),
    "kernel_larger_than_input_stride_2": ((1, 2, 4, 3), dict(kernel_shape=[5, 4], strides=[2, 2], pads=[2, 1, 2, 3])),
    "same_lower": ((2, 2, 10, 9), dict(kernel_shape=[2, 4], strides=[1, 2], auto_pad="SAME_LOWER")),
    # planes stacked by _flat_planes: the input exactly stride times the output
    "flat_3x3_stride_2_pad_1": ((2, 5, 12, 16), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "flat_3x3_stride_2_end_pads": ((1, 3, 8, 10), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[0, 0, 1, 1])),
    "flat_3x3_stride_2_pad_1_rows_end_columns": ((1, 3, 6, 4), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 0, 0, 1])),
    "flat_many_small_planes": ((2, 300, 7, 7), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    "flat_two_by_two_planes": ((1, 3, 2, 2), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    "flat_3x3_stride_2_odd_sides": ((2, 40, 13, 11), dict(kernel_shape=[3, 3], strides=[2, 2])),
}


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_pool_matches_onnxruntime(compiled, op, name):
    shape, attributes = CASES[name]
    x = _random(*shape)
    model = _model(op, x, attributes)
    np.testing.assert_allclose(_plugrt(model, x), _onnxruntime(model, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "name",
    ["3x3_stride_1_pad_1", "3x3_stride_2_pad_1", "5x5_stride_3_pad_2", "ceil_mode_3x3_pad_1", "flat_3x3_stride_2_pad_1", "flat_many_small_planes"],
)
def test_compiled_average_with_count_include_pad_matches_onnxruntime(compiled, name):
    shape, attributes = CASES[name]
    x = _random(*shape)
    model = _model("AveragePool", x, dict(attributes, count_include_pad=1))
    np.testing.assert_allclose(_plugrt(model, x), _onnxruntime(model, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize(
    "attributes",
    [
        dict(kernel_shape=[3, 3], dilations=[2, 2]),
        dict(kernel_shape=[3, 3], dilations=[2, 2], pads=[2, 2, 2, 2]),
        dict(kernel_shape=[3, 3], strides=[2, 2], dilations=[2, 2], pads=[2, 2, 2, 2]),
        dict(kernel_shape=[2, 3], strides=[1, 2], dilations=[3, 2], pads=[1, 2, 0, 1]),
        dict(kernel_shape=[3, 2], strides=[3, 1], dilations=[2, 3], ceil_mode=1),
    ],
    ids=["3x3", "3x3_same_size", "3x3_stride_2_pad_2", "2x3_mixed", "3x2_stride_3_ceil_mode"],
)
def test_compiled_dilated_pool_matches_onnxruntime(compiled, op, attributes):
    x = _random(2, 3, 17, 19)
    model = _model(op, x, attributes)
    np.testing.assert_allclose(_plugrt(model, x), _onnxruntime(model, x), rtol=1e-6, atol=1e-6)


def _light_model_pools() -> list[tuple[str, tuple[int, ...], dict]]:
    """Each distinct (op, input shape, attributes) of the light models' 2-D MaxPool and
    AveragePool nodes (not their global forms)."""
    found = {}
    for light in light_models():
        proto = onnx.shape_inference.infer_shapes(onnx.load(light.path))
        values = list(proto.graph.value_info) + list(proto.graph.input)
        shapes = {v.name: tuple(d.dim_value for d in v.type.tensor_type.shape.dim) for v in values}
        for node in proto.graph.node:
            if node.op_type in ("MaxPool", "AveragePool") and len(node.output) == 1:
                attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
                found[(node.op_type, shapes[node.input[0]], repr(sorted(attributes.items())))] = attributes
    return [(op, shape, attributes) for (op, shape, _), attributes in sorted(found.items())]


def test_every_light_model_pool_matches_onnxruntime(compiled):
    pools = _light_model_pools()
    assert len(pools) > 30  # SqueezeNet's, ShuffleNet's, Inception's, DenseNet's, VGG's, ...
    for index, (op, shape, attributes) in enumerate(pools):
        x = _random(*shape, seed=index)
        model = _model(op, x, attributes)
        np.testing.assert_allclose(
            _plugrt(model, x), _onnxruntime(model, x), rtol=1e-6, atol=1e-6, err_msg=f"{op} {shape} {attributes}"
        )


def _with_specials(shape: tuple[int, ...]) -> np.ndarray:
    """Random values with NaN, +inf and -inf sprinkled in, a row of NaN and a plane of -inf."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, flat.size // 20, replace=False)] = np.nan
    flat[rng.choice(flat.size, flat.size // 30, replace=False)] = np.inf
    flat[rng.choice(flat.size, flat.size // 30, replace=False)] = -np.inf
    x[0, 0, 0] = np.nan  # a whole first row: windows at the top border
    x[0, 1] = -np.inf  # a whole plane
    x[0, 2, :, -1] = np.nan  # the last column: windows at the right border
    return x


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize(
    "name",
    [
        "3x3_stride_2_pad_1", "3x3_stride_1_pad_1", "3x3_stride_3", "long_rows_in_bands", "ceil_mode_2x2",
        "flat_3x3_stride_2_pad_1", "flat_3x3_stride_2_end_pads", "flat_many_small_planes",
        "flat_3x3_stride_2_odd_sides", "3x3_stride_2_odd",
    ],
)  # fmt: skip
def test_compiled_pool_propagates_nan_and_infinities_as_numpy_does(numba_on, monkeypatch, op, name):
    shape, attributes = CASES[name]
    x = _with_specials((shape[0], max(shape[1], 3), *shape[2:]))
    model = _model(op, x, attributes)
    _compiled._mode.cache_clear()
    with monkeypatch.context() as patch:
        patch.setenv("PLUGRT_NUMBA", "0")
        assert pooling.compiled_pool() is None
        with np.errstate(invalid="ignore"):  # numpy warns of inf - inf in the sums
            expected = _plugrt(model, x)
    _compiled._mode.cache_clear()
    assert pooling.compiled_pool() is not None
    got = _plugrt(model, x)
    assert np.isnan(expected).any() and np.isinf(expected).any()  # the case checks both
    if op == "MaxPool":
        np.testing.assert_array_equal(got, expected)  # maxima are exact, NaN where numpy's are
    else:
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)  # NaN where numpy's are


def test_numba_off_takes_the_numpy_path_and_agrees(numba_off, monkeypatch):
    assert pooling.compiled_pool() is None
    shape, attributes = CASES["3x3_stride_2_pad_1"]
    x = _random(*shape)
    calls = []
    separable = pooling._separable_pool
    monkeypatch.setattr(pooling, "_separable_pool", lambda *args: calls.append(1) or separable(*args))
    for op in ("MaxPool", "AveragePool"):
        model = _model(op, x, attributes)
        np.testing.assert_allclose(_plugrt(model, x), _onnxruntime(model, x), rtol=1e-6, atol=1e-6)
    assert len(calls) == 2


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_compiled_pool_split_over_two_threads_matches_onnxruntime(compiled, monkeypatch, op):
    """The planes in Python chunks on ``parallel_for`` (no compiled jobs' pool)."""
    from plugrt import threads

    monkeypatch.setattr(pooling, "compiled_jobs", lambda: None)
    monkeypatch.setattr(threads, "parallel_threads", lambda work: 2)
    starts = []
    body_of = pooling.parallel_for

    def recording(count, body, work, **options):
        body_of(count, lambda start, stop: starts.append(start) or body(start, stop), work, **options)

    monkeypatch.setattr(pooling, "parallel_for", recording)
    x = _random(2, 24, 28, 28)
    model = _model(op, x, dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))
    np.testing.assert_allclose(_plugrt(model, x), _onnxruntime(model, x), rtol=1e-6, atol=1e-6)
    assert len(starts) > 1 and 0 in starts  # the planes went in several chunks


@pytest.mark.parametrize(
    "name,flat",
    [
        ("flat_3x3_stride_2_pad_1", True), ("flat_many_small_planes", True), ("flat_3x3_stride_2_odd_sides", True),
        ("3x3_stride_2_odd", True), ("3x3_stride_2_pad_1", False), ("ceil_mode_3x3_pad_1", False), ("one_row", False),
    ],
)
def test_flat_planes_take_the_shapes_they_are_for(compiled, name, flat):
    """``_flat_planes`` takes 3x3 windows whose input is exactly stride times the output
    (the cases above compare its values); other shapes keep the row buffers."""
    shape, attributes = CASES[name]
    model = _model("MaxPool", _random(*shape), attributes)
    node = (model if isinstance(model, onnx.ModelProto) else onnx.load_from_string(model)).graph.node[0]
    pool = pooling._Pooling("MaxPool", "max", {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute})
    plan = pooling._PoolPlan(pool, shape)
    kh, kw, sh, sw, dh, dw, ph, pw = plan.geometry
    loops = pooling.compiled_pool()
    assert bool(loops._flat(shape[2], shape[3], *plan.out, kh, kw, sh, sw, dh, dw, ph, pw)) is flat


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("name", ["3x3_stride_2_pad_1", "3x3_stride_1_pad_1", "ceil_mode_2x2"])
def test_compiled_jobs_over_two_threads_match_onnxruntime(compiled, monkeypatch, op, name):
    """The planes in units of one compiled job on the compiled pool, two threads."""
    jobs = pooling.compiled_jobs()
    if jobs is None:
        pytest.skip("no compiled pool here")
    monkeypatch.setattr(pooling, "threads_for", lambda work: 2)
    monkeypatch.setattr(pooling, "_COMPILED_MIN_OPS", 0)
    runs = []
    run = jobs.run
    monkeypatch.setattr(jobs, "run", lambda body, context, count, threads: runs.append((count, threads)) or run(body, context, count, threads))
    shape, attributes = CASES[name]
    x = _random(3, *shape[1:])  # more planes than units
    model = _model(op, x, attributes)
    np.testing.assert_allclose(_plugrt(model, x), _onnxruntime(model, x), rtol=1e-6, atol=1e-6)
    assert runs and all(count == 4 and threads == 2 for count, threads in runs)


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("name", ["3x3_stride_2_pad_1", "3x3_stride_1_pad_1", "3x3_stride_3", "ceil_mode_2x2"])
def test_compiled_pool_replays_bitwise_without_allocating(compiled, op, name):
    shape, attributes = CASES[name]
    model = _model(op, _random(*shape), attributes).SerializeToString()
    check_captured(model, lambda rng: {"x": rng.standard_normal(shape).astype(np.float32)})


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_float64_pool_takes_the_numpy_path_and_matches_the_reference(op):
    x = _random(1, 3, 9, 9).astype(np.float64)
    model = _model(op, x, dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))
    (expected,) = reference_model(model, {"x": x})  # onnxruntime has no double AveragePool
    np.testing.assert_allclose(_plugrt(model, x), expected, rtol=1e-12, atol=1e-12)
