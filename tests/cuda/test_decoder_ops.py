"""The decoder's ops on the CUDA provider, bound to numpy: each against onnxruntime's CPU
contrib kernels and plugrt's CPU provider on random data, GroupQueryAttention with a past
in a fixed-capacity buffer among them; and the builder-made tiny decoder placed whole on
the provider, captured with no seams, decoding the CPU provider's tokens."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import plugrt
from plugrt import genai

from cuda_helpers import NumpyCUDA, registry_of
from plugrt_cuda._capture import seam_reason

ASSETS = Path(__file__).parent.parent / "genai" / "assets" / "tiny_llama"
PROMPT = [1, 17, 42, 99, 7, 200, 3]
STEPS = 16
RNG = np.random.default_rng(25)
_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
          np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32,
          np.dtype(np.uint8): TensorProto.UINT8}


def _node_model(op: str, feeds: dict[str, np.ndarray], outputs: list[str], *, domain: str = "com.microsoft",
                initializers: dict[str, np.ndarray] | None = None, inputs: list[str] | None = None, **attributes) -> bytes:
    """One ``op`` node over ``inputs`` (names of feeds or initializers, "" for omitted)."""
    initializers = initializers or {}
    names = inputs if inputs is not None else list(feeds) + list(initializers)
    node = helper.make_node(op, names, outputs, domain=domain, **attributes)
    graph = helper.make_graph(
        [node], "one",
        [helper.make_tensor_value_info(n, _TYPES[a.dtype], a.shape) for n, a in feeds.items()],
        [onnx.ValueInfoProto(name=n) for n in outputs if n],
        [onnx.numpy_helper.from_array(a, n) for n, a in initializers.items()],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def _three_ways(model: bytes, feeds: dict[str, np.ndarray]) -> tuple[dict, dict, list]:
    """(CUDA provider on numpy, CPU provider, onnxruntime) outputs of ``model``; the first
    session must place every node on the CUDA provider."""
    ort = pytest.importorskip("onnxruntime")
    session = plugrt.load(model, device="cuda", registry=registry_of(NumpyCUDA()))
    assert {k for k, v in session.placement.nodes_per_provider.items() if v} == {"cuda"}, session.placement.summary()
    cpu = plugrt.load(model, device="cpu")
    reference = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return session.run(feeds), cpu.run(feeds), reference.run(None, feeds)


def _random(*shape: int, dtype=np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def test_simplified_layer_normalization_matches_onnxruntime_and_the_cpu_provider():
    feeds = {"x": _random(2, 3, 64)}
    model = _node_model("SimplifiedLayerNormalization", feeds, ["y", "inv"], domain="",
                        initializers={"scale": _random(64)}, epsilon=1e-5, axis=-1, stash_type=1)
    got, cpu, ort = _three_ways(model, feeds)
    np.testing.assert_allclose(got["y"], ort[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["y"], cpu["y"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["inv"], ort[1], rtol=1e-5)


def test_skip_simplified_layer_normalization_gives_the_normalised_sum_and_the_sum():
    feeds = {"x": _random(2, 3, 64), "skip": _random(2, 3, 64)}
    model = _node_model("SkipSimplifiedLayerNormalization", feeds, ["y", "", "", "sum"],
                        initializers={"gamma": _random(64), "bias": _random(64)}, epsilon=1e-6)
    got, cpu, ort = _three_ways(model, feeds)
    np.testing.assert_allclose(got["y"], ort[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["sum"], ort[1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["y"], cpu["y"], rtol=1e-5, atol=1e-5)


def _rotary_caches(rows: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    angles = np.arange(rows)[:, None] / (10000.0 ** (np.arange(half)[None, :] / half))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_embedding_matches_onnxruntime_and_the_cpu_provider(interleaved):
    cos, sin = _rotary_caches(32, 8)
    feeds = {"x": _random(2, 5, 4 * 16), "pos": np.array([[3, 4, 5, 6, 7], [0, 1, 2, 9, 20]], np.int64)}
    model = _node_model("RotaryEmbedding", feeds, ["y"], initializers={"cos": cos, "sin": sin},
                        num_heads=4, interleaved=interleaved)
    got, cpu, ort = _three_ways(model, feeds)
    np.testing.assert_allclose(got["y"], ort[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["y"], cpu["y"], rtol=1e-5, atol=1e-5)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 values < 16 along the last axis, two per byte, low nibble first."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("accuracy_level", [0, 4])
@pytest.mark.parametrize("k", [64, 80])  # 80: a partial last block
def test_matmul_nbits_matches_onnxruntime_and_the_cpu_provider(zero_points, accuracy_level, k):
    n, block = 48, 32
    blocks = -(-k // block)
    q = RNG.integers(0, 16, (n, blocks * block)).astype(np.uint8)
    initializers = {"B": _pack_nibbles(q).reshape(n, blocks, block // 2),
                    "scales": (RNG.random(n * blocks) * 0.1 + 0.01).astype(np.float32)}
    names = ["A", "B", "scales"]
    if zero_points:
        zeros = RNG.integers(0, 16, (n, blocks + blocks % 2)).astype(np.uint8)
        initializers["zeros"] = _pack_nibbles(zeros)
        names.append("zeros")
    feeds = {"A": _random(3, k)}
    model = _node_model("MatMulNBits", feeds, ["Y"], initializers=initializers, inputs=names,
                        K=k, N=n, bits=4, block_size=block, accuracy_level=accuracy_level)
    got, cpu, ort = _three_ways(model, feeds)
    np.testing.assert_allclose(got["Y"], cpu["Y"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["Y"], ort[0], rtol=1e-4, atol=1e-4)


def _gqa_model(feeds: dict[str, np.ndarray], *, packed: bool, rotary: bool, cos=None, sin=None, **attributes) -> bytes:
    names = ["q", "" if packed else "k", "" if packed else "v", "past_k", "past_v", "seqlens", "total"]
    initializers = {}
    if rotary:
        names += ["cos", "sin"]
        initializers = {"cos": cos, "sin": sin}
    return _node_model("GroupQueryAttention", feeds, ["out", "present_k", "present_v"], initializers=initializers,
                       inputs=names, num_heads=4, kv_num_heads=2, do_rotary=int(rotary), **attributes)


def _gqa_feeds(batch: int, seq: int, capacity: int, lengths: list[int], *, packed: bool) -> dict[str, np.ndarray]:
    """A step of ``seq`` tokens whose batch entries hold ``lengths`` tokens after it, the
    past in a buffer of ``capacity`` positions with stale values past each valid part."""
    heads, kv_heads, size = 4, 2, 16
    feeds = {"q": _random(batch, seq, (heads + 2 * kv_heads) * size)} if packed else {
        "q": _random(batch, seq, heads * size), "k": _random(batch, seq, kv_heads * size),
        "v": _random(batch, seq, kv_heads * size)}
    feeds["past_k"] = _random(batch, kv_heads, capacity, size)
    feeds["past_v"] = _random(batch, kv_heads, capacity, size)
    feeds["seqlens"] = np.array([n - 1 for n in lengths], np.int32)
    feeds["total"] = np.array([capacity], np.int32)
    return feeds


@pytest.mark.parametrize(
    "batch,seq,lengths,packed,rotary,window",
    [
        (1, 1, [9], True, True, -1),  # a decode step as the builder's decoders take it
        (2, 1, [5, 12], False, True, -1),  # a ragged batch: each entry writes at its own position
        (1, 4, [4], True, True, -1),  # a first prompt into the fixed-capacity buffer
        (1, 3, [10], False, False, -1),  # several new tokens after a past, causal among themselves
        (1, 1, [14], False, True, 4),  # a local window
    ],
)
def test_group_query_attention_with_a_fixed_capacity_past_matches_onnxruntime(batch, seq, lengths, packed, rotary, window):
    capacity = 16
    cos, sin = _rotary_caches(32, 8)
    feeds = _gqa_feeds(batch, seq, capacity, lengths, packed=packed)
    model = _gqa_model(feeds, packed=packed, rotary=rotary, cos=cos, sin=sin, local_window_size=window)
    got, cpu, ort = _three_ways(model, feeds)
    np.testing.assert_allclose(got["out"], ort[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["out"], cpu["out"], rtol=1e-5, atol=1e-6)
    for b, n in enumerate(lengths):  # onnxruntime leaves the buffer past the valid part as it was
        np.testing.assert_allclose(got["present_k"][b, :, :n], ort[1][b, :, :n], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["present_v"][b, :, :n], ort[2][b, :, :n], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["present_k"], cpu["present_k"], rtol=1e-5, atol=1e-6)  # zeros after, as the CPU's
    np.testing.assert_allclose(got["present_v"], cpu["present_v"], rtol=1e-5, atol=1e-6)


def test_group_query_attention_leaves_the_fed_past_unchanged():
    feeds = _gqa_feeds(1, 1, 16, [9], packed=True)
    before = feeds["past_k"].copy()
    session = plugrt.load(_gqa_model(feeds, packed=True, rotary=False), device="cuda", registry=registry_of(NumpyCUDA()))
    session.run(feeds)
    np.testing.assert_array_equal(feeds["past_k"], before)


def test_matmul_nbits_with_other_widths_is_declined_with_the_reason():
    feeds = {"A": _random(1, 64)}
    model = _node_model("MatMulNBits", feeds, ["Y"], initializers={
        "B": np.zeros((8, 2, 32), np.uint8), "scales": np.ones(16, np.float32)}, inputs=["A", "B", "scales"],
        K=64, N=8, bits=8, block_size=32)
    session = plugrt.load(model, device="cuda", registry=registry_of(NumpyCUDA()))
    reasons = " ".join(str(r) for r in session.placement.fallbacks)
    assert "bits=8" in reasons and "4-bit weights only" in reasons


# -- the tiny builder-made decoder ---------------------------------------------------------

@pytest.fixture(scope="module", params=["fp32", "int4"])
def decoders(request) -> tuple[genai.Model, genai.Model]:
    folder = ASSETS / request.param
    return genai.Model(folder, device="cuda", registry=registry_of(NumpyCUDA())), genai.Model(folder)


def _capturing_backend() -> object:
    """What seam_reason looks at of a cupy backend: the GEMM engine a GPU run uses by default."""
    return types.SimpleNamespace(gemm_engine="auto")


def test_the_builder_decoder_places_whole_on_the_cuda_provider_with_no_seams(decoders):
    model, _ = decoders
    report = model.session.placement
    assert report.fallbacks == [], report.summary()
    assert {k for k, v in report.nodes_per_provider.items() if v} == {"cuda"}
    compiled = model.session._built.compiled
    assert len(compiled) == 1  # one partition: no host transfer inside a step
    steps = compiled[0].steps
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization", "Shape"} <= {s.op_type for s in steps}
    assert [s.name for s in steps if seam_reason(s, _capturing_backend()) is not None] == []  # type: ignore[arg-type]


def test_the_builder_decoder_on_the_cuda_provider_decodes_the_cpu_providers_tokens(decoders):
    model, cpu = decoders
    got = genai.generate(model, PROMPT, max_length=len(PROMPT) + STEPS)
    expected = genai.generate(cpu, PROMPT, max_length=len(PROMPT) + STEPS)
    assert len(got) == STEPS
    assert got == expected
