"""A grouped 2-D Conv of 2 to 16 channels a group in and out (RegNet's, ResNeXt's) by the
channel-blocked loops' grouped sums: matches onnxruntime over group widths, kernels,
strides, pads, dilations, partial blocks and short rows, with and without bias, Relu and a
fused Clip, propagates NaN and infinity as onnxruntime does, is chosen on its first call
only where it times faster, steps aside where it cannot run (a weight fed at run time,
another group shape, PLUGRT_NUMBA=0), and replays without allocating."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import numpy_helper

import plugrt
from plugrt_cpu.kernels import conv as convolution

from cpu.numba_paths import PATHS, choose_faster, count_blocked_runs, numba_or_numpy, record_faster
from cpu.test_into import check_captured, one_node

pytest.importorskip("numba")


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# (input shape, channels a group, kernel, attributes)
CASES = {
    "8-a-group-3x3-same-two-blocks": ((1, 32, 9, 10), 8, (3, 3), {"pads": [1, 1, 1, 1]}),
    # RegNet-Y-400MF's shapes, smaller planes: a partial last block (104 = 6.5 blocks)
    "8-a-group-104-channels-partial-block": ((1, 104, 12, 12), 8, (3, 3), {"pads": [1, 1, 1, 1]}),
    "8-a-group-stride-2": ((2, 48, 16, 15), 8, (3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    "8-a-group-7x7-one-short-gang": ((1, 56, 7, 7), 8, (3, 3), {"pads": [1, 1, 1, 1]}),
    "8-a-group-14-wide-gang-and-rest": ((1, 24, 5, 14), 8, (3, 3), {"pads": [1, 1, 1, 1]}),
    "2-a-group-5x5": ((1, 12, 11, 9), 2, (5, 5), {"pads": [2, 2, 2, 2]}),
    "2-a-group-one-group-past-a-block": ((1, 18, 6, 6), 2, (3, 3), {"pads": [1, 1, 1, 1]}),
    "4-a-group-dilation-2": ((1, 20, 12, 13), 4, (3, 3), {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
    "4-a-group-asymmetric-pads": ((2, 16, 10, 9), 4, (3, 3), {"pads": [0, 2, 1, 0]}),
    "16-a-group-stride-2-no-pads": ((1, 48, 13, 11), 16, (3, 3), {"strides": [2, 2]}),
    "16-a-group-1x3": ((1, 32, 6, 9), 16, (1, 3), {"pads": [0, 1, 0, 1]}),
    "8-a-group-3x1-stride-2x1": ((1, 16, 9, 8), 8, (3, 1), {"pads": [1, 0, 1, 0], "strides": [2, 1]}),
    "8-a-group-1x1-spatial": ((2, 16, 1, 1), 8, (3, 3), {"pads": [1, 1, 1, 1]}),
}


def _model(x_shape, per_group: int, w: np.ndarray, b: np.ndarray | None, attributes: dict, after: str | None) -> bytes:
    """Conv (+ ``after``: Relu or Clip(0, 6), which plugrt fuses into its Conv step) with a
    constant weight and bias."""
    inputs = ["x", "w"] + (["b"] if b is not None else [])
    attributes = {"group": x_shape[1] // per_group, **attributes}
    nodes = [onnx.helper.make_node("Conv", inputs, ["c" if after else "y"], **attributes)]
    initializers = [numpy_helper.from_array(w, "w")] + ([numpy_helper.from_array(b, "b")] if b is not None else [])
    if after == "Relu":
        nodes.append(onnx.helper.make_node("Relu", ["c"], ["y"]))
    elif after == "Clip":
        nodes.append(onnx.helper.make_node("Clip", ["c", "low", "high"], ["y"]))
        initializers += [numpy_helper.from_array(np.float32(0.0), "low"), numpy_helper.from_array(np.float32(6.0), "high")]
    graph = onnx.helper.make_graph(
        nodes,
        "grouped",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x_shape)],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        initializers,
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    return model.SerializeToString()


def _case(case: str, bias: bool = True, after: str | None = None) -> tuple[bytes, np.ndarray]:
    x_shape, per_group, kernel, attributes = CASES[case]
    w = _random(x_shape[1], per_group, *kernel, seed=2)
    b = _random(x_shape[1], seed=3) if bias else None
    return _model(x_shape, per_group, w, b, attributes, after), _random(*x_shape, seed=1)


def _onnxruntime(model: bytes, x: np.ndarray) -> np.ndarray:
    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.fixture
def blocked_runs(monkeypatch) -> list[int]:
    """The channel-blocked jobs run, by their blocks of 16 channels."""
    return count_blocked_runs(monkeypatch)


@pytest.fixture(params=["grouped", "general"])
def way(request, monkeypatch, blocked_runs) -> tuple[str, list[int]]:
    """The first call's choice made for it (the general way runs, untimed, as its last
    run), and the channel-blocked jobs run."""
    if convolution.depthwise_loops() is None or convolution.compiled_pool() is None:
        pytest.skip("needs the compiled loops and their pool")
    choose_faster(monkeypatch, convolution, request.param == "grouped")
    return request.param, blocked_runs


@pytest.mark.parametrize("after", [None, "Relu", "Clip"], ids=["plain", "relu", "clip"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_grouped_and_general_both_match_onnxruntime(case, bias, after, way):
    chosen, runs = way
    model, x = _case(case, bias, after)
    session = plugrt.load(model, device="cpu")
    expected = _onnxruntime(model, x)
    for _ in range(2):  # the first call decides, the second follows the decision
        actual = session.run({"x": x})["y"]
        assert actual.shape == expected.shape
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    assert runs == ([-(-x.shape[1] // 16)] * 2 if chosen == "grouped" else [])
    if after:
        assert (actual == 0).any() and (actual > 0).any()
    if after == "Clip":
        assert actual.max() <= 6.0 and (actual == 6.0).any() == (expected == 6.0).any()


def test_grouped_propagates_nan_and_infinity_as_onnxruntime(way):
    chosen, runs = way
    model, x = _case("8-a-group-104-channels-partial-block", after="Relu")
    x[0, 2, 3, 3], x[0, 99, 0, 6], x[0, 50, 11, 11] = np.nan, np.inf, -np.inf
    actual = plugrt.load(model, device="cpu").run({"x": x})["y"]
    expected = _onnxruntime(model, x)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    # each poisons its group's 8 channels over its window (4 positions at the corner)
    assert np.isnan(actual).sum() >= 8 * 9 and bool(runs) == (chosen == "grouped")


@pytest.mark.parametrize("case", ["8-a-group-104-channels-partial-block", "2-a-group-5x5", "16-a-group-stride-2-no-pads"])
def test_grouped_is_captured_and_replays_without_allocating(case, way):
    chosen, runs = way
    x_shape, per_group, kernel, attributes = CASES[case]
    pairs = {"group": x_shape[1] // per_group, **attributes}
    text = ", ".join(f"{k} = [{', '.join(map(str, v))}]" if isinstance(v, list) else f"{k} = {v}" for k, v in pairs.items())
    model = one_node(
        f"y = Conv<{text}>(x, w, b)",
        {"x": _random(*x_shape)},
        {"y": "float"},
        constants={"w": _random(x_shape[1], per_group, *kernel, seed=2), "b": _random(x_shape[1], seed=3)},
    )
    check_captured(model, lambda rng: {"x": rng.standard_normal(x_shape).astype(np.float32)})
    assert bool(runs) == (chosen == "grouped")


def test_the_first_call_times_both_ways_and_keeps_the_faster(monkeypatch, blocked_runs):
    """Without the choice made for it, the first call runs both (each writes all of the
    output) and the later calls only the one ``_faster`` chose."""
    if convolution.depthwise_loops() is None or convolution.compiled_pool() is None:
        pytest.skip("needs the compiled loops and their pool")
    asked = record_faster(monkeypatch, convolution)
    general: list[int] = []
    original_general = convolution._Convolution._general

    def counted(self, *args, **kwargs):
        general.append(1)
        return original_general(self, *args, **kwargs)

    monkeypatch.setattr(convolution._Convolution, "_general", counted)
    model, x = _case("8-a-group-104-channels-partial-block")
    session = plugrt.load(model, device="cpu")
    for _ in range(3):
        np.testing.assert_allclose(session.run({"x": x})["y"], _onnxruntime(model, x), rtol=1e-4, atol=1e-5)
    assert len(asked) == 1
    # the first call: two timed rounds each, the general way last (then the grouped once more
    # when they won, so that the first output is the chosen way's too); then two calls of the faster
    if asked[0]:
        assert (len(blocked_runs), len(general)) == (2 + 1 + 2, 2)
    else:
        assert (len(blocked_runs), len(general)) == (2, 2 + 2)


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    yield from numba_or_numpy(request, monkeypatch, convolution.depthwise_loops)


@pytest.mark.parametrize(
    "x_shape, w_shape, group",
    [
        ((1, 24, 8, 8), (24, 3, 3, 3), 8),  # 3 channels a group: not a width the sums take
        ((1, 16, 8, 8), (32, 8, 3, 3), 2),  # twice the outputs a group
        ((1, 64, 6, 6), (64, 32, 3, 3), 2),  # 32 channels a group: wider than a block
    ],
    ids=["3-a-group", "multiplier-2", "32-a-group"],
)
def test_other_group_shapes_take_the_general_way(x_shape, w_shape, group, path, blocked_runs):
    x, w, b = _random(*x_shape, seed=1), _random(*w_shape, seed=2), _random(w_shape[0], seed=3)
    inputs = ["x", "w", "b"]
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Conv", inputs, ["y"], group=group, pads=[1, 1, 1, 1])],
        "grouped",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x_shape)],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    np.testing.assert_allclose(plugrt.load(model, device="cpu").run({"x": x})["y"], _onnxruntime(model, x), rtol=1e-4, atol=1e-5)
    assert blocked_runs == []


def test_a_weight_fed_at_run_time_takes_the_general_way(path, blocked_runs):
    x_shape, w_shape = (1, 32, 9, 9), (32, 8, 3, 3)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Conv", ["x", "w"], ["y"], group=4, pads=[1, 1, 1, 1])],
        "grouped",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x_shape),
         onnx.helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, w_shape)],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    x, w = _random(*x_shape, seed=1), _random(*w_shape, seed=2)
    actual = plugrt.load(model, device="cpu").run({"x": x, "w": w})["y"]
    expected = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x, "w": w})[0]
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
    assert blocked_runs == []


def test_the_numpy_path_matches_onnxruntime_under_plugrt_numba_0(path, blocked_runs):
    model, x = _case("8-a-group-104-channels-partial-block", after="Relu")
    np.testing.assert_allclose(plugrt.load(model, device="cpu").run({"x": x})["y"], _onnxruntime(model, x), rtol=1e-4, atol=1e-5)
    if path == "numpy":
        assert blocked_runs == []


def test_the_group_widths_and_the_window_slack_agree_with_the_compiled_loops():
    loops = convolution.depthwise_loops()
    if loops is None:
        pytest.skip("needs the compiled loops")
    assert convolution._GROUP_WIDTHS == loops.GROUP_WIDTHS
    assert convolution._WINDOW_SLACK == loops.WINDOW_SLACK  # the room conv.py leaves after a padded block
    # each lane's channel: every channel of the block once, a group's input channel j side by side
    for per_group in (1, *loops.GROUP_WIDTHS):
        lanes = loops.lane_channels(per_group)
        assert sorted(lanes) == list(range(16))
        share = 16 // per_group
        for j in range(per_group):
            assert [lane % per_group for lane in lanes[j * share : (j + 1) * share]] == [j] * share
