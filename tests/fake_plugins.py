"""Plugins for discovery tests, loaded through faked entry points (never installed)."""

from __future__ import annotations

import numpy as np

from plugrt.hookspecs import hookimpl
from plugrt.provider import CompiledPartition, Device, DeviceKind, Step, Support


class NegProvider:
    """A tiny accelerator stand-in: claims Neg only, runs it with numpy."""

    name = "fakeaccel"
    priority = 50

    def __init__(self, *, fail_in: str | None = None):
        self.fail_in = fail_in

    def devices(self):
        if self.fail_in == "devices":
            raise RuntimeError("driver exploded")
        return [Device(DeviceKind.NPU, 0, "Fake NPU")]

    def supports_op(self, node, ctx):
        if self.fail_in == "supports_op":
            raise RuntimeError("supports_op exploded")
        if node.op_type == "Neg":
            return Support.yes()
        return Support.no(f"fakeaccel only runs Neg, not {node.op_type}")

    def compile(self, partition):
        if self.fail_in == "compile":
            raise RuntimeError("compiler exploded")
        steps = [
            Step(np.negative, list(n.inputs), list(n.outputs), name=n.name, op_type=n.op_type, nodes=(n.name,))
            for n in partition.nodes
        ]
        return CompiledPartition(partition, steps, self.name)


class good:
    @staticmethod
    @hookimpl
    def plugrt_providers():
        return [NegProvider()]


class failing_init:
    @staticmethod
    @hookimpl
    def plugrt_providers():
        raise RuntimeError("plugin init exploded")


def _failing(stage: str):
    class plugin:
        @staticmethod
        @hookimpl
        def plugrt_providers():
            return [NegProvider(fail_in=stage)]

    return plugin


failing_devices = _failing("devices")
failing_supports_op = _failing("supports_op")
failing_compile = _failing("compile")


class ContextProvider(NegProvider):
    """Neg only, with EPContext export/restore: the blob names the op it runs."""

    name = "ctxaccel"
    context_source_keys = ("ctxaccel",)

    def save_context(self, compiled):
        return b"neg:" + str(len(compiled.steps)).encode()

    def load_context(self, blob, meta):
        assert blob.startswith(b"neg:"), blob
        partition = meta["partition"]
        step = Step(np.negative, list(partition.inputs), list(partition.outputs), name=partition.name, op_type="Neg")
        return CompiledPartition(partition, [step], self.name)


class ContextTwin(ContextProvider):
    name = "ctxtwin"


class with_context:
    @staticmethod
    @hookimpl
    def plugrt_providers():
        return [ContextProvider()]


class with_context_twin:
    @staticmethod
    @hookimpl
    def plugrt_providers():
        return [ContextTwin()]


class FunctionProvider(NegProvider):
    """Claims the model-local function local::Double as one op (runs it as x + x)."""

    name = "funcaccel"

    def supports_function(self, domain, name, ctx):
        return domain == "local" and name == "Double"

    def supports_op(self, node, ctx):
        if (node.domain, node.op_type) == ("local", "Double"):
            return Support.yes()
        return Support.no(f"funcaccel only runs local::Double, not {node.op_type}")

    def compile(self, partition):
        steps = [
            Step(lambda x: x + x, list(n.inputs), list(n.outputs), name=n.name, op_type=n.op_type)
            for n in partition.nodes
        ]
        return CompiledPartition(partition, steps, self.name)


class with_function:
    @staticmethod
    @hookimpl
    def plugrt_providers():
        return [FunctionProvider()]


class VersionedContextProvider(ContextProvider):
    """Neg with EPContext export/restore that restores only contexts of its own SDK version."""

    name = "ctxversioned"
    context_source_keys = ("ctxversioned",)
    sdk_version = "2.0"

    def check_context(self, meta):
        if meta["ep_sdk_version"] != self.sdk_version:
            return Support.no(
                f"saved by SDK {meta['ep_sdk_version'] or '?'}, this is {self.sdk_version}: export the model again"
            )
        return Support.yes()


class with_versioned_context:
    @staticmethod
    @hookimpl
    def plugrt_providers():
        return [VersionedContextProvider()]


class ProbedNpuProvider(NegProvider):
    """An NPU provider that declares its device kinds and counts how often it is probed."""

    name = "probednpu"
    device_kinds = (DeviceKind.NPU,)

    def __init__(self):
        super().__init__()
        self.probes = 0

    def devices(self):
        self.probes += 1
        return super().devices()


class probed_npu:
    provider = ProbedNpuProvider()

    @staticmethod
    @hookimpl
    def plugrt_providers():
        return [probed_npu.provider]


class CachingProvider(NegProvider):
    """A provider with compiled code to cache ahead (``prepare_cache``): three units."""

    name = "fakecache"
    prepared: list[str] = []

    def prepare_cache(self, progress):
        from plugrt.provider import CacheReport

        units = ["alpha", "beta", "gamma"]
        for done, unit in enumerate(units):
            progress(done, len(units), unit)
            CachingProvider.prepared.append(unit)
        progress(len(units), len(units), "")
        return CacheReport(len(units), len(units), location="/fake/cache")


class with_cache:
    @staticmethod
    @hookimpl
    def plugrt_providers():
        return [CachingProvider()]
