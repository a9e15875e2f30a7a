"""Device bindings, capture and replay."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest

import plugrt
from plugrt.capture import Captured
from plugrt.conformance.light_models import light_models
from plugrt.errors import InvalidInputError, KernelError, NoCaptureError, StaleCaptureError

from helpers import NONZERO_MIDDLE, model_bytes


X = np.arange(16, dtype=np.float32).reshape(4, 4) - 6


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name", ["resnet50", "densenet121"])
def test_replay_is_bitwise_identical_to_eager_on_light_models(name):
    model = {m.name: m for m in light_models()}[name]
    session = plugrt.load(model.path)
    eager = session.run(model.inputs)
    result = session.try_capture(model.inputs)
    assert isinstance(result, Captured) and result.report.segments
    for _ in range(2):
        replayed = session.replay(model.inputs)
        assert all(_same(replayed[k], eager[k]) for k in eager)


def test_nonzero_in_the_middle_gives_two_segments_and_one_seam():
    session = plugrt.load(NONZERO_MIDDLE, optimization="none")
    result = session.try_capture({"x": X})
    assert len(result.report.segments) == 2
    assert [node for node, _ in result.report.seams] == ["NonZero_0"]
    assert "depends on the input values" in result.report.seams[0][1]
    eager = session.run({"x": X})["y"]
    assert _same(session.replay({"x": X})["y"], eager)
    other = X[::-1].copy()  # same NonZero count: replay stays on the captured path
    assert _same(session.replay({"x": other})["y"], session.run({"x": other})["y"])


def test_seam_whose_shape_changes_falls_back_to_an_eager_run():
    session = plugrt.load(NONZERO_MIDDLE, optimization="none")
    session.try_capture({"x": X})
    fewer = np.where(X > 5, X, -1).astype(np.float32)  # fewer non-zeros than captured
    result = session.replay({"x": fewer})
    np.testing.assert_array_equal(result["y"], session.run({"x": fewer})["y"])
    assert not result.replayed and "NonZero_0" in result.reason
    assert session.capture_stats.eager_fallbacks == 1 and session.capture_stats.replays == 0


def test_replay_without_capture_or_after_reset_is_an_error(add_relu_model):
    session = plugrt.load(add_relu_model)
    with pytest.raises(NoCaptureError):
        session.replay()
    x = np.ones((2, 4), np.float32)
    session.try_capture({"x": x, "y": x})
    session.reset()
    with pytest.raises(NoCaptureError) as info:
        session.replay({"x": x, "y": x})
    assert info.value.reason == "no capture"


def test_replay_with_a_new_shape_is_stale(add_relu_model):
    session = plugrt.load(add_relu_model)
    x = np.ones((2, 4), np.float32)
    session.try_capture({"x": x, "y": x})
    with pytest.raises(StaleCaptureError) as info:
        session.replay({"x": np.ones((3, 4), np.float32), "y": x})
    assert info.value.name == "x"


class TestBindings:
    def test_bound_output_stays_in_its_buffer_and_is_returned_as_none(self, add_relu_model):
        session = plugrt.load(add_relu_model)
        x_in = session.allocate_binding(input="x", shape=(2, 4))
        z_out = session.allocate_binding(output="z", shape=(2, 4), capacity=(8, 4))
        x_in.write(np.full((2, 4), -1.0, np.float32))
        out = session.run({"y": np.full((2, 4), 3.0, np.float32)}, bindings=[x_in, z_out])
        assert out == {"z": None}
        assert z_out.shape == (2, 4) and z_out.capacity == (8, 4)
        np.testing.assert_array_equal(z_out.read(), np.full((2, 4), 2.0, np.float32))
        assert (x_in.stats.uploads, x_in.stats.upload_bytes) == (1, 32)
        assert (z_out.stats.downloads, z_out.stats.download_bytes) == (1, 32)

    def test_one_buffer_as_input_and_output_carries_state(self):
        data = model_bytes(
            """
            <ir_version: 8, opset_import: ["" : 17]>
            g (float[N, 2] past, float[1, 2] new) => (float[M, 2] present) {
                present = Concat <axis = 0> (past, new)
            }
            """
        )
        session = plugrt.load(data)
        cache = session.allocate_binding(input="past", output="present", shape=(0, 2), capacity=(4, 2))
        for step in range(3):
            session.run({"new": np.full((1, 2), step, np.float32)}, bindings=[cache])
        assert cache.shape == (3, 2)
        np.testing.assert_array_equal(cache.read(), [[0, 0], [1, 1], [2, 2]])

    def test_logical_shape_larger_than_capacity_is_refused(self, add_relu_model):
        session = plugrt.load(add_relu_model)
        binding = session.allocate_binding(input="x", shape=(2, 4))
        with pytest.raises(InvalidInputError, match="capacity"):
            binding.write(np.zeros((3, 4), np.float32))

    def test_caller_owned_array_can_be_bound(self, add_relu_model):
        session = plugrt.load(add_relu_model)
        mine = np.zeros((2, 4), np.float32)
        out = session.bind_array(mine, output="z")
        session.run({"x": np.ones((2, 4), np.float32), "y": np.ones((2, 4), np.float32)}, bindings=[out])
        np.testing.assert_array_equal(mine, np.full((2, 4), 2.0))

    def test_replay_reads_bindings_and_detects_a_freed_one(self, add_relu_model):
        session = plugrt.load(add_relu_model)
        x_in = session.allocate_binding(input="x", shape=(2, 4))
        z_out = session.allocate_binding(output="z", shape=(2, 4))
        y = np.ones((2, 4), np.float32)
        session.try_capture({"y": y}, bindings=[x_in, z_out])
        x_in.write(np.full((2, 4), 5.0, np.float32))
        assert session.replay(bindings=[x_in, z_out]) == {"z": None}
        np.testing.assert_array_equal(z_out.read(), np.full((2, 4), 6.0))
        x_in.free()
        with pytest.raises(StaleCaptureError) as info:
            session.replay(bindings=[x_in, z_out])
        assert info.value.name == "x"


def test_in_place_steps_never_overwrite_a_value_still_needed():
    # a = Relu(x) dies at Add (written over), b = Sigmoid(a)... is read twice: never overwritten
    data = model_bytes(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[64, 64] x, float[64, 64] w) => (float[64, 64] y, float[64, 64] z) {
            m = MatMul(x, w)
            a = Relu(m)
            b = Add(a, x)
            c = Mul(b, b)
            d = Sub(c, b)
            y = Relu(d)
            z = Add(b, m)
        }
        """
    )
    session = plugrt.load(data, optimization="none")
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((64, 64)).astype(np.float32), "w": rng.standard_normal((64, 64)).astype(np.float32)}
    assert not session.try_capture(feeds).report.seams
    for _ in range(3):
        eager = session.run(feeds)
        replayed = session.replay(feeds)
        assert all(_same(replayed[k], eager[k]) for k in eager)
        feeds = {k: rng.standard_normal((64, 64)).astype(np.float32) for k in feeds}


# -- errors during a replay -------------------------------------------------------------------

GATHER = """<ir_version: 8, opset_import: ["" : 17]>
g (float[4,3] data, int64[2] idx) => (float[2,3] y) {
  r = Relu(data)
  pick = Gather<axis=0>(r, idx)
  y = Neg(pick)
}"""


def _named(text: str) -> bytes:
    model = onnx.parser.parse_model(text)
    for index, node in enumerate(model.graph.node):
        node.name = f"{node.op_type.lower()}_{index}"
    return model.SerializeToString()


def test_kernel_error_during_a_replay_names_the_node_and_op_type_as_an_eager_run_does():
    session = plugrt.load(_named(GATHER), device="cpu", optimization="none")
    data = np.ones((4, 3), np.float32)
    assert isinstance(session.try_capture({"data": data, "idx": np.array([0, 3])}), Captured)
    with pytest.raises(KernelError) as eager:
        session.run({"data": data, "idx": np.array([0, 9])})
    with pytest.raises(KernelError) as replayed:
        session.replay({"data": data, "idx": np.array([0, 9])})
    err = replayed.value
    assert (err.node, err.op_type, err.provider) == ("gather_1", "Gather", "cpu")
    assert (err.node, err.op_type) == (eager.value.node, eager.value.op_type)
    assert isinstance(err.cause, IndexError) and err.__cause__ is err.cause


# -- replays from several threads ------------------------------------------------------------


def test_one_slot_replayed_from_a_thread_pool_gives_each_request_its_own_outputs(add_relu_model):
    session = plugrt.load(add_relu_model, device="cpu")
    session.try_capture({"x": X, "y": X})
    requests = [(X * k, X - k) for k in range(1, 41)]
    expected = [np.maximum(a + b, 0) for a, b in requests]  # what an eager run gives

    def serve(request):
        a, b = request
        out = session.replay({"x": a, "y": b})["z"]
        threading.Event().wait(0.001)  # hold the result while other threads replay
        return out.copy(), out

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(serve, requests))
    for (at_return, kept), want, (a, b) in zip(results, expected, requests):
        np.testing.assert_array_equal(at_return, want)
        np.testing.assert_array_equal(kept, want)  # not overwritten by a later replay
        np.testing.assert_array_equal(kept, session.run({"x": a, "y": b})["z"])
    assert session.capture_stats.replays == len(requests)


def test_replays_on_the_capturing_thread_alone_are_zero_copy(add_relu_model):
    session = plugrt.load(add_relu_model, device="cpu")
    session.try_capture({"x": X, "y": X})
    first = session.replay({"x": X, "y": X})["z"]
    second = session.replay({"x": X + 1, "y": X})["z"]
    assert np.shares_memory(first, second)  # the capture's own buffer, overwritten


def test_capturing_thread_gets_copies_once_another_thread_replayed_the_slot(add_relu_model):
    session = plugrt.load(add_relu_model, device="cpu")
    session.try_capture({"x": X, "y": X})
    with ThreadPoolExecutor(1) as pool:
        pool.submit(session.replay, {"x": X, "y": X}).result()
    first = session.replay({"x": X, "y": X})["z"]
    second = session.replay({"x": X + 1, "y": X})["z"]
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, np.maximum(X + X, 0))
    zero_copy = session.replay({"x": X, "y": X}, copy_outputs=False)["z"]
    assert np.shares_memory(zero_copy, session.replay({"x": X, "y": X}, copy_outputs=False)["z"])
