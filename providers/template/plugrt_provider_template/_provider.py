"""The template provider: claims float32 math, compiles each partition into one function."""

from __future__ import annotations

from typing import Any, Mapping

import onnx_ir as ir

from plugrt.errors import EpContextError
from plugrt.provider import (
    CompiledPartition,
    Device,
    DeviceKind,
    Partition,
    Step,
    Support,
    SupportContext,
    op_version_in_effect,
)

from . import _context
from ._kernels import CLAIMED_OPS
from ._program import Program, build_function, lower

__all__ = ["TemplateProvider"]

_CLAIMS = "float32 " + ", ".join(CLAIMED_OPS)


class TemplateProvider:
    """A virtual accelerator: numpy on the host, one fused function per partition."""

    name = "template"
    # Negative: opt-in only. Used for device="template" or providers=["template"], never
    # picked by "auto" or a policy. A real accelerator takes a positive priority (cpu is 0).
    priority = -1
    context_source_keys = ("template",)  # the EPContext "source" this provider writes and restores
    sdk_version = f"template-program-{_context.FORMAT_VERSION}"  # recorded as the node's ep_sdk_version

    def devices(self) -> list[Device]:
        # A real provider probes its hardware here (lazily, never at import) and returns
        # [] with `unavailable_reason` set when there is none.
        return [Device(DeviceKind.OTHER, 0, "Template virtual accelerator (numpy on the host CPU)")]

    def supports_op(self, node: ir.Node, ctx: SupportContext) -> Support:
        op = f"{node.domain or 'ai.onnx'}::{node.op_type}"
        if node.domain not in ("", "ai.onnx"):
            return Support.no(f"the template claims only ai.onnx ops ({_CLAIMS}), not {op}")
        spec = CLAIMED_OPS.get(node.op_type)
        if spec is None:
            return Support.no(f"the template has no kernel for {op}; it claims {_CLAIMS}")
        opset = ctx.opset(node.domain)
        version = op_version_in_effect(node.op_type, opset)
        if version not in spec.versions:
            implemented = ", ".join(str(v) for v in spec.versions)
            if version < spec.versions[0]:
                return Support.no(
                    f"the model's opset {opset} selects {node.op_type}-{version}; the template implements "
                    f"{node.op_type} from opset {spec.versions[0]} on; convert the model to opset "
                    f"{spec.versions[0]} or later with onnx.version_converter.convert_version"
                )
            return Support.no(
                f"the model's opset {opset} selects {node.op_type}-{version}, newer than the versions "
                f"the template implements ({implemented}); check the op's changes in onnx's Changelog.md "
                "and add the version to CLAIMED_OPS"
            )
        for attribute in node.attributes:
            if attribute not in spec.attributes:
                return Support.no(f"{op}: the template does not implement attribute {attribute!r}")
        for value in node.inputs:
            if value is None:
                continue
            dtype = value.dtype if isinstance(value.type, ir.TensorType) else None
            if dtype is None:
                return Support.no(
                    f"template claims float32 only; the element type of input {value.name!r} is unknown "
                    "(shape inference could not find it: declare it in the model's value_info)"
                )
            if dtype != ir.DataType.FLOAT:
                return Support.no(f"template claims float32 only; input {value.name!r} is {_type_name(dtype)}")
        return Support.yes()

    def compile(self, partition: Partition) -> CompiledPartition:
        program = lower(partition)
        return _compiled(partition, program, restored=False)

    def save_context(self, compiled: CompiledPartition) -> bytes:
        if not isinstance(compiled.state, Program):
            raise EpContextError(
                f"partition {compiled.partition.name!r} was not compiled by the template provider"
            )
        return _context.dumps(compiled.state)

    def load_context(self, blob: bytes, meta: Mapping[str, Any]) -> CompiledPartition:
        """Restore a partition from ``save_context``'s bytes. ``meta["partition"]`` is the
        Partition it stands for: its values are bound to the program's by name."""
        label = meta.get("partition_name", "?")
        try:
            program = _context.loads(blob)
        except ValueError as exc:
            raise EpContextError(f"template context of partition {label!r} cannot be restored: {exc}") from exc
        partition = meta.get("partition")
        if not isinstance(partition, Partition):
            raise EpContextError("template load_context needs meta['partition'], the Partition the context stands for")
        values = _values_by_name(partition)
        missing = [n for n in program.input_names + program.output_names if n not in values]
        if missing:
            raise EpContextError(
                f"template context of partition {label!r} reads or writes {missing}, "
                f"which partition {partition.name!r} does not have"
            )
        return _compiled(partition, program, restored=True)


def _values_by_name(partition: Partition) -> dict[str, ir.Value]:
    return {v.name or "": v for v in list(partition.inputs) + list(partition.outputs)}


def _compiled(partition: Partition, program: Program, *, restored: bool) -> CompiledPartition:
    """The CompiledPartition for ``program``: one Step that runs every node of it."""
    values = _values_by_name(partition)
    step = Step(
        build_function(program, label=f"template:{partition.name}"),
        inputs=[values[n] for n in program.input_names],
        outputs=[values[n] for n in program.output_names],
        multi_output=len(program.output_names) > 1,
        name=partition.name,
        op_type="TemplateProgram",
        nodes=tuple(program.nodes),
    )
    # no provider name here: plugrt fills in the name of the provider that compiled it
    return CompiledPartition(partition, [step], restored=restored, state=program)


def _type_name(dtype: ir.DataType) -> str:
    try:
        return str(dtype.numpy())  # "float64", as numpy users spell it
    except Exception:  # types numpy lacks (string)
        return dtype.name.lower()
