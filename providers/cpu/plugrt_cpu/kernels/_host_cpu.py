"""The CPU features numba compiles for: what the compiled loops' hand-written vector code
may use, and the sizes of the host's data caches that blocking decisions are made from.

``host_features()`` is the host's features as LLVM reports them, or nothing where numba
compiles for another CPU (``NUMBA_CPU_NAME`` set to a portable target: the cache must
then hold no host-specific code) or the platform does not say.
"""

from __future__ import annotations

import functools

__all__ = ["data_cache_bytes", "host_features"]


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


@functools.cache
def data_cache_bytes(level: int, default: int) -> int:
    """The size of this host's level-``level`` data (or unified) cache as sysfs reports it
    for CPU 0; ``default`` where it reports nothing (another platform, a sandbox). Read
    once: the packed product asks on every call."""
    for index in range(8):
        folder = f"/sys/devices/system/cpu/cpu0/cache/index{index}"
        try:
            with open(f"{folder}/level", encoding="ascii") as found, open(f"{folder}/type", encoding="ascii") as kind:
                if found.read().strip() != str(level) or kind.read().strip() not in ("Data", "Unified"):
                    continue
            with open(f"{folder}/size", encoding="ascii") as entry:
                text = entry.read().strip().upper()
            return int(text[:-1]) * 1024 if text.endswith("K") else int(text[:-1]) << 20 if text.endswith("M") else int(text)
        except (OSError, ValueError):
            break
    return default
