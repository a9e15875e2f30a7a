"""plugrt's CPU execution provider: numpy kernels, registered through the entry point."""

from __future__ import annotations

__all__ = ["CPUProvider"]


def __getattr__(name: str):
    if name == "CPUProvider":
        from ._provider import CPUProvider

        return CPUProvider
    raise AttributeError(name)
