"""Decode steps with a fixed-capacity KV cache: captured without seams on the CPU provider,
replayed bitwise equal to eager steps and without allocating, tokens as onnxruntime-genai's."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from plugrt import genai

from helpers import onnxruntime_genai_greedy

ASSETS = Path(__file__).parent / "assets" / "tiny_llama"
PROMPT = [1, 17, 42, 99, 7, 200, 3]
DECODE_STEPS = 16
MAX_LENGTH = 64
# What one replay of the decode step may allocate (tracemalloc's peak during it): the
# Python objects of the replay loop and numpy's views (a few KiB), far below one eager
# step, which allocates its activations and a copy of every layer's cache
# (test_an_eager_step_allocates_more_than_the_replay_bound checks that). The peak is
# reset before each step: tracemalloc counts Python's free lists as live memory, so a
# peak kept over many steps creeps up with them, replay or not.
REPLAY_BYTES = 8192


@pytest.fixture(params=["numba", "numpy"])
def loops(request, monkeypatch) -> str:
    """The CPU kernels' compiled decode loops on (when numba is installed) or off."""
    from plugrt_cpu.kernels import contrib_attention, contrib_normalization

    if request.param == "numba":
        pytest.importorskip("numba")
        import plugrt_cpu.kernels._numba_decode as compiled
    else:
        compiled = None
    for module in (contrib_normalization, contrib_attention):  # the loader and the module that imports it
        monkeypatch.setattr(module, "decode_loops", lambda: compiled)
    return request.param


@pytest.fixture(scope="module")
def models() -> dict[str, genai.Model]:
    return {precision: genai.Model(ASSETS / precision) for precision in ("fp32", "int4")}


@pytest.fixture(scope="module")
def fp32_model(models) -> genai.Model:
    return models["fp32"]


def _prefilled(model: genai.Model, *, capture: bool, max_length: int = MAX_LENGTH) -> genai.Generator:
    generator = genai.Generator(model, max_length=max_length, capture=capture)
    generator.append_tokens(PROMPT)
    generator.generate_next_token()
    return generator


def test_builder_model_declares_a_shared_cache_buffer(fp32_model):
    assert fp32_model.layout.past_present_share_buffer
    assert fp32_model.fixed_shape_steps


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_decode_step_of_the_builder_model_captures_with_no_seams(models, precision):
    model = models[precision]
    generator = _prefilled(model, capture=True)
    generator.generate_next_token()
    report = generator.capture_use.reports["decode"]
    assert report.seams == []
    assert len(report.segments) == 1
    steps = [step.name for compiled in model.session._built.compiled for step in compiled.steps]
    assert report.segments[0] == steps
    assert any("GroupQueryAttention" in name for name in report.segments[0])


def test_captured_decode_writes_the_new_keys_and_values_into_the_cache_bindings(fp32_model):
    generator = _prefilled(fp32_model, capture=True)
    generator.generate_next_token()
    captured = fp32_model.session._captures.get(generator._state.slots["decode"])
    outputs = dict(zip(captured.output_names, captured._outputs))
    for binding in generator._cache:  # the present is the past's own buffer: nothing to copy
        assert outputs[binding.output] is binding.buffer
    assert not any(outputs[fp32_model.layout.logits] is b.buffer for b in generator._cache)


def test_prefill_and_decode_use_their_own_capture_slots():
    model = genai.Model(ASSETS / "fp32")
    first = _prefilled(model, capture=True)
    first.generate_next_token()
    # a prompt is captured once its length comes again; the decode step at once
    assert first.capture_use.eager == {"prefill": 1}
    assert first.capture_use.replayed == {"decode": 1}
    assert "a prompt of a new length" in next(iter(first.capture_use.eager_reasons))
    second = _prefilled(model, capture=True)
    second.generate_next_token()
    assert second.capture_use.replayed == {"prefill": 1, "decode": 1}
    assert second.capture_use.eager == {}
    slots = second._state.slots
    assert slots["prefill"] != slots["decode"]
    assert set(second.capture_use.reports) == {"prefill", "decode"}


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_decode_replay_is_bitwise_equal_to_eager_steps_over_16_steps(models, precision, loops):
    replayed = _prefilled(models[precision], capture=True)
    eager = _prefilled(models[precision], capture=False)
    for _ in range(DECODE_STEPS):
        token = replayed.generate_next_token()
        assert eager.generate_next_token() == token
        assert replayed.get_logits().tobytes() == eager.get_logits().tobytes()
    for mine, theirs in zip(replayed._cache, eager._cache):
        assert mine.read().tobytes() == theirs.read().tobytes()
    assert replayed.capture_use.replayed["decode"] == DECODE_STEPS
    assert "decode" not in replayed.capture_use.eager
    assert eager.capture_use.eager_reasons == {"capture=False": DECODE_STEPS + 1}


def test_decode_replay_allocates_no_arrays(fp32_model):
    generator = _prefilled(fp32_model, capture=True)
    generator.generate_next_token()  # captures the decode step
    stats = fp32_model.session.capture_stats
    replays = stats.replays
    counted = []
    tracemalloc.start()
    try:
        for _ in range(DECODE_STEPS):
            before = stats.bytes_allocated_during_replay
            tracemalloc.reset_peak()
            generator.generate_next_token()
            counted.append(stats.bytes_allocated_during_replay - before)
    finally:
        tracemalloc.stop()
    assert stats.replays == replays + DECODE_STEPS
    assert max(counted) < REPLAY_BYTES


def test_an_eager_step_allocates_more_than_the_replay_bound(fp32_model):
    generator = _prefilled(fp32_model, capture=False)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        generator.generate_next_token()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak > REPLAY_BYTES


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_captured_greedy_tokens_match_onnxruntime_genai(precision, loops):
    max_length = len(PROMPT) + DECODE_STEPS + 1
    expected = onnxruntime_genai_greedy(ASSETS / precision, PROMPT, max_length)
    generator = genai.Generator(genai.Model(ASSETS / precision), max_length=max_length)
    generator.append_tokens(PROMPT)
    tokens = []
    while not generator.is_done():
        tokens.append(generator.generate_next_token())
    assert tokens == expected
    assert generator.capture_use.replayed["decode"] == DECODE_STEPS
    assert "decode" not in generator.capture_use.eager


def test_fixed_capacity_steps_match_onnxruntime_on_a_longer_past(loops):
    """onnxruntime's GroupQueryAttention given the same full-capacity past buffers and
    fixed-shape mask (its shared-buffer layout) gives the same logits at every step."""
    ort = pytest.importorskip("onnxruntime")
    folder = ASSETS / "fp32"
    layout = genai.DecoderLayout.from_genai_config(folder / "genai_config.json")
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    generator = genai.Generator(genai.Model(folder), max_length=MAX_LENGTH)
    generator.append_tokens(PROMPT)
    cache = {past: np.zeros((1, layout.kv_heads, MAX_LENGTH, layout.head_size), np.float32)
             for past, _ in layout.cache_names()}
    mask = np.zeros((1, MAX_LENGTH), np.int64)
    ids = np.array([PROMPT], np.int64)
    valid = 0
    for _ in range(DECODE_STEPS + 1):
        mask[0, valid:valid + ids.shape[1]] = 1
        valid += ids.shape[1]
        outputs = dict(zip(names, session.run(names, {"input_ids": ids, "attention_mask": mask, **cache})))
        cache = {past: outputs[present] for past, present in layout.cache_names()}
        token = generator.generate_next_token()
        np.testing.assert_allclose(generator.get_logits(), outputs["logits"][0, -1], rtol=0, atol=1e-4)
        assert token == int(np.argmax(outputs["logits"][0, -1]))
        ids = np.array([[token]], np.int64)
    assert generator.capture_use.replayed["decode"] == DECODE_STEPS


def test_a_step_that_cannot_be_captured_runs_eagerly_with_its_reason(fp32_model, monkeypatch):
    from plugrt.capture import NotCapturable

    declined = NotCapturable([("node", "no capture here")])
    monkeypatch.setattr(type(fp32_model.session), "try_capture", lambda self, *a, **k: declined)
    generator = genai.Generator(genai.Model(ASSETS / "fp32"), max_length=MAX_LENGTH)
    generator.append_tokens(PROMPT)
    for _ in range(3):
        generator.generate_next_token()
    reasons = generator.capture_use.eager_reasons
    assert generator.capture_use.replayed_steps == 0
    assert generator.capture_use.eager == {"prefill": 1, "decode": 2}
    assert reasons["the decode step cannot be captured (node: no capture here)"] == 2


def _contrib_model(op: str, domain: str, inputs: dict[str, np.ndarray], outputs: list[str], **attributes) -> bytes:
    from onnx import TensorProto, helper

    node = helper.make_node(op, list(inputs), outputs, domain=domain, **attributes)
    graph = helper.make_graph(
        [node], op,
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, list(array.shape)) for name, array in inputs.items()],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8).SerializeToString()


@pytest.mark.parametrize(
    "op,domain,shapes,outputs,attributes",
    [
        ("SkipSimplifiedLayerNormalization", "com.microsoft",
         {"x": (2, 5, 1024), "skip": (2, 5, 1024), "gamma": (1024,), "bias": (1024,)},
         ["y", "mean", "inv_std", "sum"], {"epsilon": 1e-6}),
        ("SkipSimplifiedLayerNormalization", "com.microsoft",
         {"x": (3, 7, 96), "skip": (3, 7, 96), "gamma": (96,)}, ["y"], {}),
        ("SimplifiedLayerNormalization", "", {"x": (3, 7, 1000), "scale": (1000,)}, ["y", "inv_std"], {"epsilon": 1e-5}),
        ("SimplifiedLayerNormalization", "", {"x": (4, 6, 10), "scale": (6, 10)}, ["y"], {"axis": 1}),
    ],
)
def test_rms_normalization_capture_variants_replay_bitwise(op, domain, shapes, outputs, attributes):
    import plugrt
    from plugrt.capture import Captured

    def feeds(seed):
        rng = np.random.default_rng(seed)
        return {name: (rng.standard_normal(shape) * 3).astype(np.float32) for name, shape in shapes.items()}

    session = plugrt.load(_contrib_model(op, domain, feeds(0), outputs, **attributes), optimization="none")
    result = session.try_capture(feeds(1))
    assert isinstance(result, Captured) and result.report.seams == []
    for seed in (2, 3):
        eager, replayed = session.run(feeds(seed)), session.replay(feeds(seed))
        for name in outputs:
            assert eager[name].tobytes() == np.asarray(replayed[name]).tobytes(), name


def test_tokens_appended_between_steps_replay_like_eager_steps(fp32_model):
    replayed = _prefilled(fp32_model, capture=True)
    eager = _prefilled(fp32_model, capture=False)
    for turn in range(3):  # each turn: a chunk of new tokens after the generated one, then decode
        for generator in (replayed, eager):
            generator.append_tokens([5 + turn, 60, 61 + turn])
        for _ in range(3):
            assert replayed.generate_next_token() == eager.generate_next_token()
            assert replayed.get_logits().tobytes() == eager.get_logits().tobytes()
    assert replayed.get_sequence() == eager.get_sequence()
    # the 4-token chunks run through the prompt slot: captured at their second turn
    assert replayed.capture_use.replayed.get("prefill", 0) >= 1
    assert replayed.capture_use.replayed["decode"] == 6
