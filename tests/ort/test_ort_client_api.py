"""onnxruntime API pieces its clients and its own API tests use, each compared with onnxruntime."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import plugrt
from plugrt import ort as plugrt_ort
from plugrt._onnxruntime.capi.onnxruntime_inference_collection import check_and_normalize_provider_args
from plugrt.errors import ModelLoadError

ort = pytest.importorskip("onnxruntime")
CPU = ["CPUExecutionProvider"]


def _save(graph: onnx.GraphProto, path, **kw) -> str:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path), **kw)
    return str(path)


@pytest.fixture
def free_dims_model(tmp_path) -> str:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["Dim1", "Dim2", 5])
    x.type.tensor_type.shape.dim[0].denotation = "DATA_BATCH"
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["Dim1", "Dim2", 5])
    return _save(helper.make_graph([helper.make_node("Abs", ["x"], ["y"])], "abs", [x], [y]), tmp_path / "abs.onnx")


@pytest.fixture
def string_model() -> bytes:
    s = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "ids", [s("x", TensorProto.STRING, [2])], [s("y", TensorProto.STRING, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


@pytest.fixture
def external_pads_model(tmp_path) -> str:
    """x + w, where w's data is in 'w.bin', which does not exist."""
    w = numpy_helper.from_array(np.zeros(4, np.int64), "w")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "w.bin"), ("offset", "0"), ("length", "32")):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "add", [vi("x", TensorProto.INT64, [4])], [vi("y", TensorProto.INT64, [4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "ext.onnx"
    onnx.save(model, str(path))
    return str(path)


def _both(configure):
    ours, theirs = plugrt.SessionOptions(), ort.SessionOptions()
    configure(ours)
    configure(theirs)
    return ours, theirs


def test_a_free_dimension_override_by_name_fixes_that_input_dimension(free_dims_model):
    ours, theirs = _both(lambda so: so.add_free_dimension_override_by_name("Dim2", 6))
    expected = ort.InferenceSession(free_dims_model, theirs, providers=CPU).get_inputs()[0].shape
    assert plugrt.InferenceSession(free_dims_model, ours, providers=CPU).get_inputs()[0].shape == expected


def test_a_free_dimension_override_by_denotation_fixes_the_denoted_dimension(free_dims_model):
    ours, theirs = _both(lambda so: so.add_free_dimension_override_by_denotation("DATA_BATCH", 3))
    expected = ort.InferenceSession(free_dims_model, theirs, providers=CPU).get_inputs()[0].shape
    assert plugrt.InferenceSession(free_dims_model, ours, providers=CPU).get_inputs()[0].shape == expected


@pytest.mark.parametrize("dtype", ["S", "V"], ids=["bytes", "void"])
def test_a_bytes_or_void_array_feeds_a_string_input(string_model, dtype):
    # S8: onnxruntime 1.32 runs an element that fills the item width into the next one
    x = np.array([b"must", b"have"], dtype=np.void if dtype == "V" else "S8")
    expected = ort.InferenceSession(string_model, providers=CPU).run(None, {"x": x})[0]
    np.testing.assert_array_equal(plugrt.InferenceSession(string_model, providers=CPU).run(None, {"x": x})[0], expected)


def test_the_models_ort_config_sets_session_options_when_asked(tmp_path, monkeypatch):
    vi = helper.make_tensor_value_info
    model = helper.make_model(
        helper.make_graph([helper.make_node("Abs", ["x"], ["y"])], "abs", [vi("x", TensorProto.FLOAT, [2])], [vi("y", TensorProto.FLOAT, [2])]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model.ir_version = 8
    helper.set_model_props(model, {"ort_config": json.dumps({"session_options": {"intra_op_num_threads": 2, "inter_op_num_threads": 5}})})
    path = str(tmp_path / "cfg.onnx")
    onnx.save(model, path)
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "1")
    theirs = ort.InferenceSession(path, providers=CPU).get_session_options()
    ours = plugrt.InferenceSession(path, providers=CPU).get_session_options()
    assert (ours.intra_op_num_threads, ours.inter_op_num_threads) == (theirs.intra_op_num_threads, theirs.inter_op_num_threads)


def test_an_external_initializer_given_as_an_array_needs_no_file(external_pads_model):
    value = np.array([0, 0, 1, 1], np.int64)
    ours, theirs = _both(lambda so: so.add_external_initializers(["w"], [ort.OrtValue.ortvalue_from_numpy(value)]))
    x = np.arange(4, dtype=np.int64)
    expected = ort.InferenceSession(external_pads_model, theirs, providers=CPU).run(None, {"x": x})[0]
    np.testing.assert_array_equal(plugrt.InferenceSession(external_pads_model, ours, providers=CPU).run(None, {"x": x})[0], expected)


def test_an_external_data_file_given_in_memory_is_read_from_memory(external_pads_model):
    data = np.array([5, 6, 7, 8], np.int64).tobytes()
    ours, theirs = _both(lambda so: so.add_external_initializers_from_files_in_memory(["w.bin"], [data], [len(data)]))
    x = np.arange(4, dtype=np.int64)
    expected = ort.InferenceSession(external_pads_model, theirs, providers=CPU).run(None, {"x": x})[0]
    np.testing.assert_array_equal(plugrt.InferenceSession(external_pads_model, ours, providers=CPU).run(None, {"x": x})[0], expected)


def test_a_missing_external_file_still_fails_to_load(external_pads_model):
    with pytest.raises(ModelLoadError, match="does not exist"):
        plugrt.InferenceSession(external_pads_model, _free_dims_only(), providers=CPU)


def _free_dims_only() -> plugrt.SessionOptions:
    options = plugrt.SessionOptions()
    options.add_free_dimension_override_by_name("unused", 1)  # takes the path that resolves external data
    return options


def test_the_optimized_model_writes_large_initializers_to_the_named_file(tmp_path):
    vi = helper.make_tensor_value_info
    weight = numpy_helper.from_array(np.ones((8, 8), np.float32), "W")
    source = _save(helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "mm", [vi("X", TensorProto.FLOAT, [2, 8])],
                                     [vi("Y", TensorProto.FLOAT, [2, 8])], [weight]), tmp_path / "mm.onnx")
    options = plugrt.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "opt.onnx")
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "opt.bin")
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "100")
    plugrt.InferenceSession(source, options, providers=CPU)
    assert os.path.getsize(tmp_path / "opt.bin") >= 8 * 8 * 4
    x = np.ones((2, 8), np.float32)
    np.testing.assert_array_equal(plugrt.InferenceSession(str(tmp_path / "opt.onnx"), providers=CPU).run(None, {"X": x})[0],
                                  ort.InferenceSession(source, providers=CPU).run(None, {"X": x})[0])


@pytest.mark.parametrize(
    ("providers", "provider_options"),
    [(None, None), (["a", ("b", {1: 2})], None), (["a", "b"], [{"x": 1}, {}])],
)
def test_provider_arguments_normalize_as_onnxruntimes(providers, provider_options):
    from onnxruntime.capi.onnxruntime_inference_collection import check_and_normalize_provider_args as theirs

    assert check_and_normalize_provider_args(providers, provider_options, ["a", "b"]) == theirs(providers, provider_options, ["a", "b"])


@pytest.mark.parametrize(("providers", "provider_options"), [(3, None), ([3], None), (["a"], 3), (["a", "b"], [{}]), ([("a", {})], [{}])])
def test_malformed_provider_arguments_raise_value_error(providers, provider_options):
    with pytest.raises(ValueError):
        check_and_normalize_provider_args(providers, provider_options, ["a", "b"])


def test_an_unknown_config_key_is_kept_with_a_warning_when_standing_in(monkeypatch):
    monkeypatch.setattr(plugrt_ort, "_STANDING_IN", True)
    options = plugrt.SessionOptions()
    with pytest.warns(UserWarning, match="CONFIG_KEY"):
        options.add_session_config_entry("CONFIG_KEY", "CONFIG_VAL")
    assert options.get_session_config_entry("CONFIG_KEY") == "CONFIG_VAL"


def test_the_logger_callback_receives_session_records(add_relu_model):
    from plugrt._ort_env import set_default_logger_callback, set_default_logger_severity

    records = []
    set_default_logger_callback(lambda *record: records.append(record), severity=0)
    try:
        plugrt.InferenceSession(add_relu_model, providers=CPU)
    finally:
        set_default_logger_callback(None)
        set_default_logger_severity(2)
    assert records and all(isinstance(r[0], int) and isinstance(r[4], str) for r in records)


def test_get_all_providers_ends_with_the_cpu_and_knows_the_cuda_names():
    names = plugrt.get_all_providers()
    assert names[-1] == "CPUExecutionProvider"
    plugrt_only = set(names) - set(plugrt_ort.ORT_PROVIDER_NAMES)
    assert {"CUDAExecutionProvider", "TensorrtExecutionProvider"} <= set(names)
    assert plugrt_only <= set(plugrt.default_registry().providers())


def test_an_ortvalue_round_trips_through_dlpack_without_a_copy():
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    value = plugrt.OrtValue.ortvalue_from_numpy(array)
    back = plugrt.OrtValue.from_dlpack(value.to_dlpack())
    assert back.data_ptr() == array.ctypes.data
    np.testing.assert_array_equal(back.numpy(), array)


@pytest.mark.parametrize(("dtype", "expected"), [(np.uint8, True), (np.bool_, False), (np.float32, False)])
def test_a_dlpack_capsule_says_whether_it_holds_uint8(dtype, expected):
    from plugrt._ort_values import is_dlpack_uint8_tensor

    capsule = np.zeros(3, dtype=dtype).__dlpack__()
    assert is_dlpack_uint8_tensor(capsule) is expected
    assert plugrt.OrtValue.from_dlpack(capsule).numpy().dtype == dtype  # the capsule was not used up


def test_a_coo_sparse_tensor_keeps_its_values_and_indices_read_only():
    from plugrt._ort_sparse import OrtSparseFormat, SparseTensor

    values, indices = np.array([1.0, 2.0], np.float32), np.array([3, 5], np.int64)
    sparse = SparseTensor.sparse_coo_from_numpy([9, 9], values, indices, None)
    assert (sparse.format(), sparse.dense_shape(), sparse.data_type()) == (OrtSparseFormat.ORT_SPARSE_COO, [9, 9], "sparse_tensor(float)")
    assert not sparse.values().flags.writeable and not sparse.as_coo_view().indices().flags.writeable
    np.testing.assert_array_equal(plugrt.OrtValue.ort_value_from_sparse_tensor(sparse).as_sparse_tensor().as_coo_view().indices(), indices)


def test_a_sparse_tensor_stays_on_the_host():
    from plugrt._ort_sparse import SparseTensor

    sparse = SparseTensor.sparse_csr_from_numpy([2, 2], np.ones(1, np.float32), np.array([1]), np.array([0, 1, 1]), None)
    with pytest.raises(RuntimeError, match="on the host"):
        sparse.to_cuda(None)
