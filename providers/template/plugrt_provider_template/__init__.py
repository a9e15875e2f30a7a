"""plugrt's template execution provider: the worked example a hardware vendor copies."""

from __future__ import annotations

__all__ = ["TemplateProvider"]


def __getattr__(name: str):
    if name == "TemplateProvider":
        from ._provider import TemplateProvider

        return TemplateProvider
    raise AttributeError(name)
