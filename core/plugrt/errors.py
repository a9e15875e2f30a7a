"""The error hierarchy: one root, split by phase, each error carrying structured fields."""

from __future__ import annotations

import difflib
from typing import Any, Sequence

from . import _ort_errors as _ort

__all__ = [
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
    "CaptureThreadError",
    "StaleCaptureError",
    "ReplayStreamError",
    "EpContextError",
    "EpContextSourceError",
    "EpContextAmbiguousError",
    "EpContextMissingPrimaryError",
    "EpContextPathError",
    "EpContextAttributeError",
    "EpContextOverwriteError",
    "ModelBuildError",
    "RunError",
    "BatchColumnError",
    "BatchRowError",
    "RunTerminatedError",
    "NotSupportedError",
    "ConformanceInputError",
    "ProviderNameMismatchError",
    "WeightStoreError",
    "WarmupShapeError",
    "BindingShapeError",
    "CommandLineError",
    "MissingDependencyError",
    "StandInError",
    "ConfigEntryMissingError",
    "ConfigEntryRequiredError",
]


class PlugrtError(Exception):
    """Root of every error plugrt raises on purpose. Each branch also inherits the
    onnxruntime status class (``plugrt._ort_errors``) that names the same failure, so code
    written for onnxruntime (``except Fail``, ``except InvalidArgument``) catches it."""


# --- loading -------------------------------------------------------------------------


class ModelLoadError(PlugrtError, _ort.InvalidProtobuf):
    """The model could not be read or is not a valid ONNX model."""

    def __init__(self, message: str, *, source: str | None = None, reason: str | None = None):
        super().__init__(message if source is None else f"{source}: {message}")
        self.source = source
        self.reason = reason or message


class UnsafeExternalDataError(ModelLoadError):
    """An external-data reference is unsafe to follow: it points outside the model's folder,
    its location holds a NUL byte, or what it names is not a regular file (a FIFO, device,
    socket or folder). ``problem`` says which."""

    OUTSIDE = "outside the model's folder"
    NUL_BYTE = "a NUL byte in the location"
    NOT_REGULAR = "not a regular file"

    def __init__(self, tensor: str, location: str, *, source: str | None = None, problem: str = OUTSIDE):
        why = {
            self.OUTSIDE: "which is outside the model's folder; external data must be a relative path "
            "inside the folder that holds the model (move the file there and fix the 'location' field)",
            self.NUL_BYTE: "which contains a NUL byte; no file name can, so the 'location' field is "
            "corrupt (set it to the data file's path relative to the model)",
            self.NOT_REGULAR: "which is not a regular file (a FIFO, device, socket or folder); external "
            "data must be a regular file inside the model's folder",
        }[problem]
        super().__init__(
            f"initializer {tensor!r} refers to external data at {location!r}, {why}",
            source=source,
            reason=f"external data {problem}",
        )
        self.tensor = tensor
        self.location = location
        self.problem = problem


class ModelLimitError(ModelLoadError):
    """The model exceeds a configured safety limit."""

    def __init__(self, limit: str, value: int, maximum: int, *, source: str | None = None):
        super().__init__(
            f"{limit} is {value}, above the limit of {maximum}; if the model is trusted, raise "
            f"the option 'limits.{limit}'",
            source=source,
            reason=f"{limit} over limit",
        )
        self.limit = limit
        self.value = value
        self.maximum = maximum


class MemoryLimitError(ModelLoadError):
    """A session (or a ``plugrt.genai.Generator``'s KV cache) would need more memory than
    the ``memory_limit`` option allows. ``needed`` and ``limit`` are bytes; ``breakdown``
    says where ``needed`` goes: ``weights``, ``activations`` (the activation memory plan's
    peak) and ``state`` (the KV cache); ``unsized`` counts intermediate values the plan
    could not size (unknown dimensions), which ``needed`` leaves out."""

    def __init__(self, needed: int, limit: int, breakdown: dict[str, int], *, unsized: int = 0, source: str | None = None):
        self.needed = needed
        self.limit = limit
        self.breakdown = dict(breakdown)
        self.unsized = unsized
        weights, activations = self.breakdown.get("weights", 0), self.breakdown.get("activations", 0)
        parts = f"weights {_format_bytes(weights)}, activations {_format_bytes(activations)}"
        state = self.breakdown.get("state", 0)
        what = "the generator needs" if state else "the session needs"
        if state:
            parts += f", KV cache {_format_bytes(state)}"
        if unsized:
            parts += f"; {unsized} intermediate value(s) of unknown size not counted"
        remedy = "raise memory_limit or use a smaller model" + (" or max_length" if state else "")
        super().__init__(
            f"{what} {_format_bytes(needed)} ({parts}) but memory_limit is {_format_bytes(limit)}; {remedy}",
            source=source,
            reason="memory over memory_limit",
        )


def _format_bytes(count: int) -> str:
    """``count`` bytes in binary units to three significant digits: 0 B, 190 MiB, 1.21 GiB."""
    size, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    digits = 0 if size >= 100 or unit == "B" else 1 if size >= 10 else 2
    text = f"{size:.{digits}f}"
    return f"{text.rstrip('0').rstrip('.') if digits else text} {unit}"


# --- placement -----------------------------------------------------------------------


class UnsupportedOpError(PlugrtError, _ort.NotImplemented):
    """No provider can run a node."""

    def __init__(
        self,
        domain: str,
        op_type: str,
        opset: int,
        *,
        node: str | None = None,
        providers_consulted: Sequence[str] = (),
        reasons: dict[str, str] | None = None,
    ):
        self.domain = domain or "ai.onnx"
        self.op_type = op_type
        self.opset = opset
        self.node = node
        self.providers_consulted = tuple(providers_consulted)
        self.reasons = dict(reasons or {})
        lines = [
            f"no provider can run {self.domain}::{op_type} at opset {opset}"
            + (f" (node {node!r})" if node else "")
        ]
        for name in self.providers_consulted:
            lines.append(f"  {name}: {self.reasons.get(name, 'declined')}")
        lines.append(
            "  fix: install a provider that supports this op, or convert the model to an opset "
            "and op set the installed providers support ('plugrt providers' lists them)"
        )
        super().__init__("\n".join(lines))


class PlacementError(PlugrtError, _ort.NotImplemented):
    """Strict placement found nodes that fell back from the requested provider."""

    def __init__(self, provider: str, fallbacks: Sequence[tuple[str, str, str]]):
        self.provider = provider
        self.fallbacks = tuple(fallbacks)  # (node name, op_type, reason)
        shown = "\n".join(f"  {n} ({op}): {why}" for n, op, why in self.fallbacks[:20])
        more = f"\n  ... and {len(self.fallbacks) - 20} more" if len(self.fallbacks) > 20 else ""
        super().__init__(
            f"strict placement: {len(self.fallbacks)} node(s) cannot run on {provider!r}:\n"
            f"{shown}{more}\n  fix: drop strict=True to allow fallback, or choose another device"
        )


class ProviderUnavailableError(PlugrtError, _ort.Fail, RuntimeError):
    """A provider the user asked for by name cannot be used."""

    def __init__(self, provider: str, cause: str, *, hint: str | None = None):
        self.provider = provider
        self.cause = cause
        self.hint = hint or "run 'plugrt providers' to see what is installed and why, or choose device='cpu'"
        super().__init__(f"provider {provider!r} is unavailable: {cause}\n  fix: {self.hint}")


# --- inputs --------------------------------------------------------------------------


class InvalidInputError(PlugrtError, ValueError, _ort.InvalidArgument):
    """An input given to ``run`` does not match the model."""

    def __init__(self, message: str, *, input_name: str | None = None):
        super().__init__(message)
        self.input_name = input_name


class UnknownInputError(InvalidInputError):
    def __init__(self, input_name: str, expected: Sequence[str]):
        self.expected = tuple(expected)
        super().__init__(
            f"unknown input {input_name!r}; the model's inputs are {list(self.expected)}",
            input_name=input_name,
        )


class MissingInputError(InvalidInputError):
    """An input the model needs was not fed. With ``missing`` and ``fed`` (the onnxruntime
    API's check before a run) the message is onnxruntime's: "Required inputs ([...]) are
    missing from input feed ([...])"."""

    def __init__(self, input_name: str, expected: Sequence[str], *, missing: Sequence[str] | None = None, fed: Sequence[str] | None = None):
        self.expected = tuple(expected)
        self.missing = tuple(missing) if missing is not None else (input_name,)
        self.fed = tuple(fed) if fed is not None else None
        if fed is not None:
            message = f"Required inputs ({list(self.missing)}) are missing from input feed ({list(fed)})"
        else:
            message = f"missing input {input_name!r}; the model needs {list(self.expected)}"
        super().__init__(message, input_name=input_name)


class InputDtypeError(InvalidInputError):
    def __init__(self, input_name: str, expected: str, actual: str):
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"input {input_name!r} has dtype {actual}, the model expects {expected}; convert it "
            f"with array.astype(numpy.{expected})" if expected.isidentifier() else
            f"input {input_name!r} has dtype {actual}, the model expects {expected}",
            input_name=input_name,
        )


class InputRankError(InvalidInputError):
    def __init__(self, input_name: str, expected: int, actual: int, declared: str):
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"input {input_name!r} has rank {actual}, the model expects rank {expected} "
            f"(shape {declared})",
            input_name=input_name,
        )


class InputShapeError(InvalidInputError):
    def __init__(self, input_name: str, axis: int, expected: int, actual: int, declared: str):
        self.axis = axis
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"input {input_name!r} has size {actual} on axis {axis}, the model expects "
            f"{expected} (shape {declared})",
            input_name=input_name,
        )


class SymbolConflictError(InvalidInputError):
    def __init__(self, symbol: str, first: tuple[str, int, int], second: tuple[str, int, int]):
        self.symbol = symbol
        self.first = first  # (input name, axis, size)
        self.second = second
        super().__init__(
            f"dimension {symbol!r} is bound to two sizes: {first[2]} (input {first[0]!r} axis "
            f"{first[1]}) and {second[2]} (input {second[0]!r} axis {second[1]}); inputs that "
            f"share a dimension name must agree on its size (an input empty along it may differ)",
            input_name=second[0],
        )


class BindingShapeError(InvalidInputError):
    """A device binding's shape disagrees with the model's declared shape (at allocation)
    or with an array written to it. ``expected`` is the declared shape, or the binding's
    capacity; ``actual`` the shape asked for or written."""

    def __init__(self, name: str, expected: Sequence[Any], actual: Sequence[int], message: str, *, input_name: str | None = None):
        self.name = name
        self.expected = tuple(expected)
        self.actual = tuple(actual)
        super().__init__(message, input_name=input_name)


# --- options -------------------------------------------------------------------------


class OptionError(PlugrtError, ValueError, _ort.InvalidArgument):
    """A session option is unknown or has an invalid value."""

    def __init__(self, message: str, *, key: str):
        super().__init__(message)
        self.key = key


#: Above this many valid keys, an unknown key's message names the closest few and where
#: the rest are listed, not every one.
_KEYS_LISTED = 20


class UnknownOptionError(OptionError):
    """An unknown option or keyword: ``suggestions`` are the valid keys closest to it."""

    def __init__(self, key: str, known: Sequence[str], *, what: str = "option", listed_in: str = "plugrt.options.OPTIONS"):
        self.known = tuple(sorted(set(known)))
        self.suggestions = tuple(difflib.get_close_matches(key, self.known, n=3, cutoff=0.6))
        message = f"unknown {what} {key!r}"
        if self.suggestions:
            message += "; did you mean " + " or ".join(repr(s) for s in self.suggestions) + "?"
        elif len(self.known) > _KEYS_LISTED:  # nothing close: the nearest few still beat a list of all
            nearest = difflib.get_close_matches(key, self.known, n=3, cutoff=0.0)
            message += "; the closest valid ones are " + ", ".join(repr(s) for s in nearest)
        if len(self.known) <= _KEYS_LISTED:
            message += f" (valid: {', '.join(self.known)})"
        else:
            message += f" ({len(self.known)} are valid, listed in {listed_in})"
        super().__init__(message, key=key)


class InvalidOptionValueError(OptionError):
    def __init__(self, key: str, value: Any, choices: str):
        self.value = value
        self.choices = choices
        super().__init__(f"invalid value {value!r} for option {key!r}; expected {choices}", key=key)


# --- execution -----------------------------------------------------------------------


class KernelError(PlugrtError, _ort.RuntimeException):
    """A kernel raised while running a node."""

    def __init__(self, node: str, op_type: str, provider: str, cause: BaseException):
        self.node = node
        self.op_type = op_type
        self.provider = provider
        self.cause = cause
        super().__init__(
            f"node {node!r} ({op_type}) failed on provider {provider!r}: "
            f"{type(cause).__name__}: {cause}"
        )


class CaptureError(PlugrtError, _ort.Fail):
    """A capture cannot be replayed."""

    def __init__(self, message: str, *, reason: str):
        super().__init__(message)
        self.reason = reason


class NoCaptureError(CaptureError):
    def __init__(self) -> None:
        super().__init__(
            "there is no capture to replay (never captured, or reset()); call try_capture() first",
            reason="no capture",
        )


class CaptureThreadError(CaptureError):
    """A capture's output buffers would be shared between threads."""

    def __init__(self, slot: str, captured_on: str, replayed_on: str):
        self.slot = slot
        self.captured_on = captured_on
        self.replayed_on = replayed_on
        super().__init__(
            f"capture slot {slot!r} was made on thread {captured_on!r} and is replayed on "
            f"{replayed_on!r} with copy_outputs=False: its outputs are buffers the next replay on "
            "any thread overwrites; leave copy_outputs out (replays off the capturing thread "
            "return copies), or use one session per thread",
            reason="replayed on another thread",
        )


class StaleCaptureError(CaptureError):
    """What a capture was recorded with has changed (a shape, a freed binding)."""

    def __init__(self, what: str, *, name: str | None = None):
        self.name = name
        super().__init__(
            f"the capture is stale: {what}; call reset() and try_capture() again", reason=what
        )


class ReplayStreamError(CaptureError):
    """The device stream recorded an error during a replay: its outputs cannot be trusted."""

    def __init__(self, site: str, why: str):
        self.site = site
        super().__init__(
            f"the device reported an error after replaying {site}: {why}; the outputs of that replay are "
            "not valid. Reset the capture (session.reset(), or graphs=False for plain runs) and run eagerly "
            "to find the failing node",
            reason=why,
        )


class EpContextError(PlugrtError, _ort.Fail):
    """An EPContext node cannot be exported or restored."""

    def __init__(self, message: str, *, node: str | None = None, source: str | None = None):
        super().__init__(message)
        self.node = node
        self.source = source


class EpContextSourceError(EpContextError):
    """No installed provider declares the node's ``source`` key."""

    def __init__(self, source: str, node: str, installed: dict[str, tuple[str, ...]]):
        self.installed = dict(installed)
        keys = "; ".join(f"{name}: {', '.join(k) or 'no keys'}" for name, k in self.installed.items()) or "none"
        super().__init__(
            f"EPContext node {node!r} was made by source {source!r}, which no installed provider "
            f"restores (providers and their context source keys: {keys}); install the provider "
            "that produced this model, or use the original model",
            node=node,
            source=source,
        )


class EpContextAmbiguousError(EpContextError):
    """Two providers declare the same ``source`` key."""

    def __init__(self, source: str, node: str, providers: Sequence[str]):
        self.providers = tuple(providers)
        super().__init__(
            f"EPContext node {node!r} has source {source!r}, which providers {list(self.providers)} "
            "all declare; uninstall or disable one of them (PLUGRT_DISABLE_PROVIDERS)",
            node=node,
            source=source,
        )


class EpContextMissingPrimaryError(EpContextError):
    """A ``main_context=0`` node has no ``main_context=1`` node to take its context from."""

    def __init__(self, source: str, node: str):
        super().__init__(
            f"EPContext node {node!r} (source {source!r}) has main_context=0 but the model has no "
            "main_context=1 node of that source holding the shared context; the model is "
            "incomplete, export it again",
            node=node,
            source=source,
        )


class EpContextPathError(EpContextError):
    """An ``embed_mode=0`` context path is unusable (outside the model folder, missing)."""

    def __init__(self, path: str, node: str, why: str):
        self.path = path
        super().__init__(f"EPContext node {node!r}: context file {path!r} {why}", node=node)


class EpContextAttributeError(EpContextError):
    """An EPContext attribute has the wrong type or value (``embed_mode="zero"``, an int path)."""

    def __init__(self, node: str, attribute: str, expected: str, actual: str):
        self.attribute = attribute
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"EPContext node {node!r}: attribute {attribute!r} is {actual}, but must be {expected}; "
            "the model is malformed, export it again",
            node=node,
        )


# --- batch inference -----------------------------------------------------------------


class BatchColumnError(InvalidInputError):
    """A batch lacks the column a model input reads, or the column cannot feed it."""

    def __init__(self, column: str, input_name: str, reason: str):
        self.column = column
        self.reason = reason
        super().__init__(
            f"column {column!r} (model input {input_name!r}): {reason}; map columns to inputs "
            "with input_columns={input: column}",
            input_name=input_name,
        )

    def __reduce__(self):  # rebuilt from fields when sent between processes
        return (type(self), (self.column, self.input_name, self.reason))


class BatchRowError(InvalidInputError):
    """One row of a batch cannot be run; the row's index (and id, when known) and column."""

    def __init__(self, row: int, column: str | None, reason: str, *, row_id: Any = None, input_name: str | None = None):
        self.row = row
        self.column = column
        self.reason = reason
        self.row_id = row_id
        where = f"row {row} of the batch" + (f" (id {row_id!r})" if row_id is not None else "")
        what = f", column {column!r}" if column is not None else ""
        super().__init__(
            f"{where}{what}: {reason}; fix or drop that row (Dataset.filter), or let Ray Data "
            "skip failing batches (DataContext.max_errored_blocks)",
            input_name=input_name,
        )

    def __reduce__(self):  # rebuilt from fields when sent between processes
        return (
            _rebuild_batch_row_error,
            (self.row, self.column, self.reason, self.row_id, self.input_name),
        )


def _rebuild_batch_row_error(row, column, reason, row_id, input_name) -> BatchRowError:
    return BatchRowError(row, column, reason, row_id=row_id, input_name=input_name)


# --- onnxruntime compatibility, conformance and provider packaging ----------------------


class RunTerminatedError(PlugrtError, _ort.Fail):
    """A run stopped between steps because its ``RunOptions.terminate`` was set."""

    def __init__(self, run_tag: str = ""):
        self.run_tag = run_tag
        tag = f" (run_tag {run_tag!r})" if run_tag else ""
        super().__init__(f"Exiting due to terminate flag being set to true{tag}; clear RunOptions.terminate to run again")


class NotSupportedError(PlugrtError, AttributeError, _ort.NotImplemented):
    """An onnxruntime API plugrt does not offer; ``alternative`` says what to use instead."""

    def __init__(self, name: str, alternative: str):
        self.name = name
        self.alternative = alternative
        super().__init__(f"{name} is not supported by plugrt; {alternative}")


class ConformanceInputError(PlugrtError):
    """A conformance run was asked for something it cannot check (a bad expectations file,
    a filter that selects no case)."""

    def __init__(self, message: str, *, path: str | None = None, filter: str | None = None):
        self.path = path
        self.filter = filter
        super().__init__(message)


class ProviderNameMismatchError(PlugrtError):
    """A provider labelled its compiled partition with another provider's name."""

    def __init__(self, provider: str, labelled: str):
        self.provider = provider
        self.labelled = labelled
        super().__init__(
            f"provider {provider!r} returned a CompiledPartition labelled {labelled!r}; leave "
            f"CompiledPartition's provider out (plugrt fills in {provider!r}) or rename it to match"
        )


# --- hostile models and misbehaving providers ----------------------------------------


class EpContextOverwriteError(EpContextError):
    """Exporting an EPContext model would replace an existing file (the source model, an
    earlier export, a blob)."""

    def __init__(self, path: str, why: str):
        self.path = path
        self.why = why
        super().__init__(
            f"EPContext export refused: {path!r} {why}; delete it or choose another "
            "'ep.context_file_path'"
        )


class ModelBuildError(ModelLoadError):
    """Building a session from a model failed in a way no specific check anticipated."""

    def __init__(self, cause: BaseException, *, source: str | None = None):
        self.cause = cause
        super().__init__(
            f"the model cannot be built: {type(cause).__name__}: {cause}; the model is malformed "
            "or uses something plugrt does not handle (report it with the model if onnxruntime "
            "accepts it)",
            source=source,
            reason=f"unexpected {type(cause).__name__}",
        )


class RunError(PlugrtError, _ort.RuntimeException):
    """A run failed outside any kernel in a way no specific check anticipated."""

    def __init__(self, cause: BaseException):
        self.cause = cause
        super().__init__(f"the run failed: {type(cause).__name__}: {cause}")


class WeightStoreError(PlugrtError, ValueError, _ort.InvalidArgument):
    """An initializer given to a ``WeightStore`` cannot be used (wrong name, dtype or shape)."""

    def __init__(self, message: str, *, name: str):
        super().__init__(message)
        self.name = name


class WarmupShapeError(InvalidInputError):
    """A shape given to ``warmup`` is not a shape (a sequence of non-negative integers) or
    makes an input larger than the ``limits.tensor_bytes`` option allows."""

    def __init__(self, input_name: str, shape: Any, reason: str):
        self.shape = shape
        self.reason = reason
        super().__init__(
            f"warmup shape {shape!r} for input {input_name!r} is invalid: {reason}; give a tuple "
            "of non-negative integers, e.g. {'" + input_name + "': (1, 16)}",
            input_name=input_name,
        )


# --- the command line ----------------------------------------------------------------


class CommandLineError(PlugrtError):
    """A ``plugrt`` command was given something it cannot use (a missing file, a bad
    ``NAME=VALUE``); the command exits with status 2, as argparse does."""

    def __init__(self, command: str, message: str, *, option: str | None = None):
        self.command = command
        self.option = option
        super().__init__(message)


class MissingDependencyError(PlugrtError, ImportError, _ort.Fail):
    """An optional package a feature needs is not installed."""

    def __init__(self, package: str, needed_for: str, install: str):
        self.package = package
        self.needed_for = needed_for
        self.install = install
        super().__init__(f"{needed_for} needs the {package!r} package, which is not installed; install it with: {install}")


class StandInError(PlugrtError):
    """plugrt cannot stand in for onnxruntime now: ``module`` (a real onnxruntime module)
    is already imported."""

    def __init__(self, message: str, *, module: str, hint: str):
        super().__init__(f"{message} ({module}); {hint}")
        self.module = module
        self.hint = hint


class ConfigEntryMissingError(OptionError, RuntimeError):
    """``get_session_config_entry``/``get_run_config_entry`` of a key never set; a
    RuntimeError too, as onnxruntime raises. ``owner`` is SessionOptions or RunOptions."""

    def __init__(self, owner: str, key: str):
        super().__init__(f"{owner} does not have configuration with key: {key}", key=key)
        self.owner = owner


class ConfigEntryRequiredError(OptionError, _ort.Fail):
    """A call needs the session config entry ``key`` set to ``value`` (an onnxruntime Fail)."""

    def __init__(self, key: str, value: str, purpose: str):
        super().__init__(f"Session configuration entry '{key}' must be set to \"{value}\" to {purpose}", key=key)
        self.value = value
