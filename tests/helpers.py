"""Helpers the tests share: models from ONNX text and one-node models run on plugrt and onnx.reference."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx.parser
from onnx import helper, numpy_helper


def text_model(text: str, check: bool = True) -> onnx.ModelProto:
    """A model written in ONNX text syntax (checked by onnx unless told not to)."""
    model = onnx.parser.parse_model(text)
    if check:
        onnx.checker.check_model(model)
    return model


def model_bytes(text: str, check: bool = True) -> bytes:
    """Serialize a model written in ONNX text syntax (checked by onnx unless told not to)."""
    return text_model(text, check).SerializeToString()


NEG_ADD = model_bytes(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[3] x) => (float[3] y) {
        n = Neg(x)
        y = Add(n, x)
    }
    """
)


#: y = local.Double(x), a model-local function whose body is Add(a, a).
#: NonZero in the middle: the nodes around it capture, NonZero is a seam (its output size depends on values).
NONZERO_MIDDLE = model_bytes(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4, 4] x) => (float[K] y) <int64[1] minus_one = {-1}, int64 zero = {0}> {
        a = Relu(x)
        b = Mul(a, a)
        idx = NonZero(b)
        flat = Reshape(b, minus_one)
        first = Gather <axis = 0> (idx, zero)
        picked = Gather(flat, first)
        y = Sqrt(picked)
    }
    """
)

LOCAL_DOUBLE = model_bytes(
    """
    <ir_version: 8, opset_import: ["" : 17, "local" : 1]>
    g (float[2] x) => (float[2] y) {
        y = local.Double(x)
    }
    <domain: "local", opset_import: ["" : 17]>
    Double (a) => (b) {
        b = Add(a, a)
    }
    """
)


def fake_entry_points(monkeypatch, *extra: tuple[str, str]) -> None:
    """Make importlib.metadata report the real plugrt entry points plus ``extra``
    (name, "module:attr") pairs, as if more distributions were installed."""
    import importlib_metadata

    from plugrt import registry as registry_module

    real = importlib_metadata.entry_points

    def entry_points(**params):
        found = list(real(**params))
        if params.get("group") == "plugrt.providers":
            found += [importlib_metadata.EntryPoint(n, v, "plugrt.providers") for n, v in extra]
        return found

    monkeypatch.setattr(registry_module.importlib_metadata, "entry_points", entry_points)


# --- one-node models: build, run on plugrt, run on onnx.reference ----------------------

Inputs = Mapping[str, Any] | Sequence[Any]


def _named_inputs(inputs: Inputs) -> dict[str, Any]:
    """``inputs`` as an ordered name -> value dict; a sequence is named x0, x1, ..."""
    if isinstance(inputs, Mapping):
        return dict(inputs)
    return {f"x{i}": value for i, value in enumerate(inputs)}


def _element_type(value: Any) -> int:
    dtype = np.asarray(value).dtype
    if dtype.kind in "OU":
        return onnx.TensorProto.STRING
    return helper.np_dtype_to_tensor_dtype(dtype)


def node_feeds(inputs: Inputs, constants: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The feeds for :func:`node_model`'s graph: the present inputs that are not constants."""
    return {
        name: value
        for name, value in _named_inputs(inputs).items()
        if value is not None and name not in (constants or {})
    }


def graph_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Mapping[str, Any],
    outputs: Sequence[str],
    opset: int,
    constants: Mapping[str, Any] | None = None,
    fixed_shapes: bool = True,
    *,
    output_types: Sequence[int] | None = None,
    opsets: Mapping[str, int] | None = None,
    ir_version: int | None = None,
) -> onnx.ModelProto:
    """A model of ``nodes`` over graph ``inputs`` (typed by their arrays; shapes unless
    ``fixed_shapes`` is false) and ``constants`` (initializers, so kernels see them as
    constants); outputs untyped unless ``output_types`` says otherwise."""
    graph_inputs = [
        helper.make_tensor_value_info(name, _element_type(value), np.shape(value) if fixed_shapes else None)
        for name, value in inputs.items()
    ]
    types = list(output_types) if output_types is not None else [onnx.TensorProto.UNDEFINED] * len(outputs)
    graph_outputs = [helper.make_tensor_value_info(name, t, None) for name, t in zip(outputs, types) if name]
    initializers = [numpy_helper.from_array(np.asarray(value), name) for name, value in (constants or {}).items()]
    graph = helper.make_graph(list(nodes), "g", graph_inputs, graph_outputs, initializers)
    imports = [helper.make_opsetid("", opset)]
    imports += [helper.make_opsetid(domain, version) for domain, version in (opsets or {}).items()]
    extra = {} if ir_version is None else {"ir_version": ir_version}
    return helper.make_model(graph, opset_imports=imports, **extra)


def node_model(
    op_type: str | onnx.NodeProto,
    inputs: Inputs,
    opset: int,
    *,
    outputs: Sequence[str] | int | None = None,
    domain: str = "",
    domain_opset: int = 1,
    constants: Mapping[str, Any] | None = None,
    output_types: Sequence[int] | None = None,
    fixed_shapes: bool = True,
    ir_version: int | None = None,
    attributes: Mapping[str, Any] | None = None,
    **more_attributes: Any,
) -> onnx.ModelProto:
    """A model of one ``op_type`` node at ``opset`` (of the default domain; ``domain_opset``
    for a custom ``domain``). ``inputs`` maps names to arrays, in the node's input order;
    None is an omitted optional input; a name in ``constants`` becomes an initializer.
    ``outputs`` is a list of names or a count (y0, y1, ...); by default one per
    ``output_types``, else just y. A ready NodeProto may stand for ``op_type``: its
    non-empty inputs are given ``inputs`` in order."""
    if isinstance(op_type, onnx.NodeProto):
        node = op_type
        named = dict(zip([name for name in node.input if name], _named_inputs(inputs).values()))
        output_names = list(node.output)
    else:
        named = _named_inputs(inputs)
        names = [name if value is not None else "" for name, value in named.items()]
        while names and not names[-1]:
            names.pop()
        if outputs is None:
            outputs = len(output_types) if output_types is not None else ("y",)
        output_names = [f"y{i}" for i in range(outputs)] if isinstance(outputs, int) else list(outputs)
        # an output may not share a name with an input: rename defaults that would
        output_names = [name + "_out" if name in named else name for name in output_names]
        node = helper.make_node(
            op_type, names, output_names, domain=domain, **dict(attributes or {}), **more_attributes
        )
    constant_values = {name: named[name] for name in (constants or {})}
    return graph_model(
        [node],
        node_feeds(named, constants),
        output_names,
        opset,
        constant_values,
        fixed_shapes,
        output_types=output_types,
        opsets={domain: domain_opset} if domain else None,
        ir_version=ir_version,
    )


def node_case(
    op_type: str | onnx.NodeProto, inputs: Inputs, opset: int, **options: Any
) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """:func:`node_model` and its feeds, for tests that run the same model several ways."""
    model = node_model(op_type, inputs, opset, **options)
    names = [value.name for value in model.graph.input]
    values = [v for name, v in _named_inputs(inputs).items() if v is not None and name not in (options.get("constants") or {})]
    return model, dict(zip(names, values))


def run_model(model: onnx.ModelProto, feeds: Mapping[str, Any], **session_options: Any) -> list[Any]:
    """Every output of ``model`` run by a plugrt session."""
    import plugrt

    return plugrt.InferenceSession(model.SerializeToString(), **session_options).run(None, dict(feeds))


def reference_model(model: onnx.ModelProto, feeds: Mapping[str, Any]) -> list[Any]:
    """Every output of ``model`` run by onnx.reference."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, dict(feeds))


def run_node(op_type: str | onnx.NodeProto, inputs: Inputs, opset: int, **options: Any) -> list[Any]:
    """Every output of the one-node model :func:`node_model` builds, run by plugrt."""
    return run_model(*node_case(op_type, inputs, opset, **options))


def reference_node(op_type: str | onnx.NodeProto, inputs: Inputs, opset: int, **options: Any) -> list[Any]:
    """Every output of the one-node model :func:`node_model` builds, run by onnx.reference."""
    return reference_model(*node_case(op_type, inputs, opset, **options))


def node_attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """A node's attributes as the CPU provider hands them to kernels (tensors as arrays,
    strings decoded)."""
    values = {}
    for attribute in node.attribute:
        value = helper.get_attribute_value(attribute)
        if attribute.type == onnx.AttributeProto.TENSOR:
            value = numpy_helper.to_array(value)
        elif isinstance(value, bytes):
            value = value.decode()
        elif attribute.type == onnx.AttributeProto.STRINGS:
            value = [v.decode() for v in value]
        values[attribute.name] = value
    return values


def run_kernel(
    op_type: str | onnx.NodeProto,
    opset: int,
    *inputs: Any,
    constants: Sequence[Any] | None = None,
    num_outputs: int = 1,
    node: onnx.NodeProto | None = None,
    domain: str = "",
    **attributes: Any,
) -> list[Any]:
    """Every output of the CPU kernel for ``op_type``, called directly the way the provider
    binds it (no session): for tests of a kernel's own numerics and layout. A NodeProto
    may stand for ``op_type``, its attributes and outputs then come from it."""
    if isinstance(op_type, onnx.NodeProto):
        node, op_type, domain = op_type, op_type.op_type, op_type.domain
        attributes = {**node_attributes(node), **attributes}
        num_outputs = len(node.output)
    import plugrt_cpu.kernels  # noqa: F401  (registers the kernels)
    from plugrt_cpu._registry import KernelContext, lookup

    spec = lookup(domain, op_type, opset)
    assert spec is not None, f"no kernel for {op_type} at opset {opset}"
    if spec.builder:
        ctx = KernelContext(
            op_type, domain, opset, attributes, len(inputs), num_outputs,
            [getattr(x, "dtype", None) for x in inputs],
            list(constants) if constants is not None else [None] * len(inputs),
            node,
        )
        result = spec.fn(ctx)(*inputs)
    else:
        names = spec.attribute_names
        result = spec.fn(*inputs, **{k: v for k, v in attributes.items() if names is None or k in names})
    return list(result) if spec.multi_output else [result]


def onnxruntime_genai_greedy(folder: Any, prompt: Sequence[int], max_length: int) -> list[int]:
    """The tokens onnxruntime-genai's greedy Generator adds to ``prompt`` until
    ``max_length`` (the model folder of a genai_config.json); skips without the package."""
    import pytest

    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=max_length)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([list(prompt)], np.int32))
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens


# --- a fresh virtual environment for install tests -------------------------------------


def fresh_venv(path: str) -> str:
    """A new virtual environment that sees this one's packages (plugrt and its
    dependencies) the way ``--system-site-packages`` sees the base interpreter's; returns
    its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True, timeout=60)
    python = os.path.join(path, "bin", "python")
    own_site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    with open(os.path.join(own_site, "inherit.pth"), "w", encoding="utf-8") as f:
        f.write("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in site.getsitepackages()) + "\n")
    return python


# --- GELU written out, as exporters write it (the rewrites' and fusions' tests) ----------


def written_out_gelu(form: str, opset: int, outputs: str = "float[4, 32] y") -> onnx.ModelProto:
    """0.5 * x * (1 + erf(x / sqrt(2))) (``form`` "erf") or its tanh approximation ("tanh")
    over a float[4, 32] input, its constants as initializers."""
    import math

    if form == "erf":
        body = "s = Div (x, divisor)\n e = Erf (s)"
        constants = {"divisor": math.sqrt(2.0)}
    else:
        body = "c = Pow (x, three)\n k = Mul (c, kappa)\n i = Add (x, k)\n s = Mul (i, root)\n e = Tanh (s)"
        constants = {"three": 3.0, "kappa": 0.044715, "root": math.sqrt(2 / math.pi)}
    model = onnx.parser.parse_model(
        f"""
        <ir_version: 9, opset_import: ["" : {opset}]>
        g (float[4, 32] x) => ({outputs}) {{
            {body}
            a = Add (e, one)
            h = Mul (x, a)
            y = Mul (h, half)
        }}
        """
    )
    constants.update(one=1.0, half=0.5)
    model.graph.initializer.extend(numpy_helper.from_array(np.float32(v), k) for k, v in constants.items())
    onnx.checker.check_model(model)
    return model
