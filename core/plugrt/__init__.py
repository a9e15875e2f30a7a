"""plugrt: an ONNX inference runtime in which every execution provider is a plugin."""

from __future__ import annotations

from .errors import (
    EpContextError,
    InputDtypeError,
    InputRankError,
    InputShapeError,
    InvalidInputError,
    InvalidOptionValueError,
    KernelError,
    MissingInputError,
    ModelLimitError,
    ModelLoadError,
    OptionError,
    PlacementError,
    PlugrtError,
    ProviderUnavailableError,
    SymbolConflictError,
    UnknownInputError,
    UnknownOptionError,
    UnsafeExternalDataError,
    UnsupportedOpError,
)
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
)
from .provider import (
    CompiledPartition,
    Device,
    DeviceKind,
    ExecutionProvider,
    Partition,
    Step,
    Support,
    SupportContext,
)
from .registry import ProviderRegistry, default_registry
from .builder import SessionBuilder
from .session import ModelMetadata, Session, TensorInfo, load

__version__ = "0.1.0"

__all__ = [
    # sessions
    "load",
    "Session",
    "SessionBuilder",
    "TensorInfo",
    "ModelMetadata",
    "InferenceSession",
    "SessionOptions",
    "get_available_providers",
    "get_all_providers",
    "get_device",
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
    "ProviderRegistry",
    "default_registry",
    # errors
    "PlugrtError",
    "ModelLoadError",
    "UnsafeExternalDataError",
    "ModelLimitError",
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
    "EpContextError",
]
