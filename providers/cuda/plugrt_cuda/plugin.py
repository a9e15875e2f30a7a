"""The plugin object the `plugrt.providers` entry point names: offers the CUDA provider."""

from __future__ import annotations

from plugrt.hookspecs import hookimpl


@hookimpl
def plugrt_providers():
    from ._provider import CUDAProvider  # imports no cupy: the provider probes CUDA on first use

    return [CUDAProvider()]
