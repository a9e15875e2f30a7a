"""onnxruntime's documented Python examples, run unchanged on ``plugrt`` and ``onnxruntime``."""

from __future__ import annotations

import importlib
import threading
import warnings

import numpy as np
import onnx
import onnx.parser
import pytest

MODEL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[3, 2] X) => (float[3, 2] Y, float[3, 2] Z) {
    Y = Relu(X)
    Z = Add(X, X)
}
"""

FOLDABLE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[3, 2] X) => (float[3, 2] Y) {
    one = Constant <value = float[1] {1.0}> ()
    two = Add(one, one)
    four = Mul(two, two)
    Y = Mul(X, four)
}
"""

X = np.array([[1.0, -2.0], [3.0, -4.0], [5.0, -6.0]], dtype=np.float32)


@pytest.fixture(params=["plugrt", "onnxruntime"])
def ort(request):
    return importlib.import_module(request.param)


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(onnx.parser.parse_model(MODEL), path)
    return str(path)


@pytest.fixture
def session(ort, model_path):
    return ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])


def test_io_binding_cpu_input_and_output(session):
    io_binding = session.io_binding()
    io_binding.bind_cpu_input("X", X)
    io_binding.bind_output("Y")
    session.run_with_iobinding(io_binding)
    (y,) = io_binding.copy_outputs_to_cpu()
    np.testing.assert_array_equal(y, np.maximum(X, 0))


def test_io_binding_get_outputs_are_ortvalues_in_bound_order(ort, session):
    io_binding = session.io_binding()
    io_binding.bind_cpu_input("X", X)
    io_binding.bind_output("Z")
    io_binding.bind_output("Y")
    session.run_with_iobinding(io_binding)
    z, y = io_binding.get_outputs()
    assert isinstance(z, ort.OrtValue) and z.device_name() == "cpu"
    np.testing.assert_array_equal(z.numpy(), X + X)
    np.testing.assert_array_equal(y.numpy(), np.maximum(X, 0))


def test_bound_cpu_input_is_read_when_the_run_happens(session):
    x = X.copy()
    io_binding = session.io_binding()
    io_binding.bind_cpu_input("X", x)
    io_binding.bind_output("Z")
    x[0, 0] = 10.0
    session.run_with_iobinding(io_binding)
    assert io_binding.copy_outputs_to_cpu()[0][0, 0] == 20.0


def test_ortvalue_output_is_written_in_place(ort, session):
    y_ortvalue = ort.OrtValue.ortvalue_from_shape_and_type([3, 2], np.float32, "cpu", 0)
    io_binding = session.io_binding()
    io_binding.bind_ortvalue_input("X", ort.OrtValue.ortvalue_from_numpy(X, "cpu", 0))
    io_binding.bind_ortvalue_output("Y", y_ortvalue)
    session.run_with_iobinding(io_binding)
    np.testing.assert_array_equal(y_ortvalue.numpy(), np.maximum(X, 0))
    assert io_binding.get_outputs()[0].data_ptr() == y_ortvalue.data_ptr()


def test_clear_binding_outputs_then_rebind(session):
    io_binding = session.io_binding()
    io_binding.bind_cpu_input("X", X)
    io_binding.bind_output("Y")
    session.run_with_iobinding(io_binding)
    io_binding.clear_binding_outputs()
    io_binding.bind_output("Z")
    io_binding.synchronize_inputs()
    session.run_with_iobinding(io_binding)
    io_binding.synchronize_outputs()
    (z,) = io_binding.copy_outputs_to_cpu()
    np.testing.assert_array_equal(z, X + X)


def test_ortvalue_reports_device_shape_and_type(ort):
    value = ort.OrtValue.ortvalue_from_numpy(X)
    assert value.device_name() == "cpu"
    assert list(value.shape()) == [3, 2]
    assert value.data_type() == "tensor(float)"
    assert value.element_type() == onnx.TensorProto.FLOAT
    assert value.is_tensor() and value.has_value()
    assert value.tensor_size_in_bytes() == X.nbytes


def test_ortvalue_from_numpy_shares_host_memory(ort):
    x = X.copy()
    value = ort.OrtValue.ortvalue_from_numpy(x)
    assert value.data_ptr() == x.ctypes.data
    assert np.shares_memory(value.numpy(), x)


def test_ortvalue_from_shape_and_type_takes_an_onnx_type_number(ort):
    value = ort.OrtValue.ortvalue_from_shape_and_type([2, 5], onnx.TensorProto.INT64)
    assert value.data_type() == "tensor(int64)" and list(value.shape()) == [2, 5]
    assert np.asarray(value).dtype == np.int64


def test_update_inplace_changes_what_the_next_run_reads(session, ort):
    value = ort.OrtValue.ortvalue_from_numpy(X.copy())
    value.update_inplace(np.ones((3, 2), np.float32))
    (z,) = session.run(["Z"], {"X": value})
    np.testing.assert_array_equal(z, np.full((3, 2), 2.0, np.float32))


def test_run_with_ort_values_returns_ortvalues(ort, session):
    (z,) = session.run_with_ort_values(["Z"], {"X": ort.OrtValue.ortvalue_from_numpy(X)})
    assert isinstance(z, ort.OrtValue)
    np.testing.assert_array_equal(z.numpy(), X + X)


def test_run_options_are_accepted_and_read_back(ort, session):
    run_options = ort.RunOptions()
    run_options.log_severity_level = 3
    run_options.logid = "first"  # the run tag
    run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    assert run_options.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
    y, z = session.run(None, {"X": X}, run_options)
    np.testing.assert_array_equal(y, np.maximum(X, 0))


def test_terminate_stops_the_run(ort, session):
    run_options = ort.RunOptions()
    run_options.terminate = True
    with pytest.raises(Exception, match="terminate flag"):
        session.run(None, {"X": X}, run_options)
    run_options.terminate = False
    assert len(session.run(None, {"X": X}, run_options)) == 2


def test_unavailable_provider_warns_and_the_next_one_is_used(ort, model_path):
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA is available here")
    with pytest.warns(UserWarning, match="CUDAExecutionProvider"):
        session = ort.InferenceSession(model_path, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert session.get_providers() == ["CPUExecutionProvider"]
    np.testing.assert_array_equal(session.run(["Y"], {"X": X})[0], np.maximum(X, 0))


def test_optimized_model_filepath_writes_the_folded_model(ort, tmp_path):
    import onnxruntime

    source = tmp_path / "foldable.onnx"
    onnx.save(onnx.parser.parse_model(FOLDABLE), source)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    written = onnx.load(options.optimized_model_filepath)
    assert [n.op_type for n in written.graph.node] == ["Mul"]
    check = onnxruntime.InferenceSession(options.optimized_model_filepath, providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(check.run(None, {"X": X})[0], X * 4)


def test_documented_session_config_keys_are_accepted(ort, model_path):
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.add_session_config_entry("session.set_denormal_as_zero", "1")
    assert options.get_session_config_entry("session.disable_prepacking") == "1"
    session = ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(["Z"], {"X": X})[0], X + X)


def test_session_options_threads_mode_and_logging(ort, model_path):
    options = ort.SessionOptions()
    options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    options.inter_op_num_threads = 2
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
    assert session.get_session_options().inter_op_num_threads == 2
    np.testing.assert_array_equal(session.run(["Z"], {"X": X})[0], X + X)


def test_get_device_names_the_build_device(ort):
    assert ort.get_device() in ("CPU", "GPU")


def test_set_providers_rebuilds_with_provider_options(session):
    session.set_providers(["CPUExecutionProvider"])
    assert session.get_providers() == ["CPUExecutionProvider"]
    assert session.get_provider_options()["CPUExecutionProvider"] == {} or isinstance(
        session.get_provider_options()["CPUExecutionProvider"], dict
    )
    np.testing.assert_array_equal(session.run(["Y"], {"X": X})[0], np.maximum(X, 0))


def test_fallback_switches_and_profiling_start_time(session):
    session.disable_fallback()
    session.enable_fallback()
    assert isinstance(session.get_profiling_start_time_ns(), int)


def test_run_async_calls_back_on_a_worker_thread(session):
    done = threading.Event()
    received = []

    def callback(results, user_data, err):
        received.append((results, user_data, err, threading.current_thread() is threading.main_thread()))
        done.set()

    session.run_async(["Z"], {"X": X}, callback, "data")
    assert done.wait(10)
    (results, user_data, err, on_main) = received[0]
    assert err == "" and user_data == "data" and not on_main
    np.testing.assert_array_equal(results[0], X + X)


def test_inputs_outputs_and_metadata(session):
    assert [(i.name, i.type, list(i.shape)) for i in session.get_inputs()] == [("X", "tensor(float)", [3, 2])]
    assert [(o.name, list(o.shape)) for o in session.get_outputs()] == [("Y", [3, 2]), ("Z", [3, 2])]
    assert session.get_modelmeta().graph_name == "g"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert session.get_overridable_initializers() == []


def test_cuda_use_tf32_is_the_cuda_tf32_option():
    from plugrt.options import parse_options
    from plugrt.ort import _provider_entries, _session_options_of

    entries = _provider_entries(["CUDAExecutionProvider", "CPUExecutionProvider"], [{"use_tf32": "0"}, {}])
    options = _session_options_of(entries)
    assert options == {"cuda.tf32": "0"} and parse_options(options)["cuda.tf32"] is False
    assert _session_options_of(_provider_entries(["CPUExecutionProvider"], [{"use_tf32": "0"}])) == {}
