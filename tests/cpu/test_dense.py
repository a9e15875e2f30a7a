"""The dense layers' products (plugrt_cpu.kernels.dense): the packed-kernel body and the BLAS body against onnxruntime, onnx.reference and float64 numpy."""

from __future__ import annotations

import time

import os
import sys
from pathlib import Path
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
from plugrt_cpu.kernels import dense

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cpu.test_into import REPLAY_BYTES, replay_bytes  # noqa: E402


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


class _Counting:
    """``_numba_dense`` with its ``panel_product`` calls counted."""

    def __init__(self, loops: Any) -> None:
        self.loops = loops
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loops, name)

    def panel_product(self, *args: Any) -> None:
        self.calls += 1
        self.loops.panel_product(*args)

    def few_rows_product(self, *args: Any) -> None:
        self.calls += 1
        self.loops.few_rows_product(*args)

    @property
    def few_rows_job(self) -> Any:  # a job on the compiled pool: counted as a call
        self.calls += 1
        return self.loops.few_rows_job


@pytest.fixture(params=["packed", "blas"])
def body(request, monkeypatch):
    """Each test with the packed body (skipped where numba or AVX-512 is missing), its
    panels cut in slices of 64 steps so that every K below takes several, and with BLAS;
    yields the counter of packed calls (None for BLAS)."""
    if request.param == "blas":
        monkeypatch.setattr(dense, "packed_kernels", lambda: None)
        yield None
        return
    pytest.importorskip("numba")
    if os.environ.get("PLUGRT_NUMBA", "1") == "0":
        pytest.skip("PLUGRT_NUMBA=0 turns the compiled loops off")
    kernels = dense.packed_kernels()
    if kernels is None:
        pytest.skip("the packed GEMM needs AVX-512")
    counting = _Counting(kernels[1])
    monkeypatch.setattr(dense, "packed_kernels", lambda: (kernels[0], counting))
    monkeypatch.setattr(dense, "slice_depth", lambda: 64)
    monkeypatch.setattr(dense, "preferred_body", lambda key, packed, blas: packed() or True)  # whichever is faster here
    yield counting


def _reference(a: np.ndarray, w: np.ndarray, bias: np.ndarray | None, gelu: int) -> np.ndarray:
    """float64 ``a @ w + bias``, then the GELU ``gelu`` names (0 none, 1 erf, 2 tanh)."""
    y = a.astype(np.float64) @ w.astype(np.float64)
    if bias is not None:
        y = y + bias
    if gelu == dense.GELU_ERF:
        from math import erf

        y = 0.5 * y * (1 + np.vectorize(erf)(y / np.sqrt(2)))
    elif gelu == dense.GELU_TANH:
        y = 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y**3)))
    return y


_GELUS = [dense.GELU_NONE, dense.GELU_ERF, dense.GELU_TANH]


# (rows, K, N): the packed body's tiles of 8 rows by up to three 16-column panels, with a
# short last tile of rows and a ragged last panel; groups of three, two and one panel
# (N 130, 20, 50); K deeper than a slice (450, 3 slices of the L1-sized depth) adds slices
@pytest.mark.parametrize(
    "shape", [(16, 3, 5), (37, 150, 50), (64, 64, 16), (200, 96, 130), (45, 450, 20), (23, 700, 130), (17, 400, 48)]
)
@pytest.mark.parametrize("gelu", _GELUS)
def test_dense_product_matches_float64(body, shape, gelu):
    m, k, n = shape
    a, w, bias = _random(m, k), _random(k, n, seed=1) * 0.2, _random(n, seed=2)
    out = np.full((m, n), np.nan, np.float32)
    applied = dense.dense_product(out, a, w, bias, panels=dense.WeightPanels(w), gelu=gelu)
    expected = _reference(a, w, bias, gelu if applied else dense.GELU_NONE)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    if body is not None:
        assert applied == bool(gelu) and body.calls >= 1
    else:
        assert not applied


# rows under a packed row tile (16): tiles of one, two and four rows (three and five use the
# four-row tile with rows left over); N 150 takes eight-panel groups and a ragged last panel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 15])
@pytest.mark.parametrize("gelu", _GELUS)
def test_fewer_rows_than_a_tile_stream_the_weight_panels(body, rows, gelu):
    a, w, bias = _random(rows, 70), _random(70, 150, seed=1) * 0.2, _random(150, seed=2)
    out = np.full((rows, 150), np.nan, np.float32)
    applied = dense.dense_product(out, a, w, bias, panels=dense.WeightPanels(w), gelu=gelu)
    np.testing.assert_allclose(out, _reference(a, w, bias, gelu if applied else dense.GELU_NONE), rtol=1e-4, atol=1e-4)
    if body is not None:
        assert applied == bool(gelu) and body.calls >= 1
    else:
        assert not applied


def test_few_rows_read_from_a_strided_stack(body):
    stack = _random(6, 2, 33)
    a, w = stack[:, 1], _random(33, 40, seed=1)  # rows 66 floats apart
    out = np.full((6, 40), np.nan, np.float32)
    dense.dense_product(out, a, w, None, panels=dense.WeightPanels(w))
    np.testing.assert_allclose(out, _reference(a, w, None, False), rtol=1e-4, atol=1e-4)


def test_few_rows_split_over_threads_give_the_serial_result(body, monkeypatch):
    a, w, bias = _random(3, 300), _random(300, 500, seed=1), _random(500, seed=2)
    serial, split = np.empty((3, 500), np.float32), np.empty((3, 500), np.float32)
    panels = dense.WeightPanels(w)
    monkeypatch.setattr(dense, "parallel_threads", lambda work: 1)
    dense.dense_product(serial, a, w, bias, panels=panels, gelu=True)
    calls = body.calls if body is not None else 0
    monkeypatch.setattr(dense, "parallel_threads", lambda work: 2)
    dense.dense_product(split, a, w, bias, panels=panels, gelu=True)
    np.testing.assert_array_equal(split, serial)
    np.testing.assert_allclose(split, _reference(a, w, bias, body is not None), rtol=1e-4, atol=1e-4)
    if body is not None and dense.compiled_pool() is not None:
        assert body.calls == calls + 1  # one job on the pool


def test_dense_product_reads_rows_of_a_wider_matrix_where_they_are(body):
    wide, w = _random(40, 100), _random(70, 33, seed=1)
    a = wide[:, 20:90]  # rows 100 floats apart
    out = np.full((40, 33), np.nan, np.float32)
    dense.dense_product(out, a, w, None, panels=dense.WeightPanels(w))
    np.testing.assert_allclose(out, _reference(a, w, None, False), rtol=1e-4, atol=1e-4)


def test_dense_product_reads_a_transposed_input(body):
    a, w = _random(40, 70).T, _random(40, 33, seed=1)  # a: (70, 40), column-major
    out = np.empty((70, 33), np.float32)
    dense.dense_product(out, a, w, None, panels=dense.WeightPanels(w))
    np.testing.assert_allclose(out, _reference(a, w, None, False), rtol=1e-4, atol=1e-4)


def test_dense_product_split_over_threads_gives_the_serial_result(body, monkeypatch):
    a, w, bias = _random(50, 80), _random(80, 300, seed=1), _random(300, seed=2)
    serial, split = np.empty((50, 300), np.float32), np.empty((50, 300), np.float32)
    panels = dense.WeightPanels(w)
    monkeypatch.setattr(dense, "parallel_threads", lambda work: 1)
    dense.dense_product(serial, a, w, bias, panels=panels, gelu=True)
    monkeypatch.setattr(dense, "parallel_threads", lambda work: 2)
    monkeypatch.setattr(dense, "PACKED_PARALLEL_MIN_WORK", 0)  # split even this small product
    dense.dense_product(split, a, w, bias, panels=panels, gelu=True)
    np.testing.assert_array_equal(split, serial)


def test_a_kept_job_context_reads_each_call_s_own_operands(body, monkeypatch):
    """The pooled body keeps its job's context per weight and call shape: a second call
    with other activations, into another output, and a third with another bias, each give
    their own product (float64 reference)."""
    monkeypatch.setattr(dense, "parallel_threads", lambda work: 2)
    monkeypatch.setattr(dense, "PACKED_PARALLEL_MIN_WORK", 0)
    w = _random(80, 300, seed=1)
    panels = dense.WeightPanels(w)
    for seed in range(3):
        a, bias = _random(50, 80, seed=10 + seed), _random(300, seed=20 + (seed // 2))
        out = np.full((50, 300), np.nan, np.float32)
        dense.dense_product(out, a, w, bias, panels=panels)
        np.testing.assert_allclose(out, _reference(a, w, bias, False), rtol=1e-4, atol=1e-4)
    if body is not None and dense.compiled_pool() is not None:
        assert len(panels.jobs) >= 1


def test_packed_body_splits_on_the_compiled_pool_below_the_pool_less_bound(body, monkeypatch):
    """With the compiled pool (OpenBLAS kept on one thread beside it), a GPT-2-sized product
    (64 x 256 x 768, under ``PACKED_PARALLEL_MIN_WORK``) is one job of several units on two
    threads, bitwise the one-thread result; without the pool it stays on one thread."""
    if body is None:
        pytest.skip("the BLAS body splits on its own (test_pooled_matmul.py)")
    from plugrt_cpu.kernels._compiled_parallel import compiled_pool

    pool = compiled_pool()
    if pool is None:
        pytest.skip("no compiled pool here")
    a, w, bias = _random(64, 256), _random(256, 768, seed=1) * 0.2, _random(768, seed=2)
    assert 64 * 256 * 768 < dense.PACKED_PARALLEL_MIN_WORK
    panels = dense.WeightPanels(w)
    serial, split, alone = (np.full((64, 768), np.nan, np.float32) for _ in range(3))
    monkeypatch.setattr(dense, "parallel_threads", lambda work: 1)
    dense.dense_product(serial, a, w, bias, panels=panels)
    jobs: list[tuple[int, int]] = []
    run = pool.run

    def counted(job: int, context: Any, count: int, threads: int) -> None:
        jobs.append((count, threads))
        run(job, context, count, threads)

    monkeypatch.setattr(pool, "run", counted)
    monkeypatch.setattr(dense, "parallel_threads", lambda work: 2)
    dense.dense_product(split, a, w, bias, panels=panels)
    assert len(jobs) == 1 and jobs[0][0] > 1 and jobs[0][1] == 2
    np.testing.assert_array_equal(split, serial)
    np.testing.assert_allclose(split, _reference(a, w, bias, False), rtol=1e-4, atol=1e-4)
    chunks: list[int] = []
    monkeypatch.setattr(dense, "compiled_pool", lambda: None)
    monkeypatch.setattr(dense, "parallel_for", lambda count, fn, *args, **kwargs: chunks.append(count))
    dense.dense_product(alone, a, w, bias, panels=panels)
    assert chunks == [] and len(jobs) == 1  # one thread: neither the pool nor parallel_for
    np.testing.assert_array_equal(alone, serial)


@pytest.mark.parametrize("gelu", [False, True])
def test_a_tall_product_splits_by_rows_on_the_pool_and_gives_the_serial_result(body, monkeypatch, gelu):
    """An activation with more rows than the weight has columns (Swin's MLP: 3136 x 96 @ 96
    x 384) is cut into blocks of rows, each unit every panel; with blocks smaller than the
    unit (``cache_rows``) each block runs every panel group and its epilogue in turn. Bitwise
    the one-thread result, and float64 numpy's values."""
    if body is None:
        pytest.skip("the BLAS body splits on its own (test_pooled_matmul.py)")
    from plugrt_cpu.kernels._compiled_parallel import compiled_pool

    pool = compiled_pool()
    if pool is None:
        pytest.skip("no compiled pool here")
    m, k, n = 600, 40, 100
    a, w, bias = _random(m, k), _random(k, n, seed=1) * 0.2, _random(n, seed=2)
    panels = dense.WeightPanels(w)
    serial, split, blocks = (np.full((m, n), np.nan, np.float32) for _ in range(3))
    monkeypatch.setattr(dense, "parallel_threads", lambda work: 1)
    dense.dense_product(serial, a, w, bias, panels=panels, gelu=gelu)
    mr = dense.packed_kernels()[0].MR
    rows, per_unit = dense.unit_shape(m, n, -(-n // 16), 2, mr)
    assert per_unit == -(-n // 16) and rows % mr == 0 and -(-m // rows) >= 4  # blocks of rows, all the panels each
    jobs: list[int] = []
    run = pool.run

    def counted(job: int, context: Any, count: int, threads: int) -> None:
        jobs.append(count)
        run(job, context, count, threads)

    monkeypatch.setattr(pool, "run", counted)
    monkeypatch.setattr(dense, "parallel_threads", lambda work: 2)
    dense.dense_product(split, a, w, bias, panels=panels, gelu=gelu)
    assert jobs == [-(-m // rows)]
    np.testing.assert_array_equal(split, serial)
    monkeypatch.setattr(dense, "cache_rows", lambda m, k, mr: mr)  # blocks of one tile inside each unit
    dense.dense_product(blocks, a, w, bias, panels=panels, gelu=gelu)
    np.testing.assert_array_equal(blocks, serial)
    np.testing.assert_allclose(serial, _reference(a, w, bias, gelu), rtol=1e-4, atol=1e-4)


def test_a_product_whose_weight_is_the_larger_operand_splits_by_panels():
    """ViT-B's MLP (197 x 768 @ 768 x 3072): each unit every row and its own panels, so the
    weight is read once; Swin's (3136 x 96 @ 96 x 384): blocks of rows, all the panels."""
    rows, per_unit = dense.unit_shape(197, 3072, 192, 2, 16)
    assert rows == 208 and per_unit == 24  # every row (13 tiles of 16), 24 of the 192 panels a unit: 8 units
    rows, per_unit = dense.unit_shape(3136, 384, 24, 2, 16)
    assert per_unit == 24 and rows == 400  # every panel, 25 of the 196 row tiles a unit: 8 units
    rows, per_unit = dense.unit_shape(20, 16, 1, 2, 16)  # a tile or two of rows: not cut by rows
    assert rows == 32 and per_unit == 1


def test_cache_rows_fill_half_the_l2_cache_for_one_slice_and_take_every_row_for_several(monkeypatch):
    monkeypatch.setattr(dense, "data_cache_bytes", lambda level, default: {1: 32 * 1024, 2: 1 << 20}[level])
    dense.slice_depth.cache_clear()
    try:
        assert dense.cache_rows(3136, 96, 16) == 1360  # 1360 rows of 96 floats: 510 KiB, half of 1 MiB
        assert dense.cache_rows(197, 3072, 16) == 197  # 3072 > a slice of 128 steps
        assert dense.cache_rows(3, 4096, 16) == 16
    finally:
        dense.slice_depth.cache_clear()


def test_panels_are_not_used_for_another_weight(body):
    w, other = _random(30, 20), _random(30, 20, seed=5)
    a = _random(17, 30, seed=1)
    out = np.empty((17, 20), np.float32)
    dense.dense_product(out, a, other, None, panels=dense.WeightPanels(w))
    np.testing.assert_allclose(out, _reference(a, other, None, False), rtol=1e-4, atol=1e-4)
    assert body is None or body.calls == 0


_LINEAR = """
    <ir_version: 8, opset_import: ["" : 20]>
    linear (float[B, S, K] x) => (float[B, S, N] y) {
        m = MatMul (x, w)
        h = Add (m, b)
        ACTIVATION
    }
"""


def _linear(k: int, n: int, gelu: bool, weight_input: bool = False) -> bytes:
    text = _LINEAR.replace("ACTIVATION", 'y = Gelu <approximate = "none"> (h)' if gelu else "y = Identity (h)")
    if weight_input:
        text = text.replace("(float[B, S, K] x)", "(float[B, S, K] x, float[K, N] w)")
    model = onnx.parser.parse_model(text.replace("K", str(k)).replace("N", str(n)))
    constants = {"b": _random(n, seed=2)} if weight_input else {"w": _random(k, n, seed=1) * 0.2, "b": _random(n, seed=2)}
    model.graph.initializer.extend(numpy_helper.from_array(a, name) for name, a in constants.items())
    onnx.checker.check_model(model)
    return model.SerializeToString()


@pytest.mark.parametrize("gelu", [False, True])
def test_linear_layer_matches_onnxruntime_and_the_reference(body, gelu):
    model = _linear(150, 70, gelu)
    feeds = {"x": _random(2, 19, 150, seed=3)}
    session = plugrt.load(model, device="cpu", profiling=True)
    ours = session.run(feeds)["y"]
    ops = [e["args"]["op_name"] for e in session.profile() if e["cat"] == "Node"]
    assert ops == (["FusedMatMulGelu"] if gelu else ["FusedMatMul", "Identity"])
    theirs = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    reference = onnx.reference.ReferenceEvaluator(model).run(None, feeds)[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)
    if body is not None:
        assert body.calls >= 1


def test_linear_layer_with_a_weight_fed_at_run_time_uses_blas(body):
    model = _linear(40, 24, True, weight_input=True)
    feeds = {"x": _random(2, 19, 40, seed=3), "w": _random(40, 24, seed=4)}
    ours = plugrt.load(model, device="cpu").run(feeds)["y"]
    theirs = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    assert body is None or body.calls == 0


def _replays_like_runs_without_allocating(session, first: dict, second: dict, rounds: tuple) -> None:
    """A capture with no seams whose replays equal eager runs on ``rounds`` of feeds and
    allocate less than REPLAY_BYTES."""
    captured = session.try_capture(first)
    assert isinstance(captured, Captured) and captured.report.seams == []
    for feeds in rounds:
        np.testing.assert_array_equal(session.replay(feeds)["y"], session.run(feeds)["y"])
    assert replay_bytes(lambda: session.replay(second), small_buffers=True) < REPLAY_BYTES


@pytest.mark.parametrize("gelu", [False, True])
def test_linear_layer_is_captured_and_replays_without_allocating(body, gelu):
    session = plugrt.load(_linear(150, 70, gelu), device="cpu")
    first, second = {"x": _random(2, 19, 150, seed=3)}, {"x": _random(2, 19, 150, seed=4)}
    _replays_like_runs_without_allocating(session, first, second, (first, second, first))


_GEMM = """
    <ir_version: 8, opset_import: ["" : 13]>
    gemm (float[M, 150] a) => (float[M, 70] y) {
        y = Gemm <transB = 1, alpha = ALPHA, beta = BETA> (a, w, c)
    }
"""

_MATMUL = """
    <ir_version: 8, opset_import: ["" : 13]>
    matmul (float[B, S, 150] a) => (float[B, S, 70] y) {
        y = MatMul (a, w)
    }
"""


def _with(text: str, **constants: np.ndarray) -> bytes:
    model = onnx.parser.parse_model(text)
    model.graph.initializer.extend(numpy_helper.from_array(a, name) for name, a in constants.items())
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _matches_onnxruntime(model: bytes, feeds: dict[str, np.ndarray]) -> None:
    ours = plugrt.load(model, device="cpu").run(feeds)["y"]
    theirs = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("alpha, beta", [(1.0, 1.0), (0.5, 2.0)])
@pytest.mark.parametrize("c_shape", [(70,), (1, 70), (23, 70)])
def test_gemm_with_a_constant_weight_matches_onnxruntime(body, alpha, beta, c_shape):
    text = _GEMM.replace("ALPHA", str(alpha)).replace("BETA", str(beta))
    model = _with(text, w=_random(70, 150, seed=1) * 0.2, c=_random(*c_shape, seed=2))
    _matches_onnxruntime(model, {"a": _random(23, 150, seed=3)})
    if body is not None:
        assert body.calls >= 1


def test_matmul_with_a_constant_weight_matches_onnxruntime_and_replays_without_allocating(body):
    model = _with(_MATMUL, w=_random(150, 70, seed=1) * 0.2)
    first, second = {"a": _random(2, 19, 150, seed=3)}, {"a": _random(2, 19, 150, seed=4)}
    _matches_onnxruntime(model, first)
    session = plugrt.load(model, device="cpu")
    _replays_like_runs_without_allocating(session, first, second, (first, second))
    if body is not None:
        assert body.calls >= 1


_CHANNELS_LAST = """
    <ir_version: 8, opset_import: ["" : 20]>
    block (float[1, 24, 5, 7] x) => (float[1, 5, 7, 40] y) {
        t = Transpose <perm = [0, 2, 3, 1]> (x)
        m = MatMul (t, w)
        h = Add (m, b)
        y = Gelu <approximate = "none"> (h)
    }
"""


def test_linear_layer_of_a_transposed_stack_matches_onnxruntime_and_replays_without_allocating(body):
    model = _with(_CHANNELS_LAST, w=_random(24, 40, seed=1) * 0.3, b=_random(40, seed=2))
    first, second = {"x": _random(1, 24, 5, 7, seed=3)}, {"x": _random(1, 24, 5, 7, seed=4)}
    _matches_onnxruntime(model, first)
    session = plugrt.load(model, device="cpu")
    _replays_like_runs_without_allocating(session, first, second, (first, second))
    if body is not None:
        assert body.calls >= 1


def test_matrix_rows_copies_a_strided_stack_only_into_a_work_array():
    a = _random(2, 3, 4).transpose(1, 0, 2)  # (3, 2, 4), not C-contiguous
    w, out = _random(4, 5), np.empty((3, 2, 5), np.float32)
    assert dense.matrix_rows(out, a, w, None) is None
    rows = dense.matrix_rows(out, a, w, None, dense.new_array)
    assert rows is not None and rows.shape == (6, 4)
    np.testing.assert_array_equal(rows, a.reshape(6, 4))


def test_the_first_product_measures_and_every_later_one_keeps_the_faster(monkeypatch):
    monkeypatch.setattr(dense, "_PREFERRED", {"packed": None, "measured": None})
    runs = []

    def body(name: str, seconds: float):
        def run() -> None:
            runs.append(name)
            time.sleep(seconds)

        return run

    slow_blas, fast_packed = body("blas", 0.01), body("packed", 0.0)
    key = (64, 32, 16, 1, False)
    assert dense.preferred_body(key, fast_packed, slow_blas) is True
    trials = dense.TRIAL_CALLS
    assert runs == ["packed", "blas"] + ["packed", "blas"] * trials + ["packed"]  # ends with the faster
    assert dense._PREFERRED["measured"] == key
    runs.clear()
    assert [dense.preferred_body(key, fast_packed, slow_blas) for _ in range(3)] == [True] * 3
    assert runs == ["packed"] * 3  # kept: one product a call
    runs.clear()
    # another shape, whose BLAS would be faster: the process's choice holds (no mix of bodies)
    assert dense.preferred_body((8, 8, 8, 2, False), body("packed", 0.01), body("blas", 0.0)) is True
    assert runs == ["packed"]


@pytest.mark.parametrize("blas_seconds, packed_kept", [(0.9, True), (0.86, True), (0.8, False), (0.5, False), (1.2, True)])
def test_blas_is_kept_only_when_clearly_faster_than_the_packed_body(monkeypatch, blas_seconds, packed_kept):
    """The trial's times on a clock the bodies advance (1 s a packed call): BLAS wins only
    under ``BLAS_CLEARLY_FASTER`` of the packed body's time."""
    monkeypatch.setattr(dense, "_PREFERRED", {"packed": None, "measured": None})

    class Clock:
        now = 0.0

        def perf_counter(self) -> float:
            return self.now

    clock = Clock()
    monkeypatch.setattr(dense, "time", clock)

    def body(seconds: float):
        def run() -> None:
            clock.now += seconds

        return run

    assert dense.BLAS_CLEARLY_FASTER == 0.85
    assert dense.preferred_body((64, 256, 768, 2, False), body(1.0), body(blas_seconds)) is packed_kept
    assert dense._PREFERRED["packed"] is packed_kept


@pytest.mark.parametrize("gelu", [False, True])
def test_every_call_gives_the_right_values_whichever_body_a_shape_keeps(gelu, monkeypatch):
    """The measuring call and the later ones: each call's output and the GELU flag it
    returns agree, whichever body the process keeps."""
    if dense.packed_kernels() is None:
        pytest.skip("the packed GEMM needs numba and AVX-512")
    monkeypatch.setattr(dense, "_PREFERRED", {"packed": None, "measured": None})
    a, w, bias = _random(40, 64), _random(64, 48, seed=1) * 0.2, _random(48, seed=2)
    panels = dense.WeightPanels(w)

    def gelu_pass(out):
        out[...] = _reference(a, w, bias, True)  # the caller's GELU (here: the exact one)
        return True

    flags = []
    for _ in range(3):
        out = np.full((40, 48), np.nan, np.float32)
        applied = dense.dense_product(out, a, w, bias, panels=panels, gelu=gelu, gelu_pass=gelu_pass)
        flags.append(applied)
        np.testing.assert_allclose(out, _reference(a, w, bias, applied), rtol=1e-4, atol=1e-4)
    assert flags == [gelu] * len(flags)  # the packed body fuses it, the BLAS one runs the pass
    assert dense._PREFERRED["packed"] is not None
