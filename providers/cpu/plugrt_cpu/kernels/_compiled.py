"""The one way the CPU kernels load their optional numba-compiled loops."""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

__all__ = ["compiled_module"]


def compiled_module(name: str) -> ModuleType | None:
    """The compiled-loops module ``plugrt_cpu.kernels.<name>``, or None when numba is not
    installed, cannot be used here, or the environment sets ``PLUGRT_NUMBA=0``; every
    caller then runs its numpy path. Imported on first use, so importing the provider never
    imports numba. Not cached here: callers remember the answer (``functools.cache``)."""
    if os.environ.get("PLUGRT_NUMBA", "1") == "0":
        return None
    try:
        return importlib.import_module(f"plugrt_cpu.kernels.{name}")
    except ImportError:
        return None
    except (RuntimeError, OSError) as e:  # numba there but unusable (e.g. no writable cache)
        warnings.warn(f"plugrt: numba's compiled loops are off ({e}); numpy runs those steps", RuntimeWarning, 3)
        return None
