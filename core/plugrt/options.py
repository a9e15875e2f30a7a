"""Session options: a strict schema, so a typo is an error at build, never ignored."""

from __future__ import annotations

import dataclasses
import decimal
import re
from typing import Any, Callable, Mapping

from .errors import InvalidOptionValueError, UnknownOptionError
from .loader import LoadLimits
from .weights import WeightStore

_LIMITS = LoadLimits()  # the defaults live in one place

__all__ = ["OPTIONS", "SessionOptions", "parse_options"]


def _choice(*choices: str) -> Callable[[str, Any], Any]:
    def parse(key: str, value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise InvalidOptionValueError(key, value, "one of " + ", ".join(repr(c) for c in choices))
        return value

    return parse


def _boolean(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("0", "1", "true", "false"):
        return value.lower() in ("1", "true")
    raise InvalidOptionValueError(key, value, "a boolean (True/False, 0/1, 'true'/'false')")


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidOptionValueError(key, value, "a positive integer")
    return value


def _non_negative_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidOptionValueError(key, value, "a non-negative integer (0 means the default)")
    return value


def _graphs(key: str, value: Any) -> bool | str:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("on", "off", "true", "false", "1", "0", "auto"):
        lowered = value.lower()
        return "auto" if lowered == "auto" else lowered in ("on", "true", "1")
    raise InvalidOptionValueError(key, value, "True (any provider that can capture), False (never) or 'auto'")


def _name_list(what: str) -> Callable[[str, Any], tuple[str, ...]]:
    """A parser of a list of ``what`` names, or of one comma-separated string of them."""

    def parse(key: str, value: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise InvalidOptionValueError(key, value, f"a list of {what} names or a comma-separated string")
        return tuple(v.strip() for v in value)

    return parse


_names = _name_list("provider")
_output_names = _name_list("output")


def _embed_mode(key: str, value: Any) -> int:
    if value in (0, 1, "0", "1") and not isinstance(value, bool):
        return int(value)
    raise InvalidOptionValueError(key, value, "0 (blob file beside the model) or 1 (embedded)")


def _weight_store(key: str, value: Any) -> Any:
    if value is None or isinstance(value, WeightStore):
        return value
    raise InvalidOptionValueError(key, value, "a plugrt.WeightStore (or None)")


def _optional_str(key: str, value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise InvalidOptionValueError(key, value, "a string")


#: Byte units, lower-cased: KB, MB, GB, TB are powers of 1000, KiB, MiB, GiB, TiB of 1024.
_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BYTE_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)
_BYTE_SIZE_FORMS = (
    "None (no limit), a positive number of bytes, or a string with a unit: '512MiB', '2GiB', '1.5GB', "
    "'800000KB' (KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, TiB of 1024; case-insensitive)"
)


def _byte_size(key: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value > 0:
            return value
        raise InvalidOptionValueError(key, value, _BYTE_SIZE_FORMS)
    match = _BYTE_SIZE.fullmatch(value) if isinstance(value, str) else None
    factor = _BYTE_UNITS.get(match.group(2).lower()) if match else None
    if match is None or factor is None:
        raise InvalidOptionValueError(key, value, _BYTE_SIZE_FORMS)
    size = int(decimal.Decimal(match.group(1)) * factor)  # exact: "1.5GB" is 1500000000 bytes
    if size <= 0:
        raise InvalidOptionValueError(key, value, _BYTE_SIZE_FORMS)
    return size


def _dim_sizes(key: str, value: Any) -> dict[str, int]:
    expected = "a mapping of dimension name to a positive size, e.g. {'batch': 8} or 'batch=8,sequence=128'"
    if isinstance(value, str):
        pairs = [item.split("=", 1) for item in value.split(",") if item.strip()]
        if not all(len(pair) == 2 and pair[1].strip().isdigit() for pair in pairs):
            raise InvalidOptionValueError(key, value, expected)
        value = {name.strip(): int(size) for name, size in pairs}
    if not isinstance(value, Mapping) or not all(
        isinstance(name, str) and name and isinstance(size, int) and not isinstance(size, bool) and size > 0
        for name, size in value.items()
    ):
        raise InvalidOptionValueError(key, value, expected)
    return dict(value)


@dataclasses.dataclass(frozen=True)
class _Option:
    parse: Callable[[str, Any], Any]
    default: Any
    help: str


#: Every option a session accepts: key -> parser, default and one line of help.
OPTIONS: dict[str, _Option] = {
    "optimization": _Option(
        _choice("none", "basic", "all"),
        "all",
        "graph optimisation level: none, basic (fold constants, drop dead nodes) or all (+ fusions)",
    ),
    "strict": _Option(_boolean, False, "raise PlacementError instead of falling back to another provider"),
    "placement": _Option(
        _choice("estimate", "priority", "measure"),
        "estimate",
        "how device='auto' and the speed policies place nodes: estimate (the fastest assignment the providers' "
        "costs and measured transfers give), measure (the plan by estimate and the CPU's alone timed on generated "
        "inputs once, the faster kept; the verdict cached per model, providers, devices and shapes for the "
        "process) or priority (each node to the highest-priority provider that runs it); provider lists, names, "
        "devices and strict always place by priority",
    ),
    "wait_for_device": _Option(
        _boolean,
        False,
        "with placement by estimate, build the device plan before load returns; when false a session whose "
        "plan puts nodes on an accelerator serves on the CPU provider until the device plan is built in the "
        "background and checked equal on the first run's inputs (EPContext restores and exports always wait)",
    ),
    "graphs": _Option(
        _graphs,
        "auto",
        "plain runs replay a capture of the plan per input signature (names, dtypes, shapes), recorded the second "
        "time it is seen and checked equal to the eager run: 'auto' where a provider the plan uses says its "
        "captures beat eager runs (CUDA graphs; not the CPU provider), True on any provider that can capture, "
        "False never",
    ),
    "max_graphs": _Option(
        _positive_int, 8, "most plain-run graphs a session keeps (one per input signature); the least recently used is dropped"
    ),
    "outputs.last_position": _Option(
        _output_names, (),
        "outputs read only at their last position along axis 1 (a decoder's logits): the product that makes "
        "each runs on that position alone, and the output's shape becomes (batch, 1, features); an output "
        "made other than by a MatMul or MatMulNBits through per-position ops is left as it is",
    ),
    "disabled_providers": _Option(_names, (), "provider names to ignore, as if not installed"),
    "profiling": _Option(_boolean, False, "record a span per node (Chrome trace JSON via session.profile())"),
    "intra_op_num_threads": _Option(_non_negative_int, 0, "host threads for this session's BLAS calls (0: every usable core other processes leave free)"),
    "weights": _Option(
        _weight_store,
        None,
        "a plugrt.WeightStore: initializers (and the forms providers prepare from them) are shared with "
        "every other session built with it, read-only",
    ),
    "memory_limit": _Option(
        _byte_size,
        None,
        "the most memory the session may need, in bytes or with a unit ('2GiB', '1.5GB'): its weights, the "
        "activation memory plan for its inputs' shapes (symbolic dimensions 1, or as memory_limit.dims says) "
        "and, for plugrt.genai, the KV cache at max_length; a session or generator that needs more is refused "
        "with MemoryLimitError (default None: no limit)",
    ),
    "memory_limit.dims": _Option(
        _dim_sizes,
        {},
        "sizes of symbolic input dimensions the memory_limit check plans activations for, e.g. "
        "{'batch': 8, 'sequence': 512} or 'batch=8,sequence=512' (a dimension not named is 1)",
    ),
    "limits.model_bytes": _Option(_positive_int, _LIMITS.model_bytes, "largest model file accepted, in bytes"),
    "limits.tensor_bytes": _Option(
        _positive_int,
        _LIMITS.tensor_bytes,
        "largest single tensor, in bytes: initializers, declared and inferred shapes, folded "
        "constants, kernel outputs and broadcast views",
    ),
    "limits.nodes": _Option(_positive_int, _LIMITS.nodes, "most nodes accepted, subgraphs and inlined functions included"),
    "limits.subgraph_depth": _Option(_positive_int, _LIMITS.subgraph_depth, "deepest nesting of subgraphs accepted"),
    "limits.context_bytes": _Option(_positive_int, _LIMITS.context_bytes, "largest EPContext blob file read, in bytes"),
    "cuda.float16_decoding": _Option(
        _boolean,
        False,
        "the CUDA provider computes a float32 model in float16 (weights and activations; norms, softmax and GEMM "
        "accumulation in float32), its inputs and outputs staying float32: for decoders, about half the memory "
        "traffic per token",
    ),
    "cuda.tf32": _Option(
        _boolean,
        True,
        "the CUDA provider's float32 GEMMs and convolutions on TF32 tensor cores (10-bit mantissa inputs, "
        "float32 accumulation), as onnxruntime's CUDA provider does by default; false computes exact float32",
    ),
    "ep.context_enable": _Option(_boolean, False, "export compiled partitions as EPContext nodes"),
    "ep.context_file_path": _Option(_optional_str, None, "where the EPContext model goes (default <model>_ctx.onnx; never replaced if it exists); with a model given as bytes, its folder is where embed_mode=0 blobs are read from"),
    "ep.context_embed_mode": _Option(
        _embed_mode,
        0,
        "0 writes each compiled blob to a file beside the context model; 1 embeds it in the node",
    ),
}


@dataclasses.dataclass(frozen=True)
class SessionOptions:
    """Validated options; look values up with ``options[key]``."""

    values: Mapping[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.values[key]


def parse_options(given: Mapping[str, Any]) -> SessionOptions:
    """Validate ``given`` against OPTIONS; unknown keys and bad values raise OptionError."""
    values = {key: opt.default for key, opt in OPTIONS.items()}
    for key, value in given.items():
        opt = OPTIONS.get(key)
        if opt is None:
            raise UnknownOptionError(key, list(OPTIONS))
        values[key] = opt.parse(key, value)
    return SessionOptions(values)
