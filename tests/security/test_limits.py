"""Limits that limit: sizes are refused before anything is allocated, computed or hung on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import plugrt
from plugrt.errors import KernelError, ModelLimitError, ModelLoadError

from helpers import model_bytes


def _child(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )


def test_tensor_limit_stops_a_3_gib_constant_of_shape_with_a_small_peak_rss(tmp_path):
    count = 3 * 2**30 // 4
    model = model_bytes(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1] x) => (float[{count}] y) <int64[1] shape = {{{count}}}> {{
            big = ConstantOfShape <value = float[1] {{1.0}}> (shape)
            y = Add(big, x)
        }}
        """
    )
    (tmp_path / "bomb.onnx").write_bytes(model)
    result = _child(
        f"""
        import plugrt
        from plugrt.errors import ModelLimitError
        try:
            plugrt.load({str(tmp_path / "bomb.onnx")!r}, **{{"limits.tensor_bytes": 2**20}})
            print("LOADED")
        except ModelLimitError as e:
            print("LIMIT", e.limit, e.value)
        # VmHWM belongs to this process image; ru_maxrss would keep the parent's peak
        # across fork and exec
        hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
        print("PEAK_KIB", hwm.split()[1])
        """
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["LIMIT"].split()[0] == "tensor_bytes" and int(lines["LIMIT"].split()[1]) >= 3 * 2**30
    assert int(lines["PEAK_KIB"]) < 200 * 1024


@pytest.mark.parametrize("optimization", ["none", "all"])
def test_constant_of_shape_over_the_limit_is_refused_before_allocating(optimization):
    session = plugrt.load(
        model_bytes(
            """
            <ir_version: 8, opset_import: ["" : 17]>
            g (int64[1] shape) => (float[N] y) {
                y = ConstantOfShape <value = float[1] {1.0}> (shape)
            }
            """
        ),
        optimization=optimization,
        **{"limits.tensor_bytes": 2**20},
    )
    np.testing.assert_array_equal(session.run({"shape": np.array([4], np.int64)})["y"], np.ones(4, np.float32))
    with pytest.raises(ModelLimitError) as info:
        session.run({"shape": np.array([2**40], np.int64)})
    assert info.value.limit == "tensor_bytes" and info.value.value == 2**42


def test_reduction_over_a_4_tib_broadcast_view_is_refused_before_computing():
    session = plugrt.load(
        model_bytes(
            """
            <ir_version: 8, opset_import: ["" : 18]>
            g (float[1] x, int64[2] shape) => (float y) {
                wide = Expand(x, shape)
                y = ReduceSum <keepdims = 0> (wide)
            }
            """
        )
    )
    started = time.perf_counter()
    with pytest.raises(ModelLimitError) as info:
        session.run({"x": np.ones(1, np.float32), "shape": np.array([2**20, 2**20], np.int64)})
    assert info.value.value == 2**42 and time.perf_counter() - started < 5
    small = session.run({"x": np.ones(1, np.float32), "shape": np.array([3, 4], np.int64)})["y"]
    assert float(small) == 12.0


def _nested_function_model(levels: int, fanout: int) -> onnx.ModelProto:
    """f0 = fanout Identity nodes in a chain; f(k) calls f(k-1) fanout times: fanout**levels nodes."""
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("local", 1)]
    functions = []
    for level in range(levels):
        callee = ("local", f"f{level - 1}") if level else ("", "Identity")
        nodes, previous = [], "x"
        for i in range(fanout):
            out = "y" if i == fanout - 1 else f"t{i}"
            nodes.append(helper.make_node(callee[1], [previous], [out], domain=callee[0]))
            previous = out
        functions.append(helper.make_function("local", f"f{level}", ["x"], ["y"], nodes, opsets))
    graph = helper.make_graph(
        [helper.make_node(f"f{levels - 1}", ["x"], ["y"], domain="local")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    return helper.make_model(graph, opset_imports=opsets, functions=functions, ir_version=9)


def test_node_limit_counts_inlined_function_bodies_before_inlining():
    model = _nested_function_model(levels=7, fanout=10)  # 10**7 nodes once inlined, a few KB on disk
    assert model.ByteSize() < 10_000
    started = time.perf_counter()
    with pytest.raises(ModelLimitError) as info:
        plugrt.load(model.SerializeToString())
    assert info.value.limit == "nodes" and time.perf_counter() - started < 5


def test_small_function_expansion_within_the_limit_runs():
    session = plugrt.load(_nested_function_model(levels=2, fanout=3).SerializeToString())
    assert session.run({"x": np.ones(1, np.float32)})["y"].tolist() == [1.0]


def test_recursive_function_is_a_model_load_error():
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("local", 1)]
    loop = helper.make_function("local", "f", ["x"], ["y"], [helper.make_node("f", ["x"], ["y"], domain="local")], opsets)
    graph = helper.make_graph(
        [helper.make_node("f", ["x"], ["y"], domain="local")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=opsets, functions=[loop], ir_version=9)
    with pytest.raises(ModelLoadError, match="calls itself"):
        plugrt.load(model.SerializeToString())


def test_loading_dev_zero_is_refused_without_reading_it():
    with pytest.raises(ModelLoadError, match="not a regular file"):
        plugrt.load("/dev/zero")


def test_loading_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "pipe.onnx")
    result = _child(
        f"""
        import plugrt
        from plugrt.errors import ModelLoadError
        try:
            plugrt.load({str(tmp_path / "pipe.onnx")!r})
        except ModelLoadError as e:
            print("REFUSED", "not a regular file" in str(e))
        """,
        timeout=60,
    )
    assert result.stdout.strip() == "REFUSED True", result.stderr


REGEX_BOMB = """
    <ir_version: 8, opset_import: ["" : 20]>
    g (string[1] x) => (bool[1] y, bool[1] z) <string[1] text = {"%s"}> {
        y = RegexFullMatch <pattern = "(a+)+$"> (text)
        z = RegexFullMatch <pattern = "(a|aa)*c"> (x)
    }
""" % ("a" * 40 + "!")


def test_catastrophic_regex_in_a_small_model_does_not_hang_load_or_run():
    model = model_bytes(REGEX_BOMB)
    assert len(model) < 300
    result = _child(
        f"""
        import numpy as np, plugrt
        s = plugrt.load({model!r})
        out = s.run({{"x": np.array(["a" * 5000 + "!"], dtype=object)}})
        print(out["y"].tolist(), out["z"].tolist())
        """,
        timeout=60,
    )
    assert result.stdout.strip() == "[False] [False]", result.stderr


def test_regex_pattern_re2_rejects_is_a_kernel_error():
    session = plugrt.load(
        model_bytes(
            """
            <ir_version: 8, opset_import: ["" : 20]>
            g (string[1] x) => (bool[1] y) {
                y = RegexFullMatch <pattern = "(a)\\\\1"> (x)
            }
            """
        )
    )
    with pytest.raises(KernelError, match="not valid RE2 syntax"):
        session.run({"x": np.array(["aa"], dtype=object)})
