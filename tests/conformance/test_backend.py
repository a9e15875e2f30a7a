"""onnx.backend.test.BackendTest driven through plugrt.backend: the node, simple,
pytorch-converted, pytorch-operator and light suites."""

from __future__ import annotations

import fnmatch
import os

import onnx.backend.test

import plugrt.backend
from plugrt.conformance.expectations import read_expectations

_backend_test = onnx.backend.test.BackendTest(plugrt.backend, __name__)

# The "real" suite downloads full-size models from the internet at test time; CI and
# this project's machines have no network access, so it cannot run here.
_backend_test.exclude(r"^OnnxBackendRealModelTest")

for _entry in read_expectations(os.path.join(os.path.dirname(__file__), "node_xfails.txt")):
    # fnmatch pattern on the case name; BackendTest names add the device suffix
    _backend_test.xfail(fnmatch.translate(_entry.pattern + "_cpu").replace(r"\Z", "$"))

globals().update(_backend_test.test_cases)
