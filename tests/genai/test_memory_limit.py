"""plugrt.genai under a memory_limit: a generator whose KV cache at max_length does not fit is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from plugrt import genai
from plugrt.errors import MemoryLimitError

FOLDER = Path(__file__).parent / "assets" / "tiny_llama" / "fp32"
LONG = 128  # tokens: the tiny model's context length, a cache of 64 KiB


def _weight_bytes() -> int:
    """The tiny Llama's initializers and Constant nodes' values (folded into initializers
    at build) and the three int64 bounds of the Slice that computes the logits at the last
    position alone, as numpy counts them: identical small values (up to 1024 elements, as
    onnx_ir's deduplication at build) counted once."""
    model = onnx.load(FOLDER / "model.onnx")
    arrays = [numpy_helper.to_array(t) for t in model.graph.initializer]
    arrays += [numpy_helper.to_array(a.t) for n in model.graph.node if n.op_type == "Constant" for a in n.attribute]
    arrays += [np.array([bound], np.int64) for bound in (-1, np.iinfo(np.int64).max, 1)]
    seen: set[tuple] = set()
    total = 0
    for array in arrays:
        key = (array.dtype.str, array.shape, array.tobytes())
        if array.size <= 1024 and key in seen:
            continue
        seen.add(key)
        total += array.nbytes
    return total


def _kv_bytes(max_length: int) -> int:
    layout = genai.DecoderLayout.from_genai_config(FOLDER / "genai_config.json")
    # layers x (key, value) x kv_heads x max_length x head_size x float32
    return layout.num_layers * 2 * layout.kv_heads * max_length * layout.head_size * 4


@pytest.fixture(scope="module")
def limited_model() -> genai.Model:
    """The tiny Llama with a limit of its weights plus a LONG cache: a generator of LONG
    tokens also needs a LONG prompt's activations, one of 8 tokens a few KiB of them."""
    return genai.Model(FOLDER, memory_limit=_weight_bytes() + _kv_bytes(LONG))


def test_a_generator_whose_kv_cache_does_not_fit_the_memory_limit_is_refused(limited_model):
    with pytest.raises(MemoryLimitError) as info:
        genai.Generator(limited_model, max_length=LONG)
    error = info.value
    assert error.breakdown["state"] == _kv_bytes(LONG)  # 2 x 2 x 2 x 128 x 16 x 4 = 64 KiB
    assert error.breakdown["weights"] == _weight_bytes()
    assert error.needed == sum(error.breakdown.values()) > error.limit
    assert "KV cache 64 KiB" in str(error) and "max_length" in str(error)


def test_a_refused_generator_allocates_no_cache(limited_model, monkeypatch):
    allocated = []
    monkeypatch.setattr(limited_model.session, "allocate_binding", lambda *a, **k: allocated.append(k))
    with pytest.raises(MemoryLimitError):
        genai.Generator(limited_model, max_length=LONG)
    assert allocated == []


def test_a_generator_whose_cache_fits_the_memory_limit_generates(limited_model):
    tokens = genai.generate(limited_model, [1, 17, 42], max_length=8)
    assert len(tokens) == 5

