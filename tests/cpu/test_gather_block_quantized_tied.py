"""GatherBlockQuantized on an embedding table tied to an LM head's 4-bit MatMulNBits weight
(the head's bytes reshaped, the same scales and zero points), as onnxruntime-genai's model
builder exports it: rows read from the head's repacked copy against onnxruntime, an untied
table, and the table's file pages left out of memory."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnxruntime
import pytest
from onnx import numpy_helper

import plugrt
from plugrt_cpu.kernels import _compiled, contrib_quantization

from cpu.test_matmul_nbits_int4 import _resident_kib_of

N = 150  # ten tiles of 16 rows, the last one padded past row 149


def _tied_model(
    directory: Path,
    *,
    n: int = N,
    k: int = 96,
    block_size: int = 32,
    zero_points: bool = False,
    scale_type: type = np.float32,
    tied: bool = True,
    seed: int = 0,
) -> str:
    """A model whose embeddings are GatherBlockQuantized over a Reshape of the LM head's
    MatMulNBits ``B`` (or, untied, of another weight of its shape) with the head's scales
    and zero points, its initializers in an external file ``weights.data``; its path."""
    rng = np.random.default_rng(seed)
    blocks = k // block_size
    arrays = {
        "head": rng.integers(0, 256, (n, blocks, block_size // 2), dtype=np.uint8),
        "scales": (rng.random((n, blocks)) * 0.05 + 0.01).astype(scale_type),
    }
    if not tied:
        arrays["table"] = rng.integers(0, 256, (n, blocks, block_size // 2), dtype=np.uint8)
    if zero_points:
        arrays["zeros"] = rng.integers(0, 256, (n, -(-blocks // 2)), dtype=np.uint8)
    zeros = ", zeros" if zero_points else ""
    kind = "float16" if scale_type == np.float16 else "float"
    model = onnx.parser.parse_model(
        f"""
        <ir_version: 10, opset_import: ["" : 21, "com.microsoft" : 1]>
        tied ({kind}[M, {k}] hidden, int64[B, S] ids) => ({kind}[B, S, {k}] embeddings, {kind}[M, {n}] logits) {{
            shape = Constant <value = int64[2] {{{n}, {k // 2}}}> ()
            rows = Reshape ({"head" if tied else "table"}, shape)
            embeddings = com.microsoft.GatherBlockQuantized <bits = 4, block_size = {block_size}, gather_axis = 0, quantize_axis = 1> (rows, ids, scales{zeros})
            logits = com.microsoft.MatMulNBits <K = {k}, N = {n}, bits = 4, block_size = {block_size}> (hidden, head, scales{zeros})
        }}
        """
    )
    model.graph.initializer.extend(numpy_helper.from_array(array, name) for name, array in arrays.items())
    path = directory / "tied.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="weights.data", size_threshold=0)
    return str(path)


def _feeds(ids: list[list[int]], k: int, scale_type: type) -> dict[str, np.ndarray]:
    hidden = np.random.default_rng(1).standard_normal((2, k)).astype(scale_type)
    return {"hidden": hidden, "ids": np.array(ids, np.int64)}


def _onnxruntime_embeddings(path: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session.run(["embeddings"], feeds)[0]


# rows 0 and the last, rows of the padded last tile (144..149), a tile's first and last lane,
# negative indices counting from the end
IDS = [[0, N - 1, 145, 16, 15], [-1, -N, 31, 144, 77]]


@pytest.mark.parametrize("k, block_size", [(96, 32), (128, 64)])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("scale_type", [np.float32, np.float16])
def test_a_tied_table_gathers_the_rows_onnxruntime_does(tmp_path, k, block_size, zero_points, scale_type):
    path = _tied_model(tmp_path, k=k, block_size=block_size, zero_points=zero_points, scale_type=scale_type)
    feeds = _feeds(IDS, k, scale_type)
    got = plugrt.load(path, device="cpu").run(feeds)["embeddings"]
    expected = _onnxruntime_embeddings(path, feeds)
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)


def test_an_untied_table_gathers_its_own_rows(tmp_path):
    path = _tied_model(tmp_path, zero_points=True, tied=False)
    feeds = _feeds(IDS, 96, np.float32)
    got = plugrt.load(path, device="cpu").run(feeds)["embeddings"]
    np.testing.assert_array_equal(got, _onnxruntime_embeddings(path, feeds))


def test_out_of_range_indices_of_a_tied_table_gather_zero_rows(tmp_path):
    path = _tied_model(tmp_path)
    session = plugrt.load(path, device="cpu")
    got = session.run(_feeds([[3, N, -N - 1]], 96, np.float32))["embeddings"]
    expected = _onnxruntime_embeddings(path, _feeds([[3]], 96, np.float32))
    np.testing.assert_array_equal(got[0, 0], expected[0, 0])
    assert not got[0, 1:].any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_a_tied_table_is_read_from_the_heads_repacked_copy_not_its_file(tmp_path):
    # every row of a 512 KiB table gathered: read from the file, its pages would come back
    # into this process's resident memory; read from the head's copy, none need
    if not _compiled.compiled_enabled():
        pytest.skip("the repacked layout is the compiled kernels' (numba)")
    n, k = 4096, 256
    path = _tied_model(tmp_path, n=n, k=k, zero_points=True)
    session = plugrt.load(path, device="cpu")
    ids = np.random.default_rng(2).permutation(n).reshape(16, n // 16)
    for row in ids:
        session.run({"hidden": np.ones((1, k), np.float32), "ids": row[None]})
    assert _resident_kib_of(str(tmp_path / "weights.data")) <= 16  # of 672 KiB


def test_a_repacked_weight_whose_source_array_is_gone_is_not_matched():
    # the bytes of a dropped array may be another array's by the time a table is looked up
    rng = np.random.default_rng(4)
    memory = rng.integers(0, 256, (32, 2, 16), dtype=np.uint8)
    scales = np.ones((32, 2), np.float32)
    head = memory.reshape(32, 2, 16)  # an array object of its own over the same bytes
    packed = contrib_quantization._Packed(head, scales, None, 32, 64, 32)
    contrib_quantization._remember_packed(packed, head, scales, None, 32)
    table = memory.reshape(32, 32)
    assert contrib_quantization._packed_from(table, scales, None, 32) is packed
    del head
    assert contrib_quantization._packed_from(table, scales, None, 32) is None


def test_recording_a_repacked_weight_does_not_keep_it_alive():
    import weakref

    rng = np.random.default_rng(5)
    head = rng.integers(0, 256, (32, 2, 16), dtype=np.uint8)
    scales = np.ones((32, 2), np.float32)
    packed = contrib_quantization._Packed(head, scales, None, 32, 64, 32)
    contrib_quantization._remember_packed(packed, head, scales, None, 32)
    collected = weakref.ref(packed)
    del packed
    assert collected() is None


@pytest.mark.parametrize("zero_points", [False, True])
def test_a_captured_tied_lookup_replays_onnxruntimes_rows_without_allocating(tmp_path, zero_points):
    """A capture replays the tied table's lookup as one bound compiled call, reading the
    ids at each replay: onnxruntime's rows bitwise, zero rows for ids out of range, and
    no arrays allocated."""
    if not _compiled.compiled_enabled():
        pytest.skip("the repacked layout is the compiled kernels' (numba)")
    from plugrt.capture import Captured

    from cpu.test_into import REPLAY_BYTES, replay_bytes

    assert _compiled.wait_ready(600)
    k = 256  # 40 rows of 256 floats: 40 KiB a lookup, which an unbound replay would allocate
    path = _tied_model(tmp_path, k=k, zero_points=zero_points)
    session = plugrt.load(path, device="cpu")
    rng = np.random.default_rng(6)
    rounds = [rng.integers(-N, N, (2, 20)).tolist() for _ in range(2)]
    captured = session.try_capture(_feeds(rounds[0], k, np.float32))
    assert isinstance(captured, Captured) and captured.report.seams == []
    for ids in rounds + rounds[:1]:
        feeds = _feeds(ids, k, np.float32)
        np.testing.assert_array_equal(session.replay(feeds)["embeddings"], _onnxruntime_embeddings(path, feeds))
    outside = [[3, N, -N - 1] + rounds[0][0][3:], rounds[0][1]]
    got = session.replay(_feeds(outside, k, np.float32))["embeddings"]
    assert not got[0, 1:3].any() and got[0, 0].any()
    feeds = _feeds(rounds[1], k, np.float32)
    assert replay_bytes(lambda: session.replay(feeds), small_buffers=True) < REPLAY_BYTES


def test_compiled_gather_rows_are_the_numpy_rows_bitwise():
    """_numba_int4.gather_rows against contrib_quantization._packed_rows (numpy), with and
    without zero points, for block sizes 32 to 128 and rows of a padded last tile."""
    if not _compiled.compiled_enabled():
        pytest.skip("numba is off here")
    assert _compiled.wait_ready(600)
    loops = _compiled.compiled_module("_numba_int4")
    if loops is None:
        pytest.skip("the compiled loops are off here")
    rng = np.random.default_rng(5)
    for n, k, block_size, zeros in [(150, 96, 32, False), (37, 256, 64, True), (20, 256, 128, True)]:
        blocks = k // block_size
        b = rng.integers(0, 256, (n, blocks, block_size // 2), dtype=np.uint8)
        scales = (rng.random((n, blocks)) * 0.05 + 0.01).astype(np.float32)
        zp = rng.integers(0, 256, (n, -(-blocks // 2)), dtype=np.uint8) if zeros else None
        packed = contrib_quantization._Packed(b, scales, zp, n, k, block_size)
        rows = rng.integers(0, n, 40).astype(np.int64)
        expected = contrib_quantization._packed_rows(packed, rows, block_size)
        got = np.empty_like(expected)
        loops.gather_rows(packed.weights, packed.scales, contrib_quantization._zeros_of(packed), rows, got)
        np.testing.assert_array_equal(got, expected)
