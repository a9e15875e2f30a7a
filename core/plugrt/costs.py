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

#: Floating-point operations per second of the nominal host.
NOMINAL_FLOPS = 20e9
#: Bytes per second the nominal host reads and writes.
NOMINAL_BYTES = 10e9
#: Seconds to call one kernel on the nominal host.
NODE_OVERHEAD = 2e-6
#: Seconds a partition costs on a provider that states no ``partition_overhead``: entering
#: and leaving it (a launch, a synchronisation), and the fusions its boundary prevents.
DEFAULT_PARTITION_OVERHEAD = 20e-6
#: An unknown element type is taken as four bytes.
_UNKNOWN_ITEMSIZE = 4


def value_bytes(value: "ir.Value | None") -> int:
    """Bytes of ``value`` as its inferred type and shape say; an unknown or symbolic
    dimension counts as 1, an unknown element type as 4 bytes, an unknown shape as 0."""
    if value is None or value.shape is None:
        return 0
    count = 1
    for dim in value.shape:
        count *= dim if isinstance(dim, int) and dim > 0 else 1
    itemsize = _UNKNOWN_ITEMSIZE
    if value.dtype is not None:
        try:
            itemsize = max(int(value.dtype.itemsize), 1)
        except (AttributeError, TypeError, ValueError):
            pass
    return count * itemsize


def _elements(value: "ir.Value | None") -> int:
    if value is None or value.shape is None:
        return 1
    return math.prod(d if isinstance(d, int) and d > 0 else 1 for d in value.shape)


def _dims(value: "ir.Value | None") -> list[int] | None:
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) and d > 0 else 1 for d in value.shape]


def node_flops(node: "ir.Node") -> float:
    """Arithmetic of ``node``: multiply-adds (twice) of Conv, ConvTranspose, MatMul and
    Gemm; one operation per output element for everything else."""
    out = node.outputs[0] if node.outputs else None
    if node.domain in ("", "ai.onnx") and len(node.inputs) >= 2:
        weight = _dims(node.inputs[1])
        if node.op_type == "Conv" and weight and len(weight) >= 2:
            return 2.0 * _elements(out) * math.prod(weight[1:])
        if node.op_type == "ConvTranspose" and weight and len(weight) >= 2:
            return 2.0 * _elements(node.inputs[0]) * math.prod(weight[1:])
        if node.op_type in ("MatMul", "Gemm"):
            a = _dims(node.inputs[0])
            if a:
                transposed = node.op_type == "Gemm" and "transA" in node.attributes and node.attributes["transA"].value
                inner = a[0] if transposed and len(a) == 2 else a[-1]
                return 2.0 * _elements(out) * inner
    return float(sum(_elements(v) for v in node.outputs if v is not None))


def node_bytes(node: "ir.Node") -> float:
    """Bytes ``node`` reads and writes (its inputs and outputs, weights included)."""
    return float(sum(value_bytes(v) for v in [*node.inputs, *node.outputs]))


def nominal_cost(node: "ir.Node") -> float:
    """The nominal host's seconds for ``node``: a kernel call plus the larger of its
    arithmetic and its memory traffic."""
    return NODE_OVERHEAD + max(node_flops(node) / NOMINAL_FLOPS, node_bytes(node) / NOMINAL_BYTES)


# -- transfers -------------------------------------------------------------------------------

#: (provider name, memory) -> (seconds per transfer, seconds per byte), each the larger of
#: the two directions; measured once per process.
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
