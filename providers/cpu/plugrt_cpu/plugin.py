"""The plugin object plugrt's entry point names: offers the CPU provider."""

from __future__ import annotations

from plugrt.hookspecs import hookimpl


@hookimpl
def plugrt_providers():
    from ._provider import CPUProvider

    return [CPUProvider()]
