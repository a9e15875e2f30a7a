"""The template provider: what it claims, how it partitions and compiles, and its contexts."""

from __future__ import annotations

import io
import json
import os
import re

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import plugrt
import plugrt_cpu.plugin
from helpers import model_bytes
from plugrt.provider import SupportContext

template_plugin = pytest.importorskip(
    "plugrt_provider_template.plugin", reason="pip install ./providers/template to test the template provider"
)

RNG = np.random.default_rng(0)


def _registry() -> plugrt.ProviderRegistry:
    # Exactly cpu and template, whatever else is installed or disabled in the environment.
    return plugrt.ProviderRegistry(entry_points=(), plugins=[plugrt_cpu.plugin, template_plugin], disabled=())


def _template():
    return _registry().providers()["template"]


def _load(model: bytes, device: str, **options) -> plugrt.Session:
    # "basic": the CPU provider's fusion passes (level "all") rewrite MatMul + Add into a
    # CPU-only node before placement, whichever provider ranks first.
    options.setdefault("optimization", "basic")
    return plugrt.load(model, device=device, registry=_registry(), **options)


def _floats(array: np.ndarray) -> str:
    return ", ".join(repr(float(v)) for v in array.ravel())


def _weights(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _model(signature: str, body: str, initializers: list[str] = (), opset: int = 17, check: bool = True) -> bytes:
    """A one-graph model from ONNX text: ``signature`` is "(inputs) => (outputs)"."""
    block = f"<{', '.join(initializers)}>" if initializers else ""
    header = f'<ir_version: {8 if opset >= 8 else 3}, opset_import: ["" : {opset}, "acme" : 1]>'
    return model_bytes(f"{header} g {signature} {block} {{ {body} }}", check=check)


W1, B1, W2 = _weights(8, 16), _weights(16), _weights(16, 4)

# MatMul -> Add -> Relu | Softmax (declined) | MatMul -> Tanh; hb is also an output, so the
# first template partition has two outputs. The intermediates carry no declared type: the
# session's type inference records them before the template is asked.
MLP = _model(
    "(float[N, 8] x) => (float[N, 4] y, float[N, 16] hb)",
    """
        h = MatMul(x, w1)
        hb = Add(h, b1)
        a = Relu(hb)
        s = Softmax<axis = -1>(a)
        m = MatMul(s, w2)
        y = Tanh(m)
    """,
    [f"float[8, 16] w1 = {{{_floats(W1)}}}", f"float[16] b1 = {{{_floats(B1)}}}", f"float[16, 4] w2 = {{{_floats(W2)}}}"],
)
MLP_FEEDS = {"x": _weights(5, 8)}


def _assert_same_as_cpu(model: bytes, feeds: dict, *, template_nodes: int) -> None:
    on_template, on_cpu = _load(model, "template"), _load(model, "cpu")
    assert on_template.placement.nodes_per_provider.get("template", 0) == template_nodes
    expected = on_cpu.run(feeds)
    for name, value in on_template.run(feeds).items():
        assert value.dtype == expected[name].dtype and value.shape == expected[name].shape
        assert value.tobytes() == expected[name].tobytes(), name  # bitwise


# -- placement ------------------------------------------------------------------------


def test_partly_claimed_model_splits_into_template_and_cpu_partitions():
    session = _load(MLP, "template")
    parts = [(p.provider, p.nodes) for p in session.placement.partitions]
    assert parts == [("template", 3), ("cpu", 1), ("template", 2)]


def test_declined_node_is_reported_as_a_fallback_with_the_template_reason():
    session = _load(MLP, "template")
    (fallback,) = session.placement.fallbacks
    assert (fallback.op_type, fallback.declined_by, fallback.placed_on) == ("Softmax", "template", "cpu")
    assert "no kernel for ai.onnx::Softmax" in fallback.reason


def test_partly_claimed_model_gives_the_cpu_provider_outputs_bitwise():
    _assert_same_as_cpu(MLP, MLP_FEEDS, template_nodes=5)


def test_full_optimisation_leaves_claimed_nodes_to_the_template():
    session = _load(MLP, "template", optimization="all")
    assert [(p.provider, p.nodes) for p in session.placement.partitions] == [("template", 3), ("cpu", 1), ("template", 2)]


# -- what supports_op claims and declines ---------------------------------------------


def _last_node(model: bytes) -> tuple[ir.Node, SupportContext]:
    graph_model = ir.from_proto(onnx.load_from_string(model))
    opsets = {d or "": v for d, v in graph_model.opset_imports.items()}
    return list(graph_model.graph)[-1], SupportContext(opsets, graph_model.graph)


@pytest.mark.parametrize(
    "model, reason",
    [
        (
            _model("(double[2] x) => (double[2] y)", "y = Add(x, x)"),
            "template claims float32 only; input 'x' is float64",
        ),
        (
            _model("(float[2] x) => (float[2] y)", "y = Softmax(x)"),
            "the template has no kernel for ai.onnx::Softmax; it claims float32 Add",
        ),
        (
            _model("(float[2] x) => (float[2] y)", "y = acme.Add(x, x)", check=False),
            "the template claims only ai.onnx ops",
        ),
        (
            _model("(float[2] x) => (float[2] y)", "y = Add(x, x)", opset=6),
            "the model's opset 6 selects Add-6; the template implements Add from opset 7 on",
        ),
        (
            _model("(float[2] x) => (float[2] y)", "t = acme.Op(x)\n y = Relu(t)", check=False),
            "template claims float32 only; the element type of input 't' is unknown",
        ),
    ],
    ids=["float64", "unclaimed-op", "custom-domain", "old-opset", "untyped-input"],
)
def test_declined_node_has_a_reason_the_user_can_act_on(model, reason):
    answer = _template().supports_op(*_last_node(model))
    assert not answer.supported
    assert reason in answer.reason


# -- numerics: every claimed op against the CPU provider, bitwise ----------------------

_UNARY = ["Neg", "Abs", "Sqrt", "Exp", "Log", "Tanh", "Relu", "Sigmoid", "LeakyRelu<alpha = 0.2>", "LeakyRelu<alpha = 1.5>"]
_BINARY = ["Add", "Sub", "Mul", "Div", "Pow"]


@pytest.mark.parametrize("op", _UNARY)
def test_unary_op_matches_cpu_bitwise(op):
    model = _model("(float[3, 4] x) => (float[3, 4] y)", f"y = {op}(x)")
    x = _weights(3, 4) * 10
    if op in ("Sqrt", "Log"):
        x = np.abs(x) + 0.1
    _assert_same_as_cpu(model, {"x": x}, template_nodes=1)


@pytest.mark.parametrize("op", _BINARY)
def test_binary_op_with_broadcasting_matches_cpu_bitwise(op):
    model = _model("(float[3, 4] a, float[4] b) => (float[3, 4] y)", f"y = {op}(a, b)")
    a, b = _weights(3, 4), _weights(4)
    if op == "Pow":
        a = np.abs(a) + 0.5
    _assert_same_as_cpu(model, {"a": a, "b": b}, template_nodes=1)


def test_pow_by_a_constant_two_matches_cpu_bitwise():
    model = _model("(float[3, 4] x) => (float[3, 4] y)", "y = Pow(x, two)", ["float two = {2.0}"])
    _assert_same_as_cpu(model, {"x": _weights(3, 4)}, template_nodes=1)


@pytest.mark.parametrize(
    "attributes, b_constant, c_kind",
    [
        ("", False, "input"),
        ("<alpha = 0.5, beta = 2.0, transA = 1, transB = 1>", False, "input"),
        ("<alpha = 0.5, beta = 2.0, transB = 1>", True, "constant"),
        ("<alpha = 1.5, beta = 0.0>", True, "constant"),
        ("<transA = 1>", True, None),
    ],
    ids=["plain", "scaled-transposed", "constant-b-and-c", "beta-zero", "no-c"],
)
def test_gemm_matches_cpu_bitwise(attributes, b_constant, c_kind):
    a_shape = (6, 3) if "transA" in attributes else (3, 6)
    b_shape = (4, 6) if "transB" in attributes else (6, 4)
    feeds = {"a": _weights(*a_shape), "b": _weights(*b_shape), "c": _weights(4)}
    inputs, initializers = [f"float[{a_shape[0]}, {a_shape[1]}] a"], []
    b_type = f"float[{b_shape[0]}, {b_shape[1]}] b"
    if b_constant:
        initializers.append(f"{b_type} = {{{_floats(feeds.pop('b'))}}}")
    else:
        inputs.append(b_type)
    if c_kind == "constant":
        initializers.append(f"float[4] c = {{{_floats(feeds.pop('c'))}}}")
    elif c_kind == "input":
        inputs.append("float[4] c")
    else:
        del feeds["c"]
    args = "a, b, c" if c_kind else "a, b"
    model = _model(f"({', '.join(inputs)}) => (float[3, 4] y)", f"y = Gemm{attributes}({args})", initializers)
    _assert_same_as_cpu(model, feeds, template_nodes=1)


# -- compile: one fused step per partition ---------------------------------------------


def _template_partitions(session: plugrt.Session) -> list:
    return [cp for cp in session.compiled_partitions if cp.provider == "template"]


def test_each_template_partition_compiles_to_one_step_running_all_its_nodes():
    session = _load(MLP, "template")
    for compiled in _template_partitions(session):
        (step,) = compiled.steps
        assert len(step.nodes) == len(compiled.partition.nodes) > 1
        assert step.outputs == compiled.partition.outputs
        assert step.multi_output == (len(step.outputs) > 1)


def test_generated_function_is_the_one_the_guide_shows():
    from plugrt_provider_template._program import generate_source

    session = _load(MLP, "template")
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "writing-a-provider.md"), encoding="utf-8") as f:
        shown = re.search(r"<!-- generated: [^>]*-->\n```python\n(.*?)```", f.read(), re.S).group(1)
    assert generate_source(_template_partitions(session)[0].state) == shown


def test_constant_weights_are_baked_into_the_program_not_passed_to_the_step():
    session = _load(MLP, "template")
    first, _ = _template_partitions(session)
    assert [v.name for v in first.steps[0].inputs] == ["x"]
    baked = sorted(a.shape for a in first.state.constants.values())
    assert baked == [(8, 16), (16,)]


# -- EPContext: save_context / load_context ---------------------------------------------


def test_restored_context_gives_identical_outputs():
    session = _load(MLP, "template")
    provider = _template()  # a fresh provider: nothing shared in memory with the session's
    restored = session.rebuilt_with(
        {
            cp.partition.name: provider.load_context(provider.save_context(cp), {"partition": cp.partition})
            for cp in _template_partitions(session)
        }
    )
    assert [p.restored for p in restored.placement.partitions] == [True, False, True]
    expected = session.run(MLP_FEEDS)
    for name, value in restored.run(MLP_FEEDS).items():
        assert value.tobytes() == expected[name].tobytes()


def test_context_blob_is_a_json_header_and_an_npz_without_pickle():
    from plugrt_provider_template._context import FORMAT

    blob = _template().save_context(_template_partitions(_load(MLP, "template"))[0])
    assert blob.startswith(FORMAT)
    length = int.from_bytes(blob[len(FORMAT) : len(FORMAT) + 8], "little")
    header = json.loads(blob[len(FORMAT) + 8 : len(FORMAT) + 8 + length])
    assert [i[0] for i in header["instructions"]] == ["MatMul", "Add", "Relu"]
    with np.load(io.BytesIO(blob[len(FORMAT) + 8 + length :]), allow_pickle=False) as arrays:
        assert sorted(arrays[k].shape for k in arrays.files) == [(8, 16), (16,)]


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda b: b.replace(b'"Relu"', b'"Evil"'), "unknown opcode"),
        (lambda b: b[:60], "truncated"),
        (lambda b: b"PK\x03\x04" + b[4:], "not a template context"),
    ],
    ids=["unknown-opcode", "truncated", "foreign"],
)
def test_damaged_context_is_refused_with_an_ep_context_error(tamper, message):
    session = _load(MLP, "template")
    compiled = _template_partitions(session)[0]
    provider = _template()
    with pytest.raises(plugrt.EpContextError, match=message):
        provider.load_context(tamper(provider.save_context(compiled)), {"partition": compiled.partition})


def test_context_for_another_partition_is_refused():
    session = _load(MLP, "template")
    first, second = _template_partitions(session)
    provider = _template()
    with pytest.raises(plugrt.EpContextError, match="does not have"):
        provider.load_context(provider.save_context(first), {"partition": second.partition})


def test_model_exported_with_template_contexts_reloads_with_identical_outputs(tmp_path):
    path = tmp_path / "mlp.onnx"
    path.write_bytes(MLP)
    exported = _load(str(path), "template", **{"ep.context_enable": True, "ep.context_embed_mode": 0})
    restored = _load(exported.context_model_path, "template")
    assert [p.restored for p in restored.placement.partitions] == [True, False, True]
    expected = exported.run(MLP_FEEDS)
    for name, value in restored.run(MLP_FEEDS).items():
        assert value.tobytes() == expected[name].tobytes()
