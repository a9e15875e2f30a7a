"""onnx.backend.test.BackendTest driven through plugrt.backend: the node, simple,
pytorch-converted, pytorch-operator and light suites."""

from __future__ import annotations

import fnmatch

import onnx.backend.test

import plugrt.backend
from plugrt.conformance.expectations import shipped_expectations
from plugrt.registry import default_registry

_backend_test = onnx.backend.test.BackendTest(plugrt.backend, __name__)

# OnnxBackendRealModelTest holds the light models, which onnx ships with their expected
# outputs (onnx/backend/test/data/light); nothing is downloaded. Six of them end in a
# Softmax over logits of 1e9 to 1e31 that are equal in exact arithmetic: one float32 ulp
# of difference between two classes (a GEMM that sums rows in another order, as OpenBLAS's
# edge tiles do on some CPUs) turns the expected uniform 0.001 into a one-hot, so onnx's
# comparison of the probabilities says nothing about the arithmetic. tests/test_light_models.py
# checks these six on their logits against onnxruntime's, and on the probabilities wherever
# the logits' tolerance still bounds them.
for _saturated in ("bvlc_alexnet", "inception_v1", "resnet50", "squeezenet", "vgg19", "zfnet512"):
    _backend_test.exclude(rf"^test_{_saturated}_cpu$")

# onnx's runner compares a sequence output item by item by calling itself, which takes
# len() of each item and so raises TypeError on a 0-d tensor, whatever the backend
# returned. test_node_cases.py runs this case with an element-wise comparison.
_backend_test.exclude(r"^test_loop16_seq_none_cpu$")

# The CPU provider's shipped expectations: cases whose expected output no correct runtime
# can reproduce are skipped, cases it does not pass are expected to fail (each says why).
_xfails, _skips = shipped_expectations(default_registry().get("cpu"))
for _entry in _skips:
    _backend_test.exclude(fnmatch.translate(_entry.pattern + "_cpu").replace(r"\Z", "$"))

for _entry in _xfails:
    # fnmatch pattern on the case name; BackendTest names add the device suffix
    _backend_test.xfail(fnmatch.translate(_entry.pattern + "_cpu").replace(r"\Z", "$"))

globals().update(_backend_test.test_cases)
