"""Weights shared between sessions: a WeightStore, share_weights_with, and what they save in RSS."""

from __future__ import annotations

import ctypes
import gc
import os
import sys

import numpy as np
import onnx
import onnx.parser
import onnx.reference
import pytest
from onnx import numpy_helper

import plugrt
from plugrt.conformance.light_models import light_model_dir
from plugrt.errors import InvalidOptionValueError, WeightStoreError

LIGHT = light_model_dir()

needs_proc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmRSS from /proc/self/status")


def _trim_heap() -> None:
    """Give freed heap pages back to the system (glibc keeps freed small chunks, e.g. of a
    parsed protobuf, resident until trimmed), so RSS counts what sessions hold."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def rss_bytes() -> int:
    """The process's resident set size, after a collection and a heap trim (freed arrays
    and parse buffers give their pages back)."""
    gc.collect()
    _trim_heap()
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line in /proc/self/status")


def dense_model(n: int, seed: int = 0) -> onnx.ModelProto:
    """y = Gemm(x, B, transB=1) @ W with random (n, n) float32 weights B and W."""
    model = onnx.parser.parse_model(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, {n}] x, float[{n}, {n}] B, float[{n}, {n}] W) => (float[batch, {n}] y) {{
            h = Gemm <transB = 1> (x, B)
            y = MatMul(h, W)
        }}
        """
    )
    rng = np.random.default_rng(seed)
    for name in ("B", "W"):
        model.graph.initializer.append(numpy_helper.from_array(rng.standard_normal((n, n), dtype=np.float32), name))
    # initializers, not inputs: constants the kernels may prepare at build
    del model.graph.input[1:]
    onnx.checker.check_model(model)
    return model


def initializer_array(session: plugrt.Session, name: str) -> np.ndarray:
    tensor = session.model.graph.initializers[name].const_value
    assert tensor is not None
    return tensor.numpy()


def light_inputs(name: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    model = onnx.load(os.path.join(LIGHT, f"light_{name}.onnx"))
    expected = numpy_helper.to_array(onnx.load_tensor(os.path.join(LIGHT, f"light_{name}_output_0.pb")))
    graph_input = model.graph.input[0]
    shape = [d.dim_value for d in graph_input.type.tensor_type.shape.dim]
    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    return {graph_input.name: x}, expected


@needs_proc
def test_a_second_alexnet_session_sharing_a_store_adds_well_under_its_weights_and_an_unshared_one_about_them():
    path = os.path.join(LIGHT, "light_bvlc_alexnet.onnx")
    store = plugrt.WeightStore()
    first = plugrt.load(path, device="cpu", weights=store)
    weight_bytes = sum(
        v.const_value.nbytes for v in first.model.graph.initializers.values() if v.const_value is not None
    )
    assert weight_bytes > 200 * 2**20  # AlexNet's folded weights (the light model builds them at load)

    before = rss_bytes()
    shared = plugrt.load(path, device="cpu", weights=store)
    shared_delta = rss_bytes() - before
    before = rss_bytes()
    unshared = plugrt.load(path, device="cpu")
    unshared_delta = rss_bytes() - before

    assert shared_delta < 0.1 * weight_bytes, (shared_delta, weight_bytes)
    assert unshared_delta > 0.75 * weight_bytes, (unshared_delta, weight_bytes)
    feeds, expected = light_inputs("bvlc_alexnet")
    for session in (shared, unshared):
        (result,) = session.run(feeds).values()
        np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-7)


@needs_proc
def test_an_unshared_session_holds_each_embedded_weight_once():
    model = dense_model(4096).SerializeToString()  # two 64 MiB weights inside the protobuf
    weight_bytes = 2 * 4096 * 4096 * 4
    before = rss_bytes()
    session = plugrt.load(model, device="cpu", optimization="none")
    delta = rss_bytes() - before
    # the weights, plus Gemm's transposed copy of B (64 MiB); a parsed protobuf kept alive
    # would add every weight again
    assert delta < 1.25 * (weight_bytes + weight_bytes // 2), delta
    assert session.run({"x": np.ones((1, 4096), np.float32)})["y"].shape == (1, 4096)


def test_sessions_sharing_a_store_hold_the_same_read_only_arrays():
    model = dense_model(64).SerializeToString()
    store = plugrt.WeightStore()
    first = plugrt.load(model, device="cpu", weights=store)
    second = plugrt.load(model, device="cpu", weights=store)
    for name in ("B", "W"):
        a, b = initializer_array(first, name), initializer_array(second, name)
        assert a is b
        assert not b.flags.writeable
        with pytest.raises(ValueError):
            b[0, 0] = 1.0


def test_sessions_sharing_weights_compute_what_onnxruntime_computes():
    import onnxruntime

    model = dense_model(64, seed=3)
    store = plugrt.WeightStore()
    sessions = [plugrt.load(model.SerializeToString(), device="cpu", weights=store) for _ in range(2)]
    x = np.random.default_rng(1).standard_normal((5, 64), dtype=np.float32)
    (expected,) = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    for session in sessions:
        np.testing.assert_allclose(session.run({"x": x})["y"], expected, rtol=1e-4, atol=1e-4)


def test_gemms_prepared_weight_is_made_once_for_two_sessions():
    model = dense_model(64).SerializeToString()
    store = plugrt.WeightStore()
    plugrt.load(model, device="cpu", weights=store, optimization="none")
    after_first = store.stats()
    plugrt.load(model, device="cpu", weights=store, optimization="none")
    after_second = store.stats()
    # B transposed for transB=1: one 64x64 float32 array, prepared by the first build only
    assert (after_first.transforms, after_first.transform_bytes) == (1, 64 * 64 * 4)
    assert (after_second.transforms, after_second.transforms_reused) == (1, 1)
    assert (after_second.arrays, after_second.reused) == (2, 2)


def test_weights_of_different_content_are_not_shared():
    store = plugrt.WeightStore()
    first = plugrt.load(dense_model(64, seed=0).SerializeToString(), device="cpu", weights=store)
    second = plugrt.load(dense_model(64, seed=1).SerializeToString(), device="cpu", weights=store)
    assert not np.shares_memory(initializer_array(first, "B"), initializer_array(second, "B"))
    x = np.ones((1, 64), np.float32)
    ref = onnx.reference.ReferenceEvaluator(dense_model(64, seed=1))
    np.testing.assert_allclose(second.run({"x": x})["y"], ref.run(None, {"x": x})[0], rtol=1e-4, atol=1e-3)
    assert store.stats().reused == 0


def test_share_weights_with_a_session_built_without_a_store_reuses_its_arrays():
    model = dense_model(64).SerializeToString()
    first = plugrt.load(model, device="cpu")
    assert first.weights is None
    second = plugrt.SessionBuilder().model_bytes(model).device("cpu").share_weights_with(first).build()
    assert first.weights is second.weights is not None
    for name in ("B", "W"):
        assert np.shares_memory(initializer_array(first, name), initializer_array(second, name))


def test_share_weights_with_a_session_that_has_a_store_joins_it():
    model = dense_model(64).SerializeToString()
    store = plugrt.WeightStore()
    first = plugrt.SessionBuilder().model_bytes(model).weights(store).build()
    second = plugrt.SessionBuilder().model_bytes(model).share_weights_with(first).build()
    assert second.weights is store
    assert initializer_array(first, "W") is initializer_array(second, "W")


def test_external_data_is_shared_by_file_identity(tmp_path):
    model = dense_model(64)
    path = tmp_path / "dense.onnx"
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="dense.bin",
              size_threshold=0)
    store = plugrt.WeightStore()
    first = plugrt.load(path, device="cpu", weights=store)
    second = plugrt.load(path, device="cpu", weights=store)
    assert store.stats().reused == 2
    x = np.ones((2, 64), np.float32)
    expected = onnx.reference.ReferenceEvaluator(dense_model(64)).run(None, {"x": x})[0]
    for session in (first, second):
        np.testing.assert_allclose(session.run({"x": x})["y"], expected, rtol=1e-4, atol=1e-3)


def test_add_initializer_supplies_a_weight_without_copying_it():
    weight = np.random.default_rng(7).standard_normal((64, 64), dtype=np.float32)
    store = plugrt.WeightStore()
    store.add_initializer("W", weight)
    session = plugrt.load(dense_model(64).SerializeToString(), device="cpu", weights=store)
    assert np.shares_memory(initializer_array(session, "W"), weight)
    x = np.ones((1, 64), np.float32)
    b = numpy_helper.to_array(dense_model(64).graph.initializer[0])
    np.testing.assert_allclose(session.run({"x": x})["y"], (x @ b.T) @ weight, rtol=1e-4, atol=1e-3)


def test_add_initializer_of_the_wrong_shape_is_rejected():
    store = plugrt.WeightStore()
    store.add_initializer("W", np.zeros((3, 3), np.float32))
    with pytest.raises(WeightStoreError) as info:
        plugrt.load(dense_model(64).SerializeToString(), device="cpu", weights=store)
    assert info.value.name == "W"
    assert "[64, 64]" in str(info.value)


def test_the_weights_option_rejects_anything_but_a_store():
    with pytest.raises(InvalidOptionValueError) as info:
        plugrt.load(dense_model(8).SerializeToString(), device="cpu", weights={"W": 1})
    assert info.value.key == "weights"


def test_session_stats_show_the_stores_counters():
    model = dense_model(64).SerializeToString()
    store = plugrt.WeightStore()
    plugrt.load(model, device="cpu", weights=store)
    second = plugrt.load(model, device="cpu", weights=store)
    assert second.stats().weights["reused"] == 2
    assert second.stats().weights["bytes_reused"] == 2 * 64 * 64 * 4


def test_ort_session_options_add_initializer_overrides_a_weight_as_onnxruntime_does():
    import onnxruntime

    model = dense_model(32).SerializeToString()
    weight = np.random.default_rng(5).standard_normal((32, 32), dtype=np.float32)
    x = np.random.default_rng(6).standard_normal((3, 32), dtype=np.float32)
    ort_options = onnxruntime.SessionOptions()
    ort_value = onnxruntime.OrtValue.ortvalue_from_numpy(weight)
    ort_options.add_initializer("W", ort_value)
    (expected,) = onnxruntime.InferenceSession(model, ort_options, providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    options = plugrt.SessionOptions()
    options.add_initializer("W", plugrt.OrtValue.ortvalue_from_numpy(weight))
    (result,) = plugrt.InferenceSession(model, options).run(None, {"x": x})
    np.testing.assert_allclose(result, expected, rtol=1e-4, atol=1e-4)


def test_a_cleared_store_holds_nothing_and_shares_nothing_old():
    model = dense_model(64).SerializeToString()
    store = plugrt.WeightStore()
    first = plugrt.load(model, device="cpu", weights=store)
    store.clear()
    assert len(store) == 0
    assert (store.stats().arrays, store.stats().bytes) == (0, 0)
    second = plugrt.load(model, device="cpu", weights=store)
    assert not np.shares_memory(initializer_array(first, "W"), initializer_array(second, "W"))
    assert len(store) == 2


def test_constants_moved_to_a_device_memory_are_moved_once_for_sessions_of_a_store():
    import importlib_metadata

    from plugrt.registry import ProviderRegistry

    group = "plugrt.providers"
    fake = importlib_metadata.EntryPoint("plugin", "device.fake_device:plugin", group)
    registry = ProviderRegistry(entry_points=[*importlib_metadata.entry_points(group=group), fake])
    model = dense_model(64).SerializeToString()
    store = plugrt.WeightStore()
    first = plugrt.load(model, providers=["fakedevice", "cpu"], registry=registry, weights=store)
    device = first.selection.providers[0]
    assert first.placement.nodes_per_provider == {"fakedevice": 2}
    built = device.allocated
    second = plugrt.load(model, providers=["fakedevice", "cpu"], registry=registry, weights=store)
    assert second.selection.providers[0] is device
    assert device.allocated == built  # B and W are already on the device
    plugrt.load(model, providers=["fakedevice", "cpu"], registry=registry)
    assert device.allocated - built == 2 * 64 * 64 * 4  # without the store: both again
    x = np.ones((2, 64), np.float32)
    expected = onnx.reference.ReferenceEvaluator(dense_model(64)).run(None, {"x": x})[0]
    np.testing.assert_allclose(second.run({"x": x})["y"], expected, rtol=1e-4, atol=1e-3)


def test_a_decoders_int4_weights_are_prepared_once_for_two_sessions_and_never_as_floats():
    # onnxruntime-genai's builder's tiny int4 Llama. With the compiled kernels each MatMulNBits
    # weight is repacked once (half a byte a weight), shared by a second session; without them
    # nothing is prepared ahead of a call. Either way no float copy of a weight is held.
    from plugrt_cpu.kernels._compiled import compiled_enabled

    path = os.path.join(os.path.dirname(__file__), "..", "genai", "assets", "tiny_llama", "int4", "model.onnx")
    model = onnx.load(path, load_external_data=False)
    nbits = [node for node in model.graph.node if node.op_type == "MatMulNBits"]
    assert nbits
    float_bytes = sum(
        4 * next(a.i for a in node.attribute if a.name == "N") * next(a.i for a in node.attribute if a.name == "K")
        for node in nbits
    )
    store = plugrt.WeightStore()
    first = plugrt.load(path, device="cpu", weights=store)
    made = store.stats()
    second = plugrt.load(path, device="cpu", weights=store)
    stats = store.stats()
    assert (stats.transforms, stats.transforms_reused) == (made.transforms, made.transforms)
    assert stats.transform_bytes <= float_bytes // 4
    if compiled_enabled():
        assert made.transforms >= len(nbits)
    feeds = plugrt.inputs.example_inputs(first.inputs, dims={"batch_size": 1, "sequence_length": 3,
                                                             "past_sequence_length": 0, "total_sequence_length": 3})
    feeds["attention_mask"] = np.ones((1, 3), np.int64)  # a prompt of 3 tokens, no padding
    for name, value in first.run(feeds).items():
        np.testing.assert_array_equal(second.run(feeds)[name], value)


def test_a_weight_given_with_add_initializer_is_prepared_once_for_two_sessions():
    store = plugrt.WeightStore()
    store.add_initializer("B", np.random.default_rng(8).standard_normal((64, 64), dtype=np.float32))
    model = dense_model(64).SerializeToString()
    plugrt.load(model, device="cpu", weights=store, optimization="none")
    plugrt.load(model, device="cpu", weights=store, optimization="none")
    # Gemm's B (transB=1) is the given array: transposed by the first build only
    assert (store.stats().transforms, store.stats().transforms_reused) == (1, 1)


def test_equal_bytes_of_two_dtypes_numpy_spells_alike_are_not_shared():
    import ml_dtypes

    def cast_model(onnx_type: int) -> bytes:
        model = onnx.parser.parse_model(
            """
            <ir_version: 9, opset_import: ["" : 19]>
            g () => (float[2048] y) {
                y = Cast <to = 1> (W)
            }
            """
        )
        raw = np.full(2048, 0x40, np.uint8).tobytes()  # one byte each, read as each dtype reads it
        model.graph.initializer.append(onnx.helper.make_tensor("W", onnx_type, [2048], raw, raw=True))
        return model.SerializeToString()

    store = plugrt.WeightStore()
    fn = plugrt.load(cast_model(onnx.TensorProto.FLOAT8E4M3FN), device="cpu", weights=store, optimization="none")
    fnuz = plugrt.load(cast_model(onnx.TensorProto.FLOAT8E4M3FNUZ), device="cpu", weights=store, optimization="none")
    assert store.stats().reused == 0
    byte = np.full(2048, 0x40, np.uint8)
    np.testing.assert_array_equal(fn.run({})["y"], byte.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    np.testing.assert_array_equal(fnuz.run({})["y"], byte.view(ml_dtypes.float8_e4m3fnuz).astype(np.float32))
