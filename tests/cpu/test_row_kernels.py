"""Softmax and LayerNormalization over the last axis: the compiled float32 passes and the numpy path against onnxruntime and onnx.reference."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnx.reference
import onnxruntime
import pytest
from onnx import numpy_helper

import plugrt
from plugrt.capture import Captured
from plugrt_cpu.kernels import softmax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from numba_paths import PATHS, numba_or_numpy  # noqa: E402
from test_into import REPLAY_BYTES, replay_bytes  # noqa: E402


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Each test with the compiled loops (skipped without numba) and with numpy."""
    yield from numba_or_numpy(request, monkeypatch, softmax.compiled_loops)


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _model(text: str, **constants: np.ndarray) -> bytes:
    model = onnx.parser.parse_model(text)
    model.graph.initializer.extend(numpy_helper.from_array(a, name) for name, a in constants.items())
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _check(model: bytes, feeds: dict[str, np.ndarray], rtol: float = 1e-5, atol: float = 1e-6) -> list[np.ndarray]:
    ours = list(plugrt.load(model, device="cpu").run(feeds).values())
    theirs = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    reference = onnx.reference.ReferenceEvaluator(model).run(None, feeds)
    for a, b, c in zip(ours, theirs, reference):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
        np.testing.assert_allclose(a, c, rtol=rtol, atol=atol)
    return ours


_SOFTMAX = """
    <ir_version: 8, opset_import: ["" : 13]>
    softmax (float[A, B, C] x) => (float[A, B, C] y) {
        y = Softmax <axis = AXIS> (x)
    }
"""


@pytest.mark.parametrize("axis", [-1, 2, 1])
def test_softmax_matches_onnxruntime_and_the_reference(path, axis):
    x = _random(3, 5, 77) * 4
    _check(_model(_SOFTMAX.replace("AXIS", str(axis))), {"x": x})


def test_softmax_of_rows_with_infinities_and_nan_matches_the_reference(path):
    x = _random(1, 4, 9)
    x[0, 0, :] = -np.inf  # all masked: NaN, as the reference gives
    x[0, 1, 3] = -np.inf  # one masked key: 0 there
    x[0, 2, 5] = np.nan  # NaN spreads over its row
    ours = plugrt.load(_model(_SOFTMAX.replace("AXIS", "-1")), device="cpu").run({"x": x})["y"]
    reference = onnx.reference.ReferenceEvaluator(_model(_SOFTMAX.replace("AXIS", "-1"))).run(None, {"x": x})[0]
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-7)
    assert np.isnan(ours[0, 0]).all() and ours[0, 1, 3] == 0 and np.isnan(ours[0, 2]).all()


_LAYER_NORM = """
    <ir_version: 8, opset_import: ["" : 17]>
    layer_norm (float[A, B, C] x) => (float[A, B, C] y, float[A, B, 1] mean, float[A, B, 1] inv_std) {
        y, mean, inv_std = LayerNormalization <axis = -1, epsilon = 1e-5> (x, scale, BIAS)
    }
"""


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_and_its_statistics_match_onnxruntime_and_the_reference(path, bias):
    text = _LAYER_NORM.replace(", BIAS", ", bias" if bias else "")
    constants = {"scale": _random(96, seed=1)} | ({"bias": _random(96, seed=2)} if bias else {})
    x = _random(2, 13, 96) * 3 + 1
    _check(_model(text, **constants), {"x": x}, rtol=1e-4, atol=1e-5)


def test_layer_norm_over_an_inner_axis_keeps_the_numpy_path(path):
    text = _LAYER_NORM.replace("axis = -1", "axis = 1").replace("float[A, B, 1] mean, float[A, B, 1] inv_std", "float[A, 1, 1] mean, float[A, 1, 1] inv_std")
    x = _random(2, 5, 6)
    _check(_model(text.replace(", BIAS", ""), scale=_random(5, 6, seed=1)), {"x": x}, rtol=1e-4, atol=1e-5)


def test_compiled_layer_norm_is_the_numpy_one_to_float32_rounding(monkeypatch):
    pytest.importorskip("numba")
    loops = softmax.compiled_loops()
    if loops is None:
        pytest.skip("the compiled loops are off")
    x, scale, bias = _random(7, 300) * 5 + 2, _random(300, seed=1), _random(300, seed=2)
    y, mean, inv_std = np.empty_like(x), np.empty(7, np.float32), np.empty(7, np.float32)
    loops.layer_norm_rows(x, scale, bias, 1e-5, y, mean, inv_std)
    wide = x.astype(np.float64)
    expected_mean = wide.mean(axis=1)
    expected_inv = 1 / np.sqrt(((wide - expected_mean[:, None]) ** 2).mean(axis=1) + 1e-5)
    np.testing.assert_allclose(mean, expected_mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(inv_std, expected_inv, rtol=1e-6)
    np.testing.assert_allclose(y, (wide - expected_mean[:, None]) * expected_inv[:, None] * scale + bias, rtol=1e-5, atol=1e-5)


_BLOCK = """
    <ir_version: 8, opset_import: ["" : 17]>
    block (float[2, 16, 64] x) => (float[2, 16, 64] y) {
        n = LayerNormalization <axis = -1> (x, scale, bias)
        y = Softmax <axis = -1> (n)
    }
"""


def test_layer_norm_and_softmax_replay_without_allocating(path):
    model = _model(_BLOCK, scale=_random(64, seed=1), bias=_random(64, seed=2))
    session = plugrt.load(model, device="cpu")
    first, second = {"x": _random(2, 16, 64, seed=3)}, {"x": _random(2, 16, 64, seed=4)}
    captured = session.try_capture(first)
    assert isinstance(captured, Captured) and captured.report.seams == []
    for feeds in (first, second, first):
        np.testing.assert_array_equal(session.replay(feeds)["y"], session.run(feeds)["y"])
    assert replay_bytes(lambda: session.replay(second), small_buffers=True) < REPLAY_BYTES


def test_softmax_takes_the_compiled_passes_exactly_where_they_apply(path):
    x = _random(4, 33)
    compiled = softmax._compiled_softmax(x, -1, None)
    assert (compiled is not None) == (path == "numba")
    assert softmax._compiled_softmax(x.T, -1, None) is None  # not C-contiguous
    assert softmax._compiled_softmax(x.astype(np.float64), -1, None) is None
    if compiled is not None:
        wide = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
        np.testing.assert_allclose(compiled, wide / wide.sum(axis=1, keepdims=True), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", [(4, 4, 256, 256), (1, 12, 197, 197)])
@pytest.mark.parametrize("in_place", [False, True], ids=["apart", "in-place"])
def test_a_large_softmax_shared_over_the_compiled_pool_matches_float64(shape, in_place, monkeypatch):
    """The rows of a large softmax as one job on the compiled pool, each row in one compiled
    loop (the vectorised exp): within float32 rounding of a float64 softmax, a masked (-inf)
    column kept at zero, a row holding NaN all NaN."""
    from plugrt_cpu.kernels import softmax
    from plugrt_cpu.kernels._compiled_parallel import compiled_pool

    pool = compiled_pool()
    if pool is None or softmax.compiled_loops() is None:
        pytest.skip("needs numba's compiled loops and pool")
    jobs = []
    original = pool.run
    monkeypatch.setattr(pool, "run", lambda *args: jobs.append(args[2]) or original(*args))
    monkeypatch.setattr(softmax, "parallel_threads", lambda work: 2)
    x = (np.random.default_rng(0).standard_normal(shape) * 4).astype(np.float32)
    x[..., 3] = -np.inf
    x[0, 0, 5, 7] = np.nan
    expected = np.exp(x.astype(np.float64) - np.nanmax(x, axis=-1, keepdims=True))
    expected /= expected.sum(axis=-1, keepdims=True)
    expected[0, 0, 5] = np.nan
    out = x if in_place else np.empty_like(x)
    source = x.copy()
    y = softmax._compiled_softmax(source if not in_place else out, -1, out)
    assert jobs and jobs[0] > 2  # several units
    np.testing.assert_allclose(y, expected, rtol=2e-6, atol=1e-7)
    masked = y[..., 3].copy()
    masked[0, 0, 5] = 0  # the NaN row
    assert (masked == 0).all() and np.isnan(y[0, 0, 5]).all()


@pytest.mark.parametrize("in_place", [False, True], ids=["apart", "in-place"])
def test_wide_rows_on_one_thread_take_the_one_pass_loop_and_narrow_rows_the_three_passes(in_place, monkeypatch):
    """On one thread, rows of ``_ONE_PASS_MIN_WIDTH`` or more run the one-pass compiled loop
    (the pool's job, run alone), within float32 rounding of a float64 softmax with a masked
    column and a NaN row; narrower rows keep the three passes (no job)."""
    from plugrt_cpu.kernels._compiled_parallel import compiled_pool

    pool = compiled_pool()
    if pool is None or softmax.compiled_loops() is None:
        pytest.skip("needs numba's compiled loops and pool")
    jobs: list[tuple[int, int]] = []
    original = pool.run
    monkeypatch.setattr(pool, "run", lambda *args: jobs.append((args[2], args[3])) or original(*args))
    monkeypatch.setattr(softmax, "parallel_threads", lambda work: 1)
    for width, one_pass in ((softmax._ONE_PASS_MIN_WIDTH, True), (softmax._ONE_PASS_MIN_WIDTH - 1, False)):
        x = (np.random.default_rng(width).standard_normal((3, 5, width)) * 4).astype(np.float32)
        x[..., 2] = -np.inf
        x[1, 2, 9] = np.nan
        expected = np.exp(x.astype(np.float64) - np.nanmax(x, axis=-1, keepdims=True))
        expected /= expected.sum(axis=-1, keepdims=True)
        expected[1, 2] = np.nan
        jobs.clear()
        out = x if in_place else np.empty_like(x)
        y = softmax._compiled_softmax(x if in_place else x.copy(), -1, out)
        assert jobs == ([(1, 1)] if one_pass else [])  # one unit of every row, on this thread
        np.testing.assert_allclose(y, expected, rtol=2e-6, atol=1e-7)
        assert (np.nan_to_num(y[..., 2]) == 0).all() and np.isnan(y[1, 2]).all()


_CHANNELS_LAST_NORM = """
    <ir_version: 8, opset_import: ["" : 17]>
    block (float[2, 20, 5, 7] x) => (float[2, 5, 7, 20] y, float[2, 5, 7, 1] mean, float[2, 5, 7, 1] inv_std) {
        t = Transpose <perm = [0, 2, 3, 1]> (x)
        y, mean, inv_std = LayerNormalization <axis = -1, epsilon = 1e-6> (t, scale, bias)
    }
"""


_SLICED_NORM = """
    <ir_version: 8, opset_import: ["" : 17]>
    block (float[2, 20, 5, 7] x) => (float[2, 10, 5, 7] y, float[2, 10, 5, 1] mean, float[2, 10, 5, 1] inv_std) {
        starts = Constant <value = int64[1] {1}> ()
        ends = Constant <value = int64[1] {20}> ()
        axes = Constant <value = int64[1] {1}> ()
        steps = Constant <value = int64[1] {2}> ()
        t = Slice (x, starts, ends, axes, steps)
        y, mean, inv_std = LayerNormalization <axis = -1, epsilon = 1e-6> (t, scale, bias)
    }
"""


@pytest.mark.parametrize("graph,width", [(_CHANNELS_LAST_NORM, 20), (_SLICED_NORM, 7)], ids=["transposed", "sliced"])
def test_layer_norm_of_a_strided_input_takes_the_compiled_rows(graph, width, path, monkeypatch):
    """ConvNeXt's LayerNorm reads its Conv's (n, C, H, W) output through a Transpose to
    (n, H, W, C); a Slice with steps gives another strided input: the compiled rows take
    both (the input copied into the output, normalised there in place)."""
    model = _model(graph, scale=_random(width, seed=1), bias=_random(width, seed=2))
    calls: list[bool] = []
    loops = softmax.compiled_loops()
    if loops is not None:
        original = loops.layer_norm_rows
        monkeypatch.setattr(loops, "layer_norm_rows", lambda x, *rest: (calls.append(True), original(x, *rest))[1])
    _check(model, {"x": _random(2, 20, 5, 7, seed=3) * 2 + 1}, rtol=1e-4, atol=1e-5)
    assert bool(calls) == (path == "numba")
    session = plugrt.load(model, device="cpu")
    first, second = {"x": _random(2, 20, 5, 7, seed=4)}, {"x": _random(2, 20, 5, 7, seed=5)}
    captured = session.try_capture(first)
    assert isinstance(captured, Captured) and captured.report.seams == []
    for feeds in (first, second, first):
        for a, b in zip(session.replay(feeds).values(), session.run(feeds).values()):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("width", [1, 5, 16, 17, 63, 64, 65, 130, 197])
def test_the_row_maximum_finds_the_largest_value_wherever_it_lies(width):
    """The softmax's row maximum (vector maxima, the last vector masked): with the largest
    value at every position of the row, in its masked tail too, and a NaN ignored."""
    pytest.importorskip("numba")
    loops = softmax.compiled_loops()
    if loops is None:
        pytest.skip("the compiled loops are off")
    x = -np.abs(_random(width, width)) - 1  # every value below -1
    x[np.arange(width), np.arange(width)] = np.arange(width, dtype=np.float32)  # row r's largest at column r
    out = np.empty_like(x)
    loops.subtract_row_max(x, out)
    np.testing.assert_array_equal(out, x - np.arange(width, dtype=np.float32)[:, None])
    if width > 1:
        x[:, -1] = np.nan
        x[-1, -1] = np.nan  # the row whose largest was there: now the one before it is
        loops.subtract_row_max(x, out)
        peaks = np.nanmax(x, axis=1)
        np.testing.assert_array_equal(out[:, :-1], x[:, :-1] - peaks[:, None])
        assert np.isnan(out[:, -1]).all()
