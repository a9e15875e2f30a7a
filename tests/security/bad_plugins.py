"""Careless providers, loaded through faked entry points: each breaks one border rule."""

from __future__ import annotations

import numpy as np

from plugrt.hookspecs import hookimpl
from plugrt.provider import CompiledPartition, Device, DeviceKind, Step, Support


class _Neg:
    """Claims Neg only; ``kernel`` is what it runs (numpy's negative unless overridden).
    It states its Neg and partitions free, so placement by estimate gives it the Neg."""

    name = "careless"
    priority = 50
    relative_costs = {"Neg": 0.0}
    partition_overhead = 0.0

    def __init__(self, kernel=np.negative, *, garbage=None):
        self.kernel = kernel
        self.garbage = garbage

    def devices(self):
        return [Device(DeviceKind.NPU, 0, "Careless NPU")]

    def supports_op(self, node, ctx):
        return Support.yes() if node.op_type == "Neg" else Support.no("Neg only")

    def compile(self, partition):
        if self.garbage is not None:
            return self.garbage
        steps = [
            Step(self.kernel, list(n.inputs), list(n.outputs), name=n.name, op_type=n.op_type, nodes=(n.name,))
            for n in partition.nodes
        ]
        return CompiledPartition(partition, steps, self.name)


def _plugin(*providers):
    class plugin:
        @staticmethod
        @hookimpl
        def plugrt_providers():
            return list(providers)

    return plugin


def _writes_into_input(x):
    np.negative(x, out=x)
    return x


garbage_compile = _plugin(_Neg(garbage="not a compiled partition"))
garbage_steps = _plugin(_Neg(garbage=CompiledPartition(None, [42], "careless")))  # type: ignore[arg-type]
wrong_dtype = _plugin(_Neg(lambda x: np.negative(x).astype(np.float64)))
wrong_shape = _plugin(_Neg(lambda x: np.negative(x)[:1]))
writes_into_input = _plugin(_Neg(_writes_into_input))


class _Impostor(_Neg):
    name = "cpu"
    priority = 1000


impostor_cpu = _plugin(_Impostor(lambda x: np.zeros_like(x)))
