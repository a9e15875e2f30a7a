"""The CPU features numba compiles for: what the compiled loops' hand-written vector code may use.

``host_features()`` is the host's features as LLVM reports them, or nothing where numba
compiles for another CPU (``NUMBA_CPU_NAME`` set to a portable target: the cache must
then hold no host-specific code) or the platform does not say.
"""

from __future__ import annotations

import functools

__all__ = ["host_features"]


@functools.cache
def host_features() -> dict[str, bool]:
    """The host CPU's features (``avx512f``, ``avx512vnni``, ...), or {} (see the module)."""
    import llvmlite.binding as llvm
    import numba

    if getattr(numba.config, "CPU_NAME", None) not in (None, "host"):  # compiled for another CPU (NUMBA_CPU_NAME)
        return {}
    try:
        return dict(llvm.get_host_cpu_features())
    except RuntimeError:  # not known on this platform
        return {}
