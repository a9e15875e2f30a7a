"""Build-time graph passes: inline functions, fold constants, drop dead nodes."""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import common as common_passes

from ._guard import planned_output_bytes
from .errors import ModelLimitError
from .ir_utils import is_constant, subgraphs, tensor_array
from .loader import map_types_erased
from .provider import ExecutionProvider, FunctionCapability, Partition, SupportContext
from .tracing import traced

__all__ = ["name_nodes", "infer_types", "inline_functions", "expand_unsupported_functions", "fold_constants", "remove_dead_nodes", "optimize"]

logger = logging.getLogger("plugrt.passes")

#: Ops whose result must not be computed once at build (random or stateful).
_NOT_FOLDABLE = frozenset(
    {
        "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli",
        "Multinomial", "Dropout", "If", "Loop", "Scan", "SequenceMap", "ImageDecoder",
    }
)


def name_nodes(model: ir.Model) -> int:
    """Give every node a unique name (``<op_type>_<n>`` for unnamed ones), subgraphs included;
    placement reports, errors and EPContext export refer to nodes by name."""
    seen: set[str] = set()
    renamed = 0
    counters: dict[str, int] = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        name = node.name
        if not name or name in seen:
            base = name or node.op_type
            while True:
                counters[base] = counters.get(base, -1) + 1
                candidate = f"{base}_{counters[base]}"
                if candidate not in seen:
                    break
            node.name = name = candidate
            renamed += 1
        seen.add(name)
    return renamed


#: onnx's data propagation holds a generated tensor's values as one shape dimension per
#: element (about 150 bytes each): above this many elements it is skipped.
_DATA_PROPAGATION_MAX_ELEMENTS = 1 << 16
#: Declared shapes above this many elements switch data propagation off as well.
_DATA_PROPAGATION_MAX_DECLARED = 1 << 28


def _data_propagation_is_bounded(model: ir.Model) -> bool:
    """False when a ConstantOfShape or Range could make onnx's data propagation build a
    huge tensor (a few bytes of shape make gigabytes, and minutes of work), or when a
    declared shape is huge (propagation through an input of 2**40 elements never ends)."""
    declared = list(model.graph.inputs) + list(model.graph.outputs)
    declared += [v for node in ir.traversal.RecursiveGraphIterator(model.graph) for v in node.outputs]
    for value in declared:
        count = 1
        for dim in value.shape or ():
            count *= dim if isinstance(dim, int) and dim > 0 else 1
        if count > _DATA_PROPAGATION_MAX_DECLARED:
            return False
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type not in ("ConstantOfShape", "Range") or node.domain not in ("", "ai.onnx"):
            continue
        arrays = [
            tensor_array(v.const_value) if v is not None and v.const_value is not None and is_constant(v) else None
            for v in node.inputs
        ]
        if not arrays or any(a is None for a in arrays):
            return False  # its size is known only at run time
        planned = planned_output_bytes(node.op_type, arrays, 1)
        if planned is None or planned > _DATA_PROPAGATION_MAX_ELEMENTS:
            return False
    return True


class _FailureOfShapeInference(logging.Filter):
    """Keeps what onnx_ir's shape-inference pass logs when onnx's inference fails (a
    warning with a whole traceback, for a model that runs fine) out of the user's stderr."""

    def __init__(self) -> None:
        super().__init__()
        self.failure: object = None

    def filter(self, record: logging.LogRecord) -> bool:
        self.failure = record.exc_info[1] if record.exc_info else record.getMessage()
        return False


def infer_types(model: ir.Model) -> bool:
    """Record value types and shapes with onnx's shape inference (best effort: a model onnx
    cannot infer still runs, its providers see fewer types; a model holding maps is not
    inferred at all)."""
    if map_types_erased(model):
        return False
    quiet = _FailureOfShapeInference()
    pass_logger = logging.getLogger(common_passes.ShapeInferencePass.__module__)
    pass_logger.addFilter(quiet)
    try:
        data_prop = _data_propagation_is_bounded(model)
        return common_passes.ShapeInferencePass(data_prop=data_prop)(model).modified
    except Exception as exc:
        quiet.failure = exc
        return False
    finally:
        pass_logger.removeFilter(quiet)
        if quiet.failure is not None:
            logger.debug("shape inference failed, types left as declared: %s", quiet.failure)


def inline_functions(model: ir.Model, providers: Sequence[ExecutionProvider]) -> bool:
    """Inline model-local functions, except those a provider claims with ``supports_function``."""
    if not model.functions:
        return False
    ctx = SupportContext({d or "": v for d, v in model.opset_imports.items()}, model.graph)

    def claimed(function: ir.Function) -> bool:
        for provider in providers:
            ask = provider.supports_function if isinstance(provider, FunctionCapability) else None
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


class _Quiet(logging.Filter):
    """Keeps a pass's per-value notes (onnx_ir's deduplication warns of every initializer
    a graph input may override, which it leaves alone as it should) off the user's stderr."""

    def filter(self, record: logging.LogRecord) -> bool:
        return False


def eliminate_common_subexpressions(model: ir.Model) -> int:
    """Merge the main graph's identical small initializers (onnx_ir's
    ``DeduplicateInitializersPass``: the same dtype, shape and bytes, up to 1024 values,
    none a graph input) and then the nodes that compute the same op, attributes and
    inputs (``CommonSubexpressionEliminationPass``: not random ops nor control flow), as
    onnxruntime does at its basic level. Exporters repeat a subexpression per layer:
    transformers' SDPA export computes the attention mask's ``Where`` in every layer, from
    the same mask and each layer's own constants. Returns how many passes changed the model."""
    dedup_logger = logging.getLogger(common_passes.DeduplicateInitializersPass.__module__)
    quiet = _Quiet()
    dedup_logger.addFilter(quiet)
    try:
        merged = common_passes.DeduplicateInitializersPass()(model).modified
    finally:
        dedup_logger.removeFilter(quiet)
    try:
        eliminated = common_passes.CommonSubexpressionEliminationPass()(model).modified
    except TypeError as exc:
        # an attribute it cannot hash (Optional's type): the nodes before it are merged,
        # each merge whole, and the graph stays as valid as it was
        logger.debug("common subexpressions: stopped at an attribute it cannot compare: %s", exc)
        eliminated = True
    return int(merged) + int(eliminated)


def _replace_with_constant(graph: ir.Graph, value: ir.Value, array: np.ndarray) -> None:
    tensor = ir.tensor(array, name=value.name)
    constant = ir.Value(name=value.name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
    value.name = f"{value.name}__folded"
    graph.register_initializer(constant)
    value.replace_all_uses_with(constant, replace_graph_outputs=True)


def _static_nbytes(value: ir.Value) -> int | None:
    """Bytes of a value whose dtype and whole shape are known, else None."""
    if value.shape is None or value.dtype is None or not isinstance(value.type, ir.TensorType):
        return None
    count = 1
    for dim in value.shape:
        if not isinstance(dim, int):
            return None
        count *= dim
    try:
        itemsize = value.dtype.itemsize
    except (AttributeError, TypeError, ValueError):
        return None
    return count * max(int(itemsize), 1)


def check_value_sizes(model: ir.Model, max_bytes: int) -> None:
    """Refuse a model with a value whose declared or inferred shape is over ``max_bytes``
    (subgraphs included), before anything is computed."""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for value in node.outputs:
            nbytes = _static_nbytes(value)
            if nbytes is not None and nbytes > max_bytes:
                raise ModelLimitError(
                    "tensor_bytes", nbytes, max_bytes,
                    source=f"value {value.name!r} of node {node.name or node.op_type!r}",
                )


def _check_before_folding(node: ir.Node, args: list, max_bytes: int) -> None:
    """Measure what folding ``node`` would allocate, before computing it."""
    for value in node.outputs:
        nbytes = _static_nbytes(value)
        if nbytes is not None and nbytes > max_bytes:
            raise ModelLimitError("tensor_bytes", nbytes, max_bytes, source=f"node {node.name or node.op_type!r}")
    output = node.outputs[0] if node.outputs else None
    itemsize = 1
    if output is not None and output.dtype is not None:
        try:
            itemsize = int(output.dtype.itemsize)
        except (AttributeError, TypeError, ValueError):
            pass
    planned = planned_output_bytes(node.op_type, args, itemsize)
    if planned is not None and planned > max_bytes:
        raise ModelLimitError("tensor_bytes", planned, max_bytes, source=f"node {node.name or node.op_type!r}")


def _known_shape(node: ir.Node) -> np.ndarray | None:
    """The value of a Shape or Size whose input's shape is static (every dimension a
    number, as shape inference gives it for a model whose inputs are fixed: the session
    refuses inputs of another shape), else None. Exports compute reshapes, masks and
    window indices from them (Swin: 473 Shape nodes), which onnxruntime folds at build.
    Where a shape is known only once constants before it are folded, ``_infer_outputs``
    gives it in the same pass (Swin: 3,384 steps to 472)."""
    if node.op_type not in ("Shape", "Size") or node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
        return None
    source = node.inputs[0] if node.inputs else None
    if source is None or source.shape is None or not source.shape.is_static() or not isinstance(source.type, ir.TensorType):
        return None
    dims = [d for d in source.shape if isinstance(d, int)]  # every one, the shape being static
    if node.op_type == "Size":
        return np.array(math.prod(dims), np.int64)
    rank = len(dims)
    start = node.attributes.get_int("start", 0)
    end = node.attributes.get_int("end", rank)
    start, end = (max(0, min(rank, a + rank if a < 0 else a)) for a in (start, end))
    return np.array(dims[start:end], np.int64)


#: Constant inputs at most this many elements are given to onnx's per-node inference as
#: data (the shapes, starts and axes that shape computations feed to Reshape, Slice, Expand).
_INFERENCE_DATA_MAX_ELEMENTS = 1 << 10


def _static(value: ir.Value) -> bool:
    return value.shape is not None and value.shape.is_static() and value.type is not None


def _infer_outputs(node: ir.Node, opsets: dict[str, int], max_bytes: int) -> None:
    """Give ``node``'s outputs the static shapes onnx's inference finds for this one node
    from its inputs' types and its small constant inputs' values, where they had none.

    The model's shape inference ran before folding: a Pad or Reshape whose pads or target
    shape are computed with ops onnx's data propagation does not follow (Swin's window
    padding takes a Mod of the width) then got no static shape, and neither did what
    follows it. Once folding has made that computation a constant, this node's inference
    gives the shape, and the Shape nodes after it fold in the same pass. (Swin, exported
    at a fixed input shape: 3,016 steps left after one pass without it; onnx's whole-model
    inference again after each pass took 0.4 s a round and eight rounds still left 2,104.)
    Only where every input's shape is static (a dynamic dimension leaves the outputs
    dynamic: a decoder's nodes are not asked), and only shapes within ``max_bytes``."""
    if all(_static(v) for v in node.outputs) or node.domain not in ("", "ai.onnx"):
        return
    if not all(v is None or _static(v) for v in node.inputs):
        return
    types: dict[str, onnx.TypeProto] = {}
    data: dict[str, onnx.TensorProto] = {}
    for value in node.inputs:
        if value is None:
            continue
        if value.type is None or not value.name:
            return
        types[value.name] = ir.serde.serialize_value(value).type
        tensor = value.const_value if is_constant(value) else None
        if tensor is not None and math.prod(tensor.shape.numpy()) <= _INFERENCE_DATA_MAX_ELEMENTS:
            data[value.name] = ir.serde.serialize_tensor(tensor)
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get("", 1), "")
        inferred = onnx.shape_inference.infer_node_outputs(schema, ir.serde.serialize_node(node), types, data)
    except Exception as exc:  # noqa: BLE001  (inference is best effort: the node keeps what it had)
        logger.debug("no inference for %s: %s", node.op_type, exc)
        return
    for value in node.outputs:
        proto = inferred.get(value.name) if value is not None and value.name else None
        if proto is None or _static(value):
            continue
        shape = ir.serde.deserialize_type_proto_for_shape(proto)
        if shape is None or not shape.is_static():
            continue
        before = value.shape, value.type
        value.shape = shape
        if value.type is None:
            value.type = ir.serde.deserialize_type_proto_for_type(proto)
        nbytes = _static_nbytes(value)
        if nbytes is None or nbytes > max_bytes:  # left unknown: a run that makes it meets the limit then
            value.shape, value.type = before


def fold_constants(
    model: ir.Model,
    provider: ExecutionProvider,
    *,
    max_bytes: int = 1 << 34,
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
        known = _known_shape(node)
        if known is not None:
            _replace_with_constant(graph, node.outputs[0], known)
            graph.remove(node, safe=True)
            folded += 1
            continue
        if not all(v is None or is_constant(v) for v in node.inputs):
            _infer_outputs(node, opsets, max_bytes)
            continue
        try:
            if not provider.supports_op(node, ctx):
                continue
            inputs = [v for v in node.inputs if v is not None]
            partition = Partition("fold", [node], inputs, list(node.outputs), opsets)
            (step,) = provider.compile(partition).steps
            args = [None if v is None or v.const_value is None else tensor_array(v.const_value) for v in step.inputs]
            _check_before_folding(node, args, max_bytes)
            result = step.fn(*args)
            results = list(result[: len(step.outputs)]) if step.multi_output else [result]
        except ModelLimitError:
            raise  # the tensor is over the limit whenever it is computed: say so at build
        except Exception as exc:  # folding is an optimisation: leave the node to run later
            logger.debug("not folding %s: %s", node.op_type, exc)
            continue
        arrays: list[tuple[ir.Value, np.ndarray]] | None = []
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
            arrays.append((value, array))  # type: ignore[union-attr]  # None only after a break
        if arrays is None:
            continue
        for value, array in arrays:
            _replace_with_constant(graph, value, array if array.flags.c_contiguous else array.copy())
        graph.remove(node, safe=True)
        folded += 1
    return folded


#: Node metadata key: the provider a node is placed on, set after placement for the
#: providers' own passes (which rewrite only the nodes that name them).
CLAIMED_BY = "plugrt.claimed_by"


def optimize(
    model: ir.Model,
    level: str,
    fold_provider: ExecutionProvider | None,
    providers: Sequence[ExecutionProvider],
    *,
    max_fold_bytes: int = 1 << 34,
) -> dict[str, int]:
    """Run the core's passes of optimisation ``level`` ("none", "basic", "all"); return
    counts. They do not depend on a provider: at "all" the rewrites of ``plugrt.rewrites``
    write ops any provider may claim (asking ``providers`` only whether one that could run
    a pattern could run what replaces it); each provider's own passes run after placement
    on the nodes placed on it (``plugrt.build``)."""
    stats: dict[str, int] = {}
    if level == "none":
        return stats
    check_value_sizes(model, max_fold_bytes)
    if fold_provider is not None:
        stats["folded"] = traced("pass:fold_constants", fold_constants, model, fold_provider, max_bytes=max_fold_bytes)
    stats["common_subexpressions"] = traced("pass:eliminate_common_subexpressions", eliminate_common_subexpressions, model)
    if level == "all" and providers:
        # provider-independent rewrites, before placement: every provider sees their ops
        from .rewrites import rewrite_passes

        for graph_pass in rewrite_passes(providers):
            result = traced(f"pass:{type(graph_pass).__name__}", graph_pass, model)
            stats[type(graph_pass).__name__] = int(result.modified)
    stats["dead_removed"] = int(traced("pass:remove_dead_nodes", remove_dead_nodes, model))
    return stats


def _function_body(node: ir.Node, opset: int) -> onnx.FunctionProto | None:
    """The ONNX schema's function body for ``node`` at ``opset``, or None."""
    try:
        # typed as Any: onnx's stubs lack the function-body accessors of OpSchema
        schema: Any = onnx.defs.get_schema(node.op_type, opset, node.domain or "")
    except onnx.defs.SchemaError:
        return None
    proto_bytes = None
    if schema.has_function:
        versions = [v for v in schema.function_opset_versions if v <= opset]
        if versions:
            proto_bytes = schema.get_function_with_opset_version(max(versions))
    elif schema.has_context_dependent_function:
        versions = [v for v in schema.context_dependent_function_opset_versions if v <= opset]
        if not versions:
            return None
        if any(v is not None and v.type is None for v in node.inputs):
            return None
        node_proto = ir.serde.serialize_node(node)
        types = []
        for value in node.inputs:
            if value is None:
                types.append(onnx.TypeProto().SerializeToString())
            elif value.type is not None:  # checked above: every present input is typed
                type_proto = onnx.TypeProto()
                ir.serde.serialize_type_into(type_proto, value.type)
                types.append(type_proto.SerializeToString())
        try:
            proto_bytes = schema.get_context_dependent_function_with_opset_version(
                max(versions), node_proto.SerializeToString(), types
            )
        except Exception:
            return None
    if not proto_bytes:
        return None
    function = onnx.FunctionProto()
    function.ParseFromString(proto_bytes)
    return function if function.node else None


def expand_unsupported_functions(model: ir.Model, providers: Sequence[ExecutionProvider]) -> int:
    """Replace each node no provider supports by its ONNX function body, when it has one.

    Ops such as Gelu, LayerNormalization or the loss functions are defined by the spec
    as functions of simpler ops; a provider without a kernel for them still runs them.
    """
    opsets = {d or "": v for d, v in model.opset_imports.items()}
    ctx = SupportContext(opsets, model.graph)
    unsupported = [
        node
        for node in model.graph
        if node.domain in ("", "ai.onnx", "ai.onnx.ml") and not any(_supported(p, node, ctx) for p in providers)
    ]
    if not unsupported:
        return 0
    if any(v is not None and v.type is None for n in unsupported for v in n.inputs):
        infer_types(model)  # context-dependent bodies need input types
    expanded = 0
    for node in unsupported:
        function = _function_body(node, ctx.opset(node.domain))
        if function is None:
            continue
        function.domain = "plugrt.expanded"
        function.name = f"{node.op_type}_{expanded}"
        for entry in function.opset_import:  # the inliner needs the model's versions
            if (entry.domain or "") in opsets:
                entry.version = opsets[entry.domain or ""]
        ir_function = ir.serde.deserialize_function(function)
        model.functions[ir_function.identifier()] = ir_function
        if "plugrt.expanded" not in model.opset_imports:
            model.opset_imports["plugrt.expanded"] = 1
        node.domain = "plugrt.expanded"
        node.op_type = function.name
        expanded += 1
    if expanded:
        common_passes.InlinePass(criteria=lambda f: f.domain == "plugrt.expanded")(model)
        model.opset_imports.pop("plugrt.expanded", None)
    return expanded


def _supported(provider: ExecutionProvider, node: ir.Node, ctx: SupportContext) -> bool:
    try:
        return bool(provider.supports_op(node, ctx))
    except Exception:
        return False
