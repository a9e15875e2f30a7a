"""OnnxPredictor called in-process: how columns feed inputs, outputs become columns, bad rows."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

import plugrt
from helpers import model_bytes
from plugrt.cli import EXAMPLE_MODEL
from plugrt.errors import BatchColumnError, BatchRowError
from plugrt.ray import OnnxPredictor, map_batches_kwargs

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")

FIXED_BATCH_OF_FOUR = """
<ir_version: 8, opset_import: ["" : 17]>
scale (float[4, 3] x) => (float[4, 3] y) <float two = {2.0}> { y = Mul(x, two) }
"""

ONE_ROW = """
<ir_version: 8, opset_import: ["" : 17]>
total (float[3] x) => (float y) { y = ReduceSum <keepdims = 0> (x) }
"""

GATHER = """
<ir_version: 8, opset_import: ["" : 17]>
lookup (int64[N] index) => (float[N, 2] row) <float[3, 2] table = {0.0, 1.0, 10.0, 11.0, 20.0, 21.0}> {
    row = Gather(table, index)
}
"""


def _images(count: int) -> np.ndarray:
    return np.random.default_rng(7).random((count, 3, 32, 32), dtype=np.float32)


def test_symbolic_batch_matches_onnxruntime_and_keeps_columns() -> None:
    import onnxruntime

    images = _images(12)
    out = OnnxPredictor(EXAMPLE_MODEL, device="cpu")({"image": images, "key": np.arange(12)})
    expected = onnxruntime.InferenceSession(EXAMPLE_MODEL).run(None, {"image": images})[0]
    np.testing.assert_allclose(out["probabilities"], expected, rtol=1e-5, atol=1e-6)
    assert out["image"] is images and np.array_equal(out["key"], np.arange(12))


def test_fixed_batch_axis_is_fed_in_chunks_and_padding_is_dropped() -> None:
    x = np.arange(30, dtype=np.float32).reshape(10, 3)  # 10 rows into a batch of 4: 4 + 4 + 2
    out = OnnxPredictor(model_bytes(FIXED_BATCH_OF_FOUR), device="cpu")({"x": x})
    np.testing.assert_array_equal(out["y"], x * 2)


def test_rows_that_are_whole_inputs_run_one_by_one() -> None:
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    out = OnnxPredictor(model_bytes(ONE_ROW), device="cpu")({"x": x})
    np.testing.assert_array_equal(out["y"], x.sum(axis=1))


def test_light_squeezenet_fixed_batch_of_one_matches_onnxruntime(tmp_path) -> None:
    import onnx
    import onnxruntime

    from plugrt.conformance.light_models import with_random_weights

    # random weights: with its constant ones the model's Softmax saturates (one ulp flips a one-hot)
    path = str(tmp_path / "squeezenet_random.onnx")
    onnx.save(with_random_weights(onnx.load(os.path.join(LIGHT, "light_squeezenet.onnx")))[0], path)
    images = np.random.default_rng(3).random((3, 3, 224, 224), dtype=np.float32)
    out = OnnxPredictor(path, device="cpu", input_columns={"data_0": "pixels"})({"pixels": images})
    ort = onnxruntime.InferenceSession(path)
    expected = np.concatenate([ort.run(None, {"data_0": images[i : i + 1]})[0] for i in range(3)])
    np.testing.assert_allclose(out["softmaxout_1"], expected, rtol=1e-4, atol=1e-6)


def test_empty_batch_gives_empty_columns_of_the_declared_shape() -> None:
    out = OnnxPredictor(EXAMPLE_MODEL, device="cpu")({"image": np.zeros((0, 3, 32, 32), np.float32)})
    assert out["probabilities"].shape == (0, 10) and out["probabilities"].dtype == np.float32


def test_output_columns_rename_and_keep_columns_false_drops_inputs() -> None:
    predictor = OnnxPredictor(
        EXAMPLE_MODEL, device="cpu", output_columns={"probabilities": "scores"}, keep_columns=False
    )
    out = predictor({"image": _images(2)})
    assert sorted(out) == ["scores"] and out["scores"].shape == (2, 10)


def test_float64_column_is_cast_to_the_model_dtype() -> None:
    x = np.arange(12, dtype=np.float64).reshape(4, 3)
    out = OnnxPredictor(model_bytes(FIXED_BATCH_OF_FOUR), device="cpu")({"x": x})
    assert out["y"].dtype == np.float32
    np.testing.assert_array_equal(out["y"], x * 2)


def test_missing_column_names_the_column_and_the_input() -> None:
    predictor = OnnxPredictor(EXAMPLE_MODEL, device="cpu", input_columns={"image": "pixels"})
    with pytest.raises(BatchColumnError) as info:
        predictor({"image": _images(2)})
    assert info.value.column == "pixels" and info.value.input_name == "image"


def test_unknown_input_in_column_mapping_is_rejected() -> None:
    with pytest.raises(plugrt.InvalidInputError, match="not inputs of the model"):
        OnnxPredictor(EXAMPLE_MODEL, device="cpu", input_columns={"img": "pixels"})


def test_string_column_for_a_float_input_is_a_column_error() -> None:
    with pytest.raises(BatchColumnError, match="cannot be cast"):
        OnnxPredictor(model_bytes(ONE_ROW), device="cpu")({"x": np.array([["a", "b", "c"]])})


def test_wrong_row_shape_in_a_dense_column_is_a_column_error() -> None:
    with pytest.raises(BatchColumnError, match="axis 1"):
        OnnxPredictor(EXAMPLE_MODEL, device="cpu")({"image": np.zeros((2, 3, 16, 32), np.float32)})


def test_ragged_row_error_names_row_column_and_id() -> None:
    rows = np.empty(3, dtype=object)
    rows[0], rows[1], rows[2] = np.zeros(3), np.zeros(3), np.zeros(4)
    predictor = OnnxPredictor(model_bytes(ONE_ROW), device="cpu", id_column="name")
    with pytest.raises(BatchRowError) as info:
        predictor({"x": rows, "name": np.array(["a", "b", "c"])})
    assert (info.value.row, info.value.column, info.value.row_id) == (2, "x", "c")


def test_row_failing_in_a_kernel_is_located_and_named() -> None:
    predictor = OnnxPredictor(model_bytes(GATHER), device="cpu", input_columns={"index": "i"})
    with pytest.raises(BatchRowError) as info:
        predictor({"i": np.array([0, 1, 7, 2])})
    assert (info.value.row, info.value.column) == (2, "i")
    assert isinstance(info.value.__cause__, plugrt.KernelError)


def test_predictor_keeps_working_after_a_bad_batch() -> None:
    predictor = OnnxPredictor(model_bytes(GATHER), device="cpu", input_columns={"index": "i"})
    with pytest.raises(BatchRowError):
        predictor({"i": np.array([9])})
    np.testing.assert_array_equal(predictor({"i": np.array([2, 0])})["row"], [[20, 21], [0, 1]])


def test_map_batches_kwargs_asks_for_a_gpu_only_when_the_device_does() -> None:
    assert map_batches_kwargs("m.onnx", device="gpu")["num_gpus"] == 1
    assert map_batches_kwargs("m.onnx", device="cuda:0")["num_gpus"] == 1
    assert "num_gpus" not in map_batches_kwargs("m.onnx", device="cpu")
    assert map_batches_kwargs("m.onnx", device="cpu", num_gpus=0.5)["num_gpus"] == 0.5


def test_map_batches_kwargs_passes_predictor_arguments_to_the_constructor() -> None:
    kwargs = map_batches_kwargs("m.onnx", device="cpu", batch_size=16, id_column="path")
    assert kwargs["fn_constructor_kwargs"] == {"model": "m.onnx", "device": "cpu", "id_column": "path"}
    assert (kwargs["batch_size"], kwargs["batch_format"]) == (16, "numpy")


def test_row_error_survives_pickling_with_its_fields() -> None:
    import pickle

    error = pickle.loads(pickle.dumps(BatchRowError(4, "image", "bad", row_id="a.png", input_name="x")))
    assert (error.row, error.column, error.row_id, error.input_name) == (4, "image", "a.png", "x")


def test_importing_plugrt_ray_does_not_import_ray() -> None:
    code = "import sys, plugrt, plugrt.ray; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
