"""The CPU provider's malloc tuning: after its first compile, freed activations come back
without page faults on glibc; PLUGRT_MALLOC_TUNING=0 and a user's own MALLOC_ thresholds
leave the C library alone; another C library is left alone without an error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from plugrt_cpu import _host_memory

_GLIBC = sys.platform.startswith("linux") and _host_memory._glibc_mallopt() is not None

# In a fresh process: one session (its compile tunes malloc, or not), then rounds of ten
# 3 MB blocks (a run's activations) allocated, written and freed; prints the page faults
# of the last 10 rounds and whether the thresholds were set. By default glibc serves
# them from the heap once the first is freed, and trims the 30 MB free top each round.
_PROBE = r"""
import resource, numpy as np, onnx, plugrt
from onnx import helper, TensorProto
from plugrt_cpu import _host_memory
graph = helper.make_graph(
    [helper.make_node("Relu", ["x"], ["y"])], "g",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
)
plugrt.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(), device="cpu")
def rounds(count):
    for _ in range(count):
        blocks = [np.empty(750_000, np.float32) for _ in range(10)]
        for b in blocks:
            b.fill(1.0)
        del blocks
rounds(3)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds(10)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, _host_memory.tune_host_allocator())
"""


def _probe(**env: str) -> tuple[int, bool]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environment.update(env)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=environment, capture_output=True, text=True, check=True)
    faults, tuned = out.stdout.split()
    return int(faults), tuned == "True"


@pytest.mark.skipif(not _GLIBC, reason="glibc's mallopt only")
def test_freed_activations_come_back_without_page_faults():
    faults, tuned = _probe()
    assert tuned
    assert faults < 200
    # the same rounds with glibc's defaults: the probe sees what the tuning removes
    # (measured: 8,000 faults, 800 a round)
    faults, tuned = _probe(PLUGRT_MALLOC_TUNING="0")
    assert not tuned
    assert faults > 1000


@pytest.mark.skipif(not _GLIBC, reason="glibc's mallopt only")
@pytest.mark.parametrize(
    "env",
    [{"PLUGRT_MALLOC_TUNING": "0"}, {"MALLOC_TRIM_THRESHOLD_": "131072"}, {"MALLOC_MMAP_THRESHOLD_": "131072"}],
    ids=["turned_off", "users_trim_threshold", "users_mmap_threshold"],
)
def test_the_users_choice_stands(env):
    _, tuned = _probe(**env)
    assert not tuned


def test_another_c_library_is_left_alone(monkeypatch):
    monkeypatch.setattr(_host_memory, "_glibc_mallopt", lambda: None)
    monkeypatch.delenv("PLUGRT_MALLOC_TUNING", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    assert _host_memory._tune() is False
