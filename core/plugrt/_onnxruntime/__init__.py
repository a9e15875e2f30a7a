"""The ``onnxruntime`` module as plugrt serves it when standing in (plugrt.ort_shim).

Only names: every object is plugrt's own (plugrt.ort, plugrt._ort_values,
plugrt._ort_env); nothing here is onnxruntime's code.
"""

from __future__ import annotations

from .._ort_env import (
    OrtAllocatorType,
    OrtArenaCfg,
    OrtDevice,
    OrtDeviceMemoryType,
    OrtDeviceVendorId,
    OrtMemoryInfo,
    OrtMemoryInfoDeviceType,
    OrtMemType,
    create_and_register_allocator,
    create_and_register_allocator_v2,
    disable_telemetry_events,
    enable_telemetry_events,
    get_build_info,
    get_version_string,
    preload_dlls,
    set_default_logger_callback,
    set_default_logger_severity,
    set_default_logger_verbosity,
    set_seed,
)
from ..ort import (
    ExecutionMode,
    ExecutionOrder,
    GraphOptimizationLevel,
    InferenceSession,
    IOBinding,
    ModelMetadata,
    NodeArg,
    OrtValue,
    RunOptions,
    SessionOptions,
    get_all_providers,
    get_available_providers,
    get_device,
)
from .._ort_sparse import OrtSparseFormat, SparseTensor
from ..ort_shim import ORT_API_VERSION as __version__
from . import capi

__all__ = [
    "__version__",
    "capi",
    "InferenceSession", "SessionOptions", "RunOptions", "OrtValue", "IOBinding", "NodeArg", "ModelMetadata",
    "GraphOptimizationLevel", "ExecutionMode", "ExecutionOrder",
    "get_available_providers", "get_all_providers", "get_device", "get_version_string", "get_build_info",
    "set_default_logger_severity", "set_default_logger_verbosity", "set_default_logger_callback",
    "disable_telemetry_events", "enable_telemetry_events", "preload_dlls", "set_seed",
    "OrtDevice", "OrtDeviceVendorId", "OrtMemoryInfo", "OrtMemoryInfoDeviceType", "OrtDeviceMemoryType",
    "OrtAllocatorType", "OrtMemType", "OrtArenaCfg", "SparseTensor", "OrtSparseFormat", "create_and_register_allocator", "create_and_register_allocator_v2",
]
