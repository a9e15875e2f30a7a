"""An onnxruntime-compatible facade: ``plugrt.InferenceSession`` behaves like ort's."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

from .session import Session, TensorInfo

__all__ = ["InferenceSession", "SessionOptions", "NodeArg", "ModelMetadata", "get_available_providers"]

#: onnxruntime provider names and the plugrt providers they mean.
_ORT_NAMES = {
    "CPUExecutionProvider": "cpu",
    "CUDAExecutionProvider": "cuda",
    "TensorrtExecutionProvider": "cuda",
}
_GRAPH_LEVELS = {0: "none", 1: "basic", 2: "all", 99: "all"}


class SessionOptions:
    """The subset of ``onnxruntime.SessionOptions`` plugrt honours."""

    def __init__(self) -> None:
        self.graph_optimization_level = 99
        self.enable_profiling = False
        self.intra_op_num_threads = 0
        self.inter_op_num_threads = 0
        self.log_severity_level = 2
        self._configs: dict[str, str] = {}

    def add_session_config_entry(self, key: str, value: str) -> None:
        self._configs[key] = value

    def to_options(self) -> dict[str, Any]:
        level = int(self.graph_optimization_level)
        options: dict[str, Any] = {
            "optimization": _GRAPH_LEVELS.get(level, "all"),
            "profiling": bool(self.enable_profiling),
            "intra_op_num_threads": int(self.intra_op_num_threads),
        }
        mapping = {
            "ep.context_enable": "ep.context_enable",
            "ep.context_file_path": "ep.context_file_path",
            "ep.context_embed_mode": "ep.context_embed_mode",
        }
        for key, value in self._configs.items():
            if key in mapping:
                options[mapping[key]] = value
            else:
                options[key] = value  # strict: unknown keys are reported by the session
        return options


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
    shape = list(info.shape) if info.shape is not None else []
    return NodeArg(info.name, info.type_string, shape)


def _provider_names(providers: Sequence[Any] | None) -> list[str] | None:
    if not providers:
        return None
    names = []
    for entry in providers:
        name = entry[0] if isinstance(entry, (tuple, list)) else entry
        names.append(_ORT_NAMES.get(name, name))
    return list(dict.fromkeys(names))


class InferenceSession:
    """``onnxruntime.InferenceSession`` work-alike: change the import, keep the code."""

    def __init__(
        self,
        path_or_bytes: str | bytes | os.PathLike,
        sess_options: SessionOptions | None = None,
        providers: Sequence[Any] | None = None,
        provider_options: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        options = sess_options.to_options() if sess_options is not None else {}
        options.update(kwargs)
        names = _provider_names(providers)
        self._session = Session(path_or_bytes, device="auto", providers=names, options=options)
        self._sess_options = sess_options

    @property
    def session(self) -> Session:
        """The underlying plugrt session."""
        return self._session

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: Any = None) -> list:
        return self._session.run_list(output_names, input_feed)

    def get_inputs(self) -> list[NodeArg]:
        initializer_inputs = {s.name for s in self._session._specs if s.default is not None}
        return [_node_arg(i) for i in self._session.inputs if i.name not in initializer_inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [_node_arg(o) for o in self._session.outputs]

    def get_overridable_initializers(self) -> list[NodeArg]:
        names = {s.name for s in self._session._specs if s.default is not None}
        return [_node_arg(i) for i in self._session.inputs if i.name in names]

    def get_providers(self) -> list[str]:
        reverse = {v: k for k, v in reversed(list(_ORT_NAMES.items()))}
        return [reverse.get(p, p) for p in self._session.providers]

    def get_provider_options(self) -> dict:
        return {name: {} for name in self.get_providers()}

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

    def end_profiling(self) -> str:
        import json
        import tempfile

        events = self._session.profile()
        fd, path = tempfile.mkstemp(prefix="plugrt_profile_", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(events, f)
        return path


def get_available_providers() -> list[str]:
    from .registry import default_registry

    reverse = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
    return [reverse.get(p.name, p.name) for p in default_registry().available()]


