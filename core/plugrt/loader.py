"""The loader: bytes or a path into a validated onnx_ir model, safely."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Union

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError
from onnx_ir import external_data as ir_external_data
from onnx_ir.passes.common import RemoveInitializersFromInputsPass

from .errors import ModelLimitError, ModelLoadError, UnsafeExternalDataError

__all__ = ["ModelSource", "LoadLimits", "LoadedModel", "load_model", "KNOWN_DOMAINS"]

ModelSource = Union[str, os.PathLike, bytes, bytearray, memoryview, onnx.ModelProto]

#: Domains whose ops plugrt knows how to ask providers about without a model-local function.
KNOWN_DOMAINS = frozenset(
    {"", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview", "ai.onnx.preview.training", "com.microsoft"}
)


@dataclasses.dataclass(frozen=True)
class LoadLimits:
    """Safety limits; each can be raised with the ``limits.<name>`` session option."""

    model_bytes: int = 2**31  # protobuf cannot exceed 2 GiB anyway
    tensor_bytes: int = 2**34
    nodes: int = 1_000_000
    subgraph_depth: int = 64


@dataclasses.dataclass
class LoadedModel:
    model: ir.Model
    base_dir: str  # folder external data is resolved against ("" for bytes)
    source: str  # a path, or "<bytes>"


def _read_proto(source: ModelSource, limits: LoadLimits) -> tuple[onnx.ModelProto, str, str]:
    if isinstance(source, onnx.ModelProto):
        return source, "", "<ModelProto>"
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        label, base_dir = "<bytes>", ""
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        label = path
        try:
            size = os.path.getsize(path)
        except OSError as exc:
            raise ModelLoadError(f"cannot read the model file: {exc.strerror}", source=label) from exc
        if size > limits.model_bytes:
            raise ModelLimitError("model_bytes", size, limits.model_bytes, source=label)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ModelLoadError(f"cannot read the model file: {exc.strerror}", source=label) from exc
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


def _walk_protos(graph: onnx.GraphProto, depth: int, limits: LoadLimits, label: str):
    if depth > limits.subgraph_depth:
        raise ModelLimitError("subgraph_depth", depth, limits.subgraph_depth, source=label)
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _walk_protos(attr.g, depth + 1, limits, label)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _walk_protos(g, depth + 1, limits, label)


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


def _check_tensor(tensor: onnx.TensorProto, limits: LoadLimits, label: str, base_dir: str) -> None:
    try:
        nbytes = _tensor_nbytes(tensor)
    except ValueError as exc:
        raise ModelLoadError(f"initializer {tensor.name!r} has {exc}", source=label) from exc
    if nbytes > limits.tensor_bytes:
        raise ModelLimitError("tensor_bytes", nbytes, limits.tensor_bytes, source=label)
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        _check_external_location(tensor.name, location, base_dir, label)
    elif tensor.HasField("raw_data") and tensor.data_type not in (
        onnx.TensorProto.STRING,
    ):
        # Sub-byte types pack several values a byte; compare only where the size is exact.
        if tensor.data_type in (
            onnx.TensorProto.INT4, onnx.TensorProto.UINT4, onnx.TensorProto.FLOAT4E2M1,
        ) or getattr(onnx.TensorProto, "INT2", -1) == tensor.data_type or getattr(
            onnx.TensorProto, "UINT2", -1
        ) == tensor.data_type:
            return
        if len(tensor.raw_data) != nbytes:
            raise ModelLoadError(
                f"initializer {tensor.name!r} holds {len(tensor.raw_data)} bytes but its shape "
                f"{list(tensor.dims)} needs {nbytes}; the file is corrupt or truncated",
                source=label,
            )


def _check_external_location(name: str, location: str, base_dir: str, label: str) -> None:
    if not location:
        raise ModelLoadError(f"initializer {name!r} has external data without a location", source=label)
    if not base_dir:
        raise ModelLoadError(
            f"initializer {name!r} stores its data in an external file ({location!r}), but the "
            "model was given as bytes; load it from its path so the file can be found",
            source=label,
        )
    if os.path.isabs(location) or location.startswith(("/", "\\")) or ".." in location.replace(
        "\\", "/"
    ).split("/"):
        raise UnsafeExternalDataError(name, location, source=label)
    root = os.path.realpath(base_dir)
    target = os.path.realpath(os.path.join(base_dir, location))
    if os.path.commonpath([root, target]) != root:
        raise UnsafeExternalDataError(name, location, source=label)
    if not os.path.isfile(target):
        raise ModelLoadError(
            f"initializer {name!r} refers to external data file {location!r}, which does not exist "
            f"beside the model",
            source=label,
        )


def _validate_proto(proto: onnx.ModelProto, limits: LoadLimits, label: str, base_dir: str) -> None:
    _check_opsets(proto, label)
    imports = {op.domain or "" for op in proto.opset_import}
    local_functions = {(f.domain, f.name) for f in proto.functions}
    nodes = 0
    for graph in _walk_protos(proto.graph, 0, limits, label):
        nodes += len(graph.node)
        if nodes > limits.nodes:
            raise ModelLimitError("nodes", nodes, limits.nodes, source=label)
        for tensor in graph.initializer:
            _check_tensor(tensor, limits, label, base_dir)
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
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    _check_tensor(attr.t, limits, label, base_dir)


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


def load_model(source: ModelSource, limits: LoadLimits | None = None) -> LoadedModel:
    """Read, validate and convert a model. Raises ModelLoadError (or a subclass)."""
    limits = limits or LoadLimits()
    proto, base_dir, label = _read_proto(source, limits)
    _validate_proto(proto, limits, label, base_dir)
    ir_logger = logging.getLogger("onnx_ir")
    previous = ir_logger.level
    ir_logger.setLevel(logging.ERROR)  # we report dangling values ourselves, with the node
    try:
        model = ir.serde.deserialize_model(proto)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"the model is malformed: {type(exc).__name__}: {exc}", source=label) from exc
    finally:
        ir_logger.setLevel(previous)
    if base_dir:
        ir_external_data.set_base_dir(model.graph, base_dir)
    if proto.ir_version < 4:
        # Before IR 4 every initializer had to be listed as an input; like onnxruntime,
        # treat them as constants rather than as inputs a caller may override.
        RemoveInitializersFromInputsPass()(model)
    _validate_ir(model, label)
    return LoadedModel(model=model, base_dir=base_dir, source=label)
