"""Provider discovery: entry points through importlib-metadata, lifecycle through pluggy."""

from __future__ import annotations

import dataclasses
import os
import threading
import traceback
from typing import Any, Iterable, cast

import importlib_metadata
import pluggy

from . import hookspecs
from .errors import ProviderUnavailableError
from .provider import SUPPORTED_PROTOCOL_VERSIONS, Device, ExecutionProvider, missing_memory_members, protocol_version

__all__ = ["ProviderFailure", "ProviderRegistry", "default_registry", "DISABLE_ENV", "INSTALL_COMMANDS", "LOAD_STAGES", "install_hint"]

#: Comma-separated provider names that discovery skips (like an uninstall, without one).
DISABLE_ENV = "PLUGRT_DISABLE_PROVIDERS"


#: How to install the providers this repository ships, by provider name (from a checkout:
#: plugrt and its providers are on no package index).
INSTALL_COMMANDS = {
    "cuda": "pip install \"./providers/cuda[cuda12]\" (or \"./providers/cuda[cuda13]\" for CUDA 13) "
    "from the plugrt checkout",
}

#: Stages at which a plugin itself failed (a broken package), as opposed to a provider
#: that loaded and found no device.
LOAD_STAGES = ("import", "init", "protocol")

#: The built-in provider's name, and the only package allowed to offer it.
_BUILT_IN = "cpu"
_BUILT_IN_PACKAGE = "plugrt_cpu"


@dataclasses.dataclass(frozen=True)
class ProviderFailure:
    """Why a plugin or provider could not be used."""

    name: str  # entry-point or provider name
    stage: str  # "import", "init", "protocol", "memory", "devices", "supports_op", "compile"
    cause: str  # "ExceptionType: message"
    detail: str = ""  # formatted traceback

    def __str__(self) -> str:
        return f"{self.name}: {self.stage} failed: {self.cause}"


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class ProviderRegistry:
    """The providers installed in this environment.

    Created on demand (never at import). Discovery loads every entry point of
    :data:`hookspecs.ENTRY_POINT_GROUP`; a plugin that fails to import or initialise is
    remembered with its cause and only becomes an error when a user asks for it by name.
    """

    def __init__(
        self,
        *,
        entry_points: Iterable[Any] | None = None,
        plugins: Iterable[Any] = (),
        disabled: Iterable[str] | None = None,
    ) -> None:
        self._entry_points = entry_points
        self._extra_plugins = list(plugins)
        env = os.environ.get(DISABLE_ENV, "")
        self.disabled = frozenset(
            n.strip() for n in (disabled if disabled is not None else env.split(",")) if n.strip()
        )
        self._lock = threading.Lock()
        self._providers: dict[str, ExecutionProvider] | None = None
        self._failures: dict[str, ProviderFailure] = {}
        self._devices: dict[str, list[Device]] = {}
        self.plugin_manager: pluggy.PluginManager | None = None

    # -- discovery ---------------------------------------------------------------------

    def _discover(self) -> dict[str, ExecutionProvider]:
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        eps = self._entry_points
        if eps is None:
            eps = importlib_metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)
        for ep in eps:
            if ep.name in self.disabled:
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin never breaks the runtime
                self._failures[ep.name] = ProviderFailure(
                    ep.name, "import", _describe(exc), traceback.format_exc()
                )
                continue
            if pm.is_registered(plugin):
                continue
            try:
                pm.register(plugin, name=ep.name)
            except Exception as exc:
                self._failures[ep.name] = ProviderFailure(ep.name, "init", _describe(exc))
        for plugin in self._extra_plugins:
            if not pm.is_registered(plugin):  # may also be installed through its entry point
                pm.register(plugin)

        providers: dict[str, ExecutionProvider] = {}
        for impl in pm.hook.plugrt_providers.get_hookimpls():
            try:
                offered = cast("list[Any]", impl.function() or [])
            except Exception as exc:
                self._failures[impl.plugin_name] = ProviderFailure(
                    impl.plugin_name, "init", _describe(exc), traceback.format_exc()
                )
                continue
            for provider in offered:
                name = getattr(provider, "name", None)
                if not isinstance(name, str) or not name:
                    self._failures[impl.plugin_name] = ProviderFailure(
                        impl.plugin_name, "init", "provider object has no 'name' string"
                    )
                    continue
                if name in self.disabled:
                    continue
                if name == _BUILT_IN and type(provider).__module__.split(".")[0] != _BUILT_IN_PACKAGE:
                    # the fallback every session relies on cannot be swapped by installing a package
                    self._failures[impl.plugin_name] = ProviderFailure(
                        impl.plugin_name,
                        "init",
                        f"offers a provider named {name!r}, a name reserved for the built-in CPU "
                        f"provider ({_BUILT_IN_PACKAGE}); the plugin must choose another name",
                    )
                    continue
                version = protocol_version(provider)
                if version not in SUPPORTED_PROTOCOL_VERSIONS:
                    # never half-loaded: an incompatible provider is listed, not offered
                    self._failures[name] = ProviderFailure(
                        name,
                        "protocol",
                        f"declares protocol_version {version!r}; this plugrt supports "
                        f"{sorted(SUPPORTED_PROTOCOL_VERSIONS)}: install a matching release of the "
                        "provider or of plugrt",
                    )
                    continue
                missing = missing_memory_members(provider)
                if missing:
                    # used anyway, it would be taken for a host provider and fed numpy arrays
                    self._failures[name] = ProviderFailure(
                        name,
                        "memory",
                        f"declares memory {provider.memory!r} but lacks MemoryCapability's "  # type: ignore[attr-defined]
                        f"{', '.join(missing)}; implement them (see plugrt.provider.MemoryCapability), "
                        "or leave 'memory' out for a provider that works on host arrays",
                    )
                    continue
                if name in providers:
                    self._failures[name] = ProviderFailure(
                        name, "init", f"two plugins offer a provider named {name!r}; keeping the first"
                    )
                    continue
                providers[name] = provider
        self.plugin_manager = pm
        return providers

    def providers(self) -> dict[str, ExecutionProvider]:
        """Every loaded provider by name, highest priority first."""
        with self._lock:
            if self._providers is None:
                found = self._discover()
                self._providers = dict(
                    sorted(found.items(), key=lambda kv: -int(getattr(kv[1], "priority", 0)))
                )
            return self._providers

    def failures(self) -> dict[str, ProviderFailure]:
        """Plugins or providers that failed, by name, with their cause."""
        self.providers()
        return dict(self._failures)

    def record_failure(self, name: str, stage: str, exc: BaseException) -> ProviderFailure:
        failure = ProviderFailure(name, stage, _describe(exc), traceback.format_exc())
        self._failures.setdefault(name, failure)
        return failure

    # -- lookup ------------------------------------------------------------------------

    def devices(self, name: str) -> list[Device]:
        """The provider's devices, probed once; [] when it has none or probing failed."""
        if name not in self._devices:
            provider = self.providers()[name]
            try:
                self._devices[name] = list(provider.devices())
            except Exception as exc:
                self.record_failure(name, "devices", exc)
                self._devices[name] = []
        return self._devices[name]

    def unavailable_reason(self, name: str) -> str | None:
        """Why a provider cannot be used, or None when it can."""
        providers = self.providers()
        if name in self.disabled:
            return f"disabled by the {DISABLE_ENV} environment variable or the 'disabled_providers' option"
        if name not in providers:
            failure = self._failures.get(name)
            if failure is not None:
                return str(failure)
            known = ", ".join(providers) or "none"
            return f"no provider named {name!r} is installed (installed: {known})"
        if not self.devices(name):
            failure = self._failures.get(name)
            if failure is not None:
                return str(failure)
            why = getattr(providers[name], "unavailable_reason", None)
            return why or "it reports no device on this machine"
        return None

    def unavailable_hint(self, name: str) -> str:
        """What to do about an unavailable provider, for its situation: not installed,
        disabled, a plugin that failed to load, or installed with no usable device."""
        providers = self.providers()
        failure = self._failures.get(name)
        if name in self.disabled:
            return f"remove {name!r} from {DISABLE_ENV} (or the 'disabled_providers' option), or choose device='cpu'"
        if name not in providers and failure is not None and failure.stage in LOAD_STAGES:
            return (
                f"its plugin failed to load ('plugrt providers' shows why): reinstall or uninstall the "
                f"package offering {name!r}, or choose device='cpu'"
            )
        if name not in providers:
            return install_hint(name) + ", or choose device='cpu'"
        if failure is not None:  # loaded, but its device probe raised
            return (
                f"the provider's own check failed ({failure.stage}); report it to the maintainers of the "
                f"package offering {name!r}, or choose device='cpu'"
            )
        return "use device='cpu' (or device='auto' to fall back to what is available)"

    def get(self, name: str) -> ExecutionProvider:
        """A usable provider by name, or ProviderUnavailableError with the cause and what to do."""
        reason = self.unavailable_reason(name)
        if reason is not None:
            raise ProviderUnavailableError(name, reason, hint=self.unavailable_hint(name))
        return self.providers()[name]

    def available(self) -> list[ExecutionProvider]:
        """Usable providers, highest priority first."""
        return [p for n, p in self.providers().items() if self.unavailable_reason(n) is None]


def install_hint(name: str) -> str:
    """How to install the provider ``name``: its command when this repository ships it."""
    command = INSTALL_COMMANDS.get(name)
    if command is not None:
        return f"install the {name} provider: {command}"
    return f"install a package that offers a provider named {name!r} ('plugrt providers' lists what is installed)"


_default: ProviderRegistry | None = None
_default_lock = threading.Lock()


def default_registry() -> ProviderRegistry:
    """The process-wide registry, created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = ProviderRegistry()
        return _default


def reset_default_registry() -> None:
    """Forget the process-wide registry (after installing a plugin at run time, in tests)."""
    global _default
    with _default_lock:
        _default = None
