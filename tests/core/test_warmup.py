"""Warm-up with named input shapes, and the counters of Session.stats()."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import onnx.parser
import pytest

import plugrt
from plugrt.errors import InputRankError, UnknownInputError, WarmupShapeError

#: Two symbolic dimensions shared by two inputs; Concat fails unless both agree on ``seq``.
CONCAT = onnx.parser.parse_model(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[batch, seq] a, float[batch, seq] b) => (float[twice, seq] y) {
        y = Concat <axis = 0> (a, b)
    }
    """
).SerializeToString()

#: A pooling kernel keeps one plan per input shape (its kernel-plan cache).
POOL = onnx.parser.parse_model(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, C, H, W] x) => (float[N, C, h, w] y) {
        y = MaxPool <kernel_shape = [2, 2], strides = [2, 2]> (x)
    }
    """
).SerializeToString()

#: An If choosing Relu or Neg, and a Loop adding x to an accumulator n times.
CONTROL_FLOW = onnx.parser.parse_model(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N] x, bool c, int64 n) => (float[N] y, float[N] z) {
        y = If (c) <
            then_branch = t () => (float[N] ty) { ty = Relu(x) },
            else_branch = e () => (float[N] ey) { ey = Neg(x) }
        >
        keep = Constant <value = bool {1}> ()
        z = Loop (n, keep, x) <
            body = b (int64 i, bool k, float[N] acc) => (bool ko, float[N] acco) {
                ko = Identity(k)
                acco = Add(acc, x)
            }
        >
    }
    """
).SerializeToString()

#: onnx's scan9_sum: y is the sum of x's rows, z the running sums.
SCAN_SUM = onnx.parser.parse_model(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2] initial, float[3, 2] x) => (float[2] y, float[3, 2] z) {
        y, z = Scan <
            num_scan_inputs = 1,
            body = b (float[2] sum_in, float[2] next) => (float[2] sum_out, float[2] scan_out) {
                sum_out = Add(sum_in, next)
                scan_out = Identity(sum_out)
            }
        > (initial, x)
    }
    """
).SerializeToString()


def test_warmup_runs_once_per_entry_of_named_shapes():
    session = plugrt.load(POOL, device="cpu")
    session.warmup([{"x": (1, 3, 8, 8)}, {"x": (2, 3, 4, 4)}])
    assert session.stats().runs == 2


def test_warmup_builds_the_kernel_plans_real_runs_then_find():
    session = plugrt.load(POOL, device="cpu")
    session.warmup([{"x": (1, 3, 8, 8)}, {"x": (2, 3, 4, 4)}])
    warmed = session.stats()
    assert warmed.kernel_cache_misses >= 2
    for shape in [(1, 3, 8, 8), (2, 3, 4, 4)]:
        session.run({"x": np.ones(shape, np.float32)})
    after = session.stats()
    assert after.kernel_cache_misses == warmed.kernel_cache_misses
    assert after.kernel_cache_hits >= warmed.kernel_cache_hits + 2


def test_warmup_gives_unnamed_inputs_the_symbols_named_ones_bind():
    session = plugrt.load(CONCAT, device="cpu")
    session.warmup({"a": (2, 5)})  # b takes (2, 5) too: batch and seq are bound by a
    assert session.stats().runs == 1


def test_warmup_runs_the_given_number_of_times_per_entry():
    session = plugrt.load(CONCAT, device="cpu")
    session.warmup([{"a": (1, 4)}, {"a": (3, 4)}], runs=3)
    assert session.stats().runs == 6


def test_warmup_of_an_unknown_input_is_an_unknown_input_error_naming_the_valid_ones():
    session = plugrt.load(CONCAT, device="cpu")
    with pytest.raises(UnknownInputError) as info:
        session.warmup([{"a": (1, 4)}, {"input_ids": (1, 16)}])
    assert info.value.input_name == "input_ids"
    assert info.value.expected == ("a", "b")
    assert session.stats().runs == 0  # every entry is checked before any run


@pytest.mark.parametrize("shape", ["1x4", (1, -4), (1, 2.5), (True, 4), 7], ids=str)
def test_warmup_of_something_that_is_not_a_shape_is_a_warmup_shape_error(shape):
    session = plugrt.load(CONCAT, device="cpu")
    with pytest.raises(WarmupShapeError) as info:
        session.warmup({"a": shape})
    assert info.value.input_name == "a"
    assert info.value.shape == shape


def test_warmup_of_a_shape_above_the_tensor_limit_is_refused_before_allocating():
    session = plugrt.load(CONCAT, device="cpu")
    with pytest.raises(WarmupShapeError, match="limits.tensor_bytes"):
        session.warmup({"a": (10**6, 10**6)})


def test_warmup_of_a_shape_of_the_wrong_rank_is_the_runs_rank_error():
    session = plugrt.load(CONCAT, device="cpu")
    with pytest.raises(InputRankError):
        session.warmup({"a": (1, 2, 3)})


def test_warmup_of_a_decoder_runs_a_prefill_and_a_decode_step_of_the_named_shapes():
    """onnxruntime-genai's builder model: integers are ones, so the generated attention
    mask agrees with the named cache lengths (a random mask would contradict them)."""
    folder = Path(__file__).parents[1] / "genai" / "assets" / "tiny_llama" / "fp32"
    head_size = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
    session = plugrt.load(str(folder / "model.onnx"))
    caches = [info.name for info in session.inputs if info.name.startswith("past_key_values")]
    heads = session.inputs[[info.name for info in session.inputs].index(caches[0])].shape[1]
    prefill = {"input_ids": (1, 16), "attention_mask": (1, 16), **{n: (1, heads, 0, head_size) for n in caches}}
    decode = {"input_ids": (1, 1), "attention_mask": (1, 17), **{n: (1, heads, 16, head_size) for n in caches}}
    session.warmup([prefill, decode])
    assert session.stats().runs == 2


def test_session_builder_warmup_takes_named_shapes():
    session = plugrt.SessionBuilder().model_bytes(POOL).device("cpu").warmup([{"x": (1, 1, 4, 4)}, {"x": (1, 1, 6, 6)}]).build()
    assert session.stats().runs == 2


def test_session_builder_warmup_with_a_count_runs_the_declared_shapes_that_many_times():
    session = plugrt.SessionBuilder().model_bytes(CONCAT).device("cpu").warmup(3).build()
    assert session.stats().runs == 3


def test_session_builder_warmup_of_an_unknown_input_fails_the_build():
    with pytest.raises(UnknownInputError):
        plugrt.SessionBuilder().model_bytes(CONCAT).device("cpu").warmup({"c": (1, 1)}).build()


def test_stats_count_if_and_loop_executions_and_their_subgraph_runs():
    session = plugrt.load(CONTROL_FLOW, device="cpu")
    assert session.stats().control_flow == {"If": 0, "Loop": 0}
    x = np.arange(4, dtype=np.float32)
    first = session.run({"x": x, "c": np.array(True), "n": np.array(3)})
    second = session.run({"x": x, "c": np.array(False), "n": np.array(2)})
    np.testing.assert_array_equal(first["z"], 4 * x)  # the loop really ran 3 times
    np.testing.assert_array_equal(second["y"], -x)
    stats = session.stats()
    assert stats.control_flow == {"If": 2, "Loop": 2}
    assert stats.subgraph_runs == 2 + 3 + 2  # one branch per If, one body run per iteration
    assert stats.runs == 2


def test_stats_count_scan_executions_and_one_body_run_per_element():
    # onnx's scan9_sum node test: running sums of the rows of x
    session = plugrt.load(SCAN_SUM, device="cpu")
    x = np.array([[1, 2], [3, 4], [5, 6]], dtype=np.float32)
    result = session.run({"initial": np.zeros(2, np.float32), "x": x})
    np.testing.assert_array_equal(result["y"], [9, 12])
    np.testing.assert_array_equal(result["z"], [[1, 2], [4, 6], [9, 12]])
    stats = session.stats()
    assert (stats.control_flow, stats.subgraph_runs) == ({"Scan": 1}, 3)


def test_stats_count_replays_and_the_bytes_they_allocate():
    session = plugrt.load(POOL, device="cpu")
    feeds = {"x": np.ones((1, 2, 4, 4), np.float32)}
    assert isinstance(session.try_capture(feeds), plugrt.Captured)
    tracemalloc.start()  # host bytes are counted while tracemalloc traces
    try:
        session.replay(feeds)
        session.replay(feeds)
        stats = session.stats()
        session.replay(feeds, copy_outputs=True)  # copies of the outputs: bytes that count
        copied = session.stats()
    finally:
        tracemalloc.stop()
    assert (stats.replays, stats.eager_fallbacks, stats.fallback_reasons) == (2, 0, {})
    assert stats.bytes_allocated_during_replay < 8192  # a few Python objects, no arrays
    assert copied.bytes_allocated_during_replay > stats.bytes_allocated_during_replay


def test_stats_are_a_snapshot_with_per_provider_counters():
    session = plugrt.load(POOL, device="cpu")
    before = session.stats()
    session.run({"x": np.ones((1, 1, 4, 4), np.float32)})
    assert before.runs == 0
    assert session.stats().providers["cpu"]["kernel_cache.misses"] == session.stats().kernel_cache_misses
    assert session.stats().as_dict()["runs"] == 1
