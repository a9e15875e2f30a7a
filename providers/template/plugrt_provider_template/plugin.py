"""The plugin object the `plugrt.providers` entry point names: offers the template provider."""

from __future__ import annotations

from plugrt.hookspecs import hookimpl


@hookimpl
def plugrt_providers():
    from ._provider import TemplateProvider  # imported on first use, never at plugrt import

    return [TemplateProvider()]
