"""The loader: bytes or a path into a validated onnx_ir model, safely."""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import sys
from typing import BinaryIO, Callable, Iterable, Iterator, Union

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError
from onnx_ir import external_data as ir_external_data
from onnx_ir.passes.common import RemoveInitializersFromInputsPass

from .errors import ModelLimitError, ModelLoadError, PlugrtError, UnsafeExternalDataError
from .ir_utils import subgraphs

__all__ = [
    "ModelSource", "LoadLimits", "LoadedModel", "load_model", "KNOWN_DOMAINS", "DEFAULT_CONTEXT_BYTES",
    "all_tensors", "contained_path", "read_regular_file", "DECLARED_TYPE_KEY",
    "map_types_erased", "write_declared_types",
]

ModelSource = Union[str, os.PathLike, bytes, bytearray, memoryview, onnx.ModelProto]

#: Domains whose ops plugrt knows how to ask providers about without a model-local function.
KNOWN_DOMAINS = frozenset(
    {"", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview", "ai.onnx.preview.training", "com.microsoft"}
)


#: Largest EPContext blob file read by default: 2 GiB, the most an embedded blob
#: (``embed_mode=1``) can hold, as protobuf caps the model there. A file is read whole into
#: memory, and a sparse one costs its claimed size in memory but nothing on disk, so the
#: ceiling is not higher; a trusted larger engine raises ``limits.context_bytes``.
DEFAULT_CONTEXT_BYTES = 2**31


@dataclasses.dataclass(frozen=True)
class LoadLimits:
    """Safety limits; each can be raised with the ``limits.<name>`` session option.

    The defaults let every real model through while a hostile one cannot take a 24 GiB
    machine down: no single tensor (initializer, folded constant, inferred value, kernel
    output, broadcast view) above 4 GiB, no more than a million nodes after every function
    is inlined.
    """

    model_bytes: int = 2**31  # protobuf cannot exceed 2 GiB anyway
    tensor_bytes: int = 2**32
    nodes: int = 1_000_000
    subgraph_depth: int = 64
    context_bytes: int = DEFAULT_CONTEXT_BYTES


@dataclasses.dataclass
class LoadedModel:
    model: ir.Model
    base_dir: str  # folder external data is resolved against ("" for bytes)
    source: str  # a path, or "<bytes>"


def read_regular_file(
    path: str | os.PathLike, max_bytes: int, limit: str, label: str, error: Callable[..., PlugrtError]
) -> bytes:
    """Read a whole regular file of at most ``max_bytes``.

    Opened non-blocking, so a FIFO cannot stall the open, then checked with ``fstat`` on
    the open descriptor (no race with a swapped path): devices, FIFOs, sockets and
    folders are refused, and the read stops one byte past the limit whatever the file
    claims its size is (``/proc`` files report 0).
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except (OSError, ValueError) as exc:
        raise error(f"cannot read {os.fspath(path)!r}: {getattr(exc, 'strerror', None) or exc}", source=label) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(
                f"{os.fspath(path)!r} is not a regular file (a device, FIFO, socket or folder); "
                "give the path of a model file",
                source=label,
            )
        if info.st_size > max_bytes:
            raise ModelLimitError(limit, info.st_size, max_bytes, source=label)
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            data = _read_bounded(f, info.st_size, max_bytes)
    except OSError as exc:
        raise error(f"cannot read {os.fspath(path)!r}: {exc.strerror or exc}", source=label) from exc
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > max_bytes:
        raise ModelLimitError(limit, len(data), max_bytes, source=label)
    return data


def _read_bounded(f: BinaryIO, claimed: int, max_bytes: int) -> bytes:
    """Read at most ``max_bytes + 1`` bytes, asking for no more than the file claims to hold
    (``read(n)`` reserves n bytes up front: 2 GiB for every small model under the default
    limit, enough to fail under ``RLIMIT_AS``). A file that grew since ``fstat``, or
    reports no size (``/proc``), is read on in chunks up to the limit."""
    parts = [f.read(min(claimed, max_bytes) + 1)]
    size = len(parts[0])
    while size > claimed and size <= max_bytes:
        chunk = f.read(min(1 << 20, max_bytes + 1 - size))
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _read_proto(source: ModelSource, limits: LoadLimits) -> tuple[onnx.ModelProto, str, str]:
    if isinstance(source, onnx.ModelProto):
        if source.ByteSize() > limits.model_bytes:
            raise ModelLimitError("model_bytes", source.ByteSize(), limits.model_bytes, source="<ModelProto>")
        return source, "", "<ModelProto>"
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        label, base_dir = "<bytes>", ""
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        label = str(path)
        data = read_regular_file(path, limits.model_bytes, "model_bytes", label, ModelLoadError)
        base_dir = os.path.dirname(os.path.abspath(path))
    else:
        raise ModelLoadError(
            f"expected a path, os.PathLike, bytes or onnx.ModelProto, got {type(source).__name__}"
        )
    if len(data) > limits.model_bytes:
        raise ModelLimitError("model_bytes", len(data), limits.model_bytes, source=label)
    if not data:
        raise ModelLoadError("the model is empty (0 bytes)", source=label)
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(
            f"not a valid ONNX protobuf (the file is corrupt or truncated, or not an ONNX model): {exc}",
            source=label,
            reason="protobuf decode failed",
        ) from exc
    return proto, base_dir, label


def _check_opsets(proto: onnx.ModelProto, label: str) -> None:
    if not proto.HasField("graph"):
        raise ModelLoadError("the model has no graph (truncated or not an ONNX model)", source=label)
    imports = {op.domain or "": op.version for op in proto.opset_import}
    if not proto.opset_import:
        raise ModelLoadError("the model declares no opset_import", source=label)
    newest = onnx.defs.onnx_opset_version()
    version = imports.get("", imports.get("ai.onnx"))
    if version is not None and version > newest:
        raise ModelLoadError(
            f"the model uses ai.onnx opset {version}, newer than the {newest} this installation "
            "knows; upgrade the 'onnx' package or export the model at a lower opset",
            source=label,
        )


def _walk_protos(graph: onnx.GraphProto, depth: int, limits: LoadLimits, label: str) -> Iterator[onnx.GraphProto]:
    if depth > limits.subgraph_depth:
        raise ModelLimitError("subgraph_depth", depth, limits.subgraph_depth, source=label)
    yield graph
    for node in graph.node:
        yield from _node_subgraphs(node, depth, limits, label)


def _node_subgraphs(node: onnx.NodeProto, depth: int, limits: LoadLimits, label: str) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield from _walk_protos(attr.g, depth + 1, limits, label)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            for g in attr.graphs:
                yield from _walk_protos(g, depth + 1, limits, label)


def _attribute_tensors(attributes: Iterable[onnx.AttributeProto]) -> Iterator[onnx.TensorProto]:
    for attr in attributes:
        if attr.type == onnx.AttributeProto.TENSOR:
            yield attr.t
        elif attr.type == onnx.AttributeProto.TENSORS:
            yield from attr.tensors
        elif attr.type == onnx.AttributeProto.SPARSE_TENSOR:
            yield attr.sparse_tensor.values
            yield attr.sparse_tensor.indices
        elif attr.type == onnx.AttributeProto.SPARSE_TENSORS:
            for sparse in attr.sparse_tensors:
                yield sparse.values
                yield sparse.indices


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor a graph holds itself (not those of its subgraphs)."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        yield from _attribute_tensors(node.attribute)


def _function_graphs(function: onnx.FunctionProto, limits: LoadLimits, label: str) -> Iterator[onnx.GraphProto]:
    for node in function.node:
        yield from _node_subgraphs(node, 0, limits, label)


def all_tensors(proto: onnx.ModelProto, limits: LoadLimits, label: str) -> Iterator[onnx.TensorProto]:
    """Every TensorProto in the model, wherever it sits: the graph, its subgraphs at any
    depth, model-local functions (their nodes, their attribute defaults, their subgraphs)."""
    for graph in _walk_protos(proto.graph, 0, limits, label):
        yield from _graph_tensors(graph)
    for function in proto.functions:
        yield from _attribute_tensors(function.attribute_proto)
        for node in function.node:
            yield from _attribute_tensors(node.attribute)
        for graph in _function_graphs(function, limits, label):
            yield from _graph_tensors(graph)


def _tensor_nbytes(tensor: onnx.TensorProto) -> int:
    count = 1
    for d in tensor.dims:
        if d < 0:
            raise ValueError(f"negative dimension {d}")
        count *= d
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except Exception:
        itemsize = 8
    return count * max(itemsize, 1)


_PACKED_TYPES = frozenset(
    getattr(onnx.TensorProto, name, -1)
    for name in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
)


def _check_tensor(tensor: onnx.TensorProto, limits: LoadLimits, label: str, base_dir: str) -> None:
    try:
        nbytes = _tensor_nbytes(tensor)
    except ValueError as exc:
        raise ModelLoadError(f"tensor {tensor.name!r} has {exc}", source=label) from exc
    if nbytes > limits.tensor_bytes:
        raise ModelLimitError("tensor_bytes", nbytes, limits.tensor_bytes, source=label)
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        _check_external(tensor, nbytes, base_dir, label)
    elif tensor.HasField("raw_data") and tensor.data_type != onnx.TensorProto.STRING:
        # Sub-byte types pack several values a byte; compare only where the size is exact.
        if tensor.data_type in _PACKED_TYPES:
            return
        if len(tensor.raw_data) != nbytes:
            raise ModelLoadError(
                f"tensor {tensor.name!r} holds {len(tensor.raw_data)} bytes but its shape "
                f"{list(tensor.dims)} needs {nbytes}; the file is corrupt or truncated",
                source=label,
            )


def _check_external(tensor: onnx.TensorProto, nbytes: int, base_dir: str, label: str) -> None:
    info = {e.key: e.value for e in tensor.external_data}
    target = contained_path(tensor.name, info.get("location", ""), base_dir, label)
    try:
        offset = int(info.get("offset") or 0)
        length = int(info["length"]) if info.get("length") else None
    except ValueError as exc:
        raise ModelLoadError(
            f"tensor {tensor.name!r} has a non-integer external data offset or length", source=label
        ) from exc
    size = os.stat(target).st_size
    if offset < 0 or (length is not None and length < 0):
        raise ModelLoadError(f"tensor {tensor.name!r} has a negative external data offset or length", source=label)
    needed = length if length is not None else nbytes
    if tensor.data_type not in _PACKED_TYPES and tensor.data_type != onnx.TensorProto.STRING and needed < nbytes:
        raise ModelLoadError(
            f"tensor {tensor.name!r} declares {needed} bytes of external data but its shape needs {nbytes}",
            source=label,
        )
    if offset + needed > size:
        raise ModelLoadError(
            f"tensor {tensor.name!r} reads bytes {offset}..{offset + needed} of {info.get('location')!r}, "
            f"which holds only {size} bytes; the external data file is truncated or the wrong one",
            source=label,
            reason="external data past the end of its file",
        )


def contained_path(name: str, location: str, base_dir: str, label: str) -> str:
    """The real path of ``location`` when it is a regular file inside ``base_dir``; raises
    otherwise. Absolute paths, ``..`` parts, links that lead out, devices and FIFOs are all
    refused, and nothing is resolved against the working directory."""
    if not location:
        raise ModelLoadError(f"tensor {name!r} has external data without a location", source=label)
    if not base_dir:
        raise ModelLoadError(
            f"tensor {name!r} stores its data in an external file ({location!r}), but the "
            "model was given as bytes; load it from its path so the file can be found",
            source=label,
        )
    if "\0" in location:
        raise UnsafeExternalDataError(name, location, source=label, problem=UnsafeExternalDataError.NUL_BYTE)
    parts = location.replace("\\", "/").split("/")
    if (
        os.path.isabs(location)
        or location.startswith(("/", "\\"))
        or ".." in parts
        or (len(location) > 1 and location[1] == ":")  # a Windows drive
    ):
        raise UnsafeExternalDataError(name, location, source=label)
    root = os.path.realpath(base_dir)
    target = os.path.realpath(os.path.join(root, location))
    if os.path.commonpath([root, target]) != root:
        raise UnsafeExternalDataError(name, location, source=label)
    try:
        info = os.stat(target)
    except OSError as exc:
        raise ModelLoadError(
            f"tensor {name!r} refers to external data file {location!r}, which does not exist "
            f"beside the model",
            source=label,
        ) from exc
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeExternalDataError(name, location, source=label, problem=UnsafeExternalDataError.NOT_REGULAR)
    return target


def _function_key(domain: str, name: str, overload: str = "") -> tuple[str, str, str]:
    return (domain or "", name, overload or "")


def _expanded_node_count(proto: onnx.ModelProto, limits: LoadLimits, label: str) -> int:
    """Nodes the model has once every model-local function call is inlined, subgraphs
    included, computed without inlining anything (a function calling another function
    ten times, ten levels deep, is 10**10 nodes from a few kilobytes). Recursive
    functions are refused: they cannot be inlined."""
    functions = {_function_key(f.domain, f.name, f.overload): f for f in proto.functions}
    cost: dict[tuple[str, str, str], int] = {}
    visiting: set[tuple[str, str, str]] = set()

    def nodes_cost(nodes: Iterable[onnx.NodeProto], depth: int) -> int:
        if depth > limits.subgraph_depth:
            raise ModelLimitError("subgraph_depth", depth, limits.subgraph_depth, source=label)
        total = 0
        for node in nodes:
            key = _function_key(node.domain, node.op_type, node.overload)
            total += function_cost(key) if key in functions else 1
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    total += nodes_cost(attr.g.node, depth + 1)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    total += sum(nodes_cost(g.node, depth + 1) for g in attr.graphs)
            if total > limits.nodes:
                raise ModelLimitError("nodes", total, limits.nodes, source=label)
        return total

    def function_cost(key: tuple[str, str, str]) -> int:
        if key in cost:
            return cost[key]
        if key in visiting:
            raise ModelLoadError(
                f"function {key[0]}::{key[1]} calls itself (directly or through other functions); "
                "ONNX functions cannot be recursive",
                source=label,
                reason="recursive function",
            )
        visiting.add(key)
        cost[key] = nodes_cost(functions[key].node, 0)
        visiting.discard(key)
        return cost[key]

    total = nodes_cost(proto.graph.node, 0)
    for key in functions:
        function_cost(key)  # unused functions are still checked for recursion and size
    return total


_AXIS_ATTRIBUTES = frozenset({"axis", "axes", "batch_axis", "time_axis", "perm"})


def _all_nodes(proto: onnx.ModelProto, limits: LoadLimits, label: str) -> Iterator[onnx.NodeProto]:
    for graph in _walk_protos(proto.graph, 0, limits, label):
        yield from graph.node
    for function in proto.functions:
        yield from function.node
        for graph in _function_graphs(function, limits, label):
            yield from graph.node


def _check_attributes(node: onnx.NodeProto, label: str) -> None:
    """Attributes that make onnx's C++ shape inference read out of bounds (a crash of the
    whole process, not an exception): axes beyond 32 bits, which it truncates, and a
    Split whose ``num_outputs`` disagrees with its outputs."""
    if node.op_type == "Split" and node.domain in ("", "ai.onnx"):
        for attr in node.attribute:
            if attr.name == "num_outputs" and attr.i != len(node.output):
                raise ModelLoadError(
                    f"node {node.name or 'Split'!r} has num_outputs={attr.i} but {len(node.output)} outputs",
                    source=label,
                    reason="Split num_outputs mismatch",
                )
    for attr in node.attribute:
        if attr.name not in _AXIS_ATTRIBUTES:
            continue
        values = [attr.i] if attr.type == onnx.AttributeProto.INT else list(attr.ints)
        if any(not -(2**31) <= v < 2**31 for v in values):
            raise ModelLoadError(
                f"node {node.name or node.op_type!r} has attribute {attr.name!r} = {values[:8]}, "
                "outside any tensor's rank",
                source=label,
                reason="axis out of range",
            )


def _validate_proto(proto: onnx.ModelProto, limits: LoadLimits, label: str, base_dir: str) -> None:
    _check_opsets(proto, label)
    imports = {op.domain or "" for op in proto.opset_import}
    local_functions = {(f.domain, f.name) for f in proto.functions}
    _expanded_node_count(proto, limits, label)
    for tensor in all_tensors(proto, limits, label):
        _check_tensor(tensor, limits, label, base_dir)
    for node in _all_nodes(proto, limits, label):
        _check_attributes(node, label)
    for graph in _walk_protos(proto.graph, 0, limits, label):
        for node in graph.node:
            domain = "" if node.domain == "ai.onnx" else node.domain
            if domain not in imports and (node.domain, node.op_type) not in local_functions:
                raise ModelLoadError(
                    f"node {node.name or node.op_type!r} uses domain {node.domain!r}, which the "
                    f"model does not import (opset_import has {sorted(imports)}); add it to "
                    "opset_import or fix the node's domain",
                    source=label,
                    reason="unknown opset domain",
                )


#: Key in a graph input's or output's ``meta`` holding the ``onnx.TypeProto`` it declares
#: when onnx_ir cannot represent that type (maps, sequences of maps: ZipMap's output,
#: DictVectorizer's input). The value itself is left untyped in the IR.
DECLARED_TYPE_KEY = "plugrt.declared_type"


def _holds_map(type_proto: onnx.TypeProto) -> bool:
    kind = type_proto.WhichOneof("value")
    if kind == "map_type":
        return True
    if kind == "sequence_type":
        return _holds_map(type_proto.sequence_type.elem_type)
    if kind == "optional_type":
        return _holds_map(type_proto.optional_type.elem_type)
    return False


def _value_infos(proto: onnx.ModelProto, limits: LoadLimits, label: str) -> Iterator[tuple[bool, onnx.ValueInfoProto]]:
    """Every declared value of the model, with whether it is a main graph input or output."""
    for graph in _walk_protos(proto.graph, 0, limits, label):
        top = graph is proto.graph
        yield from ((top, v) for v in (*graph.input, *graph.output))
        yield from ((False, v) for v in graph.value_info)
    for function in proto.functions:
        yield from ((False, v) for v in function.value_info)
        for graph in _function_graphs(function, limits, label):
            yield from ((False, v) for v in (*graph.input, *graph.output, *graph.value_info))


def _without_map_types(
    proto: onnx.ModelProto, copy: bool, limits: LoadLimits, label: str
) -> tuple[onnx.ModelProto, dict[str, onnx.TypeProto] | None]:
    """``proto`` with every map-holding type erased, since onnx_ir's deserializer refuses
    map types, and the main graph's declared types by value name so the session can
    report them (None when the model holds no map type). ``copy``: the proto is the
    caller's, so a changed one is a copy."""
    if not any(_holds_map(v.type) for _, v in _value_infos(proto, limits, label)):
        return proto, None
    if copy:
        original, proto = proto, onnx.ModelProto()
        proto.CopyFrom(original)
    declared: dict[str, onnx.TypeProto] = {}
    for top, value in _value_infos(proto, limits, label):
        if _holds_map(value.type):
            if top:
                declared[value.name] = onnx.TypeProto()
                declared[value.name].CopyFrom(value.type)
            value.ClearField("type")
    return proto, declared


_MAP_TYPES_ERASED_KEY = "plugrt.map_types_erased"


def _remember_declared_types(model: ir.Model, declared: dict[str, onnx.TypeProto]) -> None:
    model.meta[_MAP_TYPES_ERASED_KEY] = True
    for value in (*model.graph.inputs, *model.graph.outputs):
        if value.name in declared:
            value.meta[DECLARED_TYPE_KEY] = declared[value.name]


def write_declared_types(proto: onnx.ModelProto, model: ir.Model) -> None:
    """Give the graph inputs and outputs of ``proto``, serialized from ``model``, the map
    types the loader erased, so that a model plugrt writes (an optimised model, an
    EPContext model) declares what the model it loaded declared."""
    declared = {
        v.name: v.meta[DECLARED_TYPE_KEY] for v in (*model.graph.inputs, *model.graph.outputs) if DECLARED_TYPE_KEY in v.meta
    }
    for value in (*proto.graph.input, *proto.graph.output):
        if value.name in declared:
            value.type.CopyFrom(declared[value.name])


def map_types_erased(model: ir.Model) -> bool:
    """Whether the loader erased map types from ``model``. onnx's shape inference must not
    see such a model: it dereferences the missing type of a map-reading op's input (a crash
    of the process), and where it does not, it infers map types onnx_ir cannot read back."""
    return bool(model.meta.get(_MAP_TYPES_ERASED_KEY))


def _validate_ir(model: ir.Model, label: str) -> None:
    graphs = [model.graph]
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                graphs.append(attr.value)
            elif attr.type == ir.AttributeType.GRAPHS:
                graphs.extend(attr.value)
    for graph in graphs:
        for node in graph:
            for value in node.inputs:
                if value is None:
                    continue
                if value.producer() is None and not value.is_graph_input() and not value.is_initializer():
                    raise ModelLoadError(
                        f"node {node.name or node.op_type!r} reads {value.name!r}, which no node "
                        "produces and which is neither a graph input nor an initializer "
                        "(a dangling value)",
                        source=label,
                        reason="dangling value",
                    )
        for value in graph.outputs:
            if value.producer() is None and not value.is_graph_input() and not value.is_initializer():
                raise ModelLoadError(
                    f"graph output {value.name!r} is produced by no node (a dangling value)",
                    source=label,
                    reason="dangling value",
                )
    try:
        model.graph.sort()
    except ValueError as exc:
        raise ModelLoadError(
            "the graph contains a cycle (a node depends on its own output); ONNX graphs must be "
            "acyclic",
            source=label,
            reason="cycle",
        ) from exc


def _set_base_dir(model: ir.Model, base_dir: str) -> None:
    """Resolve every external tensor against the model's folder, functions included: a
    tensor without a base directory would be resolved against the working directory."""
    ir_external_data.set_base_dir(model.graph, base_dir)
    for function in model.functions.values():
        for node in ir.traversal.RecursiveGraphIterator(function):
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.TENSOR:
                    tensors = [attr.value]
                elif attr.type == ir.AttributeType.TENSORS:
                    tensors = list(attr.value)
                else:
                    continue
                for tensor in tensors:
                    if isinstance(tensor, ir.ExternalTensor):
                        tensor.base_dir = base_dir


#: External tensors smaller than this are read into memory of their own at load; larger
#: ones stay memory-mapped until first use. A read through a map makes the kernel map up to
#: 64 KiB around the page it faults on (Linux's fault_around_bytes), and onnx_ir maps the
#: file once per tensor: SmolLM2-135M's 61 norm weights of 2.3 KiB each held 64 KiB each,
#: 4 MiB, from their first read on.
SMALL_EXTERNAL_BYTES = 64 * 1024


def _read_small(tensor: ir.ExternalTensor) -> np.ndarray | None:
    """A small external tensor's bytes read into an array of its own (one read, no map);
    None where they cannot be read as they are described."""
    dtype = np.dtype(tensor.dtype.numpy())
    if sys.byteorder != "little" and dtype.itemsize > 1:
        return None  # external data is little-endian: onnx_ir's own read converts it
    length = tensor.nbytes
    if tensor.length is not None and tensor.length != length:
        return None
    try:
        with open(tensor.path, "rb") as file:
            data = os.pread(file.fileno(), length, tensor.offset or 0)
    except (OSError, ValueError):
        return None
    if len(data) != length:
        return None
    array = np.frombuffer(bytearray(data), dtype).reshape(tensor.shape.numpy())  # a bytearray: aligned as malloc aligns
    # read-only like a mapped tensor's, so that every read of it is the same array: a
    # weight repacked from it is recognised by its source (a tied embedding table)
    array.flags.writeable = False
    return array


def _owned(tensor: ir.TensorProtocol) -> ir.TensorProtocol:
    """``tensor`` with its own numpy array when it reads its bytes from the protobuf, or
    from a small piece of external data."""
    if (
        isinstance(tensor, ir.ExternalTensor)
        and tensor.dtype != ir.DataType.STRING
        and tensor.dtype.bitwidth >= 8  # sub-byte types stay as onnx_ir reads them
        and tensor.nbytes < SMALL_EXTERNAL_BYTES
    ):
        array = _read_small(tensor)
        if array is None:
            return tensor  # left lazy: its first use reports the bad external data
        meta = dict(tensor.metadata_props)
        return ir.Tensor(array, dtype=tensor.dtype, name=tensor.name, doc_string=tensor.doc_string, metadata_props=meta)
    if not isinstance(tensor, ir.serde.TensorProtoTensor):
        return tensor  # external data stays lazy (memory-mapped on first use)
    array = tensor.numpy()
    meta = dict(tensor.metadata_props)
    if tensor.dtype == ir.DataType.STRING:
        return ir.StringTensor(array, shape=tensor.shape, name=tensor.name, doc_string=tensor.doc_string, metadata_props=meta)
    return ir.Tensor(array, dtype=tensor.dtype, name=tensor.name, doc_string=tensor.doc_string, metadata_props=meta)


def _own_tensors(model: ir.Model) -> None:
    """Give every tensor held inline (initializers and attributes, in subgraphs and
    functions too) its own array. Each read of a protobuf ``raw_data`` copies it, and one
    tensor left pointing into the parsed protobuf keeps all of it alive: without this, a
    session would hold every weight two or three times."""
    graphs: list[ir.Graph | ir.Function] = [model.graph, *model.functions.values()]
    for owner in list(graphs):
        for node in ir.traversal.RecursiveGraphIterator(owner):
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.TENSOR:
                    node.attributes[attr.name] = ir.AttrTensor(attr.name, _owned(attr.value), doc_string=attr.doc_string)
                elif attr.type == ir.AttributeType.TENSORS:
                    tensors = [_owned(t) for t in attr.value]
                    node.attributes[attr.name] = ir.AttrTensors(attr.name, tensors, doc_string=attr.doc_string)
            graphs.extend(subgraphs(node))
    for graph in graphs:
        if isinstance(graph, ir.Graph):
            for value in graph.initializers.values():
                if value.const_value is not None:
                    value.const_value = _owned(value.const_value)


def load_model(source: ModelSource, limits: LoadLimits | None = None) -> LoadedModel:
    """Read, validate and convert a model. Raises ModelLoadError (or a subclass)."""
    limits = limits or LoadLimits()
    proto, base_dir, label = _read_proto(source, limits)
    _validate_proto(proto, limits, label, base_dir)
    proto, declared = _without_map_types(proto, isinstance(source, onnx.ModelProto), limits, label)
    ir_logger = logging.getLogger("onnx_ir")
    previous = ir_logger.level
    ir_logger.setLevel(logging.ERROR)  # we report dangling values ourselves, with the node
    try:
        model = ir.serde.deserialize_model(proto)
    except ModelLoadError:
        raise
    except Exception as exc:
        detail = str(exc).split("\n", 1)[0][:300]  # onnx_ir's message can quote the whole graph
        raise ModelLoadError(f"the model is malformed: {type(exc).__name__}: {detail}", source=label) from exc
    finally:
        ir_logger.setLevel(previous)
    if declared is not None:
        _remember_declared_types(model, declared)
    if base_dir:
        _set_base_dir(model, base_dir)
    _own_tensors(model)
    if proto.ir_version < 4:
        # Before IR 4 every initializer had to be listed as an input; like onnxruntime,
        # treat them as constants rather than as inputs a caller may override. The model
        # is then an IR 4 model, and says so wherever it is saved (EPContext export, the
        # optimised model file).
        RemoveInitializersFromInputsPass()(model)
        model.ir_version = 4
    _validate_ir(model, label)
    return LoadedModel(model=model, base_dir=base_dir, source=label)
