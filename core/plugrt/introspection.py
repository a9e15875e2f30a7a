"""What a built session shows about itself: placement, providers, devices, the model as built."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx_ir as ir

    from .build import BuiltGraph
    from .capture import CaptureSlots, CaptureStats
    from .intent import Selection
    from .placement import PlacementReport
    from .provider import CompiledPartition, Device
    from .signature import InputSignature, ModelMetadata
    from .transfers import MemorySpaces, TransferCounter

__all__ = ["SessionIntrospection"]


class SessionIntrospection:
    """The read-only views of a :class:`plugrt.Session`."""

    model_path: str | None
    metadata: "ModelMetadata"
    selection: "Selection"
    _model: "ir.Model"
    _built: "BuiltGraph"
    _signature: "InputSignature"
    _spaces: "MemorySpaces"
    _captures: "CaptureSlots"

    @property
    def initializer_inputs(self) -> list[str]:
        """Inputs that have an initializer as default (may be omitted or overridden)."""
        return [s.name for s in self._signature.specs if s.default is not None]

    @property
    def transfers(self) -> "TransferCounter":
        """Copies between memory spaces so far (``snapshot()`` / ``since()`` for one run)."""
        return self._spaces.counter

    @property
    def capture_stats(self) -> "CaptureStats":
        """Replays, eager fallbacks with their reasons, bytes allocated during replays."""
        return self._captures.stats

    def __repr__(self) -> str:
        model = self.model_path or f"<{self.metadata.graph_name or 'model'} given as bytes>"
        nodes = ", ".join(f"{p}: {n}" for p, n in self.placement.nodes_per_provider.items())
        return f"Session(model={model!r}, providers={self.providers}, placement={{{nodes}}})"

    @property
    def placement(self) -> "PlacementReport":
        """Where each node runs, fallbacks with their reasons, and transfers."""
        return self._built.report

    @property
    def providers(self) -> list[str]:
        """The providers this session uses, in priority order."""
        return [p.name for p in self.selection.providers]

    @property
    def devices(self) -> dict[str, "Device"]:
        """The device each provider of this session runs on, by provider name."""
        return dict(self.selection.devices)

    @property
    def compiled_partitions(self) -> list["CompiledPartition"]:
        """The compiled partitions, in execution order (restored ones included)."""
        return list(self._built.compiled)

    @property
    def model(self) -> "ir.Model":
        """The model as built: after inlining, expansion and optimisation passes."""
        return self._model
