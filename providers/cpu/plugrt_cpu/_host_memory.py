"""glibc's malloc thresholds, set once for the CPU provider's activations: freed arrays stay in the heap for the next run instead of going back to the kernel.

Every run allocates its intermediate arrays afresh (numpy's ``np.empty``, through
malloc). glibc serves blocks above its mmap threshold (128 KiB at first) with ``mmap``
and returns them on free, and trims the heap's free top above its trim threshold; it
raises both as it sees large blocks freed, up to 32 and 64 MiB, but where a run's blocks
land depends on the process's history. A block that went back to the kernel costs a page
fault per 4 KiB page when the next run writes it: measured on DenseNet-121 run alone in a
process, 2,350 faults a run (~6 ms of ~75); ShuffleNet 654 faults (~1.7 ms of ~9) in
another process, none in a third.

:func:`tune_host_allocator` sets the two thresholds to the values glibc's own adjustment
ends at (mmap 32 MiB, trim 64 MiB), once, when the CPU provider compiles its first graph
(never at import). The process then keeps up to 64 MiB of freed heap for reuse, as
onnxruntime's arena keeps its memory. It does nothing where the C library is not glibc,
where the environment already sets ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` (the user's choice stands), or where ``PLUGRT_MALLOC_TUNING=0``.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune_host_allocator"]

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's dynamic maxima on 64-bit: DEFAULT_MMAP_THRESHOLD_MAX and twice it for the trim
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20

def _glibc_mallopt() -> Any:
    """glibc's ``mallopt``, or None for another C library (or none reachable)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if getattr(libc, "gnu_get_libc_version", None) is None:
        return None  # musl and others: their mallopt, if any, takes other parameters
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


@functools.cache
def tune_host_allocator() -> bool:
    """Set glibc's mmap and trim thresholds (see the module's docstring) the first time
    it is called; returns whether they are plugrt's now. Later calls return the first
    outcome without trying again (two first calls at once both set the same values)."""
    return _tune()


def _tune() -> bool:
    if os.environ.get("PLUGRT_MALLOC_TUNING", "1") == "0":
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
