"""SessionBuilder: fluent construction of a session, with optional warm-up runs."""

from __future__ import annotations

import os
from typing import Any

from .errors import OptionError
from .inputs import example_inputs
from .loader import ModelSource
from .registry import ProviderRegistry
from .session import Session

__all__ = ["SessionBuilder"]


class SessionBuilder:
    """Fluent construction: ``SessionBuilder().model(p).device("gpu").option(k, v).build()``."""

    def __init__(self) -> None:
        self._model: ModelSource | None = None
        self._device: str | None = "auto"
        self._providers: list[str] | None = None
        self._options: dict[str, Any] = {}
        self._warmup: int = 0
        self._registry: ProviderRegistry | None = None

    def model(self, path: str | os.PathLike) -> "SessionBuilder":
        self._model = path
        return self

    def model_bytes(self, data: bytes) -> "SessionBuilder":
        self._model = bytes(data)
        return self

    def device(self, device: str) -> "SessionBuilder":
        self._device = device
        return self

    def provider(self, name: str) -> "SessionBuilder":
        """Add an explicit provider (in priority order); the CPU fallback is added last."""
        self._providers = (self._providers or []) + [name]
        return self

    def option(self, key: str, value: Any) -> "SessionBuilder":
        self._options[key] = value
        return self

    def options(self, **options: Any) -> "SessionBuilder":
        self._options.update(options)
        return self

    def registry(self, registry: ProviderRegistry) -> "SessionBuilder":
        self._registry = registry
        return self

    def warmup(self, runs: int = 1) -> "SessionBuilder":
        """Run the model ``runs`` times on inputs of the declared shapes after building."""
        self._warmup = runs
        return self

    def build(self) -> Session:
        if self._model is None:
            raise OptionError("SessionBuilder needs a model: call .model(path) or .model_bytes(data)", key="model")
        session = Session(
            self._model,
            device=self._device,
            providers=self._providers,
            options=self._options,
            registry=self._registry,
        )
        if self._warmup:
            feeds = example_inputs(session.inputs)
            for _ in range(self._warmup):
                session.run(feeds)
        return session
