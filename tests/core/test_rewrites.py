"""The core's provider-independent rewrites (plugrt.rewrites): each pattern becomes the op
it computes, with the values onnxruntime computes for the pattern; patterns that are not
quite it are left alone; a rewrite no provider could run is not made."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import pytest
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

import plugrt
from plugrt import rewrites
from plugrt.provider import Support
from plugrt_cpu import CPUProvider

from helpers import written_out_gelu


def _random(*shape: int, seed: int = 0, low: float | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if low is not None:
        return rng.uniform(low, low + 1.0, shape).astype(np.float32)
    return rng.standard_normal(shape).astype(np.float32)


def _proto(text: str, **constants: np.ndarray) -> onnx.ModelProto:
    model = onnx.parser.parse_model(text)
    model.graph.initializer.extend(numpy_helper.from_array(np.asarray(a), name) for name, a in constants.items())
    onnx.checker.check_model(model)
    return model


def _rewritten(model: onnx.ModelProto, providers: list | None = None) -> tuple[onnx.ModelProto, list[str]]:
    """The model after the core's rewrites (asking ``providers``, the CPU provider by
    default), and its nodes as ``domain::op`` ("op" for the default domain)."""
    ir_model = ir.from_proto(model)
    for graph_pass in rewrites.rewrite_passes(providers if providers is not None else [CPUProvider()]):
        graph_pass(ir_model)
    proto = ir.to_proto(ir_model)
    return proto, [f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in proto.graph.node]


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = onnxruntime.SessionOptions()
    # onnxruntime's own fusions off: it runs the nodes as written
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _assert_same_values(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    """onnxruntime on the model as written and on the rewritten one, and plugrt on the
    rewritten one, agree within float32 rounding."""
    expected = _ort(before, feeds)
    theirs = _ort(after, feeds)
    ours = list(plugrt.load(after.SerializeToString(), device="cpu", optimization="none").run(feeds).values())
    for want, got_ort, got in zip(expected, theirs, ours):
        scale = max(float(np.abs(want).max()), 1.0)
        np.testing.assert_allclose(got_ort, want, rtol=1e-5, atol=1e-5 * scale)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)


# ---------------------------------------------------------------------------------------
# BatchNormalization folded into Conv, Gemm and BatchNormalization


def _bn_constants(channels: int, prefix: str = "") -> dict[str, np.ndarray]:
    return {
        f"{prefix}scale": _random(channels, seed=3),
        f"{prefix}bias": _random(channels, seed=4),
        f"{prefix}mean": _random(channels, seed=5),
        f"{prefix}var": _random(channels, seed=6, low=0.5),
    }


_CONV_BN = """
<ir_version: 8, opset_import: ["" : 15]>
g (float[1, 3, 8, 8] x) => (float[1, 4, 6, 6] y) {
    c = Conv (x, w, b)
    y = BatchNormalization <epsilon = 0.001> (c, scale, bias, mean, var)
}
"""


def test_batch_normalization_after_a_conv_folds_into_its_weights():
    model = _proto(_CONV_BN, w=_random(4, 3, 3, 3, seed=1), b=_random(4, seed=2), **_bn_constants(4))
    after, ops = _rewritten(model)
    assert ops == ["Conv"]
    _assert_same_values(model, after, {"x": _random(1, 3, 8, 8, seed=9)})


def test_folding_gives_the_weights_the_cpu_provider_folded_before_in_float64():
    constants = dict(w=_random(4, 3, 3, 3, seed=1), b=_random(4, seed=2), **_bn_constants(4))
    after, _ = _rewritten(_proto(_CONV_BN, **constants))
    folded = {i.name: numpy_helper.to_array(i) for i in after.graph.initializer}
    weight = folded[after.graph.node[0].input[1]]
    epsilon = float(np.float32(0.001))  # the attribute is a float32
    multiplier = constants["scale"].astype(np.float64) / np.sqrt(constants["var"].astype(np.float64) + epsilon)
    expected = (constants["w"].astype(np.float64) * multiplier[:, None, None, None]).astype(np.float32)
    assert weight.tobytes() == expected.tobytes()


def test_batch_normalization_with_statistics_computed_at_run_time_is_left_alone():
    text = _CONV_BN.replace("float[1, 3, 8, 8] x)", "float[1, 3, 8, 8] x, float[4] mean)")
    constants = {k: v for k, v in _bn_constants(4).items() if k != "mean"}
    model = _proto(text, w=_random(4, 3, 3, 3, seed=1), b=_random(4, seed=2), **constants)
    _, ops = _rewritten(model)
    assert ops == ["Conv", "BatchNormalization"]


def test_a_conv_whose_output_is_also_read_elsewhere_keeps_its_batch_normalization():
    text = _CONV_BN.replace("=> (float[1, 4, 6, 6] y)", "=> (float[1, 4, 6, 6] y, float[1, 4, 6, 6] c)")
    model = _proto(text, w=_random(4, 3, 3, 3, seed=1), b=_random(4, seed=2), **_bn_constants(4))
    _, ops = _rewritten(model)
    assert ops == ["Conv", "BatchNormalization"]


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("with_c", [True, False])
def test_batch_normalization_after_a_gemm_folds_into_its_weights(trans_b, with_c):
    weight = _random(*((5, 6) if trans_b else (6, 5)), seed=1)
    inputs = "x, w, c" if with_c else "x, w"
    model = _proto(
        f"""
        <ir_version: 8, opset_import: ["" : 15]>
        g (float[3, 6] x) => (float[3, 5] y) {{
            p = Gemm <transB = {trans_b}, alpha = 0.5, beta = 2.0> ({inputs})
            y = BatchNormalization (p, scale, bias, mean, var)
        }}
        """,
        w=weight, **({"c": _random(5, seed=2)} if with_c else {}), **_bn_constants(5),
    )
    after, ops = _rewritten(model)
    assert ops == ["Gemm"]
    _assert_same_values(model, after, {"x": _random(3, 6, seed=9)})


def test_a_gemm_followed_by_a_bias_add_alone_is_left_to_the_providers():
    model = _proto(
        """
        <ir_version: 8, opset_import: ["" : 15]>
        g (float[3, 6] x) => (float[3, 5] y) {
            p = Gemm (x, w)
            y = Add (p, c)
        }
        """,
        w=_random(6, 5, seed=1), c=_random(5, seed=2),
    )
    _, ops = _rewritten(model)
    assert ops == ["Gemm", "Add"]


# ---------------------------------------------------------------------------------------
# LayerNorm


def _layer_norm_text(opset: int, axes: str = "[-1]", outputs: str = "float[2, 5, 16] y") -> str:
    reduce = f"ReduceMean <axes = {axes}> ({{}})" if opset < 18 else "ReduceMean ({}, axes)"
    return f"""
    <ir_version: 8, opset_import: ["" : {opset}]>
    g (float[2, 5, 16] x) => ({outputs}) {{
        mean = {reduce.format("x")}
        d = Sub (x, mean)
        p = Pow (d, two)
        var = {reduce.format("p")}
        ve = Add (var, eps)
        s = Sqrt (ve)
        n = Div (d, s)
        m = Mul (n, scale)
        y = Add (m, bias)
    }}
    """


def _ln_constants(opset: int, axes: tuple[int, ...] = (-1,)) -> dict[str, np.ndarray]:
    constants = dict(two=np.float32(2.0), eps=np.float32(1e-5), scale=_random(16, seed=1), bias=_random(16, seed=2))
    if opset >= 18:
        constants["axes"] = np.array(axes, np.int64)
    return constants


@pytest.mark.parametrize("opset", [17, 18])
def test_layer_norm_written_out_becomes_layer_normalization(opset):
    model = _proto(_layer_norm_text(opset), **_ln_constants(opset))
    after, ops = _rewritten(model)
    assert ops == ["LayerNormalization"]
    assert onnx.helper.get_attribute_value(after.graph.node[0].attribute[0]) == -1  # axis
    _assert_same_values(model, after, {"x": _random(2, 5, 16, seed=9)})


def test_layer_norm_below_opset_17_is_left_to_the_providers():
    model = _proto(_layer_norm_text(13), **_ln_constants(13))
    _, ops = _rewritten(model)
    assert "LayerNormalization" not in ops


def test_layer_norm_over_a_leading_axis_is_left_alone():
    model = _proto(_layer_norm_text(17, axes="[1]"), **_ln_constants(17))
    _, ops = _rewritten(model)
    assert ops[0] == "ReduceMean" and "LayerNormalization" not in ops


def test_layer_norm_whose_centred_value_is_read_elsewhere_is_left_alone():
    text = _layer_norm_text(17, outputs="float[2, 5, 16] y, float[2, 5, 16] d")
    _, ops = _rewritten(_proto(text, **_ln_constants(17)))
    assert "LayerNormalization" not in ops


# ---------------------------------------------------------------------------------------
# GELU


def _erf_gelu(opset: int, outputs: str = "float[4, 32] y") -> onnx.ModelProto:
    return written_out_gelu("erf", opset, outputs)


def _tanh_gelu(opset: int) -> onnx.ModelProto:
    return written_out_gelu("tanh", opset)


def test_erf_gelu_at_opset_20_becomes_gelu():
    model = _erf_gelu(20)
    after, ops = _rewritten(model)
    assert ops == ["Gelu"]
    feeds = {"x": _random(4, 32, seed=9) * 3}
    (want,) = ReferenceEvaluator(model).run(None, feeds)
    (got,) = ReferenceEvaluator(after).run(None, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    _assert_same_values(model, after, feeds)


def test_tanh_gelu_at_opset_20_becomes_gelu_with_the_tanh_approximation():
    after, ops = _rewritten(_tanh_gelu(20))
    assert ops == ["Gelu"]
    assert onnx.helper.get_attribute_value(after.graph.node[0].attribute[0]) == b"tanh"
    _assert_same_values(_tanh_gelu(20), after, {"x": _random(4, 32, seed=9) * 3})


@pytest.mark.parametrize(("make", "op"), [(_erf_gelu, "Gelu"), (_tanh_gelu, "FastGelu")])
def test_gelu_below_opset_20_becomes_onnxruntimes_contrib_op(make, op):
    model = make(17)
    after, ops = _rewritten(model)
    assert ops == [f"com.microsoft::{op}"]
    assert {o.domain: o.version for o in after.opset_import}["com.microsoft"] == 1
    _assert_same_values(model, after, {"x": _random(4, 32, seed=9) * 3})


def test_gelu_whose_inner_value_is_a_graph_output_is_left_alone():
    _, ops = _rewritten(_erf_gelu(20, outputs="float[4, 32] y, float[4, 32] e"))
    assert "Gelu" not in ops and "Erf" in ops


def test_a_model_without_the_default_opset_is_left_as_it_is():
    model = _proto(
        """
        <ir_version: 8, opset_import: ["ai.onnx.ml" : 1]>
        g (float[2, 3] x) => (float[2, 3] y) {
            y = ai.onnx.ml.Binarizer <threshold = 0.5> (x)
        }
        """
    )
    _, ops = _rewritten(model)
    assert ops == ["ai.onnx.ml::Binarizer"]


# ---------------------------------------------------------------------------------------
# Placement: a rewrite only where no provider loses what it could run


class _Elementwise:
    """A provider stand-in that runs the ops GELU is written with, and not Gelu."""

    name = "elementwise"

    def supports_op(self, node, ctx):
        if node.domain in ("", "ai.onnx") and node.op_type in ("Div", "Erf", "Add", "Mul"):
            return Support.yes()
        return Support.no(f"elementwise runs Div, Erf, Add and Mul only, not {node.op_type}")


def test_a_rewrite_a_provider_able_to_run_the_pattern_could_not_run_is_not_made():
    _, ops = _rewritten(_erf_gelu(20), providers=[_Elementwise(), CPUProvider()])
    assert ops == ["Div", "Erf", "Add", "Mul", "Mul"]


def test_a_pattern_split_between_providers_is_not_rewritten_into_an_op_none_runs():
    class ErfOnly:
        name = "erf_only"

        def supports_op(self, node, ctx):
            return Support.yes() if node.op_type == "Erf" else Support.no("Erf only")

    class ArithmeticOnly:
        name = "arithmetic_only"

        def supports_op(self, node, ctx):
            return Support.yes() if node.op_type in ("Div", "Add", "Mul") else Support.no("arithmetic only")

    _, ops = _rewritten(_erf_gelu(17), providers=[ErfOnly(), ArithmeticOnly()])
    assert ops == ["Div", "Erf", "Add", "Mul", "Mul"]


def test_a_rewrite_is_made_when_the_providers_that_run_the_pattern_run_its_op():
    class WithGelu(_Elementwise):
        def supports_op(self, node, ctx):
            return Support.yes() if node.op_type == "Gelu" else super().supports_op(node, ctx)

    _, ops = _rewritten(_erf_gelu(20), providers=[WithGelu(), CPUProvider()])
    assert ops == ["Gelu"]


def test_the_cpu_provider_runs_the_contrib_gelu_through_its_own_gelu_kernel():
    model = _tanh_gelu(17)
    session = plugrt.load(model.SerializeToString(), device="cpu", optimization="all", profiling=True)
    feeds = {"x": _random(4, 32, seed=9) * 3}
    (got,) = session.run(feeds).values()
    ops = [event["args"]["op_name"] for event in session.profile() if event["cat"] == "Node"]
    assert ops == ["Gelu"]  # plugrt.cpu's, for com.microsoft::FastGelu without a bias
    np.testing.assert_allclose(got, _ort(model, feeds)[0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# What other providers see: the rewritten standard and contrib ops, never a provider's own


def test_another_provider_is_asked_about_the_rewritten_ops_and_never_about_the_cpus_own(monkeypatch):
    import importlib_metadata

    import fake_plugins
    from plugrt.registry import ProviderRegistry

    asked: list[tuple[str, str]] = []
    original = fake_plugins.ReluAddProvider.supports_op

    def recording(self, node, ctx):
        asked.append((node.domain, node.op_type))
        return original(self, node, ctx)

    monkeypatch.setattr(fake_plugins.ReluAddProvider, "supports_op", recording)
    installed = list(importlib_metadata.entry_points(group="plugrt.providers"))
    fake = importlib_metadata.EntryPoint("with_relu_add", "fake_plugins:with_relu_add", "plugrt.providers")
    registry = ProviderRegistry(entry_points=[*installed, fake])
    model = _proto(
        """
        <ir_version: 9, opset_import: ["" : 17]>
        g (float[1, 3, 8, 8] x) => (float[1, 4, 6, 6] y) {
            c = Conv (x, w, b)
            n = BatchNormalization (c, scale, bias, mean, var)
            r = Relu (n)
            s = Div (r, divisor)
            e = Erf (s)
            a = Add (e, one)
            h = Mul (r, a)
            g1 = Mul (h, half)
            y = Add (g1, r)
        }
        """,
        w=_random(4, 3, 3, 3, seed=1), b=_random(4, seed=2), **_bn_constants(4),
        divisor=np.float32(math.sqrt(2.0)), one=np.float32(1.0), half=np.float32(0.5),
    )
    session = plugrt.load(
        model.SerializeToString(), providers=["reluadd", "cpu"], registry=registry, optimization="all"
    )
    feeds = {"x": _random(1, 3, 8, 8, seed=9)}
    np.testing.assert_allclose(session.run(feeds)["y"], _ort(model, feeds)[0], rtol=1e-5, atol=1e-5)
    assert ("com.microsoft", "Gelu") in asked
    assert not [a for a in asked if a[0] not in ("", "com.microsoft")]  # nothing of plugrt.cpu's
    # placement saw the rewritten graph: the folded Conv and the Gelu went to the CPU, the
    # Relu and the last Add stayed with reluadd
    reported = {fb.op_type for fb in session.placement.fallbacks}
    assert reported == {"Conv", "Gelu"}
    assert session.placement.nodes_per_provider == {"cpu": 2, "reluadd": 2}
