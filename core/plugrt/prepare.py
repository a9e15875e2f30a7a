"""From a loaded model to the graph placement reads: EPContext nodes restored, functions
inlined, types inferred, optimisation passes run, nodes named."""

from __future__ import annotations

import dataclasses
import os


import onnx_ir as ir

from . import passes
from .epcontext import required_providers, restore_context_nodes
from .errors import InvalidOptionValueError
from .intent import Selection
from .last_position import keep_last_position
from .loader import LoadLimits
from .options import SessionOptions
from .provider import CompiledPartition, DeviceKind
from .registry import ProviderRegistry
from .tracing import span, traced

__all__ = ["PreparedModel", "context_export_path", "load_limits", "prepare_model"]


@dataclasses.dataclass
class PreparedModel:
    opsets: dict[str, int]  # domain ("" for ai.onnx) -> version, after the passes
    restored: dict[ir.Node, CompiledPartition]  # EPContext nodes and their restored partitions
    optimization_stats: dict[str, int]


def load_limits(options: SessionOptions) -> LoadLimits:
    """The loader's limits, from the session options."""
    return LoadLimits(
        model_bytes=options["limits.model_bytes"],
        tensor_bytes=options["limits.tensor_bytes"],
        nodes=options["limits.nodes"],
        subgraph_depth=options["limits.subgraph_depth"],
        context_bytes=options["limits.context_bytes"],
    )


def context_export_path(options: SessionOptions, model_path: str | None) -> str:
    """Where ``ep.context_enable`` writes the context model: the option, else
    ``<model>_ctx.onnx`` beside the model file."""
    path = options["ep.context_file_path"]
    if path is not None:
        return path
    if model_path is None:
        raise InvalidOptionValueError("ep.context_file_path", None, "a file path when the model is given as bytes")
    stem, _ = os.path.splitext(model_path)
    return f"{stem}_ctx.onnx"


def _opsets(model: ir.Model) -> dict[str, int]:
    return {("" if d == "ai.onnx" else d): v for d, v in model.opset_imports.items()}


def prepare_model(
    ir_model: ir.Model,
    selection: Selection,
    registry: ProviderRegistry,
    options: SessionOptions,
    base_dir: str | None,
) -> PreparedModel:
    """Run the passes on ``ir_model`` in place. A restored EPContext node adds the
    provider that made it to ``selection`` (ahead of the fallback)."""
    context_path = options["ep.context_file_path"]
    # a model given as bytes has no folder: blobs are read only from one named explicitly
    context_dir = base_dir or (os.path.dirname(os.path.abspath(context_path)) if context_path else "")
    restored = restore_context_nodes(
        ir_model.graph, registry, context_dir, _opsets(ir_model), max_blob_bytes=options["limits.context_bytes"]
    )
    if restored:
        needed = [p for p in required_providers(ir_model.graph, registry) if p not in selection.providers]
        # a context node runs only on the provider that made it: add it ahead of the fallback
        selection.providers[-1:-1] = needed
        for provider in needed:
            selection.devices.setdefault(provider.name, registry.devices(provider.name)[0])

    last_position = options["outputs.last_position"]
    # before any fusion takes the product into another op
    rewritten = traced("pass:keep_last_position", keep_last_position, ir_model, last_position) if last_position else []
    chosen = selection.providers
    for provider in chosen:
        # a provider's whole-model rewrite for options of its own (the CUDA provider's float16 decoding)
        rewrite = getattr(provider, "rewrite_model", None)
        if rewrite is not None:
            traced(f"pass:{provider.name}.rewrite_model", rewrite, ir_model, options)
    traced("pass:inline_functions", passes.inline_functions, ir_model, chosen)
    traced("pass:expand_unsupported_functions", passes.expand_unsupported_functions, ir_model, chosen)
    if len(chosen) > 1 or options["optimization"] == "all":
        # providers decide on dtypes, and the plan writes large elementwise results
        # in place: both need value types and shapes
        traced("pass:infer_types", passes.infer_types, ir_model)
    # constants fold on the host fallback wherever the list puts it: an accelerator
    # listed last would evaluate few ops and leave every later pass nothing to fuse
    host = [p for p in chosen if selection.devices[p.name].kind == DeviceKind.CPU]
    fold_provider = host[-1] if host else (chosen[-1] if chosen else None)
    with span("optimization", level=options["optimization"], nodes_before=len(ir_model.graph)) as args:
        stats = passes.optimize(
            ir_model,
            options["optimization"],
            fold_provider,
            chosen,
            # a folded constant is no bigger than what every run would compute anyway
            max_fold_bytes=options["limits.tensor_bytes"],
        )
        args.update(nodes_after=len(ir_model.graph), **stats)
    # Unique node names: placement reports, errors and EPContext export refer to them.
    traced("pass:name_nodes", passes.name_nodes, ir_model)
    if last_position:
        stats = {**stats, "last_position_outputs": len(rewritten)}
    return PreparedModel(_opsets(ir_model), restored, stats)
