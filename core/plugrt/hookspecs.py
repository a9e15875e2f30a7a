"""Every hook a plugrt plugin may implement (pluggy hookspecs), in one place."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .provider import ExecutionProvider

PROJECT = "plugrt"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: The entry-point group a package uses to register a plugin with plugrt.
ENTRY_POINT_GROUP = "plugrt.providers"


@hookspec
def plugrt_providers() -> "list[ExecutionProvider]":
    """Return the execution providers this plugin offers (may be empty).

    Called once per registry. Creating a provider must be cheap: probe devices lazily in
    ``devices()``, never at import.
    """
    raise NotImplementedError
