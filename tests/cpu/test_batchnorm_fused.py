"""Inference BatchNormalization followed by Relu runs as one ``plugrt.cpu::ChannelAffine`` step,
whose values are onnxruntime's (onnx.reference's for non-finite inputs) for any rank, batch
and float type, also in blocks shared between threads, and whose capture replays without
allocating. Where the fusion applies is tested with the other fusions (test_fusions.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx.parser
import onnx.reference
import onnxruntime
import pytest
from onnx import numpy_helper

import plugrt
from plugrt.capture import Captured
from plugrt.conformance.light_models import light_models
from plugrt.threads import parallel_for
from plugrt_cpu.kernels import _gemm, normalization

from cpu.numba_paths import PATHS, numba_or_numpy
from cpu.test_into import REPLAY_BYTES, replay_bytes
from test_light_models import _check, _with_logits

_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """float32 planes of 16 values and more take a compiled one-pass loop where numba is
    there (its module is the Conv epilogue's), numpy's ufuncs otherwise: both are tested."""
    yield from numba_or_numpy(request, monkeypatch, _gemm.epilogue_loops)


def _batch_norm_relu(shape: tuple[int, ...], dtype: Any = np.float32, seed: int = 0) -> bytes:
    """x (``shape``) -> BatchNormalization with random constant statistics -> Relu -> y."""
    dtype = np.dtype(dtype)
    dims = ", ".join(map(str, shape))
    text = f"""
    <ir_version: 8, opset_import: ["" : 15]>
    g ({_TYPES[dtype]}[{dims}] x) => ({_TYPES[dtype]}[{dims}] y) {{
        n = BatchNormalization <epsilon = 0.001> (x, scale, bias, mean, var)
        y = Relu (n)
    }}
    """
    model = onnx.parser.parse_model(text)
    rng = np.random.default_rng(seed)
    channels = shape[1]
    constants = {
        "scale": rng.standard_normal(channels),
        "bias": rng.standard_normal(channels),
        "mean": rng.standard_normal(channels),
        "var": rng.random(channels) + 0.5,
    }
    model.graph.initializer.extend(numpy_helper.from_array(a.astype(dtype), name) for name, a in constants.items())
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _input(shape: tuple[int, ...], dtype: Any = np.float32, seed: int = 9) -> dict[str, np.ndarray]:
    return {"x": (np.random.default_rng(seed).standard_normal(shape) * 2).astype(dtype)}


def _run(model: bytes, feeds: dict[str, np.ndarray], optimization: str = "all") -> tuple[list[str], np.ndarray]:
    """The op types of the plan's steps and the output y of one run."""
    session = plugrt.load(model, device="cpu", optimization=optimization, profiling=True)
    y = session.run(feeds)["y"]
    return [e["args"]["op_name"] for e in session.profile() if e["cat"] == "Node"], y


def _onnxruntime(model: bytes, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _tolerance(dtype: Any) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if np.dtype(dtype) == np.float32 else {"rtol": 1e-12, "atol": 1e-12}


_SHAPES = {"2d": (6, 5), "3d": (2, 3, 7), "4d": (2, 4, 5, 6), "5d": (2, 3, 4, 5, 6), "4d_batch_1": (1, 8, 28, 28)}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("shape", list(_SHAPES.values()), ids=list(_SHAPES))
@pytest.mark.usefixtures("path")
def test_batch_norm_relu_runs_as_one_step_with_onnxruntimes_values(shape, dtype):
    model, feeds = _batch_norm_relu(shape, dtype), _input(shape, dtype)
    ops, y = _run(model, feeds)
    assert ops == ["ChannelAffine"]
    assert y.dtype == dtype
    np.testing.assert_allclose(y, _onnxruntime(model, feeds), **_tolerance(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.usefixtures("path")
def test_fused_step_gives_the_unfused_steps_values_bit_for_bit(dtype):
    # the pass folds the multiplier and shift as the BatchNormalization kernel does
    model, feeds = _batch_norm_relu((2, 4, 5, 6), dtype), _input((2, 4, 5, 6), dtype)  # planes of 30: compiled
    _, fused = _run(model, feeds)
    ops, unfused = _run(model, feeds, optimization="none")
    assert ops == ["BatchNormalization", "Relu"]
    assert fused.tobytes() == unfused.tobytes()


@pytest.mark.usefixtures("path")
def test_non_finite_inputs_give_onnx_references_values_and_relu_keeps_nan():
    shape = (2, 4, 4, 5)  # planes of 20: the compiled loop where numba is there
    model, feeds = _batch_norm_relu(shape), _input(shape)
    x = feeds["x"]
    x[0, :, 0, 0] = np.nan
    x[0, :, 0, 1] = np.inf
    x[1, :, 1, 1] = -np.inf
    x[1, :, 2, 2] = -0.0
    ops, y = _run(model, feeds)
    assert ops == ["ChannelAffine"]
    expected = onnx.reference.ReferenceEvaluator(onnx.load_from_string(model)).run(None, feeds)[0]
    assert np.isnan(y[0, :, 0, 0]).all()
    np.testing.assert_array_equal(np.isnan(y), np.isnan(expected))
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)  # NaN where expected has NaN


# Shapes over the kernel's 4 MiB block: whole images per block, a range of one image's
# channels per block, blocks of rows of an (N, C) input, and float64 (half the values a block).
_LARGE = {
    "images": ((3, 64, 80, 80), np.float32),
    "channel_ranges": ((1, 300, 60, 60), np.float32),
    "rows": ((20000, 64), np.float32),
    "float64_images": ((3, 64, 64, 64), np.float64),
}


def _two_threads(calls: list[int]):
    """parallel_for that records its chunk count and always uses two threads."""

    def run(count, body, work, **options):
        calls.append(count)
        parallel_for(count, body, work, **options, threads=2)

    return run


@pytest.mark.parametrize("shape, dtype", list(_LARGE.values()), ids=list(_LARGE))
@pytest.mark.usefixtures("path")
def test_blocks_shared_between_two_threads_give_onnxruntimes_values(shape, dtype, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(normalization, "parallel_for", _two_threads(calls))
    model, feeds = _batch_norm_relu(shape, dtype), _input(shape, dtype)
    ops, y = _run(model, feeds)
    assert ops == ["ChannelAffine"]
    assert calls and calls[0] >= 2  # really split into blocks
    np.testing.assert_allclose(y, _onnxruntime(model, feeds), **_tolerance(dtype))


# (48, 64, 20, 20): two blocks of short planes, which numpy would copy through buffers
# of its default size (allocated per call) on a pool thread that kept that size
@pytest.mark.parametrize("shape", [(2, 8, 16, 32), (48, 64, 20, 20)], ids=["one_block", "blocks_on_two_threads"])
@pytest.mark.usefixtures("path")
def test_fused_step_is_captured_and_replays_without_allocating(shape, monkeypatch):
    monkeypatch.setattr(normalization, "parallel_for", _two_threads([]))
    model = _batch_norm_relu(shape)
    session = plugrt.load(model, device="cpu")
    first, second = _input(shape, seed=1), _input(shape, seed=2)
    result = session.try_capture(first)
    assert isinstance(result, Captured)
    assert result.report.seams == []
    for feeds in (first, second):
        np.testing.assert_array_equal(session.replay(feeds)["y"], session.run(feeds)["y"])
    assert replay_bytes(lambda: session.replay(second), small_buffers=True) < REPLAY_BYTES


@pytest.mark.slow
def test_densenet_runs_each_batch_norm_and_relu_as_one_step_and_matches_its_expected_output():
    model = {m.name: m for m in light_models()}["densenet121"]
    session = plugrt.load(_with_logits(model.name)[0], device="cpu", profiling=True)
    outputs = list(session.run(model.inputs).values())
    ops = [e["args"]["op_name"] for e in session.profile() if e["cat"] == "Node"]
    assert "BatchNormalization" not in ops and "Relu" not in ops
    assert ops.count("ChannelAffine") == 62
    _check(model, outputs)  # logits against onnxruntime's, then the expected probabilities


@pytest.mark.parametrize("relu", [True, False], ids=["relu", "affine"])
def test_the_compiled_affine_in_place_gives_what_it_gives_apart(relu):
    """``scale_shift_relu_rows`` with ``y`` the same array as ``x`` (an in-place step) runs
    its one-array loop: the values numpy's product then sum give, NaN kept."""
    loops = _gemm.epilogue_loops()
    if loops is None:
        pytest.skip("needs numba's compiled loops")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2 * 6, 37)).astype(np.float32)
    x[3, 5] = np.nan
    multiplier, shift = rng.standard_normal(6).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    expected = x * np.tile(multiplier, 2)[:, None] + np.tile(shift, 2)[:, None]
    if relu:
        expected = np.where(expected < 0, np.float32(0), expected)
    apart, in_place = np.empty_like(x), x.copy()
    loops.scale_shift_relu_rows(x, apart, multiplier, shift, relu, 0, 12)
    loops.scale_shift_relu_rows(in_place, in_place, multiplier, shift, relu, 0, 12)
    np.testing.assert_array_equal(apart, expected)
    np.testing.assert_array_equal(in_place, expected)


def _affine_of_a_dying_intermediate(read_later: bool) -> bytes:
    """DenseNet's pattern: a Concat whose output only the BatchNormalization + Relu reads
    (it dies there), or read again by an Add after it; a last step after it (a step that
    makes a graph output has its output checked, and never runs in place)."""
    tail = "y = Add (r, c)" if read_later else "y = Neg (r)"
    text = f"""
    <ir_version: 8, opset_import: ["" : 15]>
    g (float[1, 16, 32, 32] a, float[1, 16, 32, 32] b) => (float[1, 32, 32, 32] y) {{
        c = Concat <axis = 1> (a, b)
        n = BatchNormalization <epsilon = 0.001> (c, scale, bias, mean, var)
        r = Relu (n)
        {tail}
    }}
    """
    model = onnx.parser.parse_model(text)
    rng = np.random.default_rng(3)
    constants = {
        "scale": rng.standard_normal(32), "bias": rng.standard_normal(32), "mean": rng.standard_normal(32),
        "var": rng.random(32) + 0.5,
    }
    model.graph.initializer.extend(numpy_helper.from_array(v.astype(np.float32), k) for k, v in constants.items())
    return model.SerializeToString()


def _feeds_of_two(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((1, 16, 32, 32)).astype(np.float32) for name in ("a", "b")}


def _in_place_steps(session: Any) -> list[str]:
    """The plan's kernels wrapped to write over their first input."""
    return [
        name for name, value in session._plan._fn.__globals__.items()
        if getattr(value, "__qualname__", "").startswith("_in_place")
    ]


@pytest.mark.parametrize("read_later", [False, True], ids=["dies-there", "read-later"])
@pytest.mark.usefixtures("path")
def test_the_affine_writes_over_an_input_that_dies_at_it_and_only_then(read_later):
    model = _affine_of_a_dying_intermediate(read_later)
    session = plugrt.load(model, device="cpu")
    steps = [step.op_type for step in session._plan.steps]
    assert steps == ["Concat", "ChannelAffine", "Add" if read_later else "Neg"]
    assert _in_place_steps(session) == ([] if read_later else ["k1"])
    feeds = _feeds_of_two(4)
    expected = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    for _ in range(2):  # the second run's buffers come from the first's
        np.testing.assert_allclose(session.run(feeds)["y"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("path")
def test_the_affine_in_place_is_captured_and_replays_without_allocating():
    session = plugrt.load(_affine_of_a_dying_intermediate(False), device="cpu")
    first, second = _feeds_of_two(5), _feeds_of_two(6)
    result = session.try_capture(first)
    assert isinstance(result, Captured) and result.report.seams == []
    for feeds in (first, second):
        np.testing.assert_array_equal(session.replay(feeds)["y"], session.run(feeds)["y"])
    assert replay_bytes(lambda: session.replay(second), small_buffers=True) < REPLAY_BYTES
