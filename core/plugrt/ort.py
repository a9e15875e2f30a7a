"""An onnxruntime-compatible facade: ``plugrt.InferenceSession`` behaves like ort's.

Where plugrt departs from onnxruntime on purpose, it says so here:

- ``providers="CPUExecutionProvider"`` (a string) is one provider name; onnxruntime
  iterates it character by character and warns for each.
- A provider list in which no provider is available raises ProviderUnavailableError;
  onnxruntime silently runs on the CPU.
- An unknown session config key raises UnknownOptionError; onnxruntime accepts any key.
  onnxruntime's documented keys are accepted: those in ``MAPPED_CONFIG_KEYS`` have a
  plugrt meaning, those in ``IGNORED_CONFIG_KEYS`` are accepted and have no effect.
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

from ._ort_values import IOBinding, OrtValue, RunOptions, guarded_run, host_value
from .errors import KernelError, NotSupportedError, OptionError, ProviderUnavailableError, UnknownOptionError
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
    "add_free_dimension_override_by_name": "pass inputs of the size you want: symbolic dims bind per run",
    "add_free_dimension_override_by_denotation": "pass inputs of the size you want: symbolic dims bind per run",
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

    def add_initializer(self, name: str, value: Any) -> None:
        """Use ``value`` (an OrtValue or a numpy array, kept without a copy) for the model's
        initializer ``name``. Sessions made with these options also share all their other
        weights (a plugrt.WeightStore)."""
        if self._weights is None:
            self._weights = WeightStore()
        self._weights.add_initializer(name, value.numpy() if isinstance(value, OrtValue) else value)

    def add_external_initializers(self, names: Sequence[str], values: Sequence[Any]) -> None:
        """:meth:`add_initializer` for each name and value."""
        for name, value in zip(names, values, strict=True):
            self.add_initializer(name, value)

    def add_session_config_entry(self, key: str, value: str) -> None:
        """Set an onnxruntime config key or a plugrt option; an unknown key raises now."""
        if key not in MAPPED_CONFIG_KEYS and key not in IGNORED_CONFIG_KEYS and key not in OPTIONS:
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
            raise OptionError(f"SessionOptions does not have configuration with key: {key}", key=key) from None

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
            if key in IGNORED_CONFIG_KEYS:
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


def _available_names() -> dict[str, str]:
    """plugrt name of each available provider, keyed by the names a user may give."""
    from .registry import default_registry

    names = {}
    for provider in default_registry().available():
        names[provider.name] = provider.name
        names[_PLUGRT_TO_ORT.get(provider.name, provider.name)] = provider.name
    return names


def _resolve_providers(entries: list[tuple[str, dict]], strict: bool) -> list[str] | None:
    """The plugrt providers for onnxruntime-style entries: an unavailable one warns and is
    skipped (as onnxruntime does) unless ``strict``; none left raises."""
    if not entries:
        return None
    available = _available_names()
    chosen = []
    for name, _ in entries:
        plugrt_name = _ORT_NAMES.get(name, name)
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
        self._model = path_or_bytes
        self._sess_options = sess_options
        self._options = sess_options.to_options() if sess_options is not None else {}
        self._options.update(kwargs)
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
            self._session = Session(self._model, device="auto", providers=names, options=self._options)
        finally:
            logger.setLevel(previous)
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
        if map_types_erased(model):  # written with the map types it declares (ZipMap's output)
            import onnx

            proto = ir.serde.serialize_model(model)
            write_declared_types(proto, model)
            onnx.save(proto, os.fspath(path))
            return
        ir.save(model, os.fspath(path))

    @property
    def session(self) -> Session:
        """The underlying plugrt session."""
        return self._session

    # -- running -----------------------------------------------------------------------

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: RunOptions | None = None) -> list:
        feeds = {name: host_value(value) for name, value in input_feed.items()}
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
    from .registry import default_registry

    return [_PLUGRT_TO_ORT.get(name, name) for name in default_registry().providers()]


def get_device() -> str:
    """"GPU" when a GPU provider is available, else "CPU" (onnxruntime's build device)."""
    from .provider import DeviceKind
    from .registry import default_registry

    registry = default_registry()
    for provider in registry.available():
        if any(d.kind == DeviceKind.GPU for d in registry.devices(provider.name)):
            return "GPU"
    return "CPU"
