"""plugrt: an ONNX inference runtime in which every execution provider is a plugin.

``import plugrt`` loads only the error classes: every other public name is imported on
first use (PEP 562), so that onnx, onnx_ir and the providers cost nothing until a model
is loaded or an API that needs them is called.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _deferred_sympy
from .errors import (
    BatchColumnError,
    BatchRowError,
    BindingShapeError,
    CaptureError,
    CaptureThreadError,
    CommandLineError,
    ConfigEntryMissingError,
    ConfigEntryRequiredError,
    ConformanceInputError,
    EpContextAmbiguousError,
    EpContextAttributeError,
    EpContextError,
    EpContextMissingPrimaryError,
    EpContextOverwriteError,
    EpContextPathError,
    EpContextSourceError,
    InputDtypeError,
    InputRankError,
    InputShapeError,
    InvalidInputError,
    InvalidOptionValueError,
    KernelError,
    MemoryLimitError,
    MissingInputError,
    ModelBuildError,
    ModelLimitError,
    MissingDependencyError,
    ModelLoadError,
    NoCaptureError,
    NotSupportedError,
    OptionError,
    PlacementError,
    PlugrtError,
    ProviderNameMismatchError,
    ProviderUnavailableError,
    RunError,
    ReplayStreamError,
    RunTerminatedError,
    StaleCaptureError,
    StandInError,
    SymbolConflictError,
    UnknownInputError,
    UnknownOptionError,
    UnsafeExternalDataError,
    UnsupportedOpError,
    WarmupShapeError,
    WeightStoreError,
)

# Before anything imports onnx_ir: its module-level sympy import is left until sympy is
# used (plugrt never does), 0.25-0.3 s and ~33 MiB a process (see _deferred_sympy).
_deferred_sympy.install()

if TYPE_CHECKING:
    from .ort import (
        ExecutionMode,
        GraphOptimizationLevel,
        InferenceSession,
        IOBinding,
        OrtValue,
        RunOptions,
        SessionOptions,
        get_all_providers,
        get_available_providers,
        get_device,
        ExecutionOrder,
    )
    from .ort_shim import install_as_onnxruntime
    from .bindings import DeviceBinding
    from .builder import SessionBuilder
    from .capture import Captured, CaptureReport, CaptureStats, ReplayResult
    from .provider import (
        AvailabilityCapability,
        CacheReport,
        CaptureCapability,
        CaptureContext,
        CaptureMiss,
        CapturedPartition,
        CompiledCacheCapability,
        CompiledPartition,
        ContextCapability,
        ContextCompatibilityCapability,
        CostCapability,
        CostContext,
        CountersCapability,
        Device,
        DeviceKind,
        ExecutionProvider,
        FunctionCapability,
        MemoryCapability,
        NotCapturable,
        PROTOCOL_VERSION,
        Partition,
        PassesCapability,
        SUPPORTED_PROTOCOL_VERSIONS,
        Step,
        SubgraphPlan,
        Support,
        SupportContext,
    )
    from .registry import ProviderRegistry, default_registry
    from .session import ModelMetadata, Session, TensorInfo, load
    from .stats import SessionStats
    from .transfers import TransferCounter
    from .weights import WeightStats, WeightStore

#: The module each public name other than the errors lives in, imported on first use.
_LAZY_EXPORTS: dict[str, tuple[str, ...]] = {
    ".ort": (
        "ExecutionMode", "GraphOptimizationLevel", "InferenceSession", "IOBinding", "OrtValue", "RunOptions",
        "SessionOptions", "get_all_providers", "get_available_providers", "get_device", "ExecutionOrder",
    ),
    ".ort_shim": ("install_as_onnxruntime",),
    ".bindings": ("DeviceBinding",),
    ".builder": ("SessionBuilder",),
    ".capture": ("Captured", "CaptureReport", "CaptureStats", "ReplayResult"),
    ".provider": (
        "AvailabilityCapability", "CacheReport", "CaptureCapability", "CaptureContext", "CaptureMiss", "CapturedPartition",
        "CompiledCacheCapability", "CompiledPartition", "ContextCapability", "ContextCompatibilityCapability", "CostCapability", "CostContext",
        "CountersCapability", "Device",
        "DeviceKind", "ExecutionProvider", "FunctionCapability", "MemoryCapability", "NotCapturable",
        "PROTOCOL_VERSION", "Partition", "PassesCapability", "SUPPORTED_PROTOCOL_VERSIONS", "Step", "SubgraphPlan",
        "Support", "SupportContext",
    ),
    ".registry": ("ProviderRegistry", "default_registry"),
    ".session": ("ModelMetadata", "Session", "TensorInfo", "load"),
    ".stats": ("SessionStats",),
    ".transfers": ("TransferCounter",),
    ".weights": ("WeightStats", "WeightStore"),
}
_MODULE_OF = {name: module for module, names in _LAZY_EXPORTS.items() for name in names}

__version__ = "0.1.0"

__all__ = [
    # sessions
    "load",
    "Session",
    "SessionBuilder",
    "TensorInfo",
    "ModelMetadata",
    "DeviceBinding",
    "TransferCounter",
    "Captured",
    "NotCapturable",
    "CaptureReport",
    "CaptureStats",
    "ReplayResult",
    "SessionStats",
    "WeightStore",
    "WeightStats",
    "InferenceSession",
    "SessionOptions",
    "get_available_providers",
    "get_all_providers",
    "get_device",
    "ExecutionOrder",
    "RunOptions",
    "OrtValue",
    "IOBinding",
    "GraphOptimizationLevel",
    "ExecutionMode",
    # providers
    "ExecutionProvider",
    "Device",
    "DeviceKind",
    "Support",
    "SupportContext",
    "Partition",
    "Step",
    "CompiledPartition",
    "MemoryCapability",
    "CaptureCapability",
    "ContextCapability",
    "ContextCompatibilityCapability",
    "PassesCapability",
    "FunctionCapability",
    "AvailabilityCapability",
    "CountersCapability",
    "CostCapability",
    "CostContext",
    "CompiledCacheCapability",
    "CacheReport",
    "CaptureContext",
    "CaptureMiss",
    "CapturedPartition",
    "SubgraphPlan",
    "PROTOCOL_VERSION",
    "SUPPORTED_PROTOCOL_VERSIONS",
    "ProviderRegistry",
    "default_registry",
    # errors
    "PlugrtError",
    "ModelLoadError",
    "UnsafeExternalDataError",
    "ModelLimitError",
    "MemoryLimitError",
    "UnsupportedOpError",
    "InvalidInputError",
    "UnknownInputError",
    "MissingInputError",
    "InputDtypeError",
    "InputRankError",
    "InputShapeError",
    "SymbolConflictError",
    "OptionError",
    "UnknownOptionError",
    "InvalidOptionValueError",
    "ProviderUnavailableError",
    "PlacementError",
    "KernelError",
    "CaptureError",
    "NoCaptureError",
    "StaleCaptureError",
    "ReplayStreamError",
    "CaptureThreadError",
    "EpContextError",
    "BatchColumnError",
    "BatchRowError",
    "ConformanceInputError",
    "EpContextAmbiguousError",
    "EpContextMissingPrimaryError",
    "EpContextOverwriteError",
    "EpContextPathError",
    "EpContextAttributeError",
    "EpContextSourceError",
    "ModelBuildError",
    "NotSupportedError",
    "ProviderNameMismatchError",
    "RunError",
    "WarmupShapeError",
    "BindingShapeError",
    "CommandLineError",
    "MissingDependencyError",
    "WeightStoreError",
    "RunTerminatedError",
    "StandInError",
    "ConfigEntryMissingError",
    "ConfigEntryRequiredError",
    # standing in for onnxruntime
    "install_as_onnxruntime",
]


def __getattr__(name: str) -> Any:
    """A public name, or a submodule (``plugrt.loader``), imported on first use."""
    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value  # later lookups find it without coming here
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
