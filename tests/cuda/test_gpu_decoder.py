"""The decoder's ops on a real GPU: the MatMulNBits kernel against the numpy binding's
arithmetic, and the tiny builder decoder's decode step captured in one graph with no
seams, decoding the CPU provider's tokens. Skipped without a device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plugrt import genai

from cuda_helpers import registry_of
from plugrt_cuda._backend import NumpyBackend
from plugrt_cuda._ops import OPS, OpInfo

pytestmark = pytest.mark.gpu

ASSETS = Path(__file__).parent.parent / "genai" / "assets" / "tiny_llama"
PROMPT = [1, 17, 42, 99, 7, 200, 3]
RNG = np.random.default_rng(5)


def _matmul_nbits(backend, n: int, k: int, block: int):
    attributes = {"N": n, "K": k, "bits": 4, "block_size": block, "accuracy_level": 0}
    return OPS[("com.microsoft", "MatMulNBits")].builder(OpInfo(attributes, [], 1, 4, 1, backend))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("zero_points", [None, "packed", "float"])
@pytest.mark.parametrize("m,k", [(1, 64), (5, 80)])
def test_the_matmul_nbits_kernel_matches_the_numpy_binding(gpu_provider, dtype, zero_points, m, k):
    cp = gpu_provider.backend().xp
    n, block = 72, 32
    blocks = -(-k // block)
    b = RNG.integers(0, 256, (n, blocks, block // 2)).astype(np.uint8)
    scales = (RNG.random(n * blocks) * 0.1).astype(dtype)
    zeros = {None: None, "packed": RNG.integers(0, 256, (n, -(-blocks // 2))).astype(np.uint8),
             "float": RNG.random((n, blocks)).astype(dtype) * 15}[zero_points]
    a, bias = RNG.standard_normal((m, k)).astype(dtype), RNG.standard_normal(n).astype(dtype)
    expected = _matmul_nbits(NumpyBackend(), n, k, block)(a, b, scales, zeros, None, bias)
    device = [cp.asarray(v) if v is not None else None for v in (a, b, scales, zeros, None, bias)]
    got = _matmul_nbits(gpu_provider.backend(), n, k, block)(*device).get()
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32), rtol=tolerance, atol=tolerance * k)


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_the_decode_step_is_one_graph_with_no_seams_and_the_cpu_providers_tokens(gpu_provider, precision):
    model = genai.Model(ASSETS / precision, device="cuda", registry=registry_of(gpu_provider))
    generator = genai.Generator(model, max_length=len(PROMPT) + 16)
    generator.append_tokens(PROMPT)
    tokens = []
    while not generator.is_done():
        tokens.append(generator.generate_next_token())
    report = generator.capture_use.reports["decode"]
    assert report.seams == [] and len(report.segments) == 1
    assert generator.capture_use.eager.get("decode", 0) == 0
    assert tokens == genai.generate(genai.Model(ASSETS / precision), PROMPT, max_length=len(PROMPT) + 16)
