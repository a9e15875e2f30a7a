"""plugrt standing in for onnxruntime: the runner, install_as_onnxruntime and the error classes."""

from __future__ import annotations

import subprocess
import sys

import pytest

import plugrt
from plugrt import _ort_errors as ort_errors
from plugrt.errors import (
    ConfigEntryMissingError,
    InvalidInputError,
    KernelError,
    ModelLoadError,
    NotSupportedError,
    StandInError,
)

CLIENT = """
import importlib.metadata, importlib.util, sys
import onnxruntime
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument
from onnxruntime.transformers.io_binding_helper import TypeHelper
import plugrt.errors
print(onnxruntime.__name__)
print(onnxruntime.__version__ == importlib.metadata.version("onnxruntime"))
print(importlib.util.find_spec("onnxruntime") is not None)
print(issubclass(plugrt.errors.InvalidInputError, InvalidArgument))
print(TypeHelper.ort_type_to_numpy_type("tensor(float)").__name__)
print(sys.argv[1:])
"""


def _run(tmp_path, *args: str) -> list[str]:
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    done = subprocess.run([sys.executable, "-m", "plugrt.ort_shim", str(script), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n")


def test_the_runner_serves_plugrt_as_onnxruntime(tmp_path):
    assert _run(tmp_path)[0] == "plugrt._onnxruntime"


def test_the_stand_in_version_agrees_with_its_distribution_metadata(tmp_path):
    lines = _run(tmp_path)
    assert lines[1] == "True" and lines[2] == "True"


def test_the_stand_in_native_module_holds_the_classes_plugrt_errors_inherit(tmp_path):
    assert _run(tmp_path)[3] == "True"


def test_the_stand_in_serves_optimums_type_helper(tmp_path):
    assert _run(tmp_path)[4] == "float32"


def test_the_runner_passes_the_scripts_arguments(tmp_path):
    assert _run(tmp_path, "a", "--b")[5] == "['a', '--b']"


def test_standing_in_after_the_real_onnxruntime_was_imported_is_refused():
    pytest.importorskip("onnxruntime")
    with pytest.raises(StandInError) as info:
        plugrt.install_as_onnxruntime()
    assert info.value.module.startswith("onnxruntime")
    assert not plugrt.ort_shim.is_installed()


@pytest.mark.parametrize(
    ("error_class", "ort_class"),
    [
        (InvalidInputError, ort_errors.InvalidArgument),
        (ModelLoadError, ort_errors.InvalidProtobuf),
        (KernelError, ort_errors.RuntimeException),
        (NotSupportedError, ort_errors.NotImplemented),
    ],
)
def test_plugrt_errors_are_onnxruntimes_status_classes_too(error_class, ort_class):
    assert issubclass(error_class, ort_class) and issubclass(error_class, plugrt.PlugrtError)


def test_an_invalid_input_is_caught_as_onnxruntimes_invalid_argument():
    with pytest.raises(ort_errors.InvalidArgument) as info:
        raise InvalidInputError("bad input", input_name="x")
    assert isinstance(info.value, ValueError) and info.value.input_name == "x"


def test_a_missing_config_entry_is_a_runtime_error_as_in_onnxruntime():
    with pytest.raises(RuntimeError) as info:
        plugrt.SessionOptions().get_session_config_entry("never.set")
    assert isinstance(info.value, ConfigEntryMissingError) and info.value.key == "never.set"
