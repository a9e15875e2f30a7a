"""A session's memory budget: its weights and activation memory plans against the ``memory_limit`` option."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, Collection, Mapping, Protocol

import onnx_ir as ir

from .errors import MemoryLimitError
from .ir_utils import subgraphs
from .memory_plan import MemoryPlan, dims_of, plan_memory

if TYPE_CHECKING:
    from .options import SessionOptions
    from .plan import Plan
    from .signature import InputSignature, TensorInfo
    from .weights import WeightStore

__all__ = ["PlannedSession", "SessionMemory", "initializer_bytes"]

#: Memory plans kept per executed plan (one per set of dimension sizes), oldest dropped first.
_PLANS_KEPT = 64


class PlannedSession(Protocol):
    """What the plans are made from: a :class:`plugrt.Session`."""

    inputs: list["TensorInfo"]
    model_path: str | None
    _plan: "Plan"
    _signature: "InputSignature"
    _model: ir.Model


class SessionMemory:
    """One session's activation memory plans, each planned once per set of symbolic
    dimension sizes on first use (by ``stats()`` or a check, never on the run path), and
    its ``memory_limit`` check."""

    def __init__(self, options: "SessionOptions", store: "WeightStore | None") -> None:
        self.limit: int | None = options["memory_limit"]
        self._given_dims: dict[str, int] = dict(options["memory_limit.dims"])
        self._store = store
        # what the store says was prepared for builds before this one: the rest is this session's
        self._prepared_before = _prepared_bytes(store)
        self.weights = 0  # counted by check(), when there is a limit
        self.build_plan: MemoryPlan | None = None
        # by executed plan (a switched-in device plan, a rebuilt copy): (dims, bound) -> memory plan
        self._plans: weakref.WeakKeyDictionary[Plan, dict[tuple, MemoryPlan]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def plan(self, session: PlannedSession, dims: Mapping[str, int], bound: Collection[str] = ()) -> MemoryPlan:
        """The memory plan of the session's executed plan with symbolic dimensions ``dims``,
        the outputs named in ``bound`` written into buffers the caller binds."""
        executed = session._plan
        key = (tuple(sorted(dims.items())), tuple(sorted(bound)))
        with self._lock:
            plans = self._plans.setdefault(executed, {})
            plan = plans.get(key)
        if plan is None:
            outputs = frozenset(v for v in executed.outputs if v.name in bound)
            plan = plan_memory(executed.steps, executed.inputs, executed.outputs, dims, bound=outputs)
            with self._lock:
                if len(plans) >= _PLANS_KEPT:
                    plans.pop(next(iter(plans)))
                plans[key] = plan
        return plan

    def latest(self, session: PlannedSession) -> dict[str, Any]:
        """The plan (as a dict) for the input shapes of the session's latest run, else the
        one checked at build; empty before both and for a model with no intermediates."""
        shapes = session._signature.last_shapes()
        if shapes is not None:
            plan: MemoryPlan | None = self.plan(session, dims_of([info.shape for info in session.inputs], shapes))
        else:
            plan = self.build_plan
        return plan.as_dict() if plan is not None and plan.values else {}

    def dims_at_build(self, session: PlannedSession) -> dict[str, int]:
        """The sizes the build's check plans for: each symbolic input dimension 1 unless
        the ``memory_limit.dims`` option sizes it."""
        dims = {dim: 1 for info in session.inputs for dim in info.shape or () if isinstance(dim, str)}
        dims.update(self._given_dims)
        return dims

    def check(self, session: PlannedSession) -> None:
        """At build: MemoryLimitError when the weights and the activations planned for
        :meth:`dims_at_build` exceed the limit (nothing happens without one)."""
        if self.limit is None:
            return
        prepared = max(0, _prepared_bytes(self._store) - self._prepared_before)
        self.weights = initializer_bytes(session._model) + prepared
        self.build_plan = self.plan(session, self.dims_at_build(session))
        self.refuse_over_limit(session, self.build_plan)

    def refuse_over_limit(self, session: PlannedSession, activations: MemoryPlan, state: int = 0) -> None:
        """MemoryLimitError when the weights, ``activations``' peak and ``state`` bytes (a
        KV cache) exceed the limit."""
        if self.limit is None:
            return
        breakdown = {"weights": self.weights, "activations": activations.peak_bytes, "state": state}
        needed = sum(breakdown.values())
        if needed > self.limit:
            raise MemoryLimitError(needed, self.limit, breakdown, unsized=activations.unsized, source=session.model_path)


def initializer_bytes(model: ir.Model) -> int:
    """The bytes of ``model``'s initializers, subgraphs' and external data included."""
    graphs = [model.graph]
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        graphs.extend(subgraphs(node))
    return sum(
        value.const_value.nbytes for graph in graphs for value in graph.initializers.values() if value.const_value is not None
    )


def _prepared_bytes(store: "WeightStore | None") -> int:
    """The bytes of the forms providers prepared from weights (a transposed Gemm weight, a
    repacked 4-bit one) that builds with ``store`` made or took; 0 without a store."""
    if store is None:
        return 0
    stats = store.stats()
    return stats.transform_bytes + stats.transform_bytes_reused
