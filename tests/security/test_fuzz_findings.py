"""Models the fuzz suite found crashing or hanging the process, each now a typed error."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers import model_bytes

LAYER_NORM_HUGE_AXIS = model_bytes(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 3] x, float[2, 3] w) => (float[2, 3] y) {
        y = LayerNormalization <axis = 2147483648> (x, w)
    }
    """
)

SPLIT_WRONG_NUM_OUTPUTS = model_bytes(
    """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[7] x) => (float[2] a, float[2] b, float[2] c, float[1] d) {
        a, b, c, d = Split <num_outputs = 1> (x)
    }
    """
)

HUGE_DECLARED_INPUT = model_bytes(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1099511627776] start, float limit) => (float[N] y) {
        d = Sub(limit, start)
        n = Cast <to = 7> (d)
        y = Range(start, limit, limit)
    }
    """
)


def _load_in_child(model: bytes) -> str:
    """What load() gives, from a child process: a crash of onnx's C++ code cannot take the
    test run with it."""
    code = f"""
        import plugrt
        try:
            plugrt.load({model!r})
            print("LOADED")
        except plugrt.errors.PlugrtError as e:
            print("TYPED", type(e).__name__)
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    return result.stdout.strip() or f"exit {result.returncode}"


def test_axis_beyond_32_bits_is_refused_before_shape_inference_crashes():
    assert _load_in_child(LAYER_NORM_HUGE_AXIS) == "TYPED ModelLoadError"


def test_split_with_num_outputs_unlike_its_outputs_is_refused_before_shape_inference_aborts():
    assert _load_in_child(SPLIT_WRONG_NUM_OUTPUTS) == "TYPED ModelLoadError"


def test_huge_declared_input_does_not_hang_shape_inference():
    assert _load_in_child(HUGE_DECLARED_INPUT) in ("LOADED", "TYPED ModelLoadError", "TYPED ModelLimitError")
