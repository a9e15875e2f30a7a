"""MatMulNBits from its packed weights against onnxruntime: every int8 body this host has
(AVX-512 VNNI, AVX2, portable; forced by PLUGRT_INT4_BODY) and the numpy path, at
accuracy_level 1 (float products) and 4 (int8 activations), one row and several, with and
without zero points, ragged N and K."""

from __future__ import annotations

import sys

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper

import plugrt
from plugrt_cpu.kernels import _compiled, contrib_quantization
from plugrt_cpu.kernels._int4_layout import ROWS, pack

from cpu.numba_paths import _forget_loaders

BODIES = ["vnni", "avx2", "portable"]

# (rows of A, N, K, block_size, zero points)
SHAPES = [
    (1, 37, 70, 32, False),  # N and K both ragged: a short last tile, a partial last block
    (1, 48, 64, 32, True),
    (4, 100, 200, 64, True),
    (3, 33, 256, 128, False),
    (1, 960, 576, 32, False),  # a decoder's QKV projection
    (7, 17, 96, 32, True),
]


def _model(n: int, k: int, block_size: int, accuracy: int, zero_points: bool, bits: int = 4, seed: int = 0) -> bytes:
    blocks = -(-k // block_size)
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, blocks, block_size * bits // 8), dtype=np.uint8)
    scales = (rng.random(n * blocks, dtype=np.float32) * 0.05 + 0.01).astype(np.float32)
    initializers = [
        helper.make_tensor("B", TensorProto.UINT8, b.shape, b.tobytes(), raw=True),
        helper.make_tensor("scales", TensorProto.FLOAT, scales.shape, scales),
    ]
    inputs = ["A", "B", "scales"]
    if zero_points:
        zeros = rng.integers(0, 256, (n * -(-blocks * bits // 8),), dtype=np.uint8)
        initializers.append(helper.make_tensor("zero_points", TensorProto.UINT8, zeros.shape, zeros.tobytes(), raw=True))
        inputs.append("zero_points")
    node = helper.make_node(
        "MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=block_size, accuracy_level=accuracy
    )
    graph = helper.make_graph(
        [node],
        "matmul_nbits",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model.SerializeToString()


def _onnxruntime(model: bytes, a: np.ndarray) -> np.ndarray:
    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"A": a})[0]


def _relative(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


@pytest.fixture(params=BODIES + ["numpy"])
def path(request, monkeypatch):
    """Each compiled int8 body (skipped without numba or where the CPU lacks it), with the
    numpy path made to fail if it runs; or the numpy path (PLUGRT_NUMBA=0)."""
    if request.param == "numpy":
        monkeypatch.setenv("PLUGRT_NUMBA", "0")
        _forget_loaders()
        yield "numpy"
        _forget_loaders()
        return
    pytest.importorskip("numba")
    monkeypatch.setenv("PLUGRT_NUMBA", "wait")
    _compiled._mode.cache_clear()
    loops = _compiled.compiled_module("_numba_int4")
    if loops is None:
        pytest.skip("the compiled loops are off here")
    if request.param not in loops.bodies():
        pytest.skip(f"this CPU has no {request.param} instructions")
    monkeypatch.setenv("PLUGRT_INT4_BODY", request.param)

    def numpy_rows(*args, **kwargs):
        raise AssertionError("the numpy path ran where the compiled kernels apply")

    monkeypatch.setattr(contrib_quantization, "_nbits_rows", numpy_rows)
    yield request.param
    _compiled._mode.cache_clear()


@pytest.mark.parametrize("rows, n, k, block_size, zero_points", SHAPES)
def test_accuracy_level_1_matches_onnxruntime(path, rows, n, k, block_size, zero_points):
    model = _model(n, k, block_size, 1, zero_points)
    a = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    got = plugrt.load(model).run({"A": a})["Y"]
    assert _relative(got, _onnxruntime(model, a)) <= 1e-4


def _int8_reference(a: np.ndarray, n: int, k: int, block_size: int, zero_points: bool) -> np.ndarray:
    """``_model``'s product with A quantized as onnxruntime's CompInt8 path documents it: per
    row and block, scale = max|a| / 127 and q = round-half-even(a * (127 / max|a|)); the
    int8 x int4 products summed exactly, then scaled (float64; independent of both runtimes)."""
    blocks = -(-k // block_size)
    rng = np.random.default_rng(0)  # _model's draws, in its order
    b = rng.integers(0, 256, (n, blocks, block_size // 2), dtype=np.uint8)
    scales = (rng.random(n * blocks, dtype=np.float32) * 0.05 + 0.01).astype(np.float32).reshape(n, blocks)
    nibbles = np.stack((b & 15, b >> 4), axis=-1).reshape(n, blocks, block_size).astype(np.float64)
    if zero_points:
        packed = rng.integers(0, 256, (n * -(-blocks // 2),), dtype=np.uint8).reshape(n, -1)
        zeros = np.stack((packed & 15, packed >> 4), axis=-1).reshape(n, -1)[:, :blocks].astype(np.float64)
    else:
        zeros = np.full((n, blocks), 8.0)
    weights = nibbles - zeros[..., None]
    padded = np.zeros((a.shape[0], blocks * block_size), np.float32)
    padded[:, :k] = a
    padded = padded.reshape(a.shape[0], blocks, block_size)
    peak = np.abs(padded).max(axis=-1, keepdims=True)
    inverse = np.where(peak != 0, np.float32(127) / np.where(peak != 0, peak, 1), 0).astype(np.float32)
    q = np.rint(padded * inverse).astype(np.float64)  # rint: round half to even, as the vector conversion does
    a_scale = (peak / np.float32(127)).astype(np.float32)[..., 0].astype(np.float64)
    return np.einsum("rbk,nbk,rb,nb->rn", q, weights, a_scale, scales.astype(np.float64))


@pytest.mark.parametrize("rows, n, k, block_size, zero_points", SHAPES)
def test_accuracy_level_4_quantizes_activations_as_onnxruntime_does(path, rows, n, k, block_size, zero_points):
    """Not only within the spread: the int8 activations are onnxruntime's own (same scale,
    same rounding), so the product is onnxruntime's acc4 and an independent int8 reference
    to float32 rounding, ~100 times closer than the acc1-vs-acc4 spread. (Across a
    decoder's layers the two runtimes' last-bit float differences still turn some
    roundings the other way: ``benchmarks/decoder_logits.py`` measures that.)"""
    a = np.random.default_rng(2).standard_normal((rows, k)).astype(np.float32)
    model = _model(n, k, block_size, 4, zero_points)
    got = plugrt.load(model).run({"A": a})["Y"]
    reference = _int8_reference(a, n, k, block_size, zero_points)
    quantized = _onnxruntime(model, a)
    assert _relative(quantized, reference) <= 2e-6  # the reference is onnxruntime's quantization
    assert _relative(got, reference) <= 2e-6
    assert _relative(got, quantized) <= 2e-6


@pytest.mark.parametrize("rows, n, k, block_size, zero_points", SHAPES)
def test_accuracy_level_4_is_within_onnxruntimes_own_spread(path, rows, n, k, block_size, zero_points):
    """int8 activations move the result by design: plugrt's acc4 must stay as close to
    onnxruntime's acc4 as onnxruntime's acc1 and acc4 are to each other."""
    a = np.random.default_rng(2).standard_normal((rows, k)).astype(np.float32)
    exact = _onnxruntime(_model(n, k, block_size, 1, zero_points), a)
    model = _model(n, k, block_size, 4, zero_points)
    quantized = _onnxruntime(model, a)
    spread = _relative(quantized, exact)
    assert spread > 0  # onnxruntime did quantize its activations
    got = plugrt.load(model).run({"A": a})["Y"]
    assert _relative(got, quantized) <= spread


def test_one_session_serves_one_row_and_many(path):
    """A decode step's one row and a prompt's many, alternating, through one session (each
    row count keeps its own buffers)."""
    model = _model(96, 128, 32, 4, True)
    session = plugrt.load(model)
    for rows in (1, 9, 1, 9, 3):
        a = np.random.default_rng(rows).standard_normal((rows, 128)).astype(np.float32)
        np.testing.assert_allclose(session.run({"A": a})["Y"], _onnxruntime(model, a), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits, block_size", [(2, 32), (8, 32), (4, 16)])
def test_other_widths_and_blocks_stay_correct(bits, block_size):
    """Widths and blocks the compiled kernels do not take go the numpy way, still exact."""
    model = _model(40, 96, block_size, 1, True, bits=bits)
    a = np.random.default_rng(3).standard_normal((2, 96)).astype(np.float32)
    try:
        expected = _onnxruntime(model, a)
    except Exception as e:  # noqa: BLE001  (an onnxruntime without this width)
        pytest.skip(f"onnxruntime does not run bits={bits}: {e}")
    assert _relative(plugrt.load(model).run({"A": a})["Y"], expected) <= 1e-5


def test_numpy_path_dequantizes_a_slab_of_rows_at_a_time(monkeypatch):
    """Without numba no float copy of the whole weight is made: the weight is dequantized
    a bounded slab of rows at a time."""
    monkeypatch.setenv("PLUGRT_NUMBA", "0")
    _forget_loaders()
    n, k = 4096, 512
    seen: list[int] = []
    real = contrib_quantization._nbits_rows

    def spy(*args, **kwargs):
        slab = real(*args, **kwargs)
        seen.append(slab.shape[0])
        return slab

    monkeypatch.setattr(contrib_quantization, "_nbits_rows", spy)
    model = _model(n, k, 32, 1, False)
    a = np.random.default_rng(4).standard_normal((1, k)).astype(np.float32)
    got = plugrt.load(model).run({"A": a})["Y"]
    _forget_loaders()
    assert _relative(got, _onnxruntime(model, a)) <= 1e-4
    assert sum(seen) == n and max(seen) * k * 4 <= contrib_quantization._slab_bytes()


def test_pack_keeps_half_a_byte_a_weight_in_the_documented_layout():
    """Every 4-bit value lands where the layout says (chunk c of group s: byte r * 4 + j,
    low nibble k = 32 s + 4 c + j, high nibble k + 16), and nothing else is added."""
    n, k, block_size = 40, 96, 32
    blocks = k // block_size
    rng = np.random.default_rng(5)
    b = rng.integers(0, 256, (n, blocks, block_size // 2), dtype=np.uint8)
    scales = rng.random(n * blocks, dtype=np.float32)
    weights, tiled_scales, zeros = pack(b, scales, None, n, k, block_size)
    tiles = -(-n // ROWS)
    assert zeros is None and weights.nbytes == tiles * ROWS * k // 2
    flat = b.reshape(n, k // 2)
    values = np.empty((n, k), np.uint8)
    values[:, 0::2], values[:, 1::2] = flat & 15, flat >> 4  # onnx: element 2i low, 2i + 1 high
    for row in (0, 15, 16, 39):
        t, r = divmod(row, ROWS)
        for kk in (0, 5, 16, 31, 33, 95):
            block, inner = divmod(kk, block_size)
            group, within = divmod(inner, 32)
            high, rest = divmod(within, 16)
            c, j = divmod(rest, 4)
            byte = weights[t, block, group * 4 + c, r * 4 + j]
            assert (byte >> 4 if high else byte & 15) == values[row, kk]
        assert np.array_equal(tiled_scales[t, :, r], scales.reshape(n, blocks)[row])
    assert not weights[tiles - 1, :, :, (n % ROWS) * 4 :].any()  # rows past N are zero


def test_unknown_or_missing_body_is_refused(monkeypatch):
    pytest.importorskip("numba")
    monkeypatch.setenv("PLUGRT_NUMBA", "wait")
    _compiled._mode.cache_clear()
    loops = _compiled.compiled_module("_numba_int4")
    _compiled._mode.cache_clear()
    if loops is None:
        pytest.skip("the compiled loops are off here")
    with pytest.raises(ValueError, match="choose one of vnni, avx2, portable"):
        loops.choose_body("sse9")
    assert loops.choose_body() == loops.bodies()[0]


@pytest.mark.parametrize("accuracy", [1, 4])
@pytest.mark.parametrize("rows", [1, 40])
def test_products_shared_over_threads_match_onnxruntime(path, monkeypatch, accuracy, rows):
    """Two threads (forced, whatever the load) share a product's tiles on the compiled pool,
    each float multi-row tile in its own table; the result is the one thread's."""
    if path == "numpy":
        pytest.skip("the numpy path threads inside BLAS")
    from plugrt_cpu.kernels._compiled_parallel import compiled_pool

    if compiled_pool() is None:
        pytest.skip("no compiled pool here")
    monkeypatch.setattr(contrib_quantization, "threads_for", lambda work: 2)
    model = _model(1000, 576, 32, accuracy, True)
    a = np.random.default_rng(6).standard_normal((rows, 576)).astype(np.float32)
    got = plugrt.load(model).run({"A": a})["Y"]
    if accuracy == 1:
        assert _relative(got, _onnxruntime(model, a)) <= 1e-4
    else:
        exact = _onnxruntime(_model(1000, 576, 32, 1, True), a)
        quantized = _onnxruntime(model, a)
        assert _relative(got, quantized) <= _relative(quantized, exact)


def test_the_numpy_path_says_once_how_to_get_the_compiled_kernels(monkeypatch, caplog):
    monkeypatch.setenv("PLUGRT_NUMBA", "0")
    monkeypatch.setattr(contrib_quantization, "_HINTED", [])
    _forget_loaders()
    with caplog.at_level("WARNING", logger="plugrt"):
        for seed in (0, 1):
            plugrt.load(_model(48, 64, 32, 4, False, seed=seed))
    _forget_loaders()
    hints = [r.getMessage() for r in caplog.records if "MatMulNBits" in r.getMessage()]
    assert len(hints) == 1
    assert "PLUGRT_NUMBA=0" in hints[0] and "plugrt[accelerate]" in hints[0]


def _resident_kib_of(path: str) -> int:
    """KiB of ``path``'s pages this process has mapped resident (every map of it)."""
    total, current = 0, ""
    with open("/proc/self/smaps") as maps:
        for line in maps:
            fields = line.split()
            if fields and "-" in fields[0] and not fields[0].endswith(":"):
                current = fields[5] if len(fields) > 5 else ""
            elif fields and fields[0] == "Rss:" and current == path:
                total += int(fields[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_external_4bit_weights_leave_no_pages_of_their_file_mapped_once_repacked(tmp_path):
    # eight 4-bit weights of 256 x 512 in one external file: each is read once to repack it,
    # then none of the file's pages (the neighbours the kernel maps around a fault included)
    # need stay in this process's resident memory
    import onnx

    if not _compiled.compiled_enabled():
        pytest.skip("the repacked layout is the compiled kernels' (numba)")
    rng = np.random.default_rng(3)
    n, k, block, layers = 256, 512, 32, 8
    nodes, weights = [], []
    for i in range(layers):
        b = rng.integers(0, 256, (n, k // block, block // 2), dtype=np.uint8)
        scales = rng.random((n * (k // block),), dtype=np.float32)
        weights += [onnx.numpy_helper.from_array(b, f"b{i}"), onnx.numpy_helper.from_array(scales, f"s{i}")]
        last = i + 1 == layers
        product = f"x{layers}" if last else f"y{i}"
        nodes.append(helper.make_node("MatMulNBits", [f"x{i}", f"b{i}", f"s{i}"], [product], domain="com.microsoft",
                                      K=k, N=n, bits=4, block_size=block))
        if not last:  # N = K / 2: widened back for the next layer
            nodes.append(helper.make_node("Concat", [product, product], [f"x{i + 1}"], axis=-1))
    graph = helper.make_graph(
        nodes, "stack", [helper.make_tensor_value_info("x0", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info(f"x{layers}", TensorProto.FLOAT, None)], weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    path = tmp_path / "stack.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="stack.data", size_threshold=0)
    plugrt.load(str(path), device="cpu")
    assert _resident_kib_of(str(tmp_path / "stack.data")) <= 16  # of 640 KiB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_a_large_external_weight_is_let_go_of_slab_by_slab_as_it_is_repacked(tmp_path, monkeypatch):
    # a 4 MiB weight (16384 x 512, 4 bits) repacked a 1 MiB slab at a time: after each slab
    # is read, less than a slab of the file stays resident (the whole weight did, beside its
    # copy, until the end of its repacking)
    import onnx

    if not _compiled.compiled_enabled():
        pytest.skip("the repacked layout is the compiled kernels' (numba)")
    n, k, block = 16384, 512, 32
    rng = np.random.default_rng(4)
    b = rng.integers(0, 256, (n, k // block, block // 2), dtype=np.uint8)
    scales = rng.random((n * (k // block),), dtype=np.float32)
    node = helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=block)
    graph = helper.make_graph(
        [node], "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        [onnx.numpy_helper.from_array(b, "b"), onnx.numpy_helper.from_array(scales, "s")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    path = tmp_path / "head.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="head.data", size_threshold=0)
    resident: list[int] = []
    release = contrib_quantization._release_range

    def recorded(array):
        release(array)
        resident.append(_resident_kib_of(str(tmp_path / "head.data")))

    monkeypatch.setattr(contrib_quantization, "_release_range", recorded)
    session = plugrt.load(str(path), device="cpu")
    assert len(resident) >= 4 and max(resident) < 1024, resident
    x = rng.standard_normal((1, k)).astype(np.float32)
    expected = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(session.run({"x": x})["y"], expected, rtol=1e-4, atol=1e-4)


def _kernel(model: bytes):
    """The MatMulNBits kernel ``_model`` describes, built as the provider builds it."""
    import onnx
    from onnx import numpy_helper

    from plugrt_cpu._registry import KernelContext

    proto = onnx.load_from_string(model)
    node = proto.graph.node[0]
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    constants = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    inputs = [constants.get(name) for name in node.input]
    ctx = KernelContext(
        "MatMulNBits", "com.microsoft", 1, attributes, len(inputs), 1,
        [np.dtype(np.float32)] + [None if v is None else v.dtype for v in inputs[1:]], inputs,
    )
    return contrib_quantization.matmul_nbits(ctx), inputs[1:]


@pytest.mark.parametrize("accuracy", [1, 4])
@pytest.mark.parametrize("rows, n, k", [(1, 1000, 576), (1, 37, 70), (40, 1000, 576)])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_bound_product_follows_its_input_as_into_does(path, monkeypatch, accuracy, rows, n, k, threads):
    """``into.bind`` (what a capture replays): one call over fixed buffers, which reads
    what the input holds at each call and writes what ``into`` writes, on one thread or
    sharing the tiles over two; a non-contiguous input is left to ``into``."""
    if path == "numpy":
        pytest.skip("only the compiled kernels bind")
    from plugrt_cpu.kernels._compiled_parallel import compiled_pool

    if threads == 2 and compiled_pool() is None:
        pytest.skip("no compiled pool here")
    monkeypatch.setattr(contrib_quantization, "threads_for", lambda work: threads)
    kernel, constants = _kernel(_model(n, k, 32, accuracy, True))
    rng = np.random.default_rng(9)
    a = np.empty((rows, k), np.float32)
    out = np.empty((rows, n), np.float32)
    replay = kernel.into.bind(out, a, *constants)
    assert replay is not None
    for _ in range(3):
        a[...] = rng.standard_normal((rows, k))
        replay()
        expected = np.empty_like(out)
        kernel.into(expected, a.copy(), *constants)
        np.testing.assert_array_equal(out, expected)
    assert kernel.into.bind(out, np.empty((rows, 2 * k), np.float32)[:, ::2], *constants) is None


@pytest.mark.parametrize("accuracy", [1, 4])
def test_a_captured_decode_projection_replays_like_onnxruntime_without_allocating(path, accuracy):
    """A captured one-row product (a decode step's) replays, on new inputs, what a run
    gives, within onnxruntime's figures, and allocates nothing."""
    if path == "numpy":
        pytest.skip("the numpy path allocates its slab")
    from plugrt.capture import Captured

    from cpu.test_into import REPLAY_BYTES, replay_bytes

    model = _model(1536, 576, 32, accuracy, False)
    session = plugrt.load(model)
    rng = np.random.default_rng(3)
    feeds = [{"A": rng.standard_normal((1, 576)).astype(np.float32)} for _ in range(3)]
    captured = session.try_capture(feeds[0])
    assert isinstance(captured, Captured) and captured.report.seams == []
    exact = _model(1536, 576, 32, 1, False)
    for f in feeds[1:] + feeds[:1]:
        got = session.replay(f)["Y"]
        np.testing.assert_array_equal(got, session.run(f)["Y"])
        if accuracy == 1:
            assert _relative(got, _onnxruntime(model, f["A"])) <= 1e-4
        else:
            quantized = _onnxruntime(model, f["A"])
            assert _relative(got, quantized) <= _relative(quantized, _onnxruntime(exact, f["A"]))
    assert replay_bytes(lambda: session.replay(feeds[1]), small_buffers=True) < REPLAY_BYTES


@pytest.mark.parametrize("rows", [8, 11, 64])
def test_a_prompts_rows_give_bitwise_what_each_row_gives_alone(path, rows):
    """accuracy_level 4 with several rows of A: the multi-row tiles (INT8_ROWS rows a pass,
    the rest one at a time) give each row exactly what that row gives alone."""
    if path == "numpy":
        pytest.skip("the numpy path's BLAS sums a block of rows in its own order")
    model = _model(200, 576, 32, 4, True)
    a = np.random.default_rng(12).standard_normal((rows, 576)).astype(np.float32)
    session = plugrt.load(model)
    together = session.run({"A": a})["Y"]
    alone = np.concatenate([session.run({"A": a[i : i + 1]})["Y"] for i in range(rows)])
    np.testing.assert_array_equal(together, alone)


def _chain(layers: int, width: int, accuracy: int) -> bytes:
    """``layers`` MatMulNBits in a row, each width x width with its own weights."""
    rng = np.random.default_rng(layers)
    blocks = width // 32
    nodes, initializers = [], []
    for i in range(layers):
        b = rng.integers(0, 256, (width, blocks, 16), dtype=np.uint8)
        scales = (rng.random(width * blocks, dtype=np.float32) * 0.02 + 0.005).astype(np.float32)
        initializers += [
            helper.make_tensor(f"B{i}", TensorProto.UINT8, b.shape, b.tobytes(), raw=True),
            helper.make_tensor(f"s{i}", TensorProto.FLOAT, scales.shape, scales),
        ]
        nodes.append(helper.make_node(
            "MatMulNBits", ["A" if i == 0 else f"h{i}", f"B{i}", f"s{i}"], [f"h{i + 1}" if i < layers - 1 else "Y"],
            domain="com.microsoft", K=width, N=width, bits=4, block_size=32, accuracy_level=accuracy,
        ))
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", width])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", width])], initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model.SerializeToString()


@pytest.mark.parametrize("accuracy", [1, 4])
def test_a_prompt_through_many_products_holds_the_buffers_of_one(path, accuracy):
    """The products a thread runs eagerly share its activation buffers (A quantized, A
    padded): ten more products on a 64-row prompt hold less than half the int8 copy of A
    they would hold with a set each, and still match onnxruntime."""
    import tracemalloc

    rows, width = 64, 512
    a = np.random.default_rng(5).standard_normal((rows, width)).astype(np.float32)

    def retained(layers: int) -> int:
        model = _chain(layers, width, accuracy)
        session = plugrt.load(model)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            got = session.run({"A": a})["Y"]
            held = tracemalloc.get_traced_memory()[0] - before - got.nbytes
        finally:
            tracemalloc.stop()
        expected = _onnxruntime(model, a)
        if accuracy == 1:
            assert _relative(got, expected) <= 1e-4
        else:  # int8 activations through a chain: within onnxruntime's acc1-vs-acc4 spread
            assert _relative(got, expected) <= _relative(expected, _onnxruntime(_chain(layers, width, 1), a))
        return held

    retained(2)  # the first products of these shapes on this thread
    assert retained(12) - retained(2) < 10 * rows * width // 2
