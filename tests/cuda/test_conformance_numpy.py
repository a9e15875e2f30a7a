"""ONNX's node test cases for the ops the CUDA provider claims, through plugrt's conformance
suite, with the provider's kernels bound to numpy (the cupy binding runs the same builders)."""

from __future__ import annotations

import pytest

from plugrt.conformance.suite import run_conformance

from cuda_helpers import NumpyCUDA, registry_of
from plugrt_cuda._ops import OPS


_KERNEL_OPS = (
    "Conv", "MaxPool", "AveragePool", "GlobalAveragePool", "BatchNormalization", "LRN", "Softmax", "LogSoftmax",
    "LayerNormalization", "Gemm", "MatMul", "Gather", "Concat", "Slice", "Split", "Reshape", "Transpose", "Expand",
    "Where", "Cast", "Pad", "Resize", "ReduceMean", "ReduceSum", "ReduceMax", "ReduceL2", "ReduceLogSumExp",
    "Dropout", "Gelu", "Erf", "Clip", "HardSigmoid", "Selu", "Elu", "LeakyRelu", "PRelu", "Softplus", "Flatten",
)


@pytest.mark.slow
def test_every_claimed_node_case_passes():
    registry = registry_of(NumpyCUDA())
    # the claimed ops with their own kernel math (plain elementwise ops are one xp call each)
    ops = [op for op in _KERNEL_OPS if ("", op) in OPS]
    report = run_conformance("cuda", ops=ops, registry=registry, progress=False)
    broken = [(c.name, c.status, c.detail[:200]) for c in report.cases if c.status not in ("passed", "unsupported")]
    assert broken == []
    passed = sum(c.status == "passed" for c in report.cases)
    assert passed >= 150, f"only {passed} node cases ran on the provider"
    assert report.protocol["supports_op gives a reason for every no"]["status"] == "passed"
