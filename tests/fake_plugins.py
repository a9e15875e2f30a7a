"""Plugins for discovery tests, loaded through faked entry points (never installed)."""

from __future__ import annotations

import numpy as np

from plugrt.hookspecs import hookimpl
from plugrt.provider import CompiledPartition, Device, DeviceKind, Step, Support


class NegProvider:
    """A tiny accelerator stand-in: claims Neg only, runs it with numpy. It states that its
    Neg and its partitions cost nothing, so placement by estimate (device="auto") gives it
    every Neg."""

    name = "fakeaccel"
    priority = 50
    relative_costs = {"Neg": 0.0}
    partition_overhead = 0.0

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


class HalfMemoryProvider(NegProvider):
    """Declares memory of its own but implements only part of MemoryCapability."""

    name = "halfnpu"
    memory = "npu"

    def allocate(self, shape, dtype, device):
        return np.empty(shape, dtype)

    def owns(self, array):
        return False


class half_memory:
    @staticmethod
    @hookimpl
    def plugrt_providers():
        return [HalfMemoryProvider()]


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


class DriverlessCudaProvider(NegProvider):
    """A provider named cuda that is installed on a machine without a GPU driver."""

    name = "cuda"
    device_kinds = (DeviceKind.GPU,)
    unavailable_reason = "no CUDA driver: the NVIDIA driver (libcuda) cannot be loaded"

    def devices(self):
        return []


class driverless_cuda:
    @staticmethod
    @hookimpl
    def plugrt_providers():
        return [DriverlessCudaProvider()]


class ReluAddProvider:
    """A small vendor provider as the provider guide describes one: Relu and Add on float32
    (numpy on the host), at a positive priority, stating no costs."""

    name = "reluadd"
    priority = 10

    def devices(self):
        return [Device(DeviceKind.NPU, 0, "Relu and Add")]

    def supports_op(self, node, ctx):
        if node.domain in ("", "ai.onnx") and node.op_type in ("Relu", "Add"):
            if all(v is None or v.dtype is None or v.dtype.name == "FLOAT" for v in node.inputs):
                return Support.yes()
            return Support.no("reluadd runs float32 only")
        return Support.no(f"reluadd runs Relu and Add only, not {node.op_type}")

    def compile(self, partition):
        kernels = {"Relu": lambda x: np.maximum(x, np.float32(0)), "Add": np.add}
        steps = [
            Step(kernels[n.op_type], list(n.inputs), list(n.outputs), name=n.name, op_type=n.op_type, nodes=(n.name,))
            for n in partition.nodes
        ]
        return CompiledPartition(partition, steps, self.name)


class with_relu_add:
    @staticmethod
    @hookimpl
    def plugrt_providers():
        return [ReluAddProvider()]


def _template_at_priority_10():
    from plugrt_provider_template import TemplateProvider

    class PositiveTemplate(TemplateProvider):
        """The template provider at the positive priority the guide advises a vendor's."""

        name = "template10"
        priority = 10
        context_source_keys = ("template10",)

    return PositiveTemplate()


class with_template_10:
    @staticmethod
    @hookimpl
    def plugrt_providers():
        return [_template_at_priority_10()]


class SlowCompileProvider(ReluAddProvider):
    """Relu and Add, stated far faster than the CPU, behind a compiler that takes
    ``compile_seconds`` to start (in its first ``compile``): an accelerator whose first
    run would wait for its compiler."""

    name = "slowaccel"
    priority = 20
    relative_costs = {"*": 0.0}
    partition_overhead = 0.0
    compile_seconds = 5.0
    wrong = False  # True: its Relu is off by one, so the check before the switch fails

    def compile(self, partition):
        import time

        if not getattr(self, "_started", False):
            time.sleep(self.compile_seconds)
            self._started = True
        compiled = super().compile(partition)
        if self.wrong:
            for step in compiled.steps:
                if step.op_type == "Relu":
                    step.fn = lambda x: np.maximum(x, np.float32(0)) + np.float32(1)
        compiled.provider = self.name
        return compiled


class with_slow_compile:
    @staticmethod
    @hookimpl
    def plugrt_providers():
        return [SlowCompileProvider()]


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
