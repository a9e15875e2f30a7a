"""ONNX's node test cases through the onnxruntime-compatible API (plugrt.InferenceSession)."""

from __future__ import annotations

import fnmatch
import importlib.util

import pytest

from plugrt.conformance.expectations import match, shipped_expectations
from plugrt.conformance.node_cases import iter_node_cases, run_case
from plugrt.registry import default_registry

# the CPU provider's own expectations, shipped with plugrt_cpu
XFAILS, SKIPS = shipped_expectations(default_registry().get("cpu"))
CASES = list(iter_node_cases())


# JPEG, JPEG 2000 and WebP decode through Pillow, an optional dependency (the image extra)
_NEEDS_PILLOW = ("test_image_decoder_decode_jpeg*", "test_image_decoder_decode_webp*")
_HAS_PILLOW = importlib.util.find_spec("PIL") is not None


def _param(case):
    expected = match(case.name, XFAILS)
    skipped = match(case.name, SKIPS)
    marks = [pytest.mark.xfail(reason=expected.reason, strict=True)] if expected else []
    if skipped:
        marks.append(pytest.mark.skip(reason=skipped.reason))
    if not _HAS_PILLOW and any(fnmatch.fnmatch(case.name, p) for p in _NEEDS_PILLOW):
        marks.append(pytest.mark.skip(reason="needs Pillow: pip install Pillow (or '.[image]' from the checkout)"))
    return pytest.param(case, id=case.name, marks=marks)


def test_the_expected_failures_stay_under_two_percent():
    failing = [c.name for c in CASES if match(c.name, XFAILS) or match(c.name, SKIPS)]
    assert len(CASES) >= 1800
    assert len(failing) / len(CASES) < 0.02, failing


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_node_case(case):
    result = run_case(case, timeout=120)
    assert result.status == "passed", f"{result.status}: {result.detail}"
