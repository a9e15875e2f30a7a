"""An onnxruntime-compatible facade: ``plugrt.InferenceSession`` behaves like ort's.

Where plugrt departs from onnxruntime on purpose, it says so here:

- ``providers="CPUExecutionProvider"`` (a string) is one provider name; onnxruntime
  iterates it character by character and warns for each.
- A provider list in which no provider is available raises ProviderUnavailableError;
  onnxruntime silently runs on the CPU.
- An unknown session config key raises UnknownOptionError; onnxruntime accepts any key.
  onnxruntime's documented keys are accepted: those in ``MAPPED_CONFIG_KEYS`` have a
  plugrt meaning, those in ``IGNORED_CONFIG_KEYS`` are accepted and have no effect.
  Standing in for onnxruntime (plugrt.install_as_onnxruntime), an unknown key warns and is
  kept instead, as its clients expect.
- ``inter_op_num_threads`` and ``execution_mode``: plugrt runs steps in order on the
  calling thread, so ``ORT_PARALLEL`` runs sequentially (the results are the same).
- ``log_severity_level`` sets the level of the ``plugrt`` logger while the session builds.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import threading
import time
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ._ort_values import IOBinding, OrtValue, RunOptions, guarded_run, host_value
from .errors import (
    ConfigEntryMissingError,
    ConfigEntryRequiredError,
    KernelError,
    MissingInputError,
    NotSupportedError,
    OptionError,
    ProviderUnavailableError,
    UnknownOptionError,
)
from .loader import map_types_erased, write_declared_types
from .options import OPTIONS
from .session import Session, TensorInfo
from .weights import WeightStore

__all__ = [
    "InferenceSession",
    "SessionOptions",
    "RunOptions",
    "OrtValue",
    "IOBinding",
    "NodeArg",
    "ModelMetadata",
    "GraphOptimizationLevel",
    "ExecutionMode",
    "ExecutionOrder",
    "get_available_providers",
    "get_all_providers",
    "get_device",
    "MAPPED_CONFIG_KEYS",
    "IGNORED_CONFIG_KEYS",
]

#: onnxruntime provider names and the plugrt providers they mean.
_ORT_NAMES = {
    "CPUExecutionProvider": "cpu",
    "CUDAExecutionProvider": "cuda",
    "TensorrtExecutionProvider": "cuda",
}
_PLUGRT_TO_ORT = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}

#: Every provider name onnxruntime knows, highest default priority first (as its
#: ``get_all_providers()`` lists them); plugrt runs those its installed providers stand for.
ORT_PROVIDER_NAMES = (
    "TensorrtExecutionProvider", "CUDAExecutionProvider", "MIGraphXExecutionProvider", "ROCMExecutionProvider",
    "OpenVINOExecutionProvider", "DnnlExecutionProvider", "TvmExecutionProvider", "VitisAIExecutionProvider",
    "QNNExecutionProvider", "NnapiExecutionProvider", "VSINPUExecutionProvider", "JsExecutionProvider",
    "CoreMLExecutionProvider", "ArmNNExecutionProvider", "ACLExecutionProvider", "DmlExecutionProvider",
    "RknpuExecutionProvider", "WebNNExecutionProvider", "WebGpuExecutionProvider", "XnnpackExecutionProvider",
    "CANNExecutionProvider", "AzureExecutionProvider", "CPUExecutionProvider",
)

#: Set by plugrt.install_as_onnxruntime(): standing in, plugrt takes what onnxruntime takes
#: where plugrt's own API is stricter on purpose (an unknown config key warns, not raises).
_STANDING_IN = False

#: The model metadata key holding an onnxruntime config (read when ORT_LOAD_CONFIG_FROM_MODEL=1).
_ORT_CONFIG_KEY = "ort_config"


class GraphOptimizationLevel(enum.IntEnum):
    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3
    ORT_ENABLE_ALL = 99


class ExecutionMode(enum.IntEnum):
    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


class ExecutionOrder(enum.IntEnum):
    DEFAULT = 0
    PRIORITY_BASED = 1
    MEMORY_EFFICIENT = 2


_GRAPH_LEVELS = {0: "none", 1: "basic", 2: "all", 3: "all", 99: "all"}

#: onnxruntime session config keys with a plugrt meaning -> the plugrt option they set.
MAPPED_CONFIG_KEYS = {
    "session.disable_cpu_ep_fallback": "strict",
    "ep.context_enable": "ep.context_enable",
    "ep.context_file_path": "ep.context_file_path",
    "ep.context_embed_mode": "ep.context_embed_mode",
}

#: onnxruntime's documented session config keys that plugrt accepts and ignores (each
#: tunes something plugrt does not have: thread spinning, prepacking, arenas, QDQ
#: rewrites, ORT-format models).
IGNORED_CONFIG_KEYS = frozenset(
    {
        "session.set_denormal_as_zero",
        "session.disable_prepacking",
        "session.use_env_allocators",
        "session.load_model_format",
        "session.save_model_format",
        "session.intra_op.allow_spinning",
        "session.inter_op.allow_spinning",
        "session.force_spinning_stop",
        "session.use_ort_model_bytes_directly",
        "session.use_ort_model_bytes_for_initializers",
        "session.disable_quant_qdq",
        "session.enable_quant_qdq_cleanup",
        "session.disable_double_qdq_remover",
        "session.qdqisint8allowed",
        "session.x64quantprecision",
        "session.dynamic_block_base",
        "session.strict_shape_type_inference",
        "session.allow_released_opsets_only",
        "session.node_partition_config_file",
        "session.intra_op_thread_affinities",
        "session.debug_layout_transformation",
        "session.disable_aot_function_inlining",
        "session.use_device_allocator_for_initializers",
        "session.record_ep_graph_assignment_info",
        "session.optimized_model_external_initializers_file_name",
        "session.optimized_model_external_initializers_min_size_in_bytes",
        "session.disable_model_compile",
        "session.disable_synchronize_execution_providers",
        "session.graph_optimizations_loop_level",
        "optimization.enable_gelu_approximation",
        "optimization.minimal_build_optimizations",
        "optimization.disable_specified_optimizers",
        "mlas.enable_gemm_fastmath_arm64_bfloat16",
        "ep.share_ep_contexts",
        "ep.stop_share_ep_contexts",
        "ep.context_node_name_prefix",
        "ep.context_model_external_initializers_file_name",
    }
)

_LOG_LEVELS = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.CRITICAL}

#: onnxruntime APIs plugrt does not offer, and what to use instead.
_ALTERNATIVES = {
    "register_custom_ops_library": "write an execution provider package (docs/writing-a-provider.md)",
    "add_provider_for_devices": "pass providers=[...] or plugrt.load(model, device=...)",
    "set_provider_selection_policy": "plugrt.load(model, device='prefer_gpu') (or another policy)",
    "release_captured_graph": "session.session.reset() drops the capture",
    "set_ep_dynamic_options": "set provider options when building the session",
    "get_tuning_results": "plugrt has no kernel tuning",
    "set_tuning_results": "plugrt has no kernel tuning",
    "run_with_ortvaluevector": "use run_with_ort_values or run_with_iobinding",
    "create_ortvalue_from_shape_and_type": "use OrtValue.ortvalue_from_shape_and_type",
}


class SessionOptions:
    """``onnxruntime.SessionOptions``: what plugrt honours, accepts and refuses is in the
    module docstring."""

    def __init__(self) -> None:
        self.graph_optimization_level: int = GraphOptimizationLevel.ORT_ENABLE_ALL
        self.execution_mode: int = ExecutionMode.ORT_SEQUENTIAL
        self.execution_order: int = ExecutionOrder.DEFAULT
        self.enable_profiling = False
        self.profile_file_prefix = "onnxruntime_profile_"
        self.optimized_model_filepath = ""
        self.intra_op_num_threads = 0
        self.inter_op_num_threads = 0
        self.log_severity_level = 2
        self.log_verbosity_level = 0
        self.logid = ""
        self.enable_cpu_mem_arena = True
        self.enable_mem_pattern = True
        self.enable_mem_reuse = True
        self.use_deterministic_compute = False  # plugrt's kernels are deterministic anyway
        self.use_per_session_threads = True
        self._configs: dict[str, str] = {}
        self._weights: WeightStore | None = None
        self._free_dims_by_name: dict[str, int] = {}
        self._free_dims_by_denotation: dict[str, int] = {}
        self._external_arrays: dict[str, np.ndarray] = {}  # add_external_initializers
        self._files_in_memory: dict[str, memoryview] = {}  # add_external_initializers_from_files_in_memory

    def add_free_dimension_override_by_name(self, dim_name: str, dim_value: int) -> None:
        """Fix the symbolic dimension ``dim_name`` to ``dim_value`` in the model's inputs."""
        self._free_dims_by_name[str(dim_name)] = int(dim_value)

    def add_free_dimension_override_by_denotation(self, dim_denotation: str, dim_value: int) -> None:
        """Fix every input dimension denoted ``dim_denotation`` (e.g. DATA_BATCH) to ``dim_value``."""
        self._free_dims_by_denotation[str(dim_denotation)] = int(dim_value)

    def add_initializer(self, name: str, value: Any) -> None:
        """Use ``value`` (an OrtValue or a numpy array, kept without a copy) for the model's
        initializer ``name``. Sessions made with these options also share all their other
        weights (a plugrt.WeightStore)."""
        if self._weights is None:
            self._weights = WeightStore()
        self._weights.add_initializer(name, value.numpy() if isinstance(value, OrtValue) else value)

    def add_external_initializers(self, names: Sequence[str], values: Sequence[Any]) -> None:
        """:meth:`add_initializer` for each name and value; an initializer the model keeps in
        an external file is taken from these values (the file need not exist)."""
        for name, value in zip(names, values, strict=True):
            self.add_initializer(name, value)
            self._external_arrays[name] = value.numpy() if isinstance(value, OrtValue) else np.asarray(value)

    def add_external_initializers_from_files_in_memory(self, names: Sequence[str], buffers: Sequence[Any], lengths: Sequence[int]) -> None:
        """The contents of the model's external data files ``names`` (the first ``lengths``
        bytes of each buffer): initializers stored there are read from memory, not disk."""
        for name, buffer, length in zip(names, buffers, lengths, strict=True):
            self._files_in_memory[str(name)] = memoryview(buffer).cast("B")[: int(length)]

    def add_session_config_entry(self, key: str, value: str) -> None:
        """Set an onnxruntime config key or a plugrt option; an unknown key raises now."""
        if key not in MAPPED_CONFIG_KEYS and key not in IGNORED_CONFIG_KEYS and key not in OPTIONS:
            if _STANDING_IN:  # onnxruntime's clients set keys of newer releases freely
                warnings.warn(f"session config key {key!r} is unknown to plugrt; it is kept and has no effect", stacklevel=2)
                self._configs[key] = str(value)
                return
            raise UnknownOptionError(
                key,
                [*MAPPED_CONFIG_KEYS, *IGNORED_CONFIG_KEYS, *OPTIONS],
                what="session config key",
                listed_in="plugrt.ort.MAPPED_CONFIG_KEYS, plugrt.ort.IGNORED_CONFIG_KEYS and plugrt.options.OPTIONS",
            )
        self._configs[key] = str(value) if not isinstance(value, str) else value

    def get_session_config_entry(self, key: str) -> str:
        try:
            return self._configs[key]
        except KeyError:
            raise ConfigEntryMissingError("SessionOptions", key) from None

    def has_providers(self) -> bool:
        return False

    def to_options(self) -> dict[str, Any]:
        """These settings as plugrt session options."""
        level = int(self.graph_optimization_level)
        options: dict[str, Any] = {
            "optimization": _GRAPH_LEVELS.get(level, "all"),
            "profiling": bool(self.enable_profiling),
            "intra_op_num_threads": int(self.intra_op_num_threads),
        }
        for key, value in self._configs.items():
            if key in IGNORED_CONFIG_KEYS or (key not in MAPPED_CONFIG_KEYS and key not in OPTIONS):
                continue
            options[MAPPED_CONFIG_KEYS.get(key, key)] = value
        if self._weights is not None:
            options["weights"] = self._weights
        return options

    def __getattr__(self, name: str) -> Any:
        if name in _ALTERNATIVES:
            raise NotSupportedError(f"SessionOptions.{name}", _ALTERNATIVES[name])
        raise NotSupportedError(f"SessionOptions.{name}", "see plugrt.options.OPTIONS for what plugrt offers")


@dataclasses.dataclass(frozen=True)
class NodeArg:
    name: str
    type: str
    shape: list


@dataclasses.dataclass(frozen=True)
class ModelMetadata:
    producer_name: str
    graph_name: str
    domain: str
    description: str
    graph_description: str
    version: int
    custom_metadata_map: dict


def _node_arg(info: TensorInfo) -> NodeArg:
    # onnxruntime reports an unknown dim as None and a symbolic one by its name
    shape = list(info.shape) if info.shape is not None else []
    return NodeArg(info.name, info.type_string, shape)


def _inferred_outputs(session: Session) -> list[TensorInfo]:
    """The outputs with the shapes inference found where the model declares none."""
    inferred = {v.name: v for v in session.model.graph.outputs}
    unknown = [o for o in session.outputs if o.shape is None and o.name in inferred]
    # a model holding maps (ZipMap's output) keeps its declared shapes: see map_types_erased
    if any(inferred[o.name].shape is None for o in unknown) and not map_types_erased(session.model):
        import onnx_ir as ir
        from onnx_ir.passes.common import ShapeInferencePass

        model = ir.from_proto(ir.to_proto(session.model))  # a copy: the session's graph stays as built
        ShapeInferencePass()(model)
        inferred = {v.name: v for v in model.graph.outputs}
    result = []
    for info in session.outputs:
        value = inferred.get(info.name)
        if info.shape is None and value is not None and value.shape is not None:
            dims = tuple(d if isinstance(d, int) else getattr(d, "value", None) for d in value.shape)
            info = dataclasses.replace(info, shape=dims)
        result.append(info)
    return result


def _provider_entries(providers: Any, provider_options: Sequence[Mapping[str, Any]] | None) -> list[tuple[str, dict]]:
    if providers is None:
        return []
    if isinstance(providers, str):
        providers = [providers]  # one name, not its characters
    entries = []
    for index, entry in enumerate(providers):
        if isinstance(entry, (tuple, list)):
            name, options = entry[0], dict(entry[1]) if len(entry) > 1 else {}
        else:
            name, options = entry, {}
        if provider_options is not None and index < len(provider_options):
            options.update(provider_options[index])
        entries.append((str(name), {str(k): str(v) for k, v in options.items()}))
    return entries


#: onnxruntime provider options that are plugrt session options: (provider, its key) -> ours
_PROVIDER_OPTION_KEYS = {("cuda", "use_tf32"): "cuda.tf32"}


def _session_options_of(entries: Sequence[tuple[str, Mapping[str, str]]]) -> dict[str, str]:
    """The plugrt session options onnxruntime's provider options mean (CUDAExecutionProvider's
    ``use_tf32`` is ``cuda.tf32``); the values are validated with the session's options."""
    found = {}
    for name, options in entries:
        provider = _ORT_NAMES.get(name, name)
        for key, value in options.items():
            ours = _PROVIDER_OPTION_KEYS.get((provider, key))
            if ours is not None:
                found[ours] = value
    return found


def _available_names() -> dict[str, str]:
    """plugrt name of each available provider, keyed by the names a user may give."""
    from .registry import default_registry

    names = {}
    for provider in default_registry().available():
        names[provider.name] = provider.name
        names[_PLUGRT_TO_ORT.get(provider.name, provider.name)] = provider.name
    return names


def _installed(name: str) -> bool:
    """Whether a plugrt provider of that name is installed (available or not)."""
    from .registry import default_registry

    return name in default_registry().providers()


def _resolve_providers(entries: list[tuple[str, dict]], strict: bool) -> list[str] | None:
    """The plugrt providers for onnxruntime-style entries: an unavailable one warns and is
    skipped (as onnxruntime does) unless ``strict``; none left raises."""
    if not entries:
        return None
    available = _available_names()
    chosen = []
    for name, _ in entries:
        plugrt_name = _ORT_NAMES.get(name, name)
        if name not in ORT_PROVIDER_NAMES and name not in available and not _installed(plugrt_name):
            # as onnxruntime: a warning for the name, then an error, since no provider has it
            warnings.warn(
                f"Specified provider '{name}' is not in available provider names. "
                f"Available providers: '{', '.join(get_available_providers())}'",
                stacklevel=4,
            )
            raise ProviderUnavailableError(
                name, f"Unknown Provider Type: {name}",
                hint=f"onnxruntime's names are in plugrt.ort.ORT_PROVIDER_NAMES; available: {', '.join(get_available_providers())}",
            )
        if available.get(name) or available.get(plugrt_name):
            chosen.append(available.get(name) or available[plugrt_name])
            continue
        if strict:
            chosen.append(plugrt_name)  # the registry raises with the cause
            continue
        warnings.warn(
            f"Specified provider '{name}' is not in available provider names. "
            f"Available providers: '{', '.join(get_available_providers())}'",
            stacklevel=4,
        )
    if not chosen:
        raise ProviderUnavailableError(
            ", ".join(name for name, _ in entries),
            "none of the requested providers is available",
            hint=f"available providers: {', '.join(get_available_providers())}",
        )
    return list(dict.fromkeys(chosen))


#: InferenceSession's keywords besides plugrt's options (onnxruntime's own).
_CONSTRUCTOR_KEYWORDS = (
    "path_or_bytes", "sess_options", "providers", "provider_options",
    "enable_fallback", "read_config_from_model", "disabled_optimizers",
)


class InferenceSession:
    """``onnxruntime.InferenceSession`` work-alike: change the import, keep the code."""

    def __init__(
        self,
        path_or_bytes: str | bytes | os.PathLike,
        sess_options: SessionOptions | None = None,
        providers: Sequence[Any] | str | None = None,
        provider_options: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        # onnxruntime's own keyword arguments; anything else is a plugrt option (strict)
        self._enable_fallback = int(kwargs.pop("enable_fallback", 1)) == 1
        kwargs.pop("read_config_from_model", None)
        disabled_optimizers = kwargs.pop("disabled_optimizers", None)
        if disabled_optimizers:
            raise NotSupportedError(
                "disabled_optimizers", "choose an optimisation level (SessionOptions.graph_optimization_level)"
            )
        unknown = [key for key in kwargs if key not in OPTIONS]
        if unknown:  # a typo of one of this constructor's own keywords is the likelier mistake
            raise UnknownOptionError(
                unknown[0],
                [*_CONSTRUCTOR_KEYWORDS, *OPTIONS],
                what="InferenceSession keyword",
                listed_in="InferenceSession's signature and plugrt.options.OPTIONS",
            )
        # what onnxruntime's own InferenceSession keeps, and clients read (optimum: _model_path)
        is_path = isinstance(path_or_bytes, (str, os.PathLike))
        self._model_path: str | None = str(os.fspath(path_or_bytes)) if is_path else None  # type: ignore[arg-type]
        self._model_bytes: Any = None if is_path else path_or_bytes  # kept as given, not copied
        if os.environ.get("ORT_LOAD_CONFIG_FROM_MODEL") == "1":
            sess_options = _options_from_model(path_or_bytes, sess_options)
        self._sess_options = sess_options
        self._model: Any = _model_source(path_or_bytes, sess_options)
        self._options = sess_options.to_options() if sess_options is not None else {}
        self._options.update(kwargs)
        self._sess = _NativeSession(self)
        self._build(providers, provider_options)

    def _build(self, providers: Any, provider_options: Sequence[Mapping[str, Any]] | None) -> None:
        entries = _provider_entries(providers, provider_options)
        strict = str(self._options.get("strict", "0")).lower() in ("1", "true")
        names = _resolve_providers(entries, strict)
        logger = logging.getLogger("plugrt")
        previous = logger.level
        if self._sess_options is not None:
            logger.setLevel(_LOG_LEVELS.get(int(self._sess_options.log_severity_level), logging.WARNING))
        try:
            options = {**self._options, **_session_options_of(entries)}
            self._session = Session(self._model, device="auto", providers=names, options=options)
            # onnxruntime logs its session's creation at verbose level; so does plugrt
            logger.debug("InferenceSession created on %s", ", ".join(self._session.providers))
        finally:
            logger.setLevel(previous)
        # what each run checks and converts, found once
        self._required_inputs = [i.name for i in self.get_inputs() if not i.type.startswith("optional(")]
        self._string_inputs = frozenset(i.name for i in self._session.inputs if i.type_string == "tensor(string)")
        options_by_name = {_ORT_NAMES.get(name, name): opts for name, opts in entries}
        self._provider_options = {
            ort_name: dict(options_by_name.get(plugrt_name, {}))
            for ort_name, plugrt_name in zip(self.get_providers(), self._session.providers)
        }
        self._profiling_start_ns = time.monotonic_ns()  # onnxruntime's clock for this value
        path = self._sess_options.optimized_model_filepath if self._sess_options is not None else ""
        if path:
            self._write_optimized(path)

    def _write_optimized(self, path: str) -> None:
        import onnx_ir as ir

        # the graph after the optimisation passes, before placement; at level "all" it may
        # hold fused com.microsoft ops, as onnxruntime's own optimised files do
        model = self._session.model
        configs = self._sess_options._configs if self._sess_options is not None else {}
        # initializers of at least min_size bytes go to data_file, beside the model (as onnxruntime)
        data_file = configs.get("session.optimized_model_external_initializers_file_name")
        threshold = int(configs.get("session.optimized_model_external_initializers_min_size_in_bytes", "1024"))
        if map_types_erased(model):  # written with the map types it declares (ZipMap's output)
            import onnx

            proto = ir.serde.serialize_model(model)
            write_declared_types(proto, model)
            if data_file:
                onnx.save(proto, os.fspath(path), save_as_external_data=True, location=data_file, size_threshold=threshold)
            else:
                onnx.save(proto, os.fspath(path))
            return
        if data_file:
            ir.save(model, os.fspath(path), external_data=data_file, size_threshold_bytes=threshold)
        else:
            ir.save(model, os.fspath(path))

    @property
    def session(self) -> Session:
        """The underlying plugrt session."""
        return self._session

    # -- running -----------------------------------------------------------------------

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: RunOptions | None = None) -> list:
        self._check_required(input_feed)
        strings = self._string_inputs
        feeds = {name: _as_strings(value) if name in strings else host_value(value) for name, value in input_feed.items()}
        try:
            return guarded_run(run_options, lambda: self._session.run_list(output_names, feeds))
        except KernelError as exc:
            if not self._enable_fallback or exc.provider == self._session.providers[-1]:
                raise
            # onnxruntime's fallback: a provider failed at run time, so rebuild on the
            # host provider alone and retry, once
            warnings.warn(
                f"EP Error: {exc} using {self.get_providers()}; falling back to "
                f"{_PLUGRT_TO_ORT.get(self._session.providers[-1], self._session.providers[-1])} and retrying",
                stacklevel=2,
            )
            self._build([self._session.providers[-1]], None)
            self._enable_fallback = False
            return guarded_run(run_options, lambda: self._session.run_list(output_names, feeds))

    def _check_required(self, input_feed: Mapping[str, Any]) -> None:
        """onnxruntime's check before a run: every input without a default is fed."""
        missing = [name for name in self._required_inputs if name not in input_feed]
        if missing:
            raise MissingInputError(missing[0], self._required_inputs, missing=missing, fed=list(input_feed))

    def run_with_ort_values(
        self, output_names: Sequence[str] | None, input_dict_ort_values: Mapping[str, OrtValue], run_options: RunOptions | None = None
    ) -> list[OrtValue]:
        return [OrtValue(v) for v in self.run(output_names, input_dict_ort_values, run_options)]

    def run_async(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        callback: Callable[[Any, Any, str], None],
        user_data: Any,
        run_options: RunOptions | None = None,
    ) -> None:
        """Run on a worker thread, then call ``callback(results, user_data, error)`` there
        (``error`` is "" on success, the message otherwise, as onnxruntime)."""

        def work() -> None:
            try:
                results = self.run(output_names, input_feed, run_options)
            except Exception as exc:  # reported to the callback, as onnxruntime does
                callback(None, user_data, f"{type(exc).__name__}: {exc}")
                return
            callback(results, user_data, "")

        threading.Thread(target=work, name="plugrt-run-async", daemon=True).start()

    def io_binding(self) -> IOBinding:
        return IOBinding(self._session)

    def run_with_iobinding(self, iobinding: IOBinding, run_options: RunOptions | None = None) -> None:
        if iobinding._session is not self._session:
            raise NotSupportedError(
                "an IOBinding of another session", "make the binding with this session's io_binding()"
            )
        iobinding.run(run_options)

    # -- introspection -----------------------------------------------------------------

    def get_inputs(self) -> list[NodeArg]:
        overridable = {i.name for i in self.get_overridable_initializers()}
        return [_node_arg(i) for i in self._session.inputs if i.name not in overridable]

    def get_outputs(self) -> list[NodeArg]:
        return [_node_arg(o) for o in _inferred_outputs(self._session)]

    def get_overridable_initializers(self) -> list[NodeArg]:
        initializers = {v.name for v in self._session.model.graph.inputs if v.const_value is not None}
        return [_node_arg(i) for i in self._session.inputs if i.name in initializers]

    def get_input_memory_infos(self) -> list[Any]:
        """Host memory for each input: ``run`` takes host arrays (device values go through
        IOBinding)."""
        return [_host_memory_info() for _ in self.get_inputs()]

    def get_output_memory_infos(self) -> list[Any]:
        """Host memory for each output: ``run`` returns host arrays."""
        return [_host_memory_info() for _ in self.get_outputs()]

    def get_input_epdevices(self) -> list[Any]:
        """One entry per input; None: plugrt does not expose onnxruntime's EP devices."""
        return [None for _ in self.get_inputs()]

    def get_provider_graph_assignment_info(self) -> list["EpAssignedSubgraph"]:
        """The nodes each provider runs, one entry per node (as onnxruntime's CPU provider
        reports them); needs ``session.record_ep_graph_assignment_info`` set to "1"."""
        configs = self._sess_options._configs if self._sess_options is not None else {}
        if configs.get("session.record_ep_graph_assignment_info") != "1":
            raise ConfigEntryRequiredError("session.record_ep_graph_assignment_info", "1", "get the provider graph assignment info")
        by_name = {p.name: p.provider for p in self._session.placement.partitions}
        result = []
        for compiled in self._session.compiled_partitions:
            provider = by_name.get(compiled.partition.name, "")
            for node in compiled.partition.nodes:
                result.append(EpAssignedSubgraph(_PLUGRT_TO_ORT.get(provider, provider), [EpAssignedNode(node.domain, node.op_type, node.name or "")]))
        return result

    def get_providers(self) -> list[str]:
        return [_PLUGRT_TO_ORT.get(p, p) for p in self._session.providers]

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        return {name: dict(options) for name, options in self._provider_options.items()}

    def get_session_options(self) -> SessionOptions:
        return self._sess_options or SessionOptions()

    def get_modelmeta(self) -> ModelMetadata:
        meta = self._session.metadata
        return ModelMetadata(
            producer_name=meta.producer_name,
            graph_name=meta.graph_name,
            domain=meta.domain,
            description=meta.description,
            graph_description="",
            version=meta.version,
            custom_metadata_map=dict(meta.custom_metadata_map),
        )

    def get_profiling_start_time_ns(self) -> int:
        return self._profiling_start_ns

    def set_providers(self, providers: Sequence[Any] | None = None, provider_options: Sequence[Mapping[str, Any]] | None = None) -> None:
        """Rebuild the session with another provider list (all available when None)."""
        self._build(providers, provider_options)

    def enable_fallback(self) -> None:
        self._enable_fallback = True

    def disable_fallback(self) -> None:
        self._enable_fallback = False

    def end_profiling(self) -> str:
        import json

        from .tracing import with_provider_names

        if not self._session.profiling:
            raise OptionError(
                "profiling is off; set SessionOptions.enable_profiling = True before creating the "
                "InferenceSession, or call InferenceSession.session.start_profiling() before the runs to profile",
                key="enable_profiling",
            )
        events = with_provider_names(self._session.profile(), _PLUGRT_TO_ORT)  # as onnxruntime names them
        prefix = self._sess_options.profile_file_prefix if self._sess_options is not None else "onnxruntime_profile_"
        path = f"{prefix}{self._profiling_start_ns}.json"
        with open(path, "w", encoding="utf-8") as f:
            json.dump(events, f)
        return path

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        alternative = _ALTERNATIVES.get(name, "the plugrt session is InferenceSession.session (plugrt.Session)")
        raise NotSupportedError(f"InferenceSession.{name}", alternative)

    def __repr__(self) -> str:
        return f"InferenceSession(providers={self.get_providers()}, session={self._session!r})"


def get_available_providers() -> list[str]:
    from .registry import default_registry

    return [_PLUGRT_TO_ORT.get(p.name, p.name) for p in default_registry().available()]


def get_all_providers() -> list[str]:
    """Every provider name onnxruntime knows (CPUExecutionProvider last), then plugrt
    providers that stand for none of them."""
    from .registry import default_registry

    extra = [name for name in default_registry().providers() if _PLUGRT_TO_ORT.get(name, name) not in ORT_PROVIDER_NAMES]
    return [*ORT_PROVIDER_NAMES[:-1], *extra, ORT_PROVIDER_NAMES[-1]]


def get_device() -> str:
    """"GPU" when a GPU provider is available, else "CPU" (onnxruntime's build device)."""
    from .provider import DeviceKind
    from .registry import default_registry

    registry = default_registry()
    for provider in registry.available():
        if any(d.kind == DeviceKind.GPU for d in registry.devices(provider.name)):
            return "GPU"
    return "CPU"


@dataclasses.dataclass(frozen=True)
class EpAssignedNode:
    """A node as ``get_provider_graph_assignment_info`` reports it."""

    domain: str
    op_type: str
    name: str


@dataclasses.dataclass(frozen=True)
class EpAssignedSubgraph:
    """Nodes one provider runs: ``ep_name`` and ``get_nodes()``."""

    ep_name: str
    nodes: list

    def get_nodes(self) -> list[EpAssignedNode]:
        return list(self.nodes)


class _NativeSession:
    """``InferenceSession._sess``: onnxruntime's native session, whose
    ``run_with_ort_values(feeds, output_names, run_options)`` some clients call."""

    def __init__(self, owner: InferenceSession) -> None:
        self._owner = owner

    def run_with_ort_values(self, feeds: Mapping[str, Any], output_names: Sequence[str] | None, run_options: RunOptions | None = None) -> Any:
        from ._ort_values import OrtValueVector

        return OrtValueVector(self._owner.run_with_ort_values(output_names, feeds, run_options))


def _as_strings(value: Any) -> Any:
    """A string input as plugrt's kernels take it: bytes (``S``) and void (``V``) arrays, as
    onnxruntime accepts them, become arrays of str."""
    value = host_value(value)
    if isinstance(value, np.ndarray) and value.dtype.kind in "SV":
        flat = [bytes(v.tobytes() if value.dtype.kind == "V" else v).rstrip(b"\0").decode("utf-8") for v in value.ravel()]
        return np.array(flat, dtype=object).reshape(value.shape)
    return value


def _host_memory_info() -> Any:
    from ._ort_env import OrtAllocatorType, OrtMemoryInfo, OrtMemType

    return OrtMemoryInfo("Cpu", OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, OrtMemType.DEFAULT)


def _model_proto(source: Any) -> Any:
    """The model's proto without its external data (read later through the loader's checks)."""
    import onnx

    if isinstance(source, (str, os.PathLike)):
        return onnx.load(os.fspath(source), load_external_data=False)
    return onnx.load_from_string(bytes(source))


def _options_from_model(source: Any, sess_options: SessionOptions | None) -> SessionOptions:
    """onnxruntime's ``ORT_LOAD_CONFIG_FROM_MODEL=1``: the ``session_options`` of the JSON in
    the model's ``ort_config`` metadata override the given options."""
    import json

    options = sess_options if sess_options is not None else SessionOptions()
    props = {p.key: p.value for p in _model_proto(source).metadata_props}
    if _ORT_CONFIG_KEY not in props:
        return options
    settings = json.loads(props[_ORT_CONFIG_KEY]).get("session_options", {})
    for key, value in settings.items():
        if key == "enable_profiling":
            value = bool(value)
        if key not in vars(options) or key.startswith("_"):
            raise UnknownOptionError(key, [k for k in vars(options) if not k.startswith("_")], what="session option in the model's ort_config")
        setattr(options, key, value)
    return options


def _model_source(source: Any, sess_options: SessionOptions | None) -> Any:
    """The model as the session loads it: the source itself, or, when the options override
    free dimensions or supply external initializers (as arrays or in-memory files), a
    ModelProto with those applied."""
    if sess_options is None:
        return source
    options = sess_options
    if not (options._free_dims_by_name or options._free_dims_by_denotation or options._external_arrays or options._files_in_memory):
        return source
    model = _model_proto(source)
    is_path = isinstance(source, (str, os.PathLike))
    _resolve_external_data(model, os.path.dirname(os.path.abspath(os.fspath(source))) if is_path else "", str(source) if is_path else "<bytes>", options)
    for value in model.graph.input:
        if not value.type.HasField("tensor_type"):
            continue
        for dim in value.type.tensor_type.shape.dim:
            size = options._free_dims_by_denotation.get(dim.denotation) if dim.denotation else None
            if size is None and dim.HasField("dim_param"):
                size = options._free_dims_by_name.get(dim.dim_param)
            if size is not None:
                dim.dim_value = size  # clears dim_param (a oneof)
    return model


def _resolve_external_data(model: Any, base_dir: str, label: str, options: SessionOptions) -> None:
    """Fill each external initializer of ``model`` in place: from the options' arrays or
    in-memory files when they have it, else from its file beside the model, through the
    loader's own containment checks (no path outside the model's folder is read)."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_tensor

    from .loader import contained_path

    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        if tensor.name in options._external_arrays:
            tensor.CopyFrom(onnx.numpy_helper.from_array(options._external_arrays[tensor.name], tensor.name))
            continue
        if location in options._files_in_memory:
            data = options._files_in_memory[location]
            offset = int(info.get("offset", 0))
            end = offset + int(info["length"]) if "length" in info else len(data)
            tensor.raw_data = bytes(data[offset:end])
        else:
            contained_path(tensor.name, location, base_dir, label)  # raises ModelLoadError if missing or unsafe
            load_external_data_for_tensor(tensor, base_dir)
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]
