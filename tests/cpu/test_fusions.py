"""The CPU provider's fusions: each fused model computes what the unfused one does (and what
onnxruntime does), in fewer steps, and only where no one else reads an intermediate."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx.parser
import onnx.reference
import onnx_ir as ir
import onnxruntime
import pytest
from onnx import numpy_helper

import plugrt
from plugrt.capture import Captured
from plugrt.passes import CLAIMED_BY
from plugrt_cpu import fusions


def _random(*shape: int, seed: int = 0, low: float | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if low is not None:
        return rng.uniform(low, low + 1.0, shape).astype(np.float32)
    return rng.standard_normal(shape).astype(np.float32)


def _model(text: str, **constants: np.ndarray) -> bytes:
    """A model from ONNX text, with ``constants`` as initializers (so the passes see them)."""
    model = onnx.parser.parse_model(text)
    model.graph.initializer.extend(numpy_helper.from_array(np.asarray(a), name) for name, a in constants.items())
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _step_ops(
    model: bytes, feeds: dict[str, np.ndarray], optimization: str = "all"
) -> tuple[list[str], list[np.ndarray]]:
    """The op types of the plan's steps (from the profile) and the outputs of one run."""
    session = plugrt.load(model, device="cpu", optimization=optimization, profiling=True)
    outputs = list(session.run(feeds).values())
    return [event["args"]["op_name"] for event in session.profile() if event["cat"] == "Node"], outputs


def _assert_fused(model: bytes, feeds: dict[str, np.ndarray], expected_ops: list[str]) -> None:
    """At level "all" the plan runs ``expected_ops``; the outputs match level "none" and
    onnxruntime."""
    ops, fused = _step_ops(model, feeds)
    assert ops == expected_ops
    _, unfused = _step_ops(model, feeds, optimization="none")
    ort = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    for actual, plain, theirs in zip(fused, unfused, ort):
        # the unfused Conv may take another algorithm (Winograd: errors within 1e-5 of the
        # output's scale), so the sums round differently
        scale = float(np.abs(plain).max())
        np.testing.assert_allclose(actual, plain, rtol=1e-5, atol=1e-5 * scale)
        np.testing.assert_allclose(actual, theirs, rtol=1e-5, atol=1e-5 * max(scale, 1.0))


# ---------------------------------------------------------------------------------------
# (1) Conv + BatchNormalization / per-channel Mul and Add

_CONV_BN = """
<ir_version: 8, opset_import: ["" : 13]>
g (float[2, 3, 8, 8] x) => (float[2, 4, 8, 8] y) {
    c = Conv <pads = [1, 1, 1, 1]> (x, w, b)
    y = BatchNormalization <epsilon = 0.001> (c, scale, bias, mean, var)
}
"""
_BN_CONSTANTS = dict(
    w=_random(4, 3, 3, 3), b=_random(4, seed=1), scale=_random(4, seed=2), bias=_random(4, seed=3),
    mean=_random(4, seed=4), var=_random(4, seed=5, low=0.5),
)


def test_conv_then_batch_normalization_fold_into_one_conv():
    _assert_fused(_model(_CONV_BN, **_BN_CONSTANTS), {"x": _random(2, 3, 8, 8, seed=9)}, ["Conv"])


def test_conv_then_batch_normalization_channel_mul_and_add_fold_into_one_conv():
    model = _model(
        """
        <ir_version: 8, opset_import: ["" : 13]>
        g (float[1, 3, 8, 8] x) => (float[1, 4, 6, 6] y) {
            c = Conv (x, w)
            n = BatchNormalization (c, scale, bias, mean, var)
            m = Mul (n, gain)
            y = Add (shift, m)
        }
        """,
        **{k: v for k, v in _BN_CONSTANTS.items() if k != "b"},
        gain=_random(4, 1, 1, seed=6), shift=_random(4, 1, 1, seed=7),
    )
    _assert_fused(model, {"x": _random(1, 3, 8, 8, seed=9)}, ["Conv"])


def test_batch_normalization_with_runtime_statistics_is_not_folded():
    model = _model(_CONV_BN.replace("float[2, 3, 8, 8] x", "float[2, 3, 8, 8] x, float[4] mean"),
                   **{k: v for k, v in _BN_CONSTANTS.items() if k != "mean"})
    feeds = {"x": _random(2, 3, 8, 8, seed=9), "mean": _random(4, seed=4)}
    _assert_fused(model, feeds, ["Conv", "BatchNormalization"])


def test_mul_by_a_constant_that_is_not_per_channel_is_not_folded():
    model = _model(
        """
        <ir_version: 8, opset_import: ["" : 13]>
        g (float[1, 3, 8, 8] x) => (float[1, 4, 6, 6] y) {
            c = Conv (x, w)
            y = Mul (c, gain)
        }
        """,
        w=_BN_CONSTANTS["w"], gain=_random(6, seed=6),
    )
    _assert_fused(model, {"x": _random(1, 3, 8, 8, seed=9)}, ["Conv", "Mul"])


def _batch_norm_then_channel_affine(x_shape: tuple[int, ...], y_shape: tuple[int, ...]) -> bytes:
    """MaxPool (which keeps the rank the fold needs), BatchNormalization, then Mul and Add
    by (4, 1, 1) constants."""
    window = ", ".join("1" for _ in x_shape[2:])
    text = f"""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[{", ".join(map(str, x_shape))}] x) => (float[{", ".join(map(str, y_shape))}] y) {{
        p = MaxPool <kernel_shape = [{window}]> (x)
        n = BatchNormalization (p, scale, bias, mean, var)
        m = Mul (n, gain)
        y = Add (m, shift)
    }}
    """
    constants = {k: v for k, v in _BN_CONSTANTS.items() if k not in ("w", "b")}
    return _model(text, **constants, gain=_random(4, 1, 1, seed=6), shift=_random(4, 1, 1, seed=7))


def test_channel_mul_and_add_after_batch_normalization_fold_into_it():
    # The rank comes from MaxPool's input: (4, 1, 1) is per channel on (1, 4, 5, 5).
    model = _batch_norm_then_channel_affine((1, 4, 5, 5), (1, 4, 5, 5))
    _assert_fused(model, {"x": _random(1, 4, 5, 5, seed=9)}, ["MaxPool", "BatchNormalization"])


def test_a_channel_shaped_constant_on_a_tensor_of_another_rank_is_not_folded():
    # (4, 1, 1) against (1, 4, 5) broadcasts to (4, 4, 5): not a per-channel map.
    model = _batch_norm_then_channel_affine((1, 4, 5), (4, 4, 5))
    _assert_fused(model, {"x": _random(1, 4, 5, seed=9)}, ["MaxPool", "BatchNormalization", "Mul", "Add"])


# ---------------------------------------------------------------------------------------
# (1b) BatchNormalization + Relu


def _batch_norm_relu(outputs: str = "float[2, 4, 5, 5] y", body: str = "", opset: int = 13, **feeds: str) -> bytes:
    """x -> BatchNormalization -> n -> Relu -> y, with ``body`` appended and ``feeds`` as more
    graph inputs (name: type) in place of constants."""
    inputs = ", ".join(["float[2, 4, 5, 5] x", *(f"{t} {name}" for name, t in feeds.items())])
    text = f"""
    <ir_version: 8, opset_import: ["" : {opset}]>
    g ({inputs}) => ({outputs}) {{
        n = BatchNormalization <epsilon = 0.001> (x, scale, bias, mean, var)
        y = Relu (n)
        {body}
    }}
    """
    constants = {k: v for k, v in _BN_CONSTANTS.items() if k not in ("w", "b", *feeds)}
    return _model(text, **constants)


def test_batch_normalization_then_relu_runs_as_one_channel_affine():
    _assert_fused(_batch_norm_relu(), {"x": _random(2, 4, 5, 5, seed=9)}, ["ChannelAffine"])


def test_batch_normalization_channel_mul_then_relu_fold_and_run_as_one_channel_affine():
    model = _model(
        """
        <ir_version: 8, opset_import: ["" : 13]>
        g (float[2, 4, 5, 5] x) => (float[2, 4, 5, 5] y) {
            n = BatchNormalization (x, scale, bias, mean, var)
            m = Mul (n, gain)
            y = Relu (m)
        }
        """,
        **{k: v for k, v in _BN_CONSTANTS.items() if k not in ("w", "b")}, gain=_random(4, 1, 1, seed=6),
    )
    _assert_fused(model, {"x": _random(2, 4, 5, 5, seed=9)}, ["ChannelAffine"])


def test_batch_normalization_whose_output_is_also_read_elsewhere_keeps_the_relu_apart():
    model = _batch_norm_relu("float[2, 4, 5, 5] y, float[2, 4, 5, 5] t", "t = Sigmoid (n)")
    _assert_fused(model, {"x": _random(2, 4, 5, 5, seed=9)}, ["BatchNormalization", "Relu", "Sigmoid"])


def test_batch_normalization_whose_output_is_a_graph_output_keeps_the_relu_apart():
    model = _batch_norm_relu("float[2, 4, 5, 5] n, float[2, 4, 5, 5] y")
    _assert_fused(model, {"x": _random(2, 4, 5, 5, seed=9)}, ["BatchNormalization", "Relu"])


def test_batch_normalization_with_runtime_statistics_keeps_the_relu_apart():
    model = _batch_norm_relu(var="float[4]")
    feeds = {"x": _random(2, 4, 5, 5, seed=9), "var": _random(4, seed=5, low=0.5)}
    _assert_fused(model, feeds, ["BatchNormalization", "Relu"])


def test_batch_normalization_in_training_mode_keeps_the_relu_apart():
    model = _model(
        """
        <ir_version: 8, opset_import: ["" : 15]>
        g (float[2, 4, 5, 5] x) => (float[2, 4, 5, 5] y, float[4] running_mean, float[4] running_var) {
            n, running_mean, running_var = BatchNormalization <training_mode = 1> (x, scale, bias, mean, var)
            y = Relu (n)
        }
        """,
        **{k: v for k, v in _BN_CONSTANTS.items() if k not in ("w", "b")},
    )
    feeds = {"x": _random(2, 4, 5, 5, seed=9)}
    ops, outputs = _step_ops(model, feeds)
    assert ops == ["BatchNormalization", "Relu"]
    expected = onnx.reference.ReferenceEvaluator(onnx.load_from_string(model)).run(None, feeds)
    for actual, wanted in zip(outputs, expected):
        np.testing.assert_allclose(actual, wanted, rtol=1e-5, atol=1e-6)


def test_fused_batch_normalization_relu_is_captured_and_replays_without_allocating():
    _assert_replays_without_allocating(_batch_norm_relu(), {"x": _random(2, 4, 5, 5, seed=9)}, ["ChannelAffine"])


# ---------------------------------------------------------------------------------------
# (2) Conv + Relu

def _conv_relu(out_channels: int, kernel_size: int, group: int = 1, stride: int = 1) -> bytes:
    size = (9 - kernel_size) // stride + 1
    text = f"""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2, 4, 9, 9] x) => (float[2, {out_channels}, {size}, {size}] y) {{
        c = Conv <group = {group}, strides = [{stride}, {stride}]> (x, w, b)
        y = Relu (c)
    }}
    """
    weight = _random(out_channels, 4 // group, kernel_size, kernel_size)
    return _model(text, w=weight, b=_random(out_channels, seed=1))


@pytest.mark.parametrize(
    "out_channels, kernel_size, group, stride",
    [(6, 3, 1, 1), (6, 1, 1, 1), (6, 1, 1, 2), (6, 3, 2, 2), (8, 3, 4, 1)],
    ids=["im2col", "pointwise", "strided_pointwise", "grouped", "depthwise"],
)
def test_conv_relu_runs_as_one_fused_conv(out_channels, kernel_size, group, stride):
    # The Conv kernel takes a different path per case; the Relu must apply in place on each.
    model = _conv_relu(out_channels, kernel_size, group, stride)
    _assert_fused(model, {"x": _random(2, 4, 9, 9, seed=9)}, ["FusedConv"])


def test_conv_batch_normalization_relu_becomes_one_fused_conv():
    model = _model(
        """
        <ir_version: 8, opset_import: ["" : 13]>
        g (float[2, 3, 8, 8] x) => (float[2, 4, 8, 8] y) {
            c = Conv <pads = [1, 1, 1, 1]> (x, w, b)
            n = BatchNormalization <epsilon = 0.001> (c, scale, bias, mean, var)
            y = Relu (n)
        }
        """,
        **_BN_CONSTANTS,
    )
    _assert_fused(model, {"x": _random(2, 3, 8, 8, seed=9)}, ["FusedConv"])


def test_conv_whose_output_is_also_read_elsewhere_is_not_fused():
    model = _model(
        """
        <ir_version: 8, opset_import: ["" : 13]>
        g (float[1, 3, 8, 8] x) => (float[1, 4, 6, 6] y, float[1, 4, 6, 6] z) {
            c = Conv (x, w)
            y = Relu (c)
            z = Sigmoid (c)
        }
        """,
        w=_BN_CONSTANTS["w"],
    )
    _assert_fused(model, {"x": _random(1, 3, 8, 8, seed=9)}, ["Conv", "Relu", "Sigmoid"])


def test_conv_whose_output_is_a_graph_output_is_not_fused():
    model = _model(
        """
        <ir_version: 8, opset_import: ["" : 13]>
        g (float[1, 3, 8, 8] x) => (float[1, 4, 6, 6] c, float[1, 4, 6, 6] y) {
            c = Conv (x, w)
            y = Relu (c)
        }
        """,
        w=_BN_CONSTANTS["w"],
    )
    _assert_fused(model, {"x": _random(1, 3, 8, 8, seed=9)}, ["Conv", "Relu"])


# ---------------------------------------------------------------------------------------
# (2b) Conv + Add (+ Relu): the residual of ResNet-style blocks


def _conv_add(
    channels: int, out_channels: int, kernel_size: int, size: int, *, stride: int = 1, add: str = "Add",
    relu: bool = True, z_shape: tuple[int, ...] | None = None,
) -> tuple[bytes, dict[str, np.ndarray]]:
    pad = kernel_size // 2
    out = (size + 2 * pad - kernel_size) // stride + 1
    y_shape = (2, out_channels, out, out)
    z_shape = z_shape or y_shape
    dims = lambda shape: ", ".join(map(str, shape))  # noqa: E731
    last = "y = Relu (s)" if relu else "y = Identity (s)"
    text = f"""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[2, {channels}, {size}, {size}] x, float[{dims(z_shape)}] z) => (float[{dims(y_shape)}] y) {{
        c = Conv <pads = [{pad}, {pad}, {pad}, {pad}], strides = [{stride}, {stride}]> (x, w, b)
        s = {add} (z, c)
        {last}
    }}
    """
    weight = _random(out_channels, channels, kernel_size, kernel_size) * 0.2
    feeds = {"x": _random(2, channels, size, size, seed=9), "z": _random(*z_shape, seed=10)}
    return _model(text, w=weight, b=_random(out_channels, seed=1)), feeds


@pytest.mark.parametrize(
    "channels, out_channels, kernel_size, size, stride, add",
    [(32, 64, 1, 10, 1, "Sum"), (32, 64, 1, 11, 2, "Add"), (24, 16, 3, 24, 1, "Sum"), (4, 6, 3, 9, 1, "Add")],
    ids=["pointwise", "strided_pointwise", "tap_grid", "im2col"],
)
def test_conv_add_relu_runs_as_one_fused_conv(channels, out_channels, kernel_size, size, stride, add):
    model, feeds = _conv_add(channels, out_channels, kernel_size, size, stride=stride, add=add)
    _assert_fused(model, feeds, ["FusedConv"])


def test_conv_add_without_relu_runs_as_one_fused_conv():
    model, feeds = _conv_add(32, 64, 1, 10, relu=False)
    _assert_fused(model, feeds, ["FusedConv", "Identity"])


def test_conv_add_of_a_broadcast_residual_runs_as_one_fused_conv():
    model, feeds = _conv_add(32, 64, 1, 10, z_shape=(1, 64, 1, 1))
    _assert_fused(model, feeds, ["FusedConv"])


def test_conv_add_whose_sum_is_read_twice_keeps_the_relu_apart():
    model = _model(
        """
        <ir_version: 8, opset_import: ["" : 13]>
        g (float[1, 3, 8, 8] x, float[1, 4, 6, 6] z) => (float[1, 4, 6, 6] y, float[1, 4, 6, 6] t) {
            c = Conv (x, w)
            s = Add (c, z)
            y = Relu (s)
            t = Sigmoid (s)
        }
        """,
        w=_BN_CONSTANTS["w"],
    )
    _assert_fused(model, {"x": _random(1, 3, 8, 8, seed=9), "z": _random(1, 4, 6, 6, seed=10)}, ["FusedConv", "Relu", "Sigmoid"])


@pytest.mark.parametrize(
    "channels, out_channels, kernel_size, size, z_shape",
    [(32, 64, 1, 10, None), (24, 16, 3, 24, None), (4, 6, 3, 9, None), (32, 64, 1, 10, (1, 64, 1, 1))],
    ids=["pointwise", "tap_grid", "im2col", "broadcast_residual"],
)
def test_fused_conv_add_is_captured_and_replays_without_allocating(channels, out_channels, kernel_size, size, z_shape):
    model, feeds = _conv_add(channels, out_channels, kernel_size, size, z_shape=z_shape)
    _assert_replays_without_allocating(model, feeds, ["FusedConv"])


def _assert_replays_without_allocating(model: bytes, feeds: dict[str, np.ndarray], expected_ops: list[str]) -> None:
    """At level "all" the plan runs ``expected_ops``, all captured; a replay gives what a run
    gives (also for new values) and allocates nothing."""
    from cpu.test_into import REPLAY_BYTES, replay_bytes

    session = plugrt.load(model, device="cpu", optimization="all", profiling=True)
    session.run(feeds)
    assert [e["args"]["op_name"] for e in session.profile() if e["cat"] == "Node"] == expected_ops
    session = plugrt.load(model, device="cpu", optimization="all")
    assert isinstance(session.try_capture(feeds), Captured)
    assert session.capture_report.seams == []
    other = {name: value[::-1].copy() for name, value in feeds.items()}
    for values in (feeds, other):
        eager, replayed = session.run(values), session.replay(values)
        for name in eager:
            np.testing.assert_array_equal(replayed[name], eager[name])
    assert replay_bytes(lambda: session.replay(other), small_buffers=True) < REPLAY_BYTES


# ---------------------------------------------------------------------------------------
# (3) MatMul + Add


@pytest.mark.parametrize("shape", [(5, 16), (2, 5, 16)], ids=["2d", "3d"])
def test_matmul_then_bias_add_runs_as_one_fused_matmul(shape):
    dims = ", ".join(str(d) for d in shape)
    out = ", ".join(str(d) for d in shape[:-1]) + ", 8"
    model = _model(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[{dims}] x) => (float[{out}] y) {{
            m = MatMul (x, w)
            y = Add (b, m)
        }}
        """,
        w=_random(16, 8), b=_random(8, seed=1),
    )
    _assert_fused(model, {"x": _random(*shape, seed=9)}, ["FusedMatMul"])


def test_matmul_with_a_bias_that_broadcasts_to_more_axes_is_not_fused():
    model = _model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[5, 16] x) => (float[3, 5, 8] y) {
            m = MatMul (x, w)
            y = Add (m, b)
        }
        """,
        w=_random(16, 8), b=_random(3, 1, 8, seed=1),
    )
    _assert_fused(model, {"x": _random(5, 16, seed=9)}, ["MatMul", "Add"])


# ---------------------------------------------------------------------------------------
# (4) LayerNorm and Gelu written out


def _layer_norm_text(opset: int, square: str = "Pow (d, two)") -> str:
    reduce = "ReduceMean <axes = [-1]> ({})" if opset < 18 else "ReduceMean ({}, axes)"
    return f"""
    <ir_version: 8, opset_import: ["" : {opset}]>
    g (float[2, 5, 16] x) => (float[2, 5, 16] y) {{
        mean = {reduce.format("x")}
        d = Sub (x, mean)
        p = {square}
        var = {reduce.format("p")}
        ve = Add (var, eps)
        s = Sqrt (ve)
        n = Div (d, s)
        m = Mul (n, scale)
        y = Add (m, bias)
    }}
    """


_LN_CONSTANTS = dict(
    two=np.float32(2.0), eps=np.float32(1e-5), scale=_random(16, seed=1), bias=_random(16, seed=2)
)


@pytest.mark.parametrize("opset", [13, 18])
def test_decomposed_layer_norm_runs_as_one_layer_normalization(opset):
    constants = dict(_LN_CONSTANTS, **({"axes": np.array([-1], np.int64)} if opset >= 18 else {}))
    model = _model(_layer_norm_text(opset), **constants)
    _assert_fused(model, {"x": _random(2, 5, 16, seed=9)}, ["LayerNormalization"])


def test_decomposed_layer_norm_squaring_with_mul_is_recognised():
    constants = {k: v for k, v in _LN_CONSTANTS.items() if k != "two"}
    model = _model(_layer_norm_text(13, square="Mul (d, d)"), **constants)
    _assert_fused(model, {"x": _random(2, 5, 16, seed=9)}, ["LayerNormalization"])


def test_decomposed_layer_norm_whose_centred_value_is_read_elsewhere_is_not_fused():
    text = _layer_norm_text(13).replace("=> (float[2, 5, 16] y)", "=> (float[2, 5, 16] y, float[2, 5, 16] d)")
    model = _model(text, **_LN_CONSTANTS)
    ops, _ = _step_ops(model, {"x": _random(2, 5, 16, seed=9)})
    assert "LayerNormalization" not in ops


_GELU_ERF_FORMS = {
    "x_times_one_plus_erf_then_half": "h = Mul (x, a)\n y = Mul (h, half)",
    "x_times_half_of_one_plus_erf": "h = Mul (a, half)\n y = Mul (x, h)",
    "half_x_times_one_plus_erf": "h = Mul (half, x)\n y = Mul (h, a)",
}


def _erf_gelu(tail: str, divisor: float = math.sqrt(2.0)) -> bytes:
    text = f"""
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[4, 32] x) => (float[4, 32] y) {{
        s = Div (x, divisor)
        e = Erf (s)
        a = Add (e, one)
        {tail}
    }}
    """
    return _model(text, divisor=np.float32(divisor), one=np.float32(1.0), half=np.float32(0.5))


@pytest.mark.parametrize("tail", list(_GELU_ERF_FORMS.values()), ids=list(_GELU_ERF_FORMS))
def test_erf_gelu_runs_as_one_gelu(tail):
    _assert_fused(_erf_gelu(tail), {"x": _random(4, 32, seed=9) * 3}, ["Gelu"])


def test_tanh_gelu_runs_as_one_gelu():
    model = _model(
        """
        <ir_version: 8, opset_import: ["" : 13]>
        g (float[4, 32] x) => (float[4, 32] y) {
            c = Pow (x, three)
            k = Mul (c, kappa)
            i = Add (x, k)
            s = Mul (i, root)
            t = Tanh (s)
            a = Add (t, one)
            h = Mul (x, a)
            y = Mul (h, half)
        }
        """,
        three=np.float32(3.0), kappa=np.float32(0.044715), root=np.float32(math.sqrt(2 / math.pi)),
        one=np.float32(1.0), half=np.float32(0.5),
    )
    _assert_fused(model, {"x": _random(4, 32, seed=9) * 3}, ["Gelu"])


def test_erf_of_another_scaling_is_not_taken_for_gelu():
    model = _erf_gelu(_GELU_ERF_FORMS["x_times_one_plus_erf_then_half"], divisor=3.0)
    _assert_fused(model, {"x": _random(4, 32, seed=9)}, ["Div", "Erf", "Add", "Mul", "Mul"])


# ---------------------------------------------------------------------------------------
# The private domain


def test_a_fusion_adds_the_private_domain_to_the_opset_imports():
    model = ir.from_proto(onnx.load_from_string(_conv_relu(6, 3)))
    result = fusions.FuseConvReluPass()(model)
    assert result.modified
    assert model.opset_imports[fusions.DOMAIN] == fusions.DOMAIN_VERSION
    assert [(n.domain, n.op_type) for n in model.graph] == [(fusions.DOMAIN, "FusedConv")]


def test_nodes_claimed_by_a_higher_priority_provider_are_left_alone():
    model = ir.from_proto(onnx.load_from_string(_conv_relu(6, 3)))
    model.graph.node(1).meta[CLAIMED_BY] = "gpu"
    assert not fusions.FuseConvReluPass()(model).modified
    assert [n.op_type for n in model.graph] == ["Conv", "Relu"]


def test_optimization_below_all_leaves_the_graph_unfused():
    model = _conv_relu(6, 3)
    for level in ("none", "basic"):
        ops, _ = _step_ops(model, {"x": _random(2, 4, 9, 9)}, optimization=level)
        assert ops == ["Conv", "Relu"]


def test_a_fused_model_is_captured_whole_and_replays_what_it_runs():
    model = _model(
        """
        <ir_version: 8, opset_import: ["" : 13]>
        g (float[2, 5, 16] x) => (float[2, 5, 8] y) {
            m = MatMul (x, w)
            h = Add (m, b)
            s = Div (h, root2)
            e = Erf (s)
            a = Add (e, one)
            p = Mul (h, a)
            y = Mul (p, half)
        }
        """,
        w=_random(16, 8), b=_random(8, seed=1), root2=np.float32(math.sqrt(2.0)), one=np.float32(1.0),
        half=np.float32(0.5),
    )
    session = plugrt.load(model, device="cpu")
    first, second = {"x": _random(2, 5, 16, seed=3)}, {"x": _random(2, 5, 16, seed=4)}
    captured = session.try_capture(first)
    assert isinstance(captured, Captured) and captured.report.seams == []
    for feeds in (first, second):
        np.testing.assert_array_equal(session.replay(feeds)["y"], session.run(feeds)["y"])


# ---------------------------------------------------------------------------------------
# SiLU(gate) * up: a decoder MLP's SwiGLU


def _swiglu(inner: str, outer: str, dtype: str = "float") -> bytes:
    return _model(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g ({dtype}[2, 3, 16] gate, {dtype}[2, 3, 16] up) => ({dtype}[2, 3, 16] y) {{
            s = Sigmoid (gate)
            p = {inner}
            y = {outer}
        }}
        """
    )


@pytest.mark.parametrize(
    "inner, outer", [("Mul (gate, s)", "Mul (p, up)"), ("Mul (s, gate)", "Mul (up, p)")], ids=["gate_first", "swapped"]
)
def test_sigmoid_gate_times_up_runs_as_one_silu_mul(inner, outer):
    feeds = {"gate": _random(2, 3, 16, seed=4) * 6, "up": _random(2, 3, 16, seed=5)}
    feeds["gate"][0, 0, :2] = (-120.0, 120.0)  # exp(-gate) overflows, and underflows
    _assert_fused(_swiglu(inner, outer), feeds, ["SiluMul"])


def test_silu_mul_replays_without_allocating():
    _assert_replays_without_allocating(
        _swiglu("Mul (gate, s)", "Mul (p, up)"), {"gate": _random(2, 3, 16, seed=4), "up": _random(2, 3, 16, seed=5)},
        ["SiluMul"],
    )


def test_a_sigmoid_gate_read_elsewhere_is_left_as_it_is():
    model = _model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 16] gate, float[2, 16] up) => (float[2, 16] y, float[2, 16] p) {
            s = Sigmoid (gate)
            p = Mul (gate, s)
            y = Mul (p, up)
        }
        """
    )
    # no SwiGLU: the SiLU the gate's product reads is one step of its own (FuseSiluPass)
    _assert_fused(model, {"gate": _random(2, 16, seed=4), "up": _random(2, 16, seed=5)}, ["Silu", "Mul"])


@pytest.mark.parametrize("product", ["Mul (x, s)", "Mul (s, x)"])
@pytest.mark.parametrize("dtype", ["float", "double"])
def test_x_times_its_sigmoid_runs_as_one_silu(product, dtype):
    model = _model(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g ({dtype}[2, 3, 40] x) => ({dtype}[2, 3, 40] y) {{
            s = Sigmoid (x)
            y = {product}
        }}
        """
    )
    x = _random(2, 3, 40, seed=4) * 6
    x[0, 0, :4] = (-120.0, 120.0, 0.0, -0.0)  # exp(-x) overflows, and underflows
    _assert_fused(model, {"x": x.astype(np.float64 if dtype == "double" else np.float32)}, ["Silu"])


def test_silu_replays_without_allocating():
    model = _model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 3, 40] x) => (float[2, 3, 40] y) {
            s = Sigmoid (x)
            y = Mul (x, s)
        }
        """
    )
    _assert_replays_without_allocating(model, {"x": _random(2, 3, 40, seed=4)}, ["Silu"])


@pytest.mark.parametrize("read_later", [False, True], ids=["dies-there", "read-later"])
def test_the_silu_writes_over_an_input_that_dies_at_it_and_only_then(read_later):
    """x -> Exp -> SiLU -> Neg: the SiLU writes over Exp's output where it dies there (the
    last step, which makes a graph output, never runs in place), not where an Add reads
    it after."""
    tail = "y = Add (t, e)" if read_later else "y = Neg (t)"
    model = _model(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4, 64, 128] x) => (float[4, 64, 128] y) {{
            e = Exp (x)
            s = Sigmoid (e)
            t = Mul (e, s)
            {tail}
        }}
        """
    )
    session = plugrt.load(model, device="cpu")
    assert [step.op_type for step in session._plan.steps] == ["Exp", "Silu", "Add" if read_later else "Neg"]
    wrapped = [
        name for name, value in session._plan._fn.__globals__.items()
        if getattr(value, "__qualname__", "").startswith("_in_place")
    ]
    assert wrapped == ([] if read_later else ["k1"])
    feeds = {"x": _random(4, 64, 128, seed=4)}
    expected = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    for _ in range(2):
        np.testing.assert_allclose(session.run(feeds)["y"], expected, rtol=1e-5, atol=1e-6)


def test_a_sigmoid_read_elsewhere_is_not_taken_for_silu():
    model = _model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 16] x) => (float[2, 16] y, float[2, 16] s) {
            s = Sigmoid (x)
            y = Mul (x, s)
        }
        """
    )
    _assert_fused(model, {"x": _random(2, 16, seed=4)}, ["Sigmoid", "Mul"])


def test_a_gate_times_another_sigmoid_is_not_taken_for_silu():
    model = _model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 16] gate, float[2, 16] other, float[2, 16] up) => (float[2, 16] y) {
            s = Sigmoid (other)
            p = Mul (gate, s)
            y = Mul (p, up)
        }
        """
    )
    feeds = {"gate": _random(2, 16, seed=4), "other": _random(2, 16, seed=6), "up": _random(2, 16, seed=5)}
    _assert_fused(model, feeds, ["Sigmoid", "Mul", "Mul"])


def test_silu_mul_compiled_pass_matches_float64_on_extremes_and_its_bound_call_follows_inputs(monkeypatch):
    """SiluMul's one compiled pass (and the bound call a capture replays) against float64
    numpy on extremes (exp(-g) overflowing, infinities, NaN, signed zeros), and against
    the five numpy passes it replaces."""
    from plugrt_cpu import fusions

    from cpu.numba_paths import compiled_or_skip

    compiled_or_skip(fusions.epilogue_loops)
    rng = np.random.default_rng(8)
    g = (rng.standard_normal(300) * 8).astype(np.float32)
    g[:8] = [np.nan, np.inf, -np.inf, -120.0, 120.0, 0.0, -0.0, -88.5]
    u = rng.standard_normal(300).astype(np.float32)

    def expected() -> np.ndarray:
        wide = g.astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            return (wide / (1 + np.exp(-wide)) * u).astype(np.float32)

    out = np.empty_like(g)
    replay = fusions._silu_mul_into.bind(out, g, u)
    assert replay is not None
    for _ in range(2):
        replay()
        np.testing.assert_allclose(out, expected(), rtol=2e-6, atol=1e-30)
        g[8:] = (rng.standard_normal(292) * 8).astype(np.float32)
    compiled = np.empty_like(g)
    fusions._silu_mul_into(compiled, g, u)
    monkeypatch.setattr(fusions, "epilogue_loops", lambda: None)
    numpy_path = np.empty_like(g)
    with np.errstate(invalid="ignore"):  # -inf / inf in its divide
        fusions._silu_mul_into(numpy_path, g, u)
    np.testing.assert_allclose(compiled, numpy_path, rtol=2e-6, atol=1e-30)
    assert np.signbit(compiled[[3, 6]]).tolist() == np.signbit(numpy_path[[3, 6]]).tolist()
    assert fusions._silu_mul_into.bind(out, g, u[:, None][:, 0].copy().reshape(3, 100)) is None
