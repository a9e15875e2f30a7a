"""Device intent: turn ``device="gpu:1"`` or a policy into an ordered provider list."""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Sequence

from .errors import InvalidOptionValueError, ProviderUnavailableError
from .provider import Device, DeviceKind, ExecutionProvider

if TYPE_CHECKING:
    from .registry import ProviderRegistry

__all__ = ["Selection", "resolve_device", "POLICIES", "ESTIMATED_INTENTS"]

#: Policies, named as onnxruntime's provider selection policies are.
POLICIES = ("prefer_cpu", "prefer_gpu", "prefer_npu", "max_performance", "min_power")
_KIND_ORDER = {
    "prefer_cpu": (DeviceKind.CPU, DeviceKind.NPU, DeviceKind.GPU, DeviceKind.OTHER),
    "prefer_gpu": (DeviceKind.GPU, DeviceKind.NPU, DeviceKind.OTHER, DeviceKind.CPU),
    "prefer_npu": (DeviceKind.NPU, DeviceKind.GPU, DeviceKind.OTHER, DeviceKind.CPU),
    "min_power": (DeviceKind.NPU, DeviceKind.CPU, DeviceKind.OTHER, DeviceKind.GPU),
}
#: Intents placed by estimate (the fastest assignment the estimates find): those that ask
#: for speed and name no provider or device. The others (a provider list or name, a
#: device such as "gpu:1", "prefer_cpu", "min_power") place by priority.
ESTIMATED_INTENTS = frozenset({"auto", "max_performance", "prefer_gpu", "prefer_npu"})
_DEVICE_RE = re.compile(r"^(gpu|npu|cuda|cpu)(?::(\d+))?$")


@dataclasses.dataclass
class Selection:
    """The providers a session uses, in priority order (fallback last), and their devices."""

    providers: list[ExecutionProvider]
    devices: dict[str, Device]
    pinned: frozenset[str]  # providers the user asked for by name: their failures are errors
    intent: str

    @property
    def by_estimate(self) -> bool:
        """Whether this selection is placed by estimate rather than by priority."""
        return not self.pinned and self.intent in ESTIMATED_INTENTS and len(self.providers) > 1


def _may_offer(provider: ExecutionProvider, kind: DeviceKind) -> bool:
    """False only for a provider whose declared ``device_kinds`` leave ``kind`` out, so
    that an intent for one kind never probes (imports drivers for) providers of another."""
    kinds = getattr(provider, "device_kinds", None)
    if kinds is None:
        return True
    try:
        return kind in {DeviceKind(k) for k in kinds}
    except (TypeError, ValueError):  # a malformed declaration: probe as if there were none
        return True


def _usable(registry: "ProviderRegistry", kind: DeviceKind) -> list[ExecutionProvider]:
    """Usable providers that may offer a ``kind`` device, highest priority first, probing
    only those."""
    return [
        p
        for name, p in registry.providers().items()
        if _may_offer(p, kind) and registry.unavailable_reason(name) is None
    ]


def _fallback(registry: "ProviderRegistry") -> ExecutionProvider | None:
    host = [p for p in _usable(registry, DeviceKind.CPU) if any(d.kind == DeviceKind.CPU for d in registry.devices(p.name))]
    return min(host, key=lambda p: getattr(p, "priority", 0)) if host else None


def _with_fallback(chosen: list[ExecutionProvider], registry: "ProviderRegistry") -> list[ExecutionProvider]:
    fallback = _fallback(registry)
    if fallback is not None and all(p is not fallback for p in chosen):
        chosen = chosen + [fallback]
    return chosen


def _first_device(registry: "ProviderRegistry", name: str, kind: DeviceKind | None = None, index: int | None = None) -> Device | None:
    for device in registry.devices(name):
        if (kind is None or device.kind == kind) and (index is None or device.index == index):
            return device
    return None


def resolve_device(
    device: str | None,
    providers: Sequence[str] | None,
    registry: "ProviderRegistry",
) -> Selection:
    """Resolve a device intent or an explicit provider list against what is installed."""
    devices: dict[str, Device] = {}
    if providers:
        chosen = []
        for name in providers:
            provider = registry.get(name)  # raises ProviderUnavailableError with the cause
            chosen.append(provider)
            devices[name] = registry.devices(name)[0]
        chosen = _with_fallback(chosen, registry)
        for p in chosen:
            devices.setdefault(p.name, registry.devices(p.name)[0])
        return Selection(chosen, devices, frozenset(providers), "providers=" + ",".join(providers))

    intent = (device or "auto").strip().lower() if isinstance(device, str) else device
    if not isinstance(intent, str):
        raise InvalidOptionValueError("device", device, _DEVICE_CHOICES)
    # A negative priority marks an opt-in provider (an example, a simulator): used only
    # when asked for by name or in an explicit provider list, never picked by intent.
    def by_intent(providers: list[ExecutionProvider]) -> list[ExecutionProvider]:
        return [p for p in providers if int(getattr(p, "priority", 0)) >= 0]

    if intent in ("auto", "max_performance"):
        chosen = by_intent(registry.available())  # already highest priority first
    elif intent in _KIND_ORDER:
        available = by_intent(registry.available())
        order = _KIND_ORDER[intent]

        def rank(p: ExecutionProvider) -> tuple[int, int]:
            kinds = [d.kind for d in registry.devices(p.name)]
            best = min((order.index(k) for k in kinds if k in order), default=len(order))
            return (best, -int(getattr(p, "priority", 0)))

        chosen = sorted(available, key=rank)
    else:
        match = _DEVICE_RE.match(intent)
        if match:
            kind_word, index_text = match.groups()
            index = int(index_text) if index_text is not None else None
            if kind_word == "cuda":
                provider = registry.get("cuda")
                found = _first_device(registry, "cuda", None, index)
                if found is None:
                    have = ", ".join(str(d) for d in registry.devices("cuda"))
                    raise ProviderUnavailableError(
                        "cuda", f"it has no device {index} (it has: {have})", hint="choose one of its devices, e.g. device='cuda:0'"
                    )
                devices["cuda"] = found
                chosen = [provider]
            else:
                kind = DeviceKind(kind_word)
                chosen = []
                for p in by_intent(_usable(registry, kind)):
                    found = _first_device(registry, p.name, kind, index)
                    if found is not None:
                        devices[p.name] = found
                        chosen = [p]
                        break
                if not chosen:
                    raise _no_device(registry, kind, kind_word if index is None else f"{kind_word}:{index}")
        elif intent in registry.providers() or intent in registry.failures() or intent in registry.disabled:
            chosen = [registry.get(intent)]
            return _selection(chosen, devices, registry, frozenset({intent}), intent)
        else:
            raise InvalidOptionValueError("device", device, _DEVICE_CHOICES + _installed(registry))
        return _selection(chosen, devices, registry, frozenset(), intent)
    return _selection(chosen, devices, registry, frozenset(), intent)


def _no_device(registry: "ProviderRegistry", kind: DeviceKind, where: str) -> ProviderUnavailableError:
    """Why no provider offers a ``where`` device, and what to do: install one, or (one is
    installed but cannot run here) fall back to the CPU."""
    from .registry import LOAD_STAGES, install_hint

    have = {
        p.name: [str(d) for d in registry.devices(p.name)]
        for p in registry.available()
        if int(getattr(p, "priority", 0)) >= 0
    }
    failures = registry.failures()
    # installed providers of this kind without a device say why (e.g. cuda: no CUDA driver)
    idle = {
        name: why
        for name, p in registry.providers().items()
        if name not in failures and _may_offer(p, kind) and (why := registry.unavailable_reason(name))
    }
    cause = f"no installed provider offers a {where} device (available: {have})"
    if idle:
        cause += "; unavailable: " + "; ".join(f"{name}: {why}" for name, why in idle.items())
    if failures:
        cause += "; failed providers: " + "; ".join(str(f) for f in failures.values())
    fall_back = "use device='cpu', or device='auto' to fall back to what is available"
    if idle:
        hint = f"{' and '.join(idle)} is installed but cannot run here (why: above): fix that, or {fall_back}"
    elif broken := [f.name for f in failures.values() if f.stage in LOAD_STAGES]:
        hint = f"{', '.join(broken)} failed to load (see above): reinstall or uninstall its package; or {fall_back}"
    elif kind == DeviceKind.GPU and "cuda" in registry.disabled:
        hint = registry.unavailable_hint("cuda")
    elif kind == DeviceKind.GPU:
        hint = f"{install_hint('cuda')}; or {fall_back}"
    else:
        hint = f"install a provider package that offers a {kind.value} device; or {fall_back}"
    return ProviderUnavailableError(where, cause, hint=hint)


def _selection(chosen, devices, registry, pinned, intent) -> Selection:
    chosen = _with_fallback(list(chosen), registry)
    for p in chosen:
        if p.name not in devices:
            devices[p.name] = registry.devices(p.name)[0]
    return Selection(chosen, devices, pinned, intent)


_DEVICE_CHOICES = (
    "'auto', 'cpu', 'gpu', 'gpu:N', 'cuda:N', 'npu', a provider name, or a policy ("
    + ", ".join(POLICIES)
    + ")"
)


def _installed(registry: "ProviderRegistry") -> str:
    return "; installed providers: " + (", ".join(registry.providers()) or "none")
