"""SessionBuilder: fluent construction of a session, with shared weights and warm-up runs."""

from __future__ import annotations

import os
from typing import Any

from .errors import OptionError
from .loader import ModelSource
from .registry import ProviderRegistry
from .session import Session
from .warmup import WarmupShapes
from .weights import WeightStore, adopt_session

__all__ = ["SessionBuilder"]


class SessionBuilder:
    """Fluent construction: ``SessionBuilder().model(p).device("gpu").option(k, v).build()``."""

    def __init__(self) -> None:
        self._model: ModelSource | None = None
        self._device: str | None = "auto"
        self._providers: list[str] | None = None
        self._options: dict[str, Any] = {}
        self._warmup: tuple[WarmupShapes | None, int] | None = None
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

    def weights(self, store: WeightStore) -> "SessionBuilder":
        """Share initializers (and the forms providers prepare from them) with every other
        session built with ``store``; see :class:`plugrt.WeightStore`."""
        return self.option("weights", store)

    def share_weights_with(self, session: Session) -> "SessionBuilder":
        """Share ``session``'s weights: the new session holds no second copy of an
        initializer ``session`` has (matched by content, so another file or device intent
        of the same weights qualifies). Uses ``session.weights``; a session built without
        a store gets one holding its initializers (its prepared forms, built without a
        store, are not shared then: build the first session with ``.weights(store)``)."""
        return self.option("weights", adopt_session(session))

    def warmup(self, shapes: WarmupShapes | int | None = None, *, runs: int = 1) -> "SessionBuilder":
        """After building, run the model ``runs`` times per entry of ``shapes`` on generated
        inputs (see :meth:`Session.warmup`), e.g. ``warmup([{"input_ids": (1, 16)},
        {"input_ids": (1, 1)}])``. An int is a number of runs on the declared shapes."""
        if isinstance(shapes, int):
            self._warmup = (None, int(shapes))
        else:
            self._warmup = (shapes, runs)  # checked at build, against the model's inputs
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
        if self._warmup is not None:
            shapes, runs = self._warmup
            session.warmup(shapes, runs=runs)
        return session
