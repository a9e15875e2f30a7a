"""The numba-compiled depthwise 2-D Conv: matches onnxruntime over kernels, strides, pads,
dilations and sizes, with and without bias and fused Relu, propagates NaN as onnxruntime
does, steps aside for the numpy path under PLUGRT_NUMBA=0, and replays without allocating."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import numpy_helper

import plugrt
from plugrt.capture import Captured
from plugrt_cpu.kernels import _compiled
from plugrt_cpu.kernels import conv as convolution

from cpu.numba_paths import PATHS, choose_faster, count_blocked_runs, numba_or_numpy, record_faster
from cpu.test_into import REPLAY_BYTES, _same, check_captured, one_node, replay_bytes

pytest.importorskip("numba")


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# (input shape, weight shape, attributes): group is the input's channel count
CASES = {
    "3x3-same": ((1, 8, 12, 12), (8, 1, 3, 3), {"pads": [1, 1, 1, 1]}),
    "3x3-stride-2": ((2, 8, 14, 14), (8, 1, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    "3x3-stride-2-odd-7x9": ((1, 5, 7, 9), (5, 1, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    "3x3-no-pads-7x9": ((2, 6, 7, 9), (6, 1, 3, 3), {}),
    "3x3-asymmetric-pads": ((1, 6, 10, 9), (6, 1, 3, 3), {"pads": [0, 2, 1, 0]}),
    "3x3-dilation-2": ((1, 4, 12, 13), (4, 1, 3, 3), {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
    "3x3-dilation-2-stride-2": (
        (2, 3, 11, 12),
        (3, 1, 3, 3),
        {"pads": [1, 2, 2, 1], "dilations": [2, 2], "strides": [2, 2]},
    ),
    "3x3-stride-1x2": ((1, 4, 9, 10), (4, 1, 3, 3), {"pads": [1, 1, 1, 1], "strides": [1, 2]}),
    "3x3-stride-3": ((1, 3, 17, 16), (3, 1, 3, 3), {"pads": [1, 1, 1, 1], "strides": [3, 3]}),
    "3x3-1x1-spatial": ((2, 6, 1, 1), (6, 1, 3, 3), {"pads": [1, 1, 1, 1]}),
    "3x3-shufflenet-7x7": ((1, 32, 7, 7), (32, 1, 3, 3), {"pads": [1, 1, 1, 1]}),
    "5x5-same": ((2, 4, 13, 10), (4, 1, 5, 5), {"pads": [2, 2, 2, 2]}),
    "5x5-stride-2": ((1, 4, 15, 16), (4, 1, 5, 5), {"pads": [2, 2, 2, 2], "strides": [2, 2]}),
    "5x5-no-pads-7x9": ((1, 3, 7, 9), (3, 1, 5, 5), {}),
    "7x7-same": ((2, 4, 9, 11), (4, 1, 7, 7), {"pads": [3, 3, 3, 3]}),
    "7x7-stride-2-dilation-2": ((1, 3, 17, 16), (3, 1, 7, 7), {"pads": [5, 6, 6, 5], "strides": [2, 2], "dilations": [2, 2]}),
    "5x3-rows-of-five-taps": ((1, 4, 9, 8), (4, 1, 3, 5), {"pads": [1, 2, 1, 2]}),
    "2x4-same-upper": ((1, 4, 12, 13), (4, 1, 2, 4), {"auto_pad": "SAME_UPPER", "strides": [2, 1]}),
    "3x1-pads": ((1, 4, 8, 6), (4, 1, 3, 1), {"pads": [1, 0, 1, 0]}),
    "multiplier-2": ((1, 5, 9, 9), (10, 1, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    # rows of 32 floats or more a phase: split into row phases too (conv._DepthwiseLayout)
    "3x3-stride-2-row-phases": ((1, 3, 66, 70), (3, 1, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    "5x5-stride-2-row-phases-odd-pads": ((1, 2, 67, 69), (2, 1, 5, 5), {"pads": [2, 1, 1, 2], "strides": [2, 2]}),
    "3x3-stride-3-dilation-2-row-phases": (
        (1, 2, 101, 99),
        (2, 1, 3, 3),
        {"pads": [2, 2, 2, 2], "strides": [3, 3], "dilations": [2, 2]},
    ),
    "3x3-stride-2x1-row-phases": ((1, 2, 40, 36), (2, 1, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 1]}),
    "multiplier-2-row-phases": ((1, 2, 64, 64), (4, 1, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
}


def _model(x_shape, w: np.ndarray, b: np.ndarray | None, attributes: dict, relu: bool) -> bytes:
    """Conv (+ Relu, which plugrt fuses into its Conv step) with constant weight and bias."""
    inputs = ["x", "w"] + (["b"] if b is not None else [])
    attributes = {"group": x_shape[1], **attributes}
    nodes = [onnx.helper.make_node("Conv", inputs, ["c" if relu else "y"], **attributes)]
    if relu:
        nodes.append(onnx.helper.make_node("Relu", ["c"], ["y"]))
    graph = onnx.helper.make_graph(
        nodes,
        "depthwise",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x_shape)],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")] + ([numpy_helper.from_array(b, "b")] if b is not None else []),
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    return model.SerializeToString()


def _onnxruntime(model: bytes, x: np.ndarray) -> np.ndarray:
    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.fixture
def compiled_calls(monkeypatch) -> list[np.ndarray]:
    """The inputs of the Conv calls that take the compiled depthwise loops."""
    calls: list[np.ndarray] = []
    original = convolution._Convolution._depthwise_compiled

    def counted(self, x, *args, **kwargs):
        calls.append(x)
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(convolution._Convolution, "_depthwise_compiled", counted)
    return calls


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Each test twice: with the compiled loops (skipped under PLUGRT_NUMBA=0) and with
    PLUGRT_NUMBA=0, the numpy paths."""
    yield from numba_or_numpy(request, monkeypatch, convolution.depthwise_loops)


@pytest.mark.parametrize("relu", [False, True], ids=["plain", "relu"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_depthwise_matches_onnxruntime(case, bias, relu, path, compiled_calls):
    x_shape, w_shape, attributes = CASES[case]
    x, w = _random(*x_shape, seed=1), _random(*w_shape, seed=2)
    b = _random(w_shape[0], seed=3) if bias else None
    model = _model(x_shape, w, b, attributes, relu)
    actual = plugrt.load(model, device="cpu").run({"x": x})["y"]
    assert bool(compiled_calls) == (path == "numba")
    expected = _onnxruntime(model, x)
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    if relu:
        assert (actual == 0).any() and (actual > 0).any()


def test_numpy_path_under_plugrt_numba_0_gives_what_the_compiled_loops_give(monkeypatch, compiled_calls):
    if os.environ.get("PLUGRT_NUMBA", "1") == "0":
        pytest.skip("PLUGRT_NUMBA=0 turns the compiled loops off")
    x_shape, w_shape, attributes = CASES["3x3-stride-2"]
    x = _random(*x_shape, seed=1)
    model = _model(x_shape, _random(*w_shape, seed=2), _random(w_shape[0], seed=3), attributes, relu=True)
    session = plugrt.load(model, device="cpu")
    compiled = session.run({"x": x})["y"]
    assert len(compiled_calls) == 1
    monkeypatch.setenv("PLUGRT_NUMBA", "0")
    _compiled._mode.cache_clear()
    try:
        assert convolution.depthwise_loops() is None
        numpy_path = session.run({"x": x})["y"]
    finally:
        _compiled._mode.cache_clear()
    assert len(compiled_calls) == 1  # the second run took the numpy path
    np.testing.assert_allclose(numpy_path, compiled, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("relu", [False, True], ids=["plain", "relu"])
@pytest.mark.parametrize("case", ["3x3-same", "3x3-stride-2-odd-7x9", "5x5-no-pads-7x9"])
def test_nan_and_infinity_reach_the_outputs_onnxruntime_gives_them(case, relu, path):
    x_shape, w_shape, attributes = CASES[case]
    x = _random(*x_shape, seed=1)
    height, width = x_shape[2:]
    # on the first and last columns: a tap that wraps past a row's end must not read them
    x[0, 0, 2, 0] = np.nan
    x[0, 0, 4, width - 1] = np.nan
    x[0, x_shape[1] - 1, height // 2, width // 2] = np.inf
    x[0, 1, 0, width - 1] = -np.inf
    model = _model(x_shape, _random(*w_shape, seed=2), _random(w_shape[0], seed=3), attributes, relu)
    actual = plugrt.load(model, device="cpu").run({"x": x})["y"]
    expected = _onnxruntime(model, x)
    assert np.isnan(expected).any() and not np.isnan(expected).all()
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(actual), np.isinf(expected))
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)  # NaN == NaN here


def _attribute_text(attributes: dict) -> str:
    return ", ".join(
        f"{k} = [{', '.join(map(str, v))}]"
        if isinstance(v, list)
        else f'{k} = "{v}"'
        if isinstance(v, str)
        else f"{k} = {v}"
        for k, v in attributes.items()
    )


@pytest.mark.parametrize("case", ["3x3-stride-2", "3x3-no-pads-7x9", "5x5-same", "multiplier-2"])
def test_depthwise_is_captured_and_replays_without_allocating(case, path, compiled_calls):
    x_shape, w_shape, attributes = CASES[case]
    model = one_node(
        f"y = Conv<{_attribute_text({'group': x_shape[1], **attributes})}>(x, w, b)",
        {"x": _random(*x_shape)},
        {"y": "float"},
        constants={"w": _random(*w_shape, seed=2), "b": _random(w_shape[0], seed=3)},
    )
    check_captured(model, lambda rng: {"x": rng.standard_normal(x_shape).astype(np.float32)})
    assert bool(compiled_calls) == (path == "numba")


def test_fused_relu_depthwise_replays_what_it_runs_without_allocating(path, compiled_calls):
    x_shape, w_shape, attributes = CASES["3x3-same"]
    model = _model(x_shape, _random(*w_shape, seed=2), _random(w_shape[0], seed=3), attributes, relu=True)
    session = plugrt.load(model, device="cpu")
    first = {"x": _random(*x_shape, seed=4)}
    assert isinstance(session.try_capture(first), Captured)
    second = {"x": _random(*x_shape, seed=5)}
    for feeds in (first, second):
        replayed = session.replay(feeds)["y"]
        assert (replayed == 0).any() and (replayed > 0).any()
        assert _same(replayed, session.run(feeds)["y"])
    assert replay_bytes(lambda: session.replay(second), small_buffers=True) < REPLAY_BYTES
    assert bool(compiled_calls) == (path == "numba")


def test_a_non_contiguous_input_is_read_as_it_is(path, compiled_calls):
    # a Transpose in front hands the Conv a strided view
    x_shape, w_shape, attributes = CASES["3x3-stride-2-odd-7x9"]
    w, b = _random(*w_shape, seed=2), _random(w_shape[0], seed=3)
    text = _attribute_text({"group": x_shape[1], **attributes})
    transposed = (x_shape[0], x_shape[2], x_shape[3], x_shape[1])
    model = one_node(
        f"t = Transpose<perm = [0, 3, 1, 2]>(x)\n    y = Conv<{text}>(t, w, b)",
        {"x": _random(*transposed)},
        {"y": "float"},
        constants={"w": w, "b": b},
    )
    x = _random(*transposed, seed=1)
    actual = plugrt.load(model, device="cpu", optimization="none").run({"x": x})["y"]
    if path == "numba":
        assert len(compiled_calls) == 1 and not compiled_calls[0].flags.c_contiguous
    expected = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    # the into variant copies it into a workspace
    check_captured(model, lambda rng: {"x": rng.standard_normal(transposed).astype(np.float32)})


def test_light_shufflenet_matches_onnxruntime_and_its_expected_output(path, compiled_calls):
    from test_light_models import MODELS, _check, _with_logits

    model = MODELS["shufflenet"]
    outputs = plugrt.load(_with_logits("shufflenet")[0], device="cpu").run(model.inputs)
    assert bool(compiled_calls) == (path == "numba")
    _check(model, list(outputs.values()))


@pytest.mark.parametrize("case", ["3x3-stride-2", "5x5-same", "7x7-same", "multiplier-2"])
@pytest.mark.parametrize("pool", ["compiled-pool", "parallel-for"])
def test_planes_shared_out_on_two_threads_match_onnxruntime(case, pool, monkeypatch, compiled_calls):
    """The planes as one job on the compiled pool (units of several planes, a work array
    per slot), and on ``parallel_for`` where there is no pool: the same values."""
    from plugrt_cpu.kernels import _compiled_parallel

    if convolution.depthwise_loops() is None:
        pytest.skip("PLUGRT_NUMBA=0 turns the compiled loops off")
    jobs = []
    if pool == "parallel-for":
        monkeypatch.setattr(convolution, "compiled_pool", lambda: None)
    else:
        found = _compiled_parallel.compiled_pool()
        if found is None:
            pytest.skip("no compiled pool here")
        original = found.run

        def run(body, context, count, threads):
            jobs.append((count, threads))
            return original(body, context, count, threads)

        monkeypatch.setattr(found, "run", run)
        monkeypatch.setattr(convolution, "compiled_pool", lambda: found)
    from plugrt import threads

    monkeypatch.setattr(threads, "parallel_threads", lambda work: 2)  # parallel_for's
    monkeypatch.setattr(convolution, "_depthwise_threads", lambda work: 2)  # the compiled pool's
    x_shape, w_shape, attributes = CASES[case]
    x_shape = (x_shape[0], x_shape[1] * 8, *x_shape[2:])  # enough planes for several units a thread
    w_shape = (w_shape[0] * 8, *w_shape[1:])
    x, w, b = _random(*x_shape, seed=1), _random(*w_shape, seed=2), _random(w_shape[0], seed=3)
    model = _model(x_shape, w, b, attributes, True)
    actual = plugrt.load(model, device="cpu").run({"x": x})["y"]
    np.testing.assert_allclose(actual, _onnxruntime(model, x), rtol=1e-4, atol=1e-5)
    assert compiled_calls
    if pool == "compiled-pool":
        planes = x_shape[0] * w_shape[0]
        assert jobs and all(threads == 2 and 1 < count <= planes for count, threads in jobs)


@pytest.mark.parametrize("way", ["blocked", "planes"])
def test_a_depthwise_conv_above_the_compiled_split_work_runs_on_two_threads(way, monkeypatch):
    """MobileNet v2's 144 channels of 56 x 56 to 28 x 28 (1 M multiply-adds: under
    PARALLEL_MIN_WORK, above ``_COMPILED_SPLIT_WORK`` at the loops' cost) is one job on two
    threads of the compiled pool, as the Conv units' products of that size are (it took 175
    us on one thread, 111-121 on two), with onnxruntime's values."""
    from plugrt import threads
    from plugrt_cpu.kernels import _compiled_parallel

    found = _compiled_parallel.compiled_pool() if convolution.depthwise_loops() is not None else None
    if found is None:
        pytest.skip("needs the compiled loops and their pool")
    monkeypatch.setattr(threads._MONITOR, "cores", 2)
    monkeypatch.setattr(threads._MONITOR, "others_busy", lambda: 0.0)
    monkeypatch.setattr(convolution, "_faster", lambda first, second, rounds=2: (second(), way == "blocked")[1])
    jobs = []
    original = found.run

    def run(body, context, count, threads_):
        jobs.append(threads_)
        return original(body, context, count, threads_)

    monkeypatch.setattr(found, "run", run)
    x_shape, w_shape = (1, 144, 56, 56), (144, 1, 3, 3)
    assert 144 * 28 * 28 * 9 * convolution._DEPTHWISE_COMPILED_COST < threads.PARALLEL_MIN_WORK
    x, w, b = _random(*x_shape, seed=1), _random(*w_shape, seed=2), _random(144, seed=3)
    model = _model(x_shape, w, b, {"pads": [1, 1, 1, 1], "strides": [2, 2]}, True)
    session = plugrt.load(model, device="cpu")
    session.run({"x": x})  # the first call makes the way's choice
    jobs.clear()
    actual = session.run({"x": x})["y"]
    np.testing.assert_allclose(actual, _onnxruntime(model, x), rtol=1e-4, atol=1e-5)
    assert jobs == [2]


# -- the channel-blocked loops (short planes), chosen on the first call by timing both -------

BLOCKED_CASES = {
    **{name: case for name, case in CASES.items() if case[1][0] == case[0][1]},  # one output channel per input channel
    "3x3-20-channels-two-blocks": ((2, 20, 7, 7), (20, 1, 3, 3), {"pads": [1, 1, 1, 1]}),
    "3x3-stride-2-48-channels": ((1, 48, 14, 14), (48, 1, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    "7x7-33-channels-19-wide": ((1, 33, 5, 19), (33, 1, 7, 7), {"pads": [3, 3, 3, 3]}),
    "3x3-stride-2-unread-last-row": ((1, 17, 8, 8), (17, 1, 3, 3), {"strides": [2, 2]}),
    # output rows of two windowed gangs and a remainder at stride 2
    "5x5-stride-2-21-wide": ((1, 20, 6, 41), (20, 1, 5, 5), {"pads": [2, 2, 2, 2], "strides": [2, 2]}),
}


@pytest.fixture(params=["blocked", "planes"])
def way(request, monkeypatch) -> tuple[str, list[int]]:
    """The first call's choice made for it (``conv._faster`` runs the planes, untimed, as its last run), and the
    channel-blocked jobs run, by unit count."""
    if convolution.depthwise_loops() is None or convolution.compiled_pool() is None:
        pytest.skip("needs the compiled loops and their pool")
    choose_faster(monkeypatch, convolution, request.param == "blocked")
    return request.param, count_blocked_runs(monkeypatch)


@pytest.mark.parametrize("relu", [False, True], ids=["plain", "relu"])
@pytest.mark.parametrize("case", list(BLOCKED_CASES), ids=list(BLOCKED_CASES))
def test_blocked_and_planes_both_match_onnxruntime(case, relu, way):
    chosen, blocked_runs = way
    x_shape, w_shape, attributes = BLOCKED_CASES[case]
    x, w, b = _random(*x_shape, seed=1), _random(*w_shape, seed=2), _random(w_shape[0], seed=3)
    model = _model(x_shape, w, b, attributes, relu)
    session = plugrt.load(model, device="cpu")
    expected = _onnxruntime(model, x)
    for _ in range(2):  # the first call decides, the second follows the decision
        actual = session.run({"x": x})["y"]
        assert actual.shape == expected.shape
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    assert blocked_runs == ([-(-x_shape[1] // 16)] * 2 if chosen == "blocked" else [])


def test_blocked_propagates_nan_and_infinity_as_onnxruntime(way):
    chosen, blocked_runs = way
    x_shape, w_shape, attributes = BLOCKED_CASES["3x3-20-channels-two-blocks"]
    x, w, b = _random(*x_shape, seed=1), _random(*w_shape, seed=2), _random(w_shape[0], seed=3)
    x[0, 2, 3, 3], x[1, 17, 0, 6] = np.nan, np.inf
    model = _model(x_shape, w, b, attributes, True)
    actual = plugrt.load(model, device="cpu").run({"x": x})["y"]
    expected = _onnxruntime(model, x)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    assert np.isnan(actual).sum() >= 9 and bool(blocked_runs) == (chosen == "blocked")


@pytest.mark.parametrize("case", ["3x3-20-channels-two-blocks", "7x7-33-channels-19-wide"])
def test_blocked_is_captured_and_replays_without_allocating(case, way):
    chosen, blocked_runs = way
    x_shape, w_shape, attributes = BLOCKED_CASES[case]
    model = one_node(
        f"y = Conv<{_attribute_text({'group': x_shape[1], **attributes})}>(x, w, b)",
        {"x": _random(*x_shape)},
        {"y": "float"},
        constants={"w": _random(*w_shape, seed=2), "b": _random(w_shape[0], seed=3)},
    )
    check_captured(model, lambda rng: {"x": rng.standard_normal(x_shape).astype(np.float32)})
    assert bool(blocked_runs) == (chosen == "blocked")


def test_the_first_call_times_both_ways_and_keeps_the_faster(monkeypatch):
    """Without the choice made for it, the first call runs both (each writes all of the
    output) and the later calls only the one ``_faster`` chose."""
    if convolution.depthwise_loops() is None or convolution.compiled_pool() is None:
        pytest.skip("needs the compiled loops and their pool")
    asked = record_faster(monkeypatch, convolution)
    calls = {"blocked": 0, "planes": 0}
    for name, attribute in (("blocked", "_depthwise_blocked"), ("planes", "_depthwise_planes")):
        function = getattr(convolution._Convolution, attribute)

        def counted(*args, _name=name, _function=function, **kwargs):
            calls[_name] += 1
            return _function(*args, **kwargs)

        monkeypatch.setattr(convolution._Convolution, attribute, staticmethod(counted))
    x_shape, w_shape, attributes = BLOCKED_CASES["3x3-20-channels-two-blocks"]
    x = _random(*x_shape, seed=1)
    model = _model(x_shape, _random(*w_shape, seed=2), _random(w_shape[0], seed=3), attributes, False)
    session = plugrt.load(model, device="cpu")
    for _ in range(3):
        np.testing.assert_allclose(session.run({"x": x})["y"], _onnxruntime(model, x), rtol=1e-4, atol=1e-5)
    assert len(asked) == 1
    # the first call: two timed rounds each, the planes last (then the blocked once more when
    # they won, so that the first output is the chosen way's too); then two calls of the faster
    assert calls == ({"blocked": 2 + 1 + 2, "planes": 2} if asked[0] else {"blocked": 2, "planes": 2 + 2})


@pytest.mark.parametrize("case", ["3x3-20-channels-two-blocks", "7x7-33-channels-19-wide", "3x3-stride-2-48-channels"])
def test_a_channels_last_input_is_read_as_it_is_by_the_blocked_loops(case, way, monkeypatch):
    """ConvNeXt's depthwise Conv reads a Transpose of a channels-last tensor: the blocked
    loops take each position's channels as they lie (no copy to planes first)."""
    chosen, blocked_runs = way
    layouts: list[bool] = []
    original = convolution._Convolution._depthwise_blocked

    def recorded(*args, **kwargs):
        layouts.append(args[3])
        return original(*args, **kwargs)

    monkeypatch.setattr(convolution._Convolution, "_depthwise_blocked", staticmethod(recorded))
    copies: list[str] = []
    copy = convolution._copy_to_workspace

    def copied(name, *args, **kwargs):
        copies.append(name)
        return copy(name, *args, **kwargs)

    monkeypatch.setattr(convolution, "_copy_to_workspace", copied)
    contiguous = np.ascontiguousarray

    def made_contiguous(a, *args, **kwargs):
        if isinstance(a, np.ndarray) and a.ndim == 4 and not a.flags.c_contiguous:
            copies.append("contiguous")
        return contiguous(a, *args, **kwargs)

    monkeypatch.setattr(convolution.np, "ascontiguousarray", made_contiguous)
    x_shape, w_shape, attributes = BLOCKED_CASES[case]
    n, c, h, w_ = x_shape
    attributes = {"group": c, **attributes}
    nodes = [
        onnx.helper.make_node("Transpose", ["x"], ["t"], perm=[0, 3, 1, 2]),
        onnx.helper.make_node("Conv", ["t", "w", "b"], ["c"], **attributes),
        onnx.helper.make_node("Relu", ["c"], ["y"]),
    ]
    graph = onnx.helper.make_graph(
        nodes,
        "channels-last",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, (n, h, w_, c))],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(_random(*w_shape, seed=2), "w"), numpy_helper.from_array(_random(c, seed=3), "b")],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    x = _random(n, h, w_, c, seed=1)
    session = plugrt.load(model, device="cpu")
    for _ in range(2):
        copies.clear()
        np.testing.assert_allclose(session.run({"x": x})["y"], _onnxruntime(model, x), rtol=1e-4, atol=1e-5)
    assert layouts == ([True, True] if chosen == "blocked" else [])
    if chosen == "blocked":  # after the first call (which ran the planes too), nothing copied to planes
        assert copies == []


def test_a_way_is_chosen_only_when_clearly_faster(monkeypatch):
    """``_faster`` keeps the way it would replace unless the new one wins by the margin."""
    clock = {"now": 0.0}

    def taking(seconds):
        def run():
            clock["now"] += seconds

        return run

    from plugrt_cpu.kernels import _first_call

    monkeypatch.setattr(_first_call.time, "perf_counter", lambda: clock["now"])
    assert convolution._faster(taking(0.5), taking(1.0))
    assert not convolution._faster(taking(0.95), taking(1.0))  # within the margin: keep the planes
    assert not convolution._faster(taking(1.2), taking(1.0))
