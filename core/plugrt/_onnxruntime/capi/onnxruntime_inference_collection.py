"""``onnxruntime.capi.onnxruntime_inference_collection``: the session classes, and the
provider-argument normaliser clients call."""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

from ..._ort_values import IOBinding, OrtValue
from ...ort import InferenceSession, ModelMetadata, NodeArg, SessionOptions

__all__ = ["InferenceSession", "IOBinding", "OrtValue", "SessionOptions", "NodeArg", "ModelMetadata", "Session",
           "check_and_normalize_provider_args"]

Session = InferenceSession


def check_and_normalize_provider_args(
    providers: Sequence[Any] | None,
    provider_options: Sequence[Mapping[Any, Any]] | None,
    available_provider_names: Sequence[str],
) -> tuple[list[str], list[dict[str, str]]]:
    """``providers`` (names or ``(name, options)`` pairs) and ``provider_options`` (one dict
    per provider) as two lists: names, and options with string keys and values. A name given
    twice warns and keeps its first entry; malformed arguments raise ValueError."""
    if providers is None:
        return [], []
    if isinstance(providers, str) or not isinstance(providers, Sequence):
        raise ValueError("'providers' should be a sequence of provider names or (name, options) pairs")
    mixed = any(isinstance(p, tuple) for p in providers)
    if provider_options is not None:
        if mixed:
            raise ValueError("'provider_options' cannot be given when 'providers' holds (name, options) pairs")
        if isinstance(provider_options, (str, Mapping)) or not isinstance(provider_options, Sequence):
            raise ValueError("'provider_options' should be a sequence of dicts")
        if len(provider_options) != len(providers):
            raise ValueError("'providers' and 'provider_options' should be the same length")
    names: list[str] = []
    options: list[dict[str, str]] = []
    for index, entry in enumerate(providers):
        if isinstance(entry, tuple):
            if len(entry) != 2 or not isinstance(entry[0], str) or not isinstance(entry[1], Mapping):
                raise ValueError(f"a (name, options) provider entry must be (str, dict), got {entry!r}")
            name, given = entry
        elif isinstance(entry, str):
            name, given = entry, (provider_options[index] if provider_options is not None else {})
        else:
            raise ValueError(f"a provider must be a name or a (name, options) pair, got {entry!r}")
        if not isinstance(given, Mapping):
            raise ValueError(f"provider options must be a dict, got {given!r}")
        if name in names:
            warnings.warn(f"duplicate provider {name!r} listed; its first entry is used", UserWarning, stacklevel=2)
            continue
        if name not in available_provider_names:
            warnings.warn(f"Specified provider {name!r} is not in available provider names", UserWarning, stacklevel=2)
        names.append(name)
        options.append({str(k): str(v) for k, v in given.items()})
    return names, options
