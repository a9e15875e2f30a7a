"""numba's runtime functions from an on-disk cache, beside the compiled loops' own.

numba compiles its runtime's few helpers (``NRT_incref``, ``NRT_decref``, atomics: the
"nrt" library) from LLVM IR, with LLVM's optimizer and code generator, in every process,
at the first compiled function it loads, even when every function it loads comes from
its cache. That compile is ~20 ms, and it is the only thing in a process that loads
plugrt's cached loops to run LLVM's optimizer and code generator: it pages in 27 MiB of
LLVM's code (``libllvmlite.so``, 2-core EPYC, numba 0.62-0.68), about a tenth of a
135M-parameter int4 decoder's peak memory.

:func:`install` has numba take that library from a file when one was written for this
numba, llvmlite and CPU target (``codegen.magic_tuple()``: the triple, CPU name and
features numba compiles for), loading its object code as numba loads any cached function
(``unserialize_library``), and write the file the first time it compiles the library.
Anything unexpected (another numba whose module lacks these functions, a file that does
not read back) leaves numba's own compile in place. The file holds what numba's own cache
holds for a function: its object code and the bitcode later compiles link against.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import sys
import tempfile
from typing import Any, Callable

__all__ = ["install", "state"]

_STATE = {"installed": False, "source": ""}  # source: "cache", "compiled" (and written), or "" (not yet)


def state() -> dict[str, Any]:
    """Whether :func:`install` patched numba, and where this process's runtime library came
    from (``"cache"``, ``"compiled"``, or ``""`` before numba asked for it)."""
    return dict(_STATE)


def install(directory: Callable[[], str]) -> bool:
    """Have numba's runtime library read from and written to ``directory()`` (the compiled
    loops' cache directory, asked when numba first needs the library). Does nothing once
    numba's runtime is initialised, or where numba's functions are not the ones this
    module knows. Returns whether it is in place."""
    if _STATE["installed"]:
        return True
    try:
        from numba.core.runtime import nrt, nrtdynmod
    except ImportError:
        return False
    compile_functions = getattr(nrtdynmod, "compile_nrt_functions", None)
    create_module = getattr(nrtdynmod, "create_nrt_module", None)
    if compile_functions is None or create_module is None or getattr(nrt.rtsys, "_init", True):
        return False

    def create_nrt_module(ctx: Any) -> Any:
        ir_module, library = create_module(ctx)
        library.enable_object_caching()  # keep the object code for the file (~6 KB)
        return ir_module, library

    def compile_nrt_functions(ctx: Any) -> Any:
        codegen = ctx.codegen()
        try:
            path = _path(directory(), codegen)
        except Exception:  # noqa: BLE001  (no key, no cache: numba compiles as it would)
            path = None
        library = _read(path, codegen) if path else None
        if library is not None:
            _STATE["source"] = "cache"
            return library
        library = compile_functions(ctx)
        _STATE["source"] = "compiled"
        if path:
            _write(path, library)
        return library

    nrtdynmod.create_nrt_module = create_nrt_module
    nrtdynmod.compile_nrt_functions = compile_nrt_functions
    _STATE["installed"] = True
    return True


def _path(directory: str, codegen: Any) -> str:
    import llvmlite
    import numba

    parts = [numba.__version__, llvmlite.__version__, sys.version, repr(codegen.magic_tuple())]
    for variable in ("NUMBA_OPT", "NUMBA_BOUNDSCHECK", "NUMBA_DEBUGINFO"):  # NUMBA_CPU_NAME/_FEATURES: in the tuple
        parts.append(f"{variable}={os.environ.get(variable, '')}")
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return os.path.join(directory, f"plugrt-nrt-{key}.pkl")


def _read(path: str, codegen: Any) -> Any:
    """The library from ``path``; None where there is no file or it does not read back."""
    try:
        with open(path, "rb") as handle:
            serialized = pickle.load(handle)
        name, kind, (code, bitcode) = serialized
        if name != "nrt" or kind != "object" or not isinstance(code, bytes) or not isinstance(bitcode, bytes):
            return None
    except Exception:  # noqa: BLE001  (missing, truncated or foreign: compile instead)
        return None
    try:
        return codegen.unserialize_library(serialized)
    except Exception:  # noqa: BLE001
        return None


def _write(path: str, library: Any) -> None:
    """Write ``library`` to ``path`` whole or not at all (a read-only cache: the next
    process compiles it again)."""
    try:
        serialized = library.serialize_using_object_code()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        handle = tempfile.NamedTemporaryFile("wb", dir=os.path.dirname(path), delete=False)
    except Exception:  # noqa: BLE001
        return
    try:
        with handle:
            pickle.dump(serialized, handle, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(handle.name, path)
    except Exception:  # noqa: BLE001
        with contextlib.suppress(OSError):
            os.unlink(handle.name)
