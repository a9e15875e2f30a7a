"""The activation memory plan: each intermediate value's lifetime in run order, and a best-fit reuse of freed buffers."""

from __future__ import annotations

import bisect
import dataclasses
from typing import AbstractSet, Any, Iterable, Mapping, Protocol, Sequence

import onnx_ir as ir

from .ir_utils import implicit_inputs

__all__ = ["MemoryPlan", "plan_memory", "plan_graph", "dims_of", "value_nbytes"]

#: The op type of the plan's steps that copy a value to another memory (``plugrt.build``):
#: their output is as large as their input, which is what they are sized by.
_TRANSFER = "Transfer"


class _Step(Protocol):
    """What a step of the order is read for: an ``ir.Node`` or a plan's ``Step``."""

    @property
    def inputs(self) -> Sequence[ir.Value | None]: ...

    @property
    def outputs(self) -> Sequence[ir.Value | None]: ...

    @property
    def op_type(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Where a run's intermediate values live, planned the way onnxruntime's memory
    pattern planner does: a value produced by step i is held until the last step that
    reads it (a graph output, to the end); a new value takes the smallest freed buffer
    at least its size (best fit), else a new buffer. Graph inputs and initializers are
    not activations.

    - ``peak_bytes``: the bytes of every buffer allocated (buffers are reused, never
      given back), the most the plan holds at once.
    - ``total_bytes``: the bytes of all intermediates, as if none were reused.
    - ``buffers``: distinct buffers allocated; ``buffers_reused``: values placed in a
      freed buffer instead of a new one.
    - ``values``: intermediate values planned; ``unsized``: those of them whose size is
      unknown (a dimension with no size, a type shape inference did not give), which
      take no buffer.
    - ``inputs``: each graph input's shape the plan is for (a symbolic dimension with no
      size stays its name, an unnamed one None); ``dims``: the symbolic sizes used.
    """

    peak_bytes: int
    total_bytes: int
    buffers: int
    buffers_reused: int
    values: int
    unsized: int
    inputs: dict[str, tuple[int | str | None, ...] | None]
    dims: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain dicts, ints and lists (for JSON or logging)."""
        plan = dataclasses.asdict(self)
        plan["inputs"] = {name: None if shape is None else list(shape) for name, shape in self.inputs.items()}
        return plan


def plan_memory(
    steps: Iterable[_Step],
    graph_inputs: Sequence[ir.Value],
    graph_outputs: Sequence[ir.Value],
    dims: Mapping[str, int],
    *,
    bound: AbstractSet[ir.Value] = frozenset(),
) -> MemoryPlan:
    """The memory plan of running ``steps`` in this order (``ir.Node`` or plan ``Step``
    objects), symbolic dimensions sized by ``dims`` (name -> size). ``bound`` values are
    written into buffers the caller provides (outputs bound like onnxruntime's IOBinding
    ones, a KV cache): they are not planned."""
    order = list(steps)
    produced: dict[ir.Value, int] = {}
    last_read: dict[ir.Value, int] = {}
    sizes: dict[ir.Value, int | None] = {}
    for index, step in enumerate(order):
        for value in _reads(step):
            if value in produced:
                last_read[value] = index
        for output in step.outputs:
            # an output named "" is one ONNX says the node does not produce
            if output is not None and output.name != "" and output not in produced and output not in bound:
                produced[output] = last_read[output] = index
                sizes[output] = _size(step, output, sizes, dims)
    for value in graph_outputs:
        if value in produced:
            last_read[value] = len(order)
    dying: dict[int, list[ir.Value]] = {}
    for value, index in last_read.items():
        dying.setdefault(index, []).append(value)

    buffers: list[int] = []  # size of each buffer
    free: list[tuple[int, int]] = []  # (size, buffer) of freed buffers, sorted: the best fit is the first that fits
    held: dict[ir.Value, int] = {}
    total = reused = unsized = 0
    by_step: dict[int, list[ir.Value]] = {}
    for value, index in produced.items():
        by_step.setdefault(index, []).append(value)
    for index in range(len(order)):
        for value in by_step.get(index, ()):
            size = sizes[value]
            if size is None:
                unsized += 1
                continue
            total += size
            if size == 0:
                continue
            fit = bisect.bisect_left(free, (size, -1))
            if fit < len(free):
                held[value] = free.pop(fit)[1]
                reused += 1
            else:
                held[value] = len(buffers)
                buffers.append(size)
        # a step's inputs are freed after its outputs are placed: it reads them while it writes
        for value in dying.get(index, ()):
            buffer = held.pop(value, None)
            if buffer is not None:
                bisect.insort(free, (buffers[buffer], buffer))
    return MemoryPlan(
        peak_bytes=sum(buffers),
        total_bytes=total,
        buffers=len(buffers),
        buffers_reused=reused,
        values=len(produced),
        unsized=unsized,
        inputs={value.name or "": _shape(value, dims) for value in graph_inputs},
        dims=dict(dims),
    )


def plan_graph(graph: ir.Graph, dims: Mapping[str, int]) -> MemoryPlan:
    """The memory plan of ``graph``'s nodes in their (topological) order."""
    return plan_memory(graph, graph.inputs, graph.outputs, dims)


def dims_of(declared: Sequence[tuple[int | str | None, ...] | None], shapes: Sequence[tuple[int, ...] | None]) -> dict[str, int]:
    """The sizes of symbolic dimensions that ``shapes`` (one per input, None for a value
    with no shape) give the ``declared`` input shapes (ints, symbol names or None); an
    input empty along a symbol sizes it 0 only when no other input sizes it, as the run's
    checks let an empty input differ."""
    dims: dict[str, int] = {}
    for want, got in zip(declared, shapes):
        if want is None or got is None or len(want) != len(got):
            continue
        for symbol, size in zip(want, got):
            if isinstance(symbol, str) and not dims.get(symbol):
                dims[symbol] = int(size)
    return dims


def value_nbytes(value: ir.Value, dims: Mapping[str, int]) -> int | None:
    """The bytes of tensor ``value`` with symbolic dimensions sized by ``dims``; None when
    its type, shape or a dimension's size is unknown, or its elements have no fixed size
    (strings)."""
    if not isinstance(value.type, ir.TensorType):
        return None  # no type, or a sequence or an optional: its size depends on what it holds
    dtype = value.type.dtype
    count = _elements(value, dims)
    if count is None or dtype in (ir.DataType.UNDEFINED, ir.DataType.STRING):
        return None
    return (count * dtype.bitwidth + 7) // 8


def _elements(value: ir.Value, dims: Mapping[str, int]) -> int | None:
    shape = _shape(value, dims)
    if shape is None:
        return None
    count = 1
    for dim in shape:
        if not isinstance(dim, int):
            return None
        count *= dim
    return count


def _shape(value: ir.Value, dims: Mapping[str, int]) -> tuple[int | str | None, ...] | None:
    if value.shape is None:
        return None
    return tuple(dim if isinstance(dim, int) else dims.get(dim.value, dim.value) if dim.value else None for dim in value.shape)


def _size(step: _Step, value: ir.Value, sizes: Mapping[ir.Value, int | None], dims: Mapping[str, int]) -> int | None:
    size = value_nbytes(value, dims)
    if size is None and step.op_type == _TRANSFER and step.inputs and step.inputs[0] is not None:
        source = step.inputs[0]
        return sizes[source] if source in sizes else value_nbytes(source, dims)
    return size


def _reads(step: _Step) -> list[ir.Value]:
    """The values ``step`` reads: its inputs, and for a node with subgraphs the outer
    values they read (a plan's control-flow step lists those among its inputs)."""
    values = [v for v in step.inputs if v is not None]
    if isinstance(step, ir.Node):
        values.extend(implicit_inputs(step))
    return values
