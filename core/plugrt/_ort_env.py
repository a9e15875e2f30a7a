"""onnxruntime's process-wide calls (version, logging, telemetry) and its device and memory descriptors."""

from __future__ import annotations

import enum
import logging
from typing import Any, Callable, Mapping

from .errors import InvalidInputError, OptionError

__all__ = [
    "ORT_API_VERSION",
    "get_version_string",
    "get_build_info",
    "set_default_logger_severity",
    "set_default_logger_verbosity",
    "set_default_logger_callback",
    "disable_telemetry_events",
    "enable_telemetry_events",
    "preload_dlls",
    "set_seed",
    "OrtDevice",
    "OrtDeviceVendorId",
    "OrtMemoryInfo",
    "OrtAllocatorType",
    "OrtMemType",
    "OrtDeviceMemoryType",
    "OrtMemoryInfoDeviceType",
    "OrtArenaCfg",
    "create_and_register_allocator",
    "create_and_register_allocator_v2",
]

_LEVELS = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.CRITICAL}
_SEVERITY_OF = {logging.DEBUG: 0, logging.INFO: 1, logging.WARNING: 2, logging.ERROR: 3, logging.CRITICAL: 4}


#: The onnxruntime release whose Python API plugrt answers for (``onnxruntime.__version__``
#: and ``importlib.metadata.version("onnxruntime")`` when plugrt stands in).
ORT_API_VERSION = "1.22.0"


def get_version_string() -> str:
    """The onnxruntime version the API answers for (``onnxruntime.__version__``)."""
    return ORT_API_VERSION


def get_build_info() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        plugrt_version = version("plugrt")
    except PackageNotFoundError:
        plugrt_version = "unknown"
    return f"Build Info: plugrt {plugrt_version}, onnxruntime API {get_version_string()}, pure Python with plugin providers"


def _severity(severity: Any) -> int:
    if isinstance(severity, bool) or not isinstance(severity, int) or not 0 <= severity <= 4:
        raise _LoggerError(f"severity must be an int from 0 (verbose) to 4 (fatal), got {severity!r}", key="severity")
    return severity


class _LoggerError(OptionError, RuntimeError):
    """A logging setting onnxruntime refuses with RuntimeError."""


def set_default_logger_severity(severity: int) -> None:
    """The level of the ``plugrt`` logger: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal."""
    logging.getLogger("plugrt").setLevel(_LEVELS[_severity(severity)])


def set_default_logger_verbosity(verbosity: int) -> None:
    """Accepted; plugrt's logging has levels, not verbosity."""


class _CallbackHandler(logging.Handler):
    """Sends ``plugrt`` log records to an onnxruntime-style callback
    ``(severity, category, logid, code_location, message)``."""

    def __init__(self, callback: Callable[[int, str, str, str, str], Any]) -> None:
        super().__init__()
        self.callback = callback

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.callback(_SEVERITY_OF.get(record.levelno, 2), record.name, "", f"{record.pathname}:{record.lineno}", record.getMessage())
        except Exception:  # a callback that raises must not break the run that logged
            self.handleError(record)


_callback_handler: _CallbackHandler | None = None


def set_default_logger_callback(callback: Callable[[int, str, str, str, str], Any] | None, severity: int = 2) -> None:
    """Route plugrt's log records at ``severity`` and above to ``callback``; None restores
    the default handling."""
    global _callback_handler
    logger = logging.getLogger("plugrt")
    if callback is not None and not callable(callback):
        raise _LoggerError(f"the logger callback must be callable or None, got {type(callback).__name__}", key="callback")
    level = _LEVELS[_severity(severity)]
    if _callback_handler is not None:
        logger.removeHandler(_callback_handler)
        _callback_handler = None
    if callback is None:
        return
    _callback_handler = _CallbackHandler(callback)
    logger.addHandler(_callback_handler)
    logger.setLevel(level)


def disable_telemetry_events() -> None:
    """Accepted: plugrt sends no telemetry."""


def enable_telemetry_events() -> None:
    """Accepted: plugrt sends no telemetry."""


def preload_dlls(cuda: bool = True, cudnn: bool = True, msvc: bool = True, directory: str | None = None) -> None:
    """Accepted: plugrt's providers load their libraries when a session needs them."""


def set_seed(seed: int) -> None:
    """Seed the random-number ops (numpy's global generator, which the CPU kernels use)."""
    import numpy as np

    np.random.seed(int(seed))


class OrtDeviceVendorId(enum.IntEnum):
    NONE = 0
    AMD = 0x1002
    NVIDIA = 0x10DE
    ARM = 0x13B5
    MICROSOFT = 0x1414
    HUAWEI = 0x19E5
    QUALCOMM = 0x5143
    INTEL = 0x8086


class OrtMemoryInfoDeviceType(enum.IntEnum):
    CPU = 0
    GPU = 1
    FPGA = 2
    NPU = 3


class OrtDeviceMemoryType(enum.IntEnum):
    DEFAULT = 0
    HOST_ACCESSIBLE = 5


class OrtAllocatorType(enum.IntEnum):
    INVALID = -1
    ORT_DEVICE_ALLOCATOR = 0
    ORT_ARENA_ALLOCATOR = 1


class OrtMemType(enum.IntEnum):
    CPU_INPUT = -2
    CPU_OUTPUT = -1
    CPU = -1
    DEFAULT = 0


_DEVICE_TYPES = {"cpu": (OrtMemoryInfoDeviceType.CPU, OrtDeviceVendorId.NONE), "cuda": (OrtMemoryInfoDeviceType.GPU, OrtDeviceVendorId.NVIDIA),
                 "gpu": (OrtMemoryInfoDeviceType.GPU, OrtDeviceVendorId.NVIDIA)}


class OrtDevice:
    """A device: its type (0 CPU, 1 GPU, ...), vendor, id and memory type."""

    def __init__(self, device_type: int, mem_type: int, vendor_id: int, device_id: int) -> None:
        self._type, self._mem, self._vendor, self._id = int(device_type), int(mem_type), int(vendor_id), int(device_id)

    @classmethod
    def make(cls, name: str, device_id: int) -> "OrtDevice":
        try:
            kind, vendor = _DEVICE_TYPES[name.lower()]
        except KeyError:
            raise InvalidInputError(f"unknown device {name!r}; plugrt knows {', '.join(_DEVICE_TYPES)}") from None
        return cls(kind, OrtDeviceMemoryType.DEFAULT, vendor, device_id)

    @staticmethod
    def cpu() -> int:
        return int(OrtMemoryInfoDeviceType.CPU)

    @staticmethod
    def cuda() -> int:
        return int(OrtMemoryInfoDeviceType.GPU)

    @staticmethod
    def default_memory() -> int:
        return int(OrtDeviceMemoryType.DEFAULT)

    def device_id(self) -> int:
        return self._id

    def device_type(self) -> int:
        return self._type

    def device_vendor_id(self) -> int:
        return self._vendor

    def device_mem_type(self) -> int:
        return self._mem

    def __repr__(self) -> str:
        return f"OrtDevice(type={self._type}, mem={self._mem}, vendor={self._vendor:#x}, id={self._id})"


class OrtMemoryInfo:
    """Where a value lives: allocator name, device id, memory type (descriptive in plugrt:
    its providers allocate)."""

    def __init__(self, name: str, allocator_type: int, device_id: int, mem_type: int) -> None:
        self.name = name
        self.allocator_type = OrtAllocatorType(int(allocator_type))
        self.device_id = int(device_id)
        self.mem_type = OrtMemType(int(mem_type))
        gpu = name.lower().startswith(("cuda", "gpu"))
        self.device_type = OrtMemoryInfoDeviceType.GPU if gpu else OrtMemoryInfoDeviceType.CPU
        self.device_mem_type = OrtDeviceMemoryType.DEFAULT
        self.device_vendor_id = int(OrtDeviceVendorId.NVIDIA if gpu else OrtDeviceVendorId.NONE)
        self.alignment = 0

    @classmethod
    def create_v2(
        cls, name: str, device_type: int, vendor_id: int, device_id: int, device_mem_type: int, alignment: int, allocator_type: int
    ) -> "OrtMemoryInfo":
        info = cls(name, allocator_type, device_id, OrtMemType.DEFAULT)
        info.device_type = OrtMemoryInfoDeviceType(int(device_type))
        info.device_vendor_id = int(vendor_id)
        info.device_mem_type = OrtDeviceMemoryType(int(device_mem_type))
        info.alignment = int(alignment)
        return info

    def __repr__(self) -> str:
        return f"OrtMemoryInfo(name={self.name!r}, device_id={self.device_id}, mem_type={self.mem_type.name})"


_ARENA_KEYS = (
    "max_mem", "arena_extend_strategy", "initial_chunk_size_bytes", "max_dead_bytes_per_chunk",
    "initial_growth_chunk_size_bytes", "max_power_of_two_extend_bytes",
)


class OrtArenaCfg:
    """An arena configuration: ``OrtArenaCfg(max_mem, arena_extend_strategy,
    initial_chunk_size_bytes, max_dead_bytes_per_chunk)`` or ``OrtArenaCfg({key: value})``.
    Accepted and kept; plugrt's providers manage their own memory."""

    def __init__(self, *args: Any) -> None:
        values: dict[str, int] = {key: -1 for key in _ARENA_KEYS}
        if len(args) == 1 and isinstance(args[0], Mapping):
            for key, value in args[0].items():
                if key not in values:
                    raise InvalidInputError(f"unknown OrtArenaCfg key {key!r}; valid: {', '.join(_ARENA_KEYS)}")
                values[key] = int(value)
        elif len(args) == 4:
            values.update(zip(_ARENA_KEYS, (int(a) for a in args)))
        elif args:
            raise InvalidInputError("OrtArenaCfg takes four ints or one dict")
        for key, value in values.items():
            setattr(self, key, value)


_registered_allocators: list[tuple[str, OrtMemoryInfo, Any]] = []


def create_and_register_allocator(mem_info: OrtMemoryInfo, arena_cfg: OrtArenaCfg | None) -> None:
    """Accepted and recorded; sessions with ``session.use_env_allocators`` run as others
    (plugrt's providers own their allocators)."""
    _registered_allocators.append(("CPUExecutionProvider", mem_info, arena_cfg))


def create_and_register_allocator_v2(provider_type: str, mem_info: OrtMemoryInfo, provider_options: Mapping[str, Any], arena_cfg: OrtArenaCfg | None) -> None:
    """:func:`create_and_register_allocator` for ``provider_type``."""
    _registered_allocators.append((provider_type, mem_info, arena_cfg))
