"""onnxruntime's status exception classes, as plugrt's errors also are (``except Fail:``).

onnxruntime raises one class per status code from its native module
(``onnxruntime.capi.onnxruntime_pybind11_state``); each derives from ``Exception`` alone.
plugrt's errors inherit the one that names the same failure (errors.py), so code written
for onnxruntime catches them, and ``plugrt.install_as_onnxruntime()`` serves these very
classes under onnxruntime's module names.
"""

from __future__ import annotations

__all__ = [
    "Fail",
    "InvalidArgument",
    "NoSuchFile",
    "NoModel",
    "EngineError",
    "RuntimeException",
    "InvalidProtobuf",
    "ModelLoaded",
    "NotImplemented",
    "InvalidGraph",
    "EPFail",
    "ModelLoadCanceled",
    "ModelRequiresCompilation",
    "NotFound",
    "DeviceReset",
    "STATUS_CODES",
]


class Fail(Exception):
    """Status FAIL (1): a failure with no more specific code."""


class InvalidArgument(Exception):
    """Status INVALID_ARGUMENT (2): an input or option the call cannot take."""


class NoSuchFile(Exception):
    """Status NO_SUCHFILE (3)."""


class NoModel(Exception):
    """Status NO_MODEL (4)."""


class EngineError(Exception):
    """Status ENGINE_ERROR (5)."""


class RuntimeException(Exception):
    """Status RUNTIME_EXCEPTION (6): a kernel failed while running."""


class InvalidProtobuf(Exception):
    """Status INVALID_PROTOBUF (7): the model could not be parsed."""


class ModelLoaded(Exception):
    """Status MODEL_LOADED (8)."""


class NotImplemented(Exception):  # noqa: A001 - onnxruntime's own name for status 9
    """Status NOT_IMPLEMENTED (9): no kernel or API for what was asked."""


class InvalidGraph(Exception):
    """Status INVALID_GRAPH (10)."""


class EPFail(Exception):
    """Status EP_FAIL (11): an execution provider failed."""


class ModelLoadCanceled(Exception):
    """Status MODEL_LOAD_CANCELED (12)."""


class ModelRequiresCompilation(Exception):
    """Status MODEL_REQUIRES_COMPILATION (13)."""


class NotFound(Exception):
    """Status NOT_FOUND (14)."""


class DeviceReset(Exception):
    """A device was reset (no status code of its own in onnxruntime's Python module)."""


#: Each class's status code, for messages in onnxruntime's "[ONNXRuntimeError] : N : NAME" form.
STATUS_CODES = {
    Fail: (1, "FAIL"), InvalidArgument: (2, "INVALID_ARGUMENT"), NoSuchFile: (3, "NO_SUCHFILE"),
    NoModel: (4, "NO_MODEL"), EngineError: (5, "ENGINE_ERROR"), RuntimeException: (6, "RUNTIME_EXCEPTION"),
    InvalidProtobuf: (7, "INVALID_PROTOBUF"), ModelLoaded: (8, "MODEL_LOADED"), NotImplemented: (9, "NOT_IMPLEMENTED"),
    InvalidGraph: (10, "INVALID_GRAPH"), EPFail: (11, "EP_FAIL"), ModelLoadCanceled: (12, "MODEL_LOAD_CANCELED"),
    ModelRequiresCompilation: (13, "MODEL_REQUIRES_COMPILATION"), NotFound: (14, "NOT_FOUND"),
}
