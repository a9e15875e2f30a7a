"""External data is never read from outside the model's folder, wherever the tensor sits."""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import plugrt
from plugrt.errors import ModelLimitError, ModelLoadError, UnsafeExternalDataError

SECRET = np.arange(16, dtype=np.float32)


def _external(location: str, name: str = "c") -> TensorProto:
    tensor = numpy_helper.from_array(SECRET, name)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(SECRET.nbytes))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def _constant(location: str, output: str = "y") -> onnx.NodeProto:
    return helper.make_node("Constant", [], [output], value=_external(location))


def _model(nodes, functions=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16])]
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("local", 1)],
        functions=list(functions),
        ir_version=9,
    )


def _function_model(location: str) -> onnx.ModelProto:
    leak = helper.make_function("local", "Leak", [], ["y"], [_constant(location)], [helper.make_opsetid("", 18)])
    return _model([helper.make_node("Leak", [], ["y"], domain="local")], [leak])


def _nested_function_model(location: str) -> onnx.ModelProto:
    inner = helper.make_function("local", "Inner", [], ["y"], [_constant(location)], [helper.make_opsetid("", 18)])
    outer = helper.make_function(
        "local", "Outer", [], ["y"], [helper.make_node("Inner", [], ["y"], domain="local")],
        [helper.make_opsetid("", 18), helper.make_opsetid("local", 1)],
    )
    return _model([helper.make_node("Outer", [], ["y"], domain="local")], [outer, inner])


def _function_subgraph_model(location: str) -> onnx.ModelProto:
    branch = helper.make_graph(
        [_constant(location, "b")], "branch", [], [helper.make_tensor_value_info("b", TensorProto.FLOAT, [16])]
    )
    body = [
        helper.make_node("Constant", [], ["cond"], value=numpy_helper.from_array(np.array(True), "cond")),
        helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch),
    ]
    leak = helper.make_function("local", "Leak", [], ["y"], body, [helper.make_opsetid("", 18)])
    return _model([helper.make_node("Leak", [], ["y"], domain="local")], [leak])


BUILDERS = {
    "function": _function_model,
    "nested function": _nested_function_model,
    "subgraph in a function": _function_subgraph_model,
    "graph": lambda location: _model([_constant(location)]),
}


@pytest.fixture
def layout(tmp_path, monkeypatch):
    """A model folder, a secret file outside it, and a working directory holding a copy."""
    model_dir = tmp_path / "models"
    model_dir.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.bin").write_bytes(SECRET.tobytes())
    monkeypatch.chdir(outside)
    opened: list[str] = []

    def hook(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            opened.append(os.fsdecode(args[0]))

    sys.addaudithook(hook)  # hooks cannot be removed; this one only appends to a list
    yield model_dir, outside, opened
    opened.clear()


def _secret_opened(opened: list[str], outside) -> bool:
    return any(os.path.realpath(os.path.join(os.getcwd(), p)).startswith(str(outside)) for p in opened)


@pytest.mark.parametrize("where", list(BUILDERS))
@pytest.mark.parametrize("trick", ["absolute", "dotdot", "cwd-relative", "symlink"])
def test_external_data_outside_the_model_folder_is_never_read(layout, where, trick):
    model_dir, outside, opened = layout
    location = {
        "absolute": str(outside / "secret.bin"),
        "dotdot": "../outside/secret.bin",
        "cwd-relative": "secret.bin",  # exists in the working directory, not beside the model
        "symlink": "link.bin",
    }[trick]
    if trick == "symlink":
        os.symlink(outside / "secret.bin", model_dir / "link.bin")
    path = model_dir / "m.onnx"
    onnx.save(BUILDERS[where](location), path)
    opened.clear()
    with pytest.raises(ModelLoadError) as info:
        plugrt.load(str(path))
    if trick != "cwd-relative":
        assert isinstance(info.value, UnsafeExternalDataError)
    assert not _secret_opened(opened, outside), opened


@pytest.mark.parametrize("where", list(BUILDERS))
def test_external_data_inside_the_folder_is_read_wherever_the_tensor_sits(layout, where):
    model_dir, _, _ = layout
    (model_dir / "weights.bin").write_bytes(SECRET.tobytes())
    onnx.save(BUILDERS[where]("weights.bin"), model_dir / "m.onnx")
    result = plugrt.load(str(model_dir / "m.onnx"), optimization="none").run({})
    np.testing.assert_array_equal(result["y"], SECRET)


def test_external_data_that_is_a_fifo_is_refused(layout):
    model_dir, _, _ = layout
    os.mkfifo(model_dir / "pipe.bin")
    onnx.save(_function_model("pipe.bin"), model_dir / "m.onnx")
    with pytest.raises(UnsafeExternalDataError):
        plugrt.load(str(model_dir / "m.onnx"))


def test_external_data_fifo_inside_the_folder_is_called_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "pipe.bin")
    onnx.save(_model([_constant("pipe.bin")]), tmp_path / "m.onnx")
    with pytest.raises(UnsafeExternalDataError) as info:
        plugrt.load(str(tmp_path / "m.onnx"))
    assert info.value.problem == UnsafeExternalDataError.NOT_REGULAR
    assert "not a regular file" in str(info.value) and "outside" not in str(info.value)


def test_external_data_location_with_a_nul_byte_is_called_a_nul_byte(tmp_path):
    (tmp_path / "weights.bin").write_bytes(SECRET.tobytes())
    onnx.save(_model([_constant("weights.bin\x00.txt")]), tmp_path / "m.onnx")
    with pytest.raises(UnsafeExternalDataError) as info:
        plugrt.load(str(tmp_path / "m.onnx"))
    assert info.value.problem == UnsafeExternalDataError.NUL_BYTE
    assert info.value.location == "weights.bin\x00.txt"
    assert "NUL byte" in str(info.value) and "outside" not in str(info.value)


def test_external_data_past_the_end_of_its_file_is_refused(layout):
    model_dir, _, _ = layout
    (model_dir / "short.bin").write_bytes(SECRET.tobytes()[:10])
    onnx.save(_function_model("short.bin"), model_dir / "m.onnx")
    with pytest.raises(ModelLoadError, match="truncated"):
        plugrt.load(str(model_dir / "m.onnx"))


def test_external_function_tensor_over_the_size_limit_is_refused_before_reading(layout):
    model_dir, _, opened = layout
    (model_dir / "weights.bin").write_bytes(SECRET.tobytes())
    onnx.save(_function_model("weights.bin"), model_dir / "m.onnx")
    opened.clear()
    with pytest.raises(ModelLimitError) as info:
        plugrt.load(str(model_dir / "m.onnx"), **{"limits.tensor_bytes": 32})
    assert info.value.limit == "tensor_bytes"
    assert not any(p.endswith("weights.bin") for p in opened)
