"""optimum's ORTModel classes, their pipelines and sentence-transformers' ONNX backend, run
unchanged with plugrt standing in for onnxruntime, give onnxruntime's outputs.

Each client runs in a subprocess per runtime (client_run.py): a client imports onnxruntime
once per process. Needs the ``clients`` extra (optimum-onnx, sentence-transformers, a CPU
torch); the tiny models are built and exported once per test session.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# found, not imported: torch would load its own BLAS into this process (the clients run in subprocesses)
_MISSING = [m for m in ("torch", "transformers", "optimum", "sentence_transformers", "onnxruntime") if importlib.util.find_spec(m) is None]
if not _MISSING and importlib.util.find_spec("optimum.onnxruntime") is None:
    _MISSING = ["optimum.onnxruntime (optimum-onnx)"]
if _MISSING:
    pytest.skip(f"the clients extra is not installed (pip install -e '.[clients]'): no {', '.join(_MISSING)}", allow_module_level=True)

pytestmark = pytest.mark.slow

RUNNER = Path(__file__).with_name("client_run.py")
#: (task, output) pairs and the largest absolute difference allowed (0: equal, e.g. tokens)
CASES = [
    ("classification", "logits", 1e-4),
    ("features", "last_hidden_state", 1e-4),
    ("pipelines", "text_classification", 1e-4),
    ("pipelines", "feature_extraction", 1e-4),
    ("gpt2", "logits_io0", 1e-4),
    ("gpt2", "tokens_io0", 0),
    ("gpt2", "logits_io1", 1e-4),
    ("gpt2", "tokens_io1", 0),
    ("llama", "logits_io0", 1e-4),
    ("llama", "tokens_io0", 0),
    ("llama", "logits_io1", 1e-4),
    ("llama", "tokens_io1", 0),
    ("t5", "logits", 1e-4),
    ("t5", "tokens", 0),
    ("whisper", "logits", 1e-4),
    ("whisper", "tokens", 0),
    ("image", "logits", 1e-4),
    ("sentence", "embeddings", 1e-5),
]


@pytest.fixture(scope="session")
def client_outputs(tmp_path_factory):
    """``outputs(task, runtime)``: the saved outputs of one client task, run once per session."""
    work = tmp_path_factory.mktemp("clients")
    cache: dict = {}

    def outputs(task: str, runtime: str):
        if (task, runtime) not in cache:
            if (task, "onnxruntime") not in cache and runtime != "onnxruntime":
                outputs(task, "onnxruntime")  # the export runs under onnxruntime first
            target = work / f"{task}-{runtime}.npz"
            env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
            done = subprocess.run([sys.executable, str(RUNNER), runtime, task, str(work), str(target)],
                                  capture_output=True, text=True, env=env, timeout=900)
            assert done.returncode == 0, f"{task} on {runtime} failed:\n{done.stderr[-4000:]}"
            cache[task, runtime] = dict(np.load(target))
        return cache[task, runtime]

    return outputs


@pytest.mark.parametrize("task", sorted({task for task, _, _ in CASES}))
def test_the_client_ran_on_plugrt_when_standing_in(client_outputs, task):
    assert str(client_outputs(task, "plugrt")["runtime_module"]) == "plugrt._onnxruntime"
    assert str(client_outputs(task, "onnxruntime")["runtime_module"]) == "onnxruntime"


@pytest.mark.parametrize(("task", "output", "tolerance"), CASES, ids=[f"{t}-{o}" for t, o, _ in CASES])
def test_client_output_equals_onnxruntime(client_outputs, task, output, tolerance):
    expected = client_outputs(task, "onnxruntime")[output]
    actual = client_outputs(task, "plugrt")[output]
    assert actual.shape == expected.shape
    if tolerance == 0:
        np.testing.assert_array_equal(actual, expected)
    else:
        np.testing.assert_allclose(actual, expected, rtol=0, atol=tolerance)
