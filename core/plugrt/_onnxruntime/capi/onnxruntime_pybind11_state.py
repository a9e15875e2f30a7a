"""``onnxruntime.capi.onnxruntime_pybind11_state``: onnxruntime's native module, as plugrt
serves it: the status exception classes (plugrt's errors inherit them) and the classes
clients reach through it."""

from __future__ import annotations

from ..._ort_env import (
    OrtAllocatorType,
    OrtArenaCfg,
    OrtDevice,
    OrtMemoryInfo,
    OrtMemType,
    get_build_info,
    get_version_string,
    set_default_logger_severity,
)
from ..._ort_errors import (
    DeviceReset,
    EngineError,
    EPFail,
    Fail,
    InvalidArgument,
    InvalidGraph,
    InvalidProtobuf,
    ModelLoadCanceled,
    ModelLoaded,
    ModelRequiresCompilation,
    NoModel,
    NoSuchFile,
    NotFound,
    NotImplemented,
    RuntimeException,
)
from ..._ort_values import OrtValue, OrtValueVector, RunOptions, is_dlpack_uint8_tensor
from ...ort import (
    ExecutionMode,
    ExecutionOrder,
    GraphOptimizationLevel,
    ModelMetadata,
    NodeArg,
    SessionOptions,
    get_all_providers,
    get_available_providers,
    get_device,
)


def get_default_session_options() -> SessionOptions:
    return SessionOptions()


__all__ = [
    "Fail", "InvalidArgument", "NoSuchFile", "NoModel", "EngineError", "RuntimeException", "InvalidProtobuf",
    "ModelLoaded", "NotImplemented", "InvalidGraph", "EPFail", "ModelLoadCanceled", "ModelRequiresCompilation",
    "NotFound", "DeviceReset",
    "OrtValue", "OrtValueVector", "RunOptions", "SessionOptions", "ModelMetadata", "NodeArg",
    "GraphOptimizationLevel", "ExecutionMode", "ExecutionOrder", "OrtDevice", "OrtMemoryInfo", "OrtAllocatorType",
    "OrtMemType", "OrtArenaCfg", "get_all_providers", "get_available_providers", "get_device",
    "get_default_session_options", "is_dlpack_uint8_tensor", "get_version_string", "get_build_info", "set_default_logger_severity",
]
