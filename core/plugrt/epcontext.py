"""EPContext: export compiled partitions as ``com.microsoft::EPContext`` nodes, restore them.

The node is onnxruntime's: attributes ``main_context``, ``ep_cache_context``,
``embed_mode``, ``source``, ``ep_sdk_version``, ``partition_name``, ``notes``; inputs and
outputs are the partition's boundary values. With ``embed_mode=1`` the provider's blob
is the attribute's bytes; with ``embed_mode=0`` it is a file beside the model, named by
a relative path that may not leave the model's folder.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import onnx
import onnx_ir as ir

from .errors import (
    EpContextAmbiguousError,
    EpContextError,
    EpContextMissingPrimaryError,
    EpContextPathError,
    EpContextSourceError,
)
from .ir_utils import is_constant
from .provider import CompiledPartition, ExecutionProvider, Partition

if TYPE_CHECKING:
    from .registry import ProviderRegistry
    from .session import Session

__all__ = ["EP_CONTEXT_DOMAIN", "EP_CONTEXT_OP", "export_context_model", "restore_context_nodes", "context_nodes"]

EP_CONTEXT_DOMAIN = "com.microsoft"
EP_CONTEXT_OP = "EPContext"


def _attr(node: ir.Node, name: str, default: Any = None) -> Any:
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def context_nodes(graph: ir.Graph) -> list[ir.Node]:
    return [n for n in graph if n.domain == EP_CONTEXT_DOMAIN and n.op_type == EP_CONTEXT_OP]


def _source_keys(provider: ExecutionProvider) -> tuple[str, ...]:
    return tuple(getattr(provider, "context_source_keys", ()) or ())


# -- export ---------------------------------------------------------------------------------


def export_context_model(session: "Session", path: str, embed_mode: int) -> tuple[str, list[str]]:
    """Write the session's model with each exportable partition replaced by an EPContext
    node. Returns the model path and the blob files written (embed_mode 0)."""
    providers = {p.name: p for p in session.selection.providers}
    proto = ir.serde.serialize_model(session.model)
    folder = os.path.dirname(os.path.abspath(path))
    stem = os.path.splitext(os.path.basename(path))[0]
    blobs: list[str] = []
    nodes = list(proto.graph.node)
    replaced = 0
    for compiled in session.compiled_partitions:
        provider = providers.get(compiled.provider)
        keys = _source_keys(provider) if provider is not None else ()
        if compiled.restored or not keys or not hasattr(provider, "save_context"):
            continue
        blob = provider.save_context(compiled)
        if not isinstance(blob, (bytes, bytearray)):
            raise EpContextError(f"{compiled.provider}.save_context returned {type(blob).__name__}, not bytes")
        partition = compiled.partition
        names = {n.name for n in partition.nodes}
        if not names or "" in names:
            raise EpContextError(f"partition {partition.name!r} has unnamed nodes; cannot export it")
        attributes: dict[str, Any] = {
            "main_context": 1,
            "embed_mode": embed_mode,
            "source": keys[0],
            "ep_sdk_version": str(getattr(provider, "sdk_version", "") or ""),
            "partition_name": partition.name,
            "notes": f"plugrt export of {len(names)} node(s)",
        }
        if embed_mode == 1:
            attributes["ep_cache_context"] = bytes(blob)
        else:
            filename = f"{stem}_{keys[0]}_{partition.name}.bin"
            with open(os.path.join(folder, filename), "wb") as f:
                f.write(blob)
            blobs.append(os.path.join(folder, filename))
            attributes["ep_cache_context"] = filename
        context_node = onnx.helper.make_node(
            EP_CONTEXT_OP,
            [v.name for v in partition.inputs if not is_constant(v)],
            [v.name for v in partition.outputs],
            name=f"EPContext_{partition.name}",
            domain=EP_CONTEXT_DOMAIN,
            **attributes,
        )
        positions = [i for i, n in enumerate(nodes) if n.name in names]
        if len(positions) != len(names):
            raise EpContextError(f"partition {partition.name!r}: its nodes are not all in the model")
        first = positions[0]
        nodes = [n for n in nodes if n.name not in names]
        nodes.insert(first, context_node)
        replaced += 1
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    _drop_unused_initializers(proto.graph)
    if replaced and not any(o.domain == EP_CONTEXT_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid(EP_CONTEXT_DOMAIN, 1))
    onnx.save(proto, path)
    onnx.checker.check_model(path)
    return path, blobs


def _graph_reads(graph: onnx.GraphProto, found: set[str]) -> None:
    for node in graph.node:
        found.update(node.input)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _graph_reads(attr.g, found)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    _graph_reads(g, found)


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    used: set[str] = set()
    _graph_reads(graph, used)
    used.update(o.name for o in graph.output)
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)


# -- restore --------------------------------------------------------------------------------


def _read_blob(node: ir.Node, label: str, base_dir: str) -> bytes:
    value = _attr(node, "ep_cache_context", b"")
    embed_mode = int(_attr(node, "embed_mode", 1))
    if embed_mode == 1:
        return value if isinstance(value, bytes) else value.encode("utf-8")
    location = value.decode("utf-8") if isinstance(value, bytes) else value
    if not base_dir:
        raise EpContextPathError(location, label, "cannot be found: the model was loaded from bytes; load it from its path")
    if os.path.isabs(location) or ".." in location.replace("\\", "/").split("/"):
        raise EpContextPathError(location, label, "leaves the model's folder; it must be a relative path inside it")
    root = os.path.realpath(base_dir)
    target = os.path.realpath(os.path.join(base_dir, location))
    if os.path.commonpath([root, target]) != root:
        raise EpContextPathError(location, label, "resolves outside the model's folder (through a link)")
    if not os.path.isfile(target):
        raise EpContextPathError(location, label, "does not exist beside the model")
    with open(target, "rb") as f:
        return f.read()


def restore_context_nodes(
    graph: ir.Graph,
    registry: "ProviderRegistry",
    base_dir: str,
    opset_imports: dict[str, int],
) -> dict[ir.Node, CompiledPartition]:
    """Load every EPContext node through the provider that declares its ``source``."""
    found = context_nodes(graph)
    if not found:
        return {}
    owners: dict[str, list[ExecutionProvider]] = {}
    for provider in registry.providers().values():
        for key in _source_keys(provider):
            owners.setdefault(key, []).append(provider)
    primaries: dict[str, ir.Node] = {}
    for node in found:
        if int(_attr(node, "main_context", 1)) == 1:
            primaries.setdefault(str(_as_text(_attr(node, "source", ""))), node)
    restored: dict[ir.Node, CompiledPartition] = {}
    for node in found:
        label = node.name or "EPContext"
        source = str(_as_text(_attr(node, "source", "")))
        candidates = owners.get(source, [])
        if not candidates:
            installed = {n: _source_keys(p) for n, p in registry.providers().items()}
            raise EpContextSourceError(source, label, installed)
        if len(candidates) > 1:
            raise EpContextAmbiguousError(source, label, [p.name for p in candidates])
        provider = candidates[0]
        main = int(_attr(node, "main_context", 1))
        holder = node if main == 1 else primaries.get(source)
        if holder is None:
            raise EpContextMissingPrimaryError(source, label)
        blob = _read_blob(holder, holder.name or label, base_dir)
        partition = Partition(
            str(_as_text(_attr(node, "partition_name", label))) or label,
            [node],
            [v for v in node.inputs if v is not None],
            [v for v in node.outputs if v is not None],
            dict(opset_imports),
        )
        meta = {
            "partition": partition,
            "partition_name": partition.name,
            "source": source,
            "main_context": main,
            "embed_mode": int(_attr(node, "embed_mode", 1)),
            "ep_sdk_version": str(_as_text(_attr(node, "ep_sdk_version", ""))),
            "notes": str(_as_text(_attr(node, "notes", ""))),
        }
        compiled = provider.load_context(blob, meta)
        compiled.provider = provider.name
        compiled.restored = True
        compiled.partition = partition
        restored[node] = compiled
    return restored


def _as_text(value: Any) -> Any:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def required_providers(graph: ir.Graph, registry: "ProviderRegistry") -> list[ExecutionProvider]:
    """Providers the EPContext nodes of ``graph`` need (one per source key, when unique)."""
    names: list[ExecutionProvider] = []
    for node in context_nodes(graph):
        source = str(_as_text(_attr(node, "source", "")))
        for provider in registry.providers().values():
            if source in _source_keys(provider) and provider not in names:
                names.append(provider)
    return names


