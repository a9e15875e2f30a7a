"""Winograd F(4x4, 3x3) and F(2x2, 3x3) for float32 3x3 Conv: matches onnxruntime over sizes
that are and are not multiples of the tile, pads, batches, bias and fused Relu, and a weight
fed at run time; takes the larger tiles where they give enough tiles;
keeps NaN and infinity where onnxruntime puts them; steps aside under PLUGRT_NUMBA=0 and
where the GEMM paths are faster; replays without allocating."""

from __future__ import annotations


import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

import plugrt
from plugrt_cpu.kernels import winograd

from cpu.numba_paths import PATHS, numba_or_numpy
from cpu.test_into import check_captured, one_node

pytest.importorskip("numba")


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# (input shape, output channels, attributes); every one is planned for Winograd
CASES = {
    "56x56": ((1, 16, 56, 56), 16, {"pads": [1, 1, 1, 1]}),
    "odd-29x31-batch-2": ((2, 16, 29, 31), 8, {"pads": [1, 1, 1, 1]}),
    "no-pads-30x34": ((1, 24, 30, 34), 12, {}),
    "asymmetric-pads": ((1, 16, 27, 30), 20, {"pads": [0, 2, 1, 0]}),
    "pads-2": ((1, 16, 26, 25), 4, {"pads": [2, 2, 2, 2]}),
    "same-upper": ((1, 17, 25, 27), 9, {"auto_pad": "SAME_UPPER"}),
    "batch-5-small": ((5, 16, 10, 11), 3, {"pads": [1, 1, 1, 1]}),
    "one-row-of-tiles": ((1, 16, 3, 190), 8, {"pads": [1, 1, 1, 1]}),
    # F(2x2, 3x3): too few 4x4 tiles
    "f2-14x14": ((1, 32, 14, 14), 24, {"pads": [1, 1, 1, 1]}),
    "f2-13x15-batch-2": ((2, 16, 13, 15), 8, {"pads": [1, 1, 1, 1]}),
    "f2-asymmetric-pads": ((1, 16, 12, 13), 20, {"pads": [0, 2, 1, 0]}),
    "f2-no-pads": ((1, 16, 16, 17), 5, {}),
}
# the tile each case takes
TILES = {case: 2 if case.startswith("f2-") else 4 for case in CASES}


def _model(x_shape, w: np.ndarray, b: np.ndarray | None, attributes: dict, relu: bool, weight_input: bool = False) -> bytes:
    inputs = ["x", "w"] + (["b"] if b is not None else [])
    nodes = [onnx.helper.make_node("Conv", inputs, ["c" if relu else "y"], **attributes)]
    if relu:
        nodes.append(onnx.helper.make_node("Relu", ["c"], ["y"]))
    graph_inputs = [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x_shape)]
    initializers = [numpy_helper.from_array(b, "b")] if b is not None else []
    if weight_input:
        graph_inputs.append(onnx.helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, w.shape))
    else:
        initializers.append(numpy_helper.from_array(w, "w"))
    graph = onnx.helper.make_graph(
        nodes, "winograd", graph_inputs, [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], initializers
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def _onnxruntime(model: bytes, feeds: dict) -> np.ndarray:
    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _close(actual: np.ndarray, expected: np.ndarray) -> None:
    """Winograd's transforms round differently from a direct sum: within 1e-5 of the
    output's scale (measured at most 6e-6 on these cases)."""
    assert actual.shape == expected.shape
    scale = float(np.abs(expected[np.isfinite(expected)]).max())
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5 * scale)


class _Calls(list):
    """The inputs of the Conv calls that ran Winograd's transforms to the end, and their tiles."""

    tiles: list[int]


@pytest.fixture
def winograd_calls(monkeypatch) -> _Calls:
    calls = _Calls()
    calls.tiles = []
    original = winograd.WinogradPlan.__call__

    def counted(self, x, *args, **kwargs):
        y = original(self, x, *args, **kwargs)
        if y is not None:
            calls.append(x)
            calls.tiles.append(self.variant.tile)
        return y

    monkeypatch.setattr(winograd.WinogradPlan, "__call__", counted)
    return calls


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Each test twice: with the compiled transforms (skipped under PLUGRT_NUMBA=0) and
    with PLUGRT_NUMBA=0, the GEMM paths."""
    yield from numba_or_numpy(request, monkeypatch, winograd.winograd_loops)


@pytest.mark.parametrize("relu", [False, True], ids=["plain", "relu"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_winograd_matches_onnxruntime(case, bias, relu, path, winograd_calls):
    x_shape, m, attributes = CASES[case]
    x, w = _random(*x_shape, seed=1), _random(m, x_shape[1], 3, 3, seed=2)
    b = _random(m, seed=3) if bias else None
    model = _model(x_shape, w, b, attributes, relu)
    session = plugrt.load(model, device="cpu")
    expected = _onnxruntime(model, {"x": x})
    for _ in range(2):  # the first call transforms the weight into a workspace, the second keeps it
        _close(session.run({"x": x})["y"], expected)
    assert len(winograd_calls) == (2 if path == "numba" else 0)
    assert set(winograd_calls.tiles) <= {TILES[case]}


@pytest.mark.parametrize("case", ["odd-29x31-batch-2", "f2-13x15-batch-2"])
def test_a_weight_fed_at_run_time_is_transformed_each_call(case, path, winograd_calls):
    x_shape, m, attributes = CASES[case]
    x = _random(*x_shape, seed=1)
    model = _model(x_shape, _random(m, x_shape[1], 3, 3), _random(m, seed=3), attributes, relu=True, weight_input=True)
    session = plugrt.load(model, device="cpu")
    for seed in (4, 5, 6):
        feeds = {"x": x, "w": _random(m, x_shape[1], 3, 3, seed=seed)}
        _close(session.run(feeds)["y"], _onnxruntime(model, feeds))
    assert len(winograd_calls) == (3 if path == "numba" else 0)


@pytest.mark.parametrize("relu", [False, True], ids=["plain", "relu"])
@pytest.mark.parametrize("case", ["odd-29x31-batch-2", "f2-13x15-batch-2"])
def test_nan_and_infinity_reach_the_outputs_onnxruntime_gives_them(case, relu, path, winograd_calls):
    x_shape, m, attributes = CASES[case]
    x = _random(*x_shape, seed=1)
    x[0, 0, 5, 7] = np.nan
    x[1, 3, 11, 14] = np.inf
    x[1, 2, 0, 0] = -np.inf
    model = _model(x_shape, _random(m, x_shape[1], 3, 3, seed=2), _random(m, seed=3), attributes, relu)
    session = plugrt.load(model, device="cpu")
    actual = session.run({"x": x})["y"]
    expected = _onnxruntime(model, {"x": x})
    assert np.isnan(expected).any() and not np.isnan(expected).all()
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(actual), np.isinf(expected))
    _close(actual, expected)
    assert not winograd_calls  # the direct way computed it
    # and a finite input afterwards takes the transforms again
    finite = _random(*x_shape, seed=7)
    _close(session.run({"x": finite})["y"], _onnxruntime(model, {"x": finite}))
    assert len(winograd_calls) == (1 if path == "numba" else 0)


@pytest.mark.parametrize(
    "x_shape, w_shape, attributes",
    [
        ((1, 64, 7, 7), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]}),  # 20 tiles of 2x2: too few
        ((1, 8, 56, 56), (16, 8, 3, 3), {"pads": [1, 1, 1, 1]}),  # too few channels
        ((1, 16, 56, 56), (16, 16, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
        ((1, 16, 56, 56), (16, 16, 3, 3), {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
        ((1, 32, 56, 56), (32, 16, 3, 3), {"pads": [1, 1, 1, 1], "group": 2}),
        ((1, 16, 56, 56), (16, 16, 5, 5), {"pads": [2, 2, 2, 2]}),
    ],
    ids=["7x7", "8-channels", "stride-2", "dilation-2", "groups", "5x5"],
)
def test_the_gemm_paths_take_what_winograd_does_not_pay_for(x_shape, w_shape, attributes, winograd_calls):
    x = _random(*x_shape, seed=1)
    model = _model(x_shape, _random(*w_shape, seed=2), _random(w_shape[0], seed=3), attributes, relu=False)
    actual = plugrt.load(model, device="cpu").run({"x": x})["y"]
    np.testing.assert_allclose(actual, _onnxruntime(model, {"x": x}), rtol=1e-4, atol=1e-4)
    assert not winograd_calls


def test_float64_takes_the_gemm_paths(winograd_calls):
    x_shape, m, attributes = CASES["56x56"]
    x = np.random.default_rng(1).standard_normal(x_shape)
    w = np.random.default_rng(2).standard_normal((m, x_shape[1], 3, 3))
    model = one_node("y = Conv<pads = [1, 1, 1, 1]>(x, w)", {"x": x}, {"y": "double"}, constants={"w": w})
    actual = plugrt.load(model, device="cpu").run({"x": x})["y"]
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]  # onnxruntime has no double Conv
    np.testing.assert_allclose(actual, expected, rtol=1e-10, atol=1e-10)
    assert not winograd_calls


@pytest.mark.parametrize("case", ["56x56", "odd-29x31-batch-2", "asymmetric-pads", "f2-13x15-batch-2"])
def test_winograd_is_captured_and_replays_without_allocating(case, path, winograd_calls):
    x_shape, m, attributes = CASES[case]
    pads = attributes.get("pads", [0, 0, 0, 0])
    model = one_node(
        f"y = Conv<pads = [{', '.join(map(str, pads))}]>(x, w, b)",
        {"x": _random(*x_shape)},
        {"y": "float"},
        constants={"w": _random(m, x_shape[1], 3, 3, seed=2), "b": _random(m, seed=3)},
    )
    check_captured(model, lambda rng: {"x": rng.standard_normal(x_shape).astype(np.float32)})
    assert bool(winograd_calls) == (path == "numba")


def test_a_non_contiguous_input_is_read_as_it_is(path, winograd_calls):
    # a Transpose in front hands the Conv a strided view
    x_shape, m, _ = CASES["odd-29x31-batch-2"]
    transposed = (x_shape[0], x_shape[2], x_shape[3], x_shape[1])
    model = one_node(
        "t = Transpose<perm = [0, 3, 1, 2]>(x)\n    y = Conv<pads = [1, 1, 1, 1]>(t, w, b)",
        {"x": _random(*transposed)},
        {"y": "float"},
        constants={"w": _random(m, x_shape[1], 3, 3, seed=2), "b": _random(m, seed=3)},
    )
    x = _random(*transposed, seed=1)
    actual = plugrt.load(model, device="cpu", optimization="none").run({"x": x})["y"]
    _close(actual, _onnxruntime(model, {"x": x}))
    assert bool(winograd_calls) == (path == "numba")
    check_captured(model, lambda rng: {"x": rng.standard_normal(transposed).astype(np.float32)})


def test_light_vgg19_matches_its_expected_output(path, winograd_calls):
    from test_light_models import MODELS, _check, _with_logits

    model = MODELS["vgg19"]
    outputs = plugrt.load(_with_logits("vgg19")[0], device="cpu").run(model.inputs)
    assert bool(winograd_calls) == (path == "numba")
    _check(model, list(outputs.values()))


@pytest.fixture(params=["compiled-bands", "python-bands"])
def bands_on_two_threads(request, monkeypatch):
    """Bands shared out between two threads whatever the machine has, run as one compiled
    job without the GIL (``_numba_winograd.winograd_bands``) or as Python bands on
    ``parallel_for``."""
    if winograd.winograd_loops() is None:
        pytest.skip("PLUGRT_NUMBA=0 turns the compiled transforms off")
    monkeypatch.setattr(winograd, "threads_for", lambda work: 2)
    if request.param == "python-bands":
        monkeypatch.setattr(winograd, "compiled_pool", lambda: None)
    elif winograd.compiled_pool() is None:
        pytest.skip("no compiled pool here")
    return request.param


@pytest.mark.parametrize("case", ["56x56", "odd-29x31-batch-2", "batch-5-small", "f2-14x14", "f2-13x15-batch-2"])
def test_bands_on_two_threads_match_onnxruntime(case, bands_on_two_threads, winograd_calls):
    x_shape, m, attributes = CASES[case]
    x, w, b = _random(*x_shape, seed=1), _random(m, x_shape[1], 3, 3, seed=2), _random(m, seed=3)
    model = _model(x_shape, w, b, attributes, relu=True)
    session = plugrt.load(model, device="cpu")
    expected = _onnxruntime(model, {"x": x})
    for _ in range(3):
        _close(session.run({"x": x})["y"], expected)
    assert len(winograd_calls) == 3


def test_compiled_bands_give_a_non_finite_input_to_the_direct_way(bands_on_two_threads, winograd_calls):
    x_shape, m, attributes = CASES["odd-29x31-batch-2"]
    x = _random(*x_shape, seed=1)
    x[1, 3, 11, 14] = np.nan  # in the second image: the first image's bands finish
    model = _model(x_shape, _random(m, x_shape[1], 3, 3, seed=2), _random(m, seed=3), attributes, relu=False)
    actual = plugrt.load(model, device="cpu").run({"x": x})["y"]
    expected = _onnxruntime(model, {"x": x})
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    _close(actual, expected)
    assert not winograd_calls


# -- Conv + Add (+ Relu), the residual of ResNet's basic blocks: the output transform adds it


def _residual_model(x_shape, m: int, w: np.ndarray, b: np.ndarray, attributes: dict, relu: bool) -> tuple[bytes, tuple]:
    out_shape = (x_shape[0], m, *_out_size(x_shape, attributes))
    nodes = [onnx.helper.make_node("Conv", ["x", "w", "b"], ["c"], **attributes),
             onnx.helper.make_node("Add", ["c", "z"], ["s" if relu else "y"])]
    if relu:
        nodes.append(onnx.helper.make_node("Relu", ["s"], ["y"]))
    graph = onnx.helper.make_graph(
        nodes, "residual",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x_shape),
         onnx.helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, out_shape)],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )  # fmt: skip
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    return model.SerializeToString(), out_shape


def _out_size(x_shape, attributes: dict) -> tuple[int, int]:
    """The output's height and width of a 3x3 Conv with unit strides (onnx's formula)."""
    if attributes.get("auto_pad") == "SAME_UPPER":
        return x_shape[2], x_shape[3]
    top, left, bottom, right = attributes.get("pads", [0, 0, 0, 0])
    return x_shape[2] + top + bottom - 2, x_shape[3] + left + right - 2


@pytest.fixture
def residual_calls(monkeypatch) -> list:
    """Whether each Winograd call that ran to the end was given a residual."""
    calls: list = []
    original = winograd.WinogradPlan.__call__

    def counted(self, x, weight, bias, relu, y=None, residual=None):
        out = original(self, x, weight, bias, relu, y, residual)
        if out is not None:
            calls.append(residual is not None)
        return out

    monkeypatch.setattr(winograd.WinogradPlan, "__call__", counted)
    return calls


@pytest.mark.parametrize("relu", [False, True], ids=["add", "add-relu"])
@pytest.mark.parametrize("case", ["56x56", "odd-29x31-batch-2", "asymmetric-pads", "same-upper", "f2-14x14", "f2-13x15-batch-2"])
def test_a_residual_is_added_by_the_output_transform(case, relu, path, residual_calls):
    x_shape, m, attributes = CASES[case]
    w, b = _random(m, x_shape[1], 3, 3, seed=2), _random(m, seed=3)
    model, out_shape = _residual_model(x_shape, m, w, b, attributes, relu)
    session = plugrt.load(model, device="cpu")
    for seed in (1, 4):
        feeds = {"x": _random(*x_shape, seed=seed), "z": _random(*out_shape, seed=seed + 10) * 3}
        _close(session.run(feeds)["y"], _onnxruntime(model, feeds))
    assert residual_calls == ([True, True] if path == "numba" else [])


@pytest.mark.parametrize("case", ["odd-29x31-batch-2", "f2-13x15-batch-2"])
def test_a_residual_on_two_threads_matches_onnxruntime(case, bands_on_two_threads, residual_calls):
    x_shape, m, attributes = CASES[case]
    model, out_shape = _residual_model(x_shape, m, _random(m, x_shape[1], 3, 3, seed=2), _random(m, seed=3), attributes, True)
    feeds = {"x": _random(*x_shape, seed=1), "z": _random(*out_shape, seed=5)}
    _close(plugrt.load(model, device="cpu").run(feeds)["y"], _onnxruntime(model, feeds))
    assert residual_calls == [True]


def test_a_residual_with_a_non_finite_input_is_added_the_direct_way(bands_on_two_threads, residual_calls):
    x_shape, m, attributes = CASES["odd-29x31-batch-2"]
    model, out_shape = _residual_model(x_shape, m, _random(m, x_shape[1], 3, 3, seed=2), _random(m, seed=3), attributes, True)
    x = _random(*x_shape, seed=1)
    x[1, 3, 11, 14] = np.nan  # in the second image: the first image's bands store theirs first
    feeds = {"x": x, "z": _random(*out_shape, seed=5)}
    actual = plugrt.load(model, device="cpu").run(feeds)["y"]
    expected = _onnxruntime(model, feeds)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    _close(actual, expected)
    assert residual_calls == []


def test_an_output_in_the_residuals_own_buffer_is_right(path):
    """A capture may plan the sum into the residual's buffer: that call takes a direct
    way (a Winograd call that met a non-finite input could not give the residual back)."""
    from plugrt.threads import begin_run
    from plugrt_cpu._registry import KernelContext, capture_variant
    from plugrt_cpu.kernels.conv_residual import build_residual_conv

    x_shape, m, attributes = CASES["odd-29x31-batch-2"]
    w, b = _random(m, x_shape[1], 3, 3, seed=2), _random(m, seed=3)
    model, out_shape = _residual_model(x_shape, m, w, b, attributes, True)
    x, z = _random(*x_shape, seed=1), _random(*out_shape, seed=5)
    expected = _onnxruntime(model, {"x": x, "z": z})
    ctx = KernelContext("Conv", "", 11, dict(attributes), 4, 1, [x.dtype] * 4, [None, w, b, None])
    kernel = build_residual_conv(ctx, True)
    begin_run(2)
    try:
        into = np.empty(out_shape, np.float32)
        capture_variant(kernel)(into, x, w, b, z)
        in_place = z.copy()
        capture_variant(kernel)(in_place, x, w, b, in_place)
    finally:
        begin_run(0)
    _close(into, expected)
    _close(in_place, expected)


def test_a_residual_conv_is_captured_and_replays_without_allocating(path, residual_calls):
    from cpu.test_into import REPLAY_BYTES, replay_bytes
    from plugrt.capture import Captured

    x_shape, m, attributes = CASES["odd-29x31-batch-2"]
    model, out_shape = _residual_model(x_shape, m, _random(m, x_shape[1], 3, 3, seed=2), _random(m, seed=3), attributes, True)
    session = plugrt.load(model, device="cpu", optimization="all")  # Conv + Add + Relu: one FusedConv
    feeds = [{"x": _random(*x_shape, seed=s), "z": _random(*out_shape, seed=s + 1)} for s in (1, 5)]
    assert isinstance(session.try_capture(feeds[0]), Captured)
    assert session.capture_report.seams == []
    for values in feeds:
        expected = _onnxruntime(model, values)
        eager, replayed = session.run(values)["y"], session.replay(values)["y"]
        np.testing.assert_array_equal(replayed, eager)
        _close(replayed, expected)
    assert replay_bytes(lambda: session.replay(feeds[1]), small_buffers=True) < REPLAY_BYTES
    assert bool(residual_calls) == (path == "numba")
