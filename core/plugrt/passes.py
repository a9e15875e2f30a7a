"""Build-time graph passes: inline functions, fold constants, drop dead nodes."""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import common as common_passes

from .ir_utils import is_constant, subgraphs, tensor_array
from .provider import ExecutionProvider, Partition, SupportContext

__all__ = ["inline_functions", "fold_constants", "remove_dead_nodes", "optimize"]

logger = logging.getLogger("plugrt.passes")

#: Ops whose result must not be computed once at build (random or stateful).
_NOT_FOLDABLE = frozenset(
    {
        "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli",
        "Multinomial", "Dropout", "If", "Loop", "Scan", "SequenceMap", "ImageDecoder",
    }
)


def inline_functions(model: ir.Model, providers: Sequence[ExecutionProvider]) -> bool:
    """Inline model-local functions, except those a provider claims with ``supports_function``."""
    if not model.functions:
        return False
    ctx = SupportContext({d or "": v for d, v in model.opset_imports.items()}, model.graph)

    def claimed(function: ir.Function) -> bool:
        for provider in providers:
            ask = getattr(provider, "supports_function", None)
            if ask is not None:
                try:
                    if ask(function.domain, function.name, ctx):
                        return True
                except Exception:
                    continue
        return False

    result = common_passes.InlinePass(criteria=lambda f: not claimed(f))(model)
    return result.modified


def remove_dead_nodes(model: ir.Model) -> bool:
    return common_passes.RemoveUnusedNodesPass()(model).modified


def _replace_with_constant(graph: ir.Graph, value: ir.Value, array: np.ndarray) -> None:
    tensor = ir.tensor(array, name=value.name)
    constant = ir.Value(name=value.name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
    value.name = f"{value.name}__folded"
    graph.register_initializer(constant)
    value.replace_all_uses_with(constant)
    for index, output in enumerate(graph.outputs):
        if output is value:
            graph.outputs[index] = constant


def fold_constants(
    model: ir.Model,
    provider: ExecutionProvider,
    *,
    max_bytes: int = 1 << 28,
) -> int:
    """Run every node whose inputs are all constants once, with ``provider`` (the CPU
    provider's kernels), and replace its outputs by initializers. Returns the count."""
    graph = model.graph
    opsets = {d or "": v for d, v in model.opset_imports.items()}
    ctx = SupportContext(opsets, graph)
    folded = 0
    for node in list(graph):
        if node.op_type in _NOT_FOLDABLE or node.domain not in ("", "ai.onnx"):
            continue
        if any(True for _ in subgraphs(node)):
            continue
        if not all(v is None or is_constant(v) for v in node.inputs):
            continue
        try:
            if not provider.supports_op(node, ctx):
                continue
            inputs = [v for v in node.inputs if v is not None]
            partition = Partition("fold", [node], inputs, list(node.outputs), opsets)
            (step,) = provider.compile(partition).steps
            args = [None if v is None else tensor_array(v.const_value) for v in step.inputs]
            result = step.fn(*args)
            results = list(result[: len(step.outputs)]) if step.multi_output else [result]
        except Exception as exc:  # folding is an optimisation: leave the node to run later
            logger.debug("not folding %s: %s", node.op_type, exc)
            continue
        arrays = []
        for value, array in zip(step.outputs, results):
            if value is None:
                continue
            if not isinstance(array, np.ndarray) and not np.isscalar(array) and not isinstance(array, np.generic):
                arrays = None  # a sequence or optional: keep the node
                break
            array = np.asarray(array)
            if array.dtype == object or array.nbytes > max_bytes:
                arrays = None
                break
            arrays.append((value, array))
        if arrays is None:
            continue
        for value, array in arrays:
            _replace_with_constant(graph, value, np.ascontiguousarray(array))
        graph.remove(node, safe=True)
        folded += 1
    return folded


def optimize(
    model: ir.Model,
    level: str,
    fold_provider: ExecutionProvider | None,
    providers: Sequence[ExecutionProvider],
) -> dict[str, int]:
    """Run the passes of optimisation ``level`` ("none", "basic", "all"); return counts."""
    stats: dict[str, int] = {}
    if level == "none":
        return stats
    if fold_provider is not None:
        stats["folded"] = fold_constants(model, fold_provider)
    stats["dead_removed"] = int(remove_dead_nodes(model))
    if level == "all":
        for provider in providers:
            make = getattr(provider, "passes", None)
            if make is None:
                continue
            for graph_pass in make(model):
                result = graph_pass(model)
                stats[type(graph_pass).__name__] = stats.get(type(graph_pass).__name__, 0) + int(result.modified)
    return stats
