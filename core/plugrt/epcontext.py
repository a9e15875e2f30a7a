"""EPContext: export compiled partitions as ``com.microsoft::EPContext`` nodes, restore them.

The node is onnxruntime's: attributes ``main_context``, ``ep_cache_context``,
``embed_mode``, ``source``, ``ep_sdk_version``, ``partition_name``, ``notes``; inputs and
outputs are the partition's boundary values. With ``embed_mode=1`` the provider's blob
is the attribute's bytes; with ``embed_mode=0`` it is a file beside the model, named by
a relative path that may not leave the model's folder.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

import onnx
import onnx_ir as ir

from .errors import (
    EpContextAmbiguousError,
    EpContextAttributeError,
    EpContextError,
    EpContextMissingPrimaryError,
    EpContextOverwriteError,
    EpContextPathError,
    EpContextSourceError,
    ModelLoadError,
    ProviderNameMismatchError,
    UnsafeExternalDataError,
)
from .ir_utils import is_constant
from .tracing import span, spanned
from .loader import DEFAULT_CONTEXT_BYTES, contained_path, read_regular_file, write_declared_types
from .provider import (
    CompiledPartition,
    ContextCapability,
    ContextCompatibilityCapability,
    ExecutionProvider,
    Partition,
)

if TYPE_CHECKING:
    from .build import BuiltModel
    from .registry import ProviderRegistry

__all__ = ["EP_CONTEXT_DOMAIN", "EP_CONTEXT_OP", "export_context_model", "restore_context_nodes", "context_nodes"]

EP_CONTEXT_DOMAIN = "com.microsoft"
EP_CONTEXT_OP = "EPContext"


def _describe(attr: ir.Attr) -> str:
    return f"{attr.type.name.lower()} {attr.value!r}"


def _flag(node: ir.Node, name: str, default: int) -> int:
    """A 0/1 attribute (``main_context``, ``embed_mode``), refused when it is anything else."""
    attr = node.attributes.get(name)
    if attr is None:
        return default
    if attr.type != ir.AttributeType.INT or attr.value not in (0, 1):
        raise EpContextAttributeError(node.name or "EPContext", name, "the int 0 or 1", _describe(attr))
    return int(attr.value)


def _text(node: ir.Node, name: str, default: str = "") -> str:
    """A string attribute (``source``, ``partition_name``, ...), refused when it is not one."""
    attr = node.attributes.get(name)
    if attr is None:
        return default
    if attr.type != ir.AttributeType.STRING:
        raise EpContextAttributeError(node.name or "EPContext", name, "a string", _describe(attr))
    return str(_as_text(attr.value))


def context_nodes(graph: ir.Graph) -> list[ir.Node]:
    return [n for n in graph if n.domain == EP_CONTEXT_DOMAIN and n.op_type == EP_CONTEXT_OP]


def _source_keys(provider: ExecutionProvider) -> tuple[str, ...]:
    return tuple(provider.context_source_keys or ()) if isinstance(provider, ContextCapability) else ()


# -- export ---------------------------------------------------------------------------------


def _refuse_overwrite(path: str, source: str | None) -> None:
    if source is not None and os.path.exists(source) and (
        os.path.realpath(path) == os.path.realpath(source)
        or (os.path.exists(path) and os.path.samefile(path, source))
    ):
        raise EpContextOverwriteError(path, "is the source model; exporting there would destroy it")
    if os.path.lexists(path):
        # onnxruntime refuses too: an existing context model may be another export's
        raise EpContextOverwriteError(path, "already exists")


@spanned("epcontext_export")
def export_context_model(
    session: "BuiltModel", path: str, embed_mode: int, *, source: str | None = None
) -> tuple[str, list[str]]:
    """Write the session's model with each exportable partition replaced by an EPContext
    node. Returns the model path and the blob files written (embed_mode 0).

    Nothing is replaced: the source model, an existing file at ``path`` and existing blob
    files are refused with EpContextOverwriteError. Everything is written to temporary
    files and checked with onnx.checker first; a failed export leaves no file behind.
    """
    path = os.path.abspath(path)
    _refuse_overwrite(path, source)
    providers = {p.name: p for p in session.selection.providers}
    proto = ir.serde.serialize_model(session.model)
    write_declared_types(proto, session.model)
    folder = os.path.dirname(path)
    stem = os.path.splitext(os.path.basename(path))[0]
    blobs: list[tuple[str, bytes]] = []
    nodes = list(proto.graph.node)
    replaced = 0
    for compiled in session.compiled_partitions:
        provider = providers.get(compiled.provider)
        keys = _source_keys(provider) if provider is not None else ()
        if compiled.restored or not keys or not isinstance(provider, ContextCapability):
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
            _refuse_overwrite(os.path.join(folder, filename), source)
            blobs.append((filename, bytes(blob)))
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
    written = _write_all(folder, [(os.path.basename(path), None, proto)] + [(n, b, None) for n, b in blobs])
    return written[0], written[1:]


def _write_all(folder: str, files: list[tuple[str, bytes | None, onnx.ModelProto | None]]) -> list[str]:
    """Write every file under a temporary name, check the model, then move each to its
    name without replacing anything; on any failure remove what was written."""
    temporary: list[tuple[str, str]] = []
    placed: list[str] = []
    try:
        for name, data, model in files:
            fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
            temporary.append((temp, os.path.join(folder, name)))
            with os.fdopen(fd, "wb") as f:
                f.write(data if data is not None else model.SerializeToString())  # type: ignore[union-attr]
            if model is not None:
                try:
                    onnx.checker.check_model(temp)
                except onnx.checker.ValidationError as exc:
                    raise EpContextError(f"the exported EPContext model is not valid ONNX: {exc}") from exc
        for temp, final in temporary:
            try:
                os.link(temp, final)  # fails if the name appeared meanwhile: nothing is replaced
            except FileExistsError as exc:
                raise EpContextOverwriteError(final, "already exists") from exc
            placed.append(final)
    except BaseException:
        for final in placed:
            os.unlink(final)
        raise
    finally:
        for temp, _ in temporary:
            if os.path.exists(temp):
                os.unlink(temp)
    return placed


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


def _read_blob(node: ir.Node, label: str, base_dir: str, max_bytes: int) -> bytes:
    embed_mode = _flag(node, "embed_mode", 1)
    attr = node.attributes.get("ep_cache_context")
    if attr is not None and attr.type != ir.AttributeType.STRING:
        expected = "a string (the blob)" if embed_mode == 1 else "a string (the blob file's path beside the model)"
        raise EpContextAttributeError(label, "ep_cache_context", expected, _describe(attr))
    value = b"" if attr is None else attr.value
    if embed_mode == 1:
        return value if isinstance(value, bytes) else value.encode("utf-8")
    location = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    if not base_dir:
        raise EpContextPathError(
            location,
            label,
            "cannot be found: the model was loaded from bytes, so it has no folder; load it from "
            "its path, or set 'ep.context_file_path' to a file in the folder that holds the blobs",
        )
    try:
        target = contained_path(label, location, base_dir, label)
    except UnsafeExternalDataError as exc:
        why = {
            UnsafeExternalDataError.NUL_BYTE: "contains a NUL byte, which no file name can; the attribute is corrupt",
            UnsafeExternalDataError.NOT_REGULAR: "is not a regular file (a FIFO, device, socket or folder)",
        }.get(exc.problem, "resolves outside the model's folder (absolute, '..' or a link out)")
        raise EpContextPathError(location, label, why) from exc
    except ModelLoadError as exc:
        raise EpContextPathError(location, label, "does not exist beside the model") from exc
    return read_regular_file(target, max_bytes, "context_bytes", label, EpContextError)


def restore_context_nodes(
    graph: ir.Graph,
    registry: "ProviderRegistry",
    base_dir: str,
    opset_imports: dict[str, int],
    *,
    max_blob_bytes: int = DEFAULT_CONTEXT_BYTES,
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
        if _flag(node, "main_context", 1) == 1:
            primaries.setdefault(_text(node, "source"), node)
    restored: dict[ir.Node, CompiledPartition] = {}
    for node in found:
        label = node.name or "EPContext"
        source = _text(node, "source")
        candidates = owners.get(source, [])
        if not candidates:
            installed = {n: _source_keys(p) for n, p in registry.providers().items()}
            raise EpContextSourceError(source, label, installed)
        if len(candidates) > 1:
            raise EpContextAmbiguousError(source, label, [p.name for p in candidates])
        provider = candidates[0]
        main = _flag(node, "main_context", 1)
        holder = node if main == 1 else primaries.get(source)
        if holder is None:
            raise EpContextMissingPrimaryError(source, label)
        blob = _read_blob(holder, holder.name or label, base_dir, max_blob_bytes)
        partition = Partition(
            _text(node, "partition_name", label) or label,
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
            "embed_mode": _flag(node, "embed_mode", 1),
            "ep_sdk_version": _text(node, "ep_sdk_version"),
            "notes": _text(node, "notes"),
        }
        if isinstance(provider, ContextCompatibilityCapability):
            verdict = provider.check_context(meta)
            if not verdict:
                raise EpContextError(
                    f"EPContext node {label!r} cannot be restored by {provider.name!r}: {verdict.reason}",
                    node=label,
                    source=source,
                )
        assert isinstance(provider, ContextCapability)  # owners holds only providers with contexts
        with span("epcontext_restore", partition=partition.name, provider=provider.name, blob_bytes=len(blob)):
            compiled = provider.load_context(blob, meta)
        if compiled.provider and compiled.provider != provider.name:
            raise ProviderNameMismatchError(provider.name, compiled.provider)
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
        source = _text(node, "source")
        for provider in registry.providers().values():
            if source in _source_keys(provider) and provider not in names:
                names.append(provider)
    return names


