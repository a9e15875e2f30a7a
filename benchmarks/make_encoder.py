"""Build the benchmark's transformer encoder: a BERT-style ONNX model with seeded random weights.

Token ids ``int64[batch, sequence]`` (batch symbolic) go through a Gather embedding plus a
positional embedding, then ``layers`` post-norm encoder layers (multi-head self-attention
and a GELU feed-forward block, each with a residual Add and LayerNormalization), and out
as ``float[batch, sequence, hidden]``. Everything is MatMul, Add, Mul, Reshape, Transpose,
Softmax, LayerNormalization and Erf-based GELU, as exporters write them.

    python benchmarks/make_encoder.py encoder.onnx [--layers 4 --hidden 256 --heads 4 ...]
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["make_encoder", "encoder_inputs"]


class _GraphBuilder:
    """Appends nodes and initializers with unique names."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def constant(self, hint: str, array: np.ndarray) -> str:
        name = self._name(hint)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def weight(self, hint: str, shape: tuple[int, ...], scale: float = 0.02) -> str:
        return self.constant(hint, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def op(self, op_type: str, *inputs: str, hint: str = "", **attributes) -> str:
        output = self._name(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], name=output, **attributes))
        return output


def _linear(g: _GraphBuilder, x: str, d_in: int, d_out: int, hint: str) -> str:
    y = g.op("MatMul", x, g.weight(f"{hint}_w", (d_in, d_out)), hint=f"{hint}_matmul")
    return g.op("Add", y, g.weight(f"{hint}_b", (d_out,)), hint=f"{hint}_bias")


def _layer_norm(g: _GraphBuilder, x: str, hidden: int, decomposed: bool, opset: int) -> str:
    scale = g.constant("ln_scale", (1.0 + g.rng.standard_normal(hidden) * 0.02).astype(np.float32))
    bias = g.weight("ln_bias", (hidden,))
    if not decomposed:
        return g.op("LayerNormalization", x, scale, bias, axis=-1, epsilon=1e-5)

    def mean(y: str) -> str:  # ReduceMean takes its axes as an input from opset 18
        if opset >= 18:
            return g.op("ReduceMean", y, g.constant("ln_axes", np.array([-1], np.int64)), keepdims=1)
        return g.op("ReduceMean", y, axes=[-1], keepdims=1)

    centered = g.op("Sub", x, mean(x))
    variance = mean(g.op("Pow", centered, g.constant("two", np.array(2.0, np.float32))))
    std = g.op("Sqrt", g.op("Add", variance, g.constant("eps", np.array(1e-5, np.float32))))
    return g.op("Add", g.op("Mul", g.op("Div", centered, std), scale), bias)


def _gelu(g: _GraphBuilder, x: str) -> str:
    """0.5 * x * (1 + erf(x / sqrt(2))), the form torch.onnx writes below opset 20."""
    inner = g.op("Div", x, g.constant("sqrt2", np.array(math.sqrt(2.0), np.float32)))
    one_plus = g.op("Add", g.op("Erf", inner), g.constant("one", np.array(1.0, np.float32)))
    return g.op("Mul", g.op("Mul", x, one_plus), g.constant("half", np.array(0.5, np.float32)))


def _attention(g: _GraphBuilder, x: str, hidden: int, heads: int) -> str:
    head = hidden // heads
    split = g.constant("split_shape", np.array([0, 0, heads, head], np.int64))
    merge = g.constant("merge_shape", np.array([0, 0, hidden], np.int64))

    def project(hint: str, perm: list[int]) -> str:
        y = g.op("Reshape", _linear(g, x, hidden, hidden, hint), split)
        return g.op("Transpose", y, perm=perm)

    q = project("q", [0, 2, 1, 3])  # [B, H, S, D]
    k = project("k", [0, 2, 3, 1])  # [B, H, D, S]
    v = project("v", [0, 2, 1, 3])
    scores = g.op("MatMul", q, k)
    scores = g.op("Mul", scores, g.constant("scale", np.array(1.0 / math.sqrt(head), np.float32)))
    probs = g.op("Softmax", scores, axis=-1)
    context = g.op("Transpose", g.op("MatMul", probs, v), perm=[0, 2, 1, 3])
    return _linear(g, g.op("Reshape", context, merge), hidden, hidden, "attn_out")


def make_encoder(
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    sequence: int = 128,
    vocab: int = 1000,
    ffn: int | None = None,
    opset: int = 17,
    decomposed_layernorm: bool = False,
    seed: int = 0,
) -> onnx.ModelProto:
    """The encoder as a checked ModelProto (the same weights for the same arguments)."""
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    if opset < 17 and not decomposed_layernorm:
        raise ValueError("LayerNormalization needs opset 17; use decomposed_layernorm=True below it")
    ffn = ffn or 4 * hidden
    g = _GraphBuilder(np.random.default_rng(seed))
    tokens = g.op("Gather", g.weight("word_embedding", (vocab, hidden)), "input_ids", axis=0)
    x = g.op("Add", tokens, g.weight("position_embedding", (sequence, hidden)))
    x = _layer_norm(g, x, hidden, decomposed_layernorm, opset)
    for _ in range(layers):
        attended = g.op("Add", x, _attention(g, x, hidden, heads))
        x = _layer_norm(g, attended, hidden, decomposed_layernorm, opset)
        up = _gelu(g, _linear(g, x, hidden, ffn, "ffn_up"))
        down = g.op("Add", x, _linear(g, up, ffn, hidden, "ffn_down"))
        x = _layer_norm(g, down, hidden, decomposed_layernorm, opset)
    g.nodes.append(helper.make_node("Identity", [x], ["hidden_states"], name="hidden_states"))
    graph = helper.make_graph(
        g.nodes,
        "encoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", sequence])],
        [helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, ["batch", sequence, hidden])],
        g.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="plugrt")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def encoder_inputs(batch: int, sequence: int = 128, vocab: int = 1000, seed: int = 1) -> dict[str, np.ndarray]:
    """Seeded token ids for one run of the encoder."""
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, vocab, size=(batch, sequence), dtype=np.int64)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="where to write the .onnx file")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--opset", type=int, default=17)
    parser.add_argument("--decomposed-layernorm", action="store_true", help="LayerNorm as ReduceMean/Sub/Pow/...")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = make_encoder(
        layers=args.layers, hidden=args.hidden, heads=args.heads, sequence=args.sequence,
        opset=args.opset, decomposed_layernorm=args.decomposed_layernorm, seed=args.seed,
    )
    onnx.save(model, args.output)
    print(f"wrote {args.output}: {len(model.graph.node)} nodes, opset {args.opset}")


if __name__ == "__main__":
    main()
