"""Where plugrt's onnxruntime facade departs from onnxruntime on purpose, and what it adds."""

from __future__ import annotations

import warnings

import fake_plugins
import numpy as np
import onnx
import onnx.parser
import pytest

import plugrt as ort
from plugrt.hookspecs import hookimpl
from plugrt.provider import CompiledPartition, Step
from plugrt._ort_values import guarded_run
from plugrt.errors import (
    NotSupportedError,
    PlacementError,
    ProviderUnavailableError,
    RunTerminatedError,
    UnknownOptionError,
)

MODEL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[3, 2] X) => (float[3, 2] Y) {
    Y = Relu(X)
}
"""

UNDECLARED_OUTPUT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] X) => (float[M, K] Y) {
    Y = Transpose <perm = [1, 0]> (X)
}
"""

X = np.array([[1.0, -2.0], [3.0, -4.0], [5.0, -6.0]], dtype=np.float32)


@pytest.fixture
def model_bytes():
    return onnx.parser.parse_model(MODEL).SerializeToString()


def test_a_string_of_providers_is_one_name(model_bytes):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        session = ort.InferenceSession(model_bytes, providers="CPUExecutionProvider")
    assert session.get_providers() == ["CPUExecutionProvider"]


def test_an_unknown_provider_name_warns_then_raises(model_bytes):
    with pytest.warns(UserWarning), pytest.raises(ProviderUnavailableError, match="Unknown Provider Type: NoSuchExecutionProvider"):
        ort.InferenceSession(model_bytes, providers=["NoSuchExecutionProvider"])


def test_strict_refuses_an_unavailable_provider(model_bytes):
    with pytest.raises(ProviderUnavailableError):
        ort.InferenceSession(model_bytes, providers=["NoSuchExecutionProvider", "CPUExecutionProvider"], strict=True)


def test_unknown_config_key_is_rejected():
    options = ort.SessionOptions()
    with pytest.raises(UnknownOptionError, match="session.not_a_key"):
        options.add_session_config_entry("session.not_a_key", "1")


def test_unknown_constructor_keyword_is_rejected(model_bytes):
    with pytest.raises(UnknownOptionError, match="bogus"):
        ort.InferenceSession(model_bytes, bogus=1)


def test_disable_cpu_ep_fallback_maps_to_strict(model_bytes):
    pytest.importorskip("plugrt_provider_template")
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    model = onnx.parser.parse_model(
        # a dynamic dimension: a Shape of a static one folds to a constant at build
        '<ir_version: 8, opset_import: ["" : 17]> g (float[N] X) => (int64[1] S) { S = Shape(X) }'
    )
    with pytest.raises(PlacementError):
        ort.InferenceSession(model.SerializeToString(), options, providers=["template", "CPUExecutionProvider"])


def test_unsupported_api_names_the_plugrt_alternative(model_bytes):
    session = ort.InferenceSession(model_bytes)
    with pytest.raises(NotSupportedError, match="OrtValue.ortvalue_from_shape_and_type"):
        session.create_ortvalue_from_shape_and_type([1], np.float32, "cpu")
    with pytest.raises(NotSupportedError, match="docs/writing-a-provider.md"):
        ort.SessionOptions().register_custom_ops_library("libcustom.so")


@pytest.mark.parametrize("level", [ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL])
def test_get_outputs_reports_inferred_shapes(level):
    model = onnx.parser.parse_model(UNDECLARED_OUTPUT)
    model.graph.output[0].type.tensor_type.ClearField("shape")  # declared without a shape
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    session = ort.InferenceSession(model.SerializeToString(), options)
    assert list(session.get_outputs()[0].shape) == [4, "N"]


def test_terminate_set_during_a_run_stops_before_the_next_step(model_bytes):
    session = ort.InferenceSession(model_bytes)
    run_options = ort.RunOptions()
    run_options.run_tag = "job-7"
    steps = []

    def run():
        run_options.terminate = True  # as another thread would, mid-run
        steps.append("started")
        return session.run(None, {"X": X})

    with pytest.raises(RunTerminatedError) as caught:
        guarded_run(run_options, run)
    assert caught.value.run_tag == "job-7" and steps == []


def test_gpu_graph_id_captures_then_replays_with_the_bound_input_as_it_is_now(model_bytes):
    session = ort.InferenceSession(model_bytes)
    x = X.copy()
    binding = session.io_binding()
    binding.bind_cpu_input("X", x)
    binding.bind_output("Y")
    run_options = ort.RunOptions()
    run_options.add_run_config_entry("gpu_graph_id", "0")
    session.run_with_iobinding(binding, run_options)
    assert session.session.capture_report is not None
    x[...] = -X
    session.run_with_iobinding(binding, run_options)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], np.maximum(-X, 0))


def test_run_with_iobinding_without_outputs_is_refused(model_bytes):
    session = ort.InferenceSession(model_bytes)
    binding = session.io_binding()
    binding.bind_cpu_input("X", X)
    with pytest.raises(ort.errors.InvalidInputError, match="At least one output"):
        session.run_with_iobinding(binding)


def test_device_output_on_a_machine_without_that_device_is_refused(model_bytes):
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA is available here")
    session = ort.InferenceSession(model_bytes)
    with pytest.raises(ProviderUnavailableError):
        session.io_binding().bind_output("Y", "cuda")


def test_each_gpu_graph_id_keeps_its_own_capture(model_bytes):
    session = ort.InferenceSession(model_bytes)
    results = []
    for graph_id, x in (("1", X), ("2", -X), ("1", X)):
        binding = session.io_binding()
        binding.bind_cpu_input("X", x)
        binding.bind_output("Y")
        run_options = ort.RunOptions()
        run_options.add_run_config_entry("gpu_graph_id", graph_id)
        session.run_with_iobinding(binding, run_options)
        results.append(binding.copy_outputs_to_cpu()[0])
    np.testing.assert_array_equal(results[1], np.maximum(-X, 0))
    np.testing.assert_array_equal(results[2], np.maximum(X, 0))


def test_repr_shows_model_providers_and_placement(model_bytes):
    text = repr(ort.InferenceSession(model_bytes).session)
    assert "providers=['cpu'" in text and "cpu: 1" in text and "given as bytes" in text


class _BreaksAtRun(fake_plugins.NegProvider):
    """Claims Neg, and its kernel fails when run (a driver error, say)."""

    name = "breaksatrun"

    def compile(self, partition):
        def broken(x):
            raise RuntimeError("device lost")

        steps = [Step(broken, list(n.inputs), list(n.outputs), name=n.name, op_type=n.op_type) for n in partition.nodes]
        return CompiledPartition(partition, steps)


class _breaks_at_run:
    @staticmethod
    @hookimpl
    def plugrt_providers():
        return [_BreaksAtRun()]


NEG = onnx.parser.parse_model(
    '<ir_version: 8, opset_import: ["" : 17]> g (float[3, 2] X) => (float[3, 2] Y) { Y = Neg(X) }'
).SerializeToString()


@pytest.fixture
def breaking_registry(monkeypatch):
    import plugrt_cpu.plugin

    import plugrt.registry

    registry = plugrt.ProviderRegistry(entry_points=(), plugins=[plugrt_cpu.plugin, _breaks_at_run], disabled=())
    monkeypatch.setattr(plugrt.registry, "_default", registry)
    return registry


def test_a_provider_failing_at_run_falls_back_to_the_cpu_once(breaking_registry):
    session = ort.InferenceSession(NEG, providers=["breaksatrun", "CPUExecutionProvider"])
    with pytest.warns(UserWarning, match="device lost"):
        (y,) = session.run(None, {"X": X})
    np.testing.assert_array_equal(y, -X)
    assert session.get_providers() == ["CPUExecutionProvider"]


def test_with_fallback_disabled_a_provider_failing_at_run_raises(breaking_registry):
    session = ort.InferenceSession(NEG, providers=["breaksatrun", "CPUExecutionProvider"])
    session.disable_fallback()
    with pytest.raises(ort.KernelError, match="device lost"):
        session.run(None, {"X": X})


def test_a_typo_of_providers_suggests_providers(model_bytes):
    with pytest.raises(UnknownOptionError) as info:
        ort.InferenceSession(model_bytes, provider=["CPUExecutionProvider"])
    assert info.value.key == "provider" and info.value.suggestions[0] == "providers"
    assert "did you mean 'providers'" in str(info.value)


def test_an_unknown_config_key_names_the_closest_keys_first_and_stays_short():
    options = ort.SessionOptions()
    with pytest.raises(UnknownOptionError) as info:
        options.add_session_config_entry("session.intra_op.allow_spining", "1")
    message = str(info.value)
    assert message.startswith(
        "unknown session config key 'session.intra_op.allow_spining'; did you mean 'session.intra_op.allow_spinning'"
    )
    assert len(message) < 400 and message.count("'session.") <= 4  # the key and three suggestions, not all 50


def test_a_config_key_close_to_none_still_gets_a_short_message():
    options = ort.SessionOptions()
    with pytest.raises(UnknownOptionError) as info:
        options.add_session_config_entry("session.foo_bar", "1")
    message = str(info.value)
    assert "closest valid ones are" in message and "plugrt.ort.IGNORED_CONFIG_KEYS" in message
    assert len(message) < 400
