"""cuda.float16_decoding on the numpy binding: the tiny builder decoder computed in float16
decodes the float32 run's tokens over 16 steps, its logits within 2% of the largest."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plugrt import genai

from cuda_helpers import NumpyCUDA, registry_of

FP32 = Path(__file__).parent.parent / "genai" / "assets" / "tiny_llama" / "fp32"
PROMPT = [1, 17, 42, 99, 7, 200, 3]
STEPS = 16
# measured: the logits differ by at most 0.54% of their largest magnitude over the 16 steps
LOGIT_TOLERANCE = 0.02


def _model(**options) -> genai.Model:
    return genai.Model(FP32, device="cuda", registry=registry_of(NumpyCUDA()), **options)


@pytest.fixture(scope="module")
def models() -> tuple[genai.Model, genai.Model]:
    return _model(), _model(**{"cuda.float16_decoding": True})


def test_float16_decoding_keeps_the_float32_interface_and_computes_in_float16(models):
    float32, float16 = models
    assert [(i.name, i.dtype) for i in float16.session.inputs] == [(i.name, i.dtype) for i in float32.session.inputs]
    assert [(o.name, o.dtype) for o in float16.session.outputs] == [(o.name, o.dtype) for o in float32.session.outputs]
    assert float16.session.placement.fallbacks == []
    steps = float16.session._built.compiled[0].steps
    attention = [s for s in steps if s.op_type == "GroupQueryAttention"]
    assert attention and all(s.inputs[0].dtype.name == "FLOAT16" for s in attention)
    assert all(s.inputs[0].dtype.name == "FLOAT" for s in float32.session._built.compiled[0].steps if s.op_type == "GroupQueryAttention")


def test_float16_decoding_gives_the_float32_tokens_with_logits_close(models):
    generators = [genai.Generator(model, max_length=len(PROMPT) + STEPS) for model in models]
    tokens: list[list[int]] = [[], []]
    for generator in generators:
        generator.append_tokens(PROMPT)
    while not generators[0].is_done():
        for generator, chosen in zip(generators, tokens):
            chosen.append(generator.generate_next_token())
        wide, narrow = (np.asarray(g.get_logits(), np.float32) for g in generators)
        peak = float(np.max(np.abs(wide)))
        assert float(np.max(np.abs(wide - narrow))) <= LOGIT_TOLERANCE * peak
        assert not np.array_equal(wide, narrow)  # the float16 run did compute in float16
    assert len(tokens[0]) == STEPS
    assert tokens[0] == tokens[1]


def test_a_non_boolean_float16_decoding_value_is_refused():
    from plugrt.errors import OptionError

    with pytest.raises(OptionError, match="cuda.float16_decoding"):
        _model(**{"cuda.float16_decoding": "sometimes"})
