"""Placement estimates: what a node costs on a provider, a partition's fixed cost, a transfer's.

Seconds throughout. The core's *nominal* estimate of a node is a roofline of a nominal
host (``NOMINAL_FLOPS``, ``NOMINAL_BYTES``, ``NODE_OVERHEAD``): not tuned to this machine,
and the same on every machine, so a decision between two providers that state their costs
relative to it (``relative_costs``) never depends on where it is made. What a provider
states (``CostCapability`` in :mod:`plugrt.provider`) comes first; a provider that states
nothing costs what the session's fallback (the CPU provider) costs, so it wins a node only
by an estimate it states. Transfers are measured once per memory space and process.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ._nominal import NODE_OVERHEAD, NOMINAL_BYTES, NOMINAL_FLOPS, node_bytes, node_flops, nominal_cost, value_bytes
from .provider import HOST_MEMORY, CostCapability, CostContext, ExecutionProvider, memory_of

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = [
    "NOMINAL_FLOPS",
    "NOMINAL_BYTES",
    "NODE_OVERHEAD",
    "DEFAULT_PARTITION_OVERHEAD",
    "CostModel",
    "value_bytes",
    "node_flops",
    "node_bytes",
    "nominal_cost",
    "transfer_rate",
]

#: Seconds a partition costs on a provider that states no ``partition_overhead``: entering
#: and leaving it (a launch, a synchronisation), and the fusions its boundary prevents.
DEFAULT_PARTITION_OVERHEAD = 20e-6

# -- transfers -------------------------------------------------------------------------------

#: (provider name, memory) -> (seconds per transfer, seconds per byte), each half of a
#: round trip host -> device -> host; measured once per process.
_RATES: dict[tuple[str, str], tuple[float, float]] = {}
#: When a provider's copies cannot be timed (they raise): what is assumed instead.
_ASSUMED_RATE = (20e-6, 1 / 10e9)


def _time(fn: Callable[[], Any], repeats: int = 5) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def transfer_rate(provider: Any) -> tuple[float, float]:
    """(seconds per transfer, seconds per byte) of copies between host memory and
    ``provider``'s memory: timed once per process with a one-element and a 1 MiB array."""
    import numpy as np

    memory = memory_of(provider)
    if memory is None:
        return (0.0, 0.0)
    key = (str(getattr(provider, "name", "")), memory.memory)
    rate = _RATES.get(key)
    if rate is not None:
        return rate
    try:
        device = memory.default_device
        small, large = np.zeros(1, np.float32), np.zeros(1 << 18, np.float32)

        def round_trip(array: Any) -> Callable[[], Any]:
            return lambda: memory.to_host(memory.to_device(array, device))

        round_trip(small)()  # the first copy may set up the device
        overhead = _time(round_trip(small)) / 2
        per_byte = max(_time(round_trip(large)) / 2 - overhead, 0.0) / large.nbytes
        rate = (overhead, per_byte)
    except Exception:
        rate = _ASSUMED_RATE
    _RATES[key] = rate
    return rate


class CostModel:
    """The estimates placement weighs for one session's providers (priority order, the
    fallback last): per node and provider, per partition, per transfer."""

    def __init__(self, providers: Sequence[ExecutionProvider], ctx: CostContext):
        self.providers = list(providers)
        self.ctx = ctx
        self.reference = self.providers[-1] if self.providers else None
        self._memories = {p.name: memory_of(p) for p in self.providers}
        self._nominal: dict[int, float] = {}
        self._stated: dict[tuple[str, int], float | None] = {}

    def memory(self, provider: str) -> str:
        found = self._memories.get(provider)
        return found.memory if found is not None else HOST_MEMORY

    def nominal(self, node: "ir.Node") -> float:
        key = id(node)
        cost = self._nominal.get(key)
        if cost is None:
            cost = self._nominal[key] = nominal_cost(node)
        return cost

    def _statement(self, provider: ExecutionProvider, node: "ir.Node") -> float | None:
        """What ``provider`` states ``node`` costs; None when it states nothing."""
        key = (provider.name, id(node))
        if key in self._stated:
            return self._stated[key]
        cost: float | None = None
        if isinstance(provider, CostCapability):
            try:
                stated = provider.estimate_cost(node, self.ctx)
            except Exception:  # an estimate is advice: a broken one is no statement
                stated = None
            if isinstance(stated, (int, float)) and not isinstance(stated, bool) and stated >= 0:
                cost = float(stated)
        if cost is None:
            factors = getattr(provider, "relative_costs", None)
            if isinstance(factors, dict):
                factor = factors.get(node.op_type, factors.get("*"))
                if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor >= 0:
                    cost = float(factor) * self.nominal(node)
        self._stated[key] = cost
        return cost

    def node_cost(self, provider: ExecutionProvider, node: "ir.Node") -> float:
        """Seconds ``node`` takes on ``provider``: its statement, else the fallback's
        estimate (its statement, else the nominal one)."""
        cost = self._statement(provider, node)
        if cost is None and self.reference is not None and provider is not self.reference:
            cost = self._statement(self.reference, node)
        return self.nominal(node) if cost is None else cost

    def fused_cost(self, provider: ExecutionProvider, node: "ir.Node", producer: "ir.Node") -> float | None:
        """Seconds ``node`` costs on ``provider`` right after ``producer`` there (a fusion's
        epilogue), as the provider states; None when it states nothing."""
        fused = getattr(provider, "fused_cost", None)
        if not callable(fused):
            return None
        try:
            stated = fused(node, producer, self.ctx)
        except Exception:  # advice, as estimate_cost
            return None
        if isinstance(stated, (int, float)) and not isinstance(stated, bool) and stated >= 0:
            return float(stated)
        return None

    def partition_cost(self, provider: ExecutionProvider, nodes: Sequence["ir.Node"]) -> float:
        """Seconds a partition of ``nodes`` costs on ``provider``: its nodes (a fused
        epilogue at its ``fused_cost`` where its producer is in the partition too) and its
        overhead."""
        members = set(map(id, nodes))
        total = self.partition_overhead(provider)
        for node in nodes:
            source = node.inputs[0] if node.inputs else None
            producer = source.producer() if source is not None else None
            fused = None
            if (
                source is not None
                and producer is not None
                and id(producer) in members
                and not source.is_graph_output()
                and len(list(source.uses())) == 1
            ):
                fused = self.fused_cost(provider, node, producer)
            total += self.node_cost(provider, node) if fused is None else fused
        return total

    def partition_overhead(self, provider: ExecutionProvider) -> float:
        stated = getattr(provider, "partition_overhead", None)
        if isinstance(stated, (int, float)) and not isinstance(stated, bool) and stated >= 0:
            return float(stated)
        return DEFAULT_PARTITION_OVERHEAD

    def transfer_cost(self, source: str, target: str, nbytes: int) -> float:
        """Seconds to move ``nbytes`` from memory space ``source`` to ``target`` (names of
        memory spaces); between two device memories, through the host."""
        if source == target:
            return 0.0
        cost = 0.0
        for space in (source, target):
            if space == HOST_MEMORY:
                continue
            owner = next((m for m in self._memories.values() if m is not None and m.memory == space), None)
            overhead, per_byte = transfer_rate(owner) if owner is not None else _ASSUMED_RATE
            cost += overhead + per_byte * nbytes
        return cost
