"""plugrt.genai: greedy and sampled generation over the builder's tiny Llama decoders."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from plugrt import genai
from plugrt.errors import InvalidInputError, InvalidOptionValueError

from helpers import onnxruntime_genai_greedy

ASSETS = Path(__file__).parent / "assets" / "tiny_llama"
PROMPT = [1, 17, 42, 99, 7, 200, 3]
NEW_TOKENS = 17  # the prefill's token and 16 decode steps


@pytest.fixture(scope="module")
def fp32_model() -> genai.Model:
    return genai.Model(ASSETS / "fp32")


def _onnxruntime_greedy(folder: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding with plain onnxruntime sessions, written independently of plugrt.genai."""
    ort = pytest.importorskip("onnxruntime")
    layout = genai.DecoderLayout.from_genai_config(folder / "genai_config.json")
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    empty = np.zeros((1, layout.kv_heads, 0, layout.head_size), np.float32)
    past = {past: empty for past, _ in layout.cache_names()}
    ids, tokens = np.array([prompt], np.int64), []
    while len(tokens) < new_tokens:
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, len(prompt) + len(tokens)), np.int64), **past}
        outputs = dict(zip(names, session.run(names, feeds)))
        past = {past_name: outputs[present] for past_name, present in layout.cache_names()}
        tokens.append(int(np.argmax(outputs["logits"][0, -1])))
        ids = np.array([[tokens[-1]]], np.int64)
    return tokens


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_greedy_generation_matches_onnxruntime(precision):
    model = genai.Model(ASSETS / precision)
    tokens = genai.generate(model, PROMPT, max_length=len(PROMPT) + NEW_TOKENS)
    assert tokens == _onnxruntime_greedy(ASSETS / precision, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_greedy_generation_matches_onnxruntime_genai(precision):
    expected = onnxruntime_genai_greedy(ASSETS / precision, PROMPT, len(PROMPT) + NEW_TOKENS)
    model = genai.Model(ASSETS / precision)
    assert genai.generate(model, PROMPT, max_length=len(PROMPT) + NEW_TOKENS) == expected


def test_kv_cache_lives_in_bindings_of_fixed_capacity(fp32_model):
    generator = genai.Generator(fp32_model, max_length=20)
    generator.append_tokens(PROMPT)
    for _ in range(3):
        generator.generate_next_token()
    layout = fp32_model.layout
    caches = generator._cache
    assert len(caches) == 2 * layout.num_layers
    for binding in caches:  # past and present share the buffer: every step sees all of it
        assert binding.capacity == binding.shape == (1, layout.kv_heads, 20, layout.head_size)
    # the prompt and two decoded tokens have run; the third token waits for the next step
    assert generator._state.mask.tolist() == [[1] * (len(PROMPT) + 2) + [0] * (20 - len(PROMPT) - 2)]


def test_cache_grows_in_its_bindings_without_a_shared_buffer():
    layout = genai.DecoderLayout.from_genai_config(ASSETS / "fp32" / "genai_config.json")
    model = genai.Model(ASSETS / "fp32", layout=dataclasses.replace(layout, past_present_share_buffer=False))
    generator = genai.Generator(model, max_length=20)
    generator.append_tokens(PROMPT)
    for _ in range(3):
        generator.generate_next_token()
    for binding in generator._cache:
        assert binding.capacity == (1, layout.kv_heads, 20, layout.head_size)
        assert binding.shape == (1, layout.kv_heads, len(PROMPT) + 2, layout.head_size)
    assert generator.capture_use.replayed_steps == 0
    assert generator.capture_use.eager_steps == 3
    assert "grows every step" in next(iter(generator.capture_use.eager_reasons))


def test_top_k_one_sampling_is_greedy(fp32_model):
    greedy = genai.generate(fp32_model, PROMPT, max_length=20)
    assert genai.generate(fp32_model, PROMPT, max_length=20, do_sample=True, top_k=1, seed=3) == greedy


def test_sampled_tokens_come_from_the_top_k(fp32_model):
    generator = genai.Generator(fp32_model, do_sample=True, top_k=4, seed=5, max_length=40)
    generator.append_tokens(PROMPT)
    greedy_choices = 0
    while not generator.is_done():
        token = generator.generate_next_token()
        logits = generator.get_logits()
        top = set(np.argsort(-logits)[:4].tolist())
        assert token in top
        greedy_choices += token == int(np.argmax(logits))
    assert greedy_choices < 40 - len(PROMPT)  # it sampled, not always the best


def test_sampled_tokens_come_from_the_nucleus(fp32_model):
    generator = genai.Generator(fp32_model, do_sample=True, top_k=0, top_p=0.6, seed=7, max_length=30)
    generator.append_tokens(PROMPT)
    while not generator.is_done():
        token = generator.generate_next_token()
        logits = generator.get_logits().astype(np.float64)
        probabilities = np.exp(logits - logits.max())
        probabilities /= probabilities.sum()
        order = np.argsort(-probabilities)
        nucleus = order[: int(np.searchsorted(np.cumsum(probabilities[order]), 0.6)) + 1]
        assert token in set(nucleus.tolist())


def test_sampling_is_reproducible_with_a_seed(fp32_model):
    options = dict(max_length=24, do_sample=True, top_k=20, temperature=1.5)
    first = genai.generate(fp32_model, PROMPT, seed=11, **options)
    assert genai.generate(fp32_model, PROMPT, seed=11, **options) == first
    assert genai.generate(fp32_model, PROMPT, seed=12, **options) != first


def test_generation_stops_at_an_end_of_sequence_token():
    layout = genai.DecoderLayout.from_genai_config(ASSETS / "fp32" / "genai_config.json")
    greedy = genai.generate(genai.Model(ASSETS / "fp32"), PROMPT, max_length=24)
    stop = greedy[3]
    model = genai.Model(ASSETS / "fp32", layout=dataclasses.replace(layout, eos_token_ids=(stop,)))
    assert genai.generate(model, PROMPT, max_length=24) == greedy[: greedy.index(stop) + 1]


def test_prompt_longer_than_max_length_is_rejected(fp32_model):
    generator = genai.Generator(fp32_model, max_length=4)
    with pytest.raises(InvalidInputError, match="max_length=4"):
        generator.append_tokens(PROMPT)


def test_max_length_past_the_models_context_length_is_rejected(fp32_model):
    # the tiny Llama's genai_config.json says context_length 128: its rotary rows end there
    with pytest.raises(InvalidOptionValueError, match="context length, 128"):
        genai.Generator(fp32_model, max_length=129)
    assert genai.Generator(fp32_model, max_length=128).max_length == 128


def test_token_outside_the_vocabulary_is_rejected(fp32_model):
    generator = genai.Generator(fp32_model, max_length=16)
    with pytest.raises(InvalidInputError, match=r"\[0, 256\)"):
        generator.append_tokens([1, 256])


@pytest.mark.parametrize("options", [{"top_p": 0.0}, {"temperature": 0.0}, {"top_k": -1}, {"beams": 2}])
def test_invalid_search_options_are_rejected(fp32_model, options):
    with pytest.raises(InvalidOptionValueError):
        genai.Generator(fp32_model, **options)


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_a_prompts_logits_are_computed_at_its_last_position_alone(precision):
    """The generator reads the last position's logits: the model's session computes only
    those, as onnxruntime computes that position of the whole prompt's logits."""
    ort = pytest.importorskip("onnxruntime")
    folder = ASSETS / precision
    model = genai.Model(folder)
    layout = model.layout
    reference = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    empty = np.zeros((1, layout.kv_heads, 0, layout.head_size), np.float32)
    feeds = {
        "input_ids": np.array([PROMPT], np.int64),
        "attention_mask": np.ones((1, len(PROMPT)), np.int64),
        **{past: empty for past, _ in layout.cache_names()},
    }
    expected = reference.run(["logits"], feeds)[0]
    got = model.session.run(feeds, ["logits"])["logits"]
    assert expected.shape[1] == len(PROMPT) and got.shape == (1, 1, expected.shape[2])
    np.testing.assert_allclose(got[0, 0], expected[0, -1], rtol=1e-4, atol=1e-4)
    everything = genai.Model(folder, **{"outputs.last_position": ()})  # asked for every position
    assert everything.session.run(feeds, ["logits"])["logits"].shape == expected.shape
