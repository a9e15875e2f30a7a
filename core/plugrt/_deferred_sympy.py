"""Defer the sympy import that onnx_ir makes at module level until sympy is really used.

onnx_ir imports sympy (and builds a table of sympy functions in ``onnx_ir._symbolic_shapes``)
when it is imported, but calls it only for arithmetic on symbolic dimensions
(``SymbolicDim("N") * 2``), which plugrt never does. Importing sympy took 0.25-0.3 s and
33 MiB of a 2-core Xeon process (``python -X importtime``, ``/proc/self/status``), a tenth
of a 135M-parameter int4 decoder's whole peak memory.

:func:`install` puts a stand-in module in ``sys.modules`` for both, before onnx_ir is
imported. The first attribute read from a stand-in (``sympy.Max``, ``sympy.__path__`` for
``import sympy.polys``) imports the real module and answers from it, so code that uses
sympy, plugrt's or the application's, sees sympy as it is; only a process that never uses it
never pays for it.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["install"]

_SYMPY = "sympy"
_TABLE = "onnx_ir._symbolic_shapes"  # the onnx_ir module that reads sympy as it is imported


class _Deferred(types.ModuleType):
    """A module to be imported on its first attribute read: then it imports the real one
    (which takes its place in ``sys.modules``) and answers from it. It carries the real
    module's spec, so that ``importlib.util.find_spec`` answers for it as before."""

    def __init__(self, spec: importlib.machinery.ModuleSpec) -> None:
        super().__init__(spec.name)
        self.__spec__ = spec

    def __getattr__(self, attribute: str) -> object:
        name = self.__name__
        if sys.modules.get(name) is self:
            del sys.modules[name]
        return getattr(importlib.import_module(name), attribute)


def install() -> bool:
    """Put the stand-ins in place where they help: sympy not imported yet, onnx_ir not
    imported yet, and both installed with the module that reads sympy at import. Returns
    whether it did."""
    if _SYMPY in sys.modules or "onnx_ir" in sys.modules:
        return False
    try:
        package = importlib.util.find_spec("onnx_ir")  # top-level specs: nothing is imported
        sympy = importlib.util.find_spec(_SYMPY)
        if package is None or package.submodule_search_locations is None or sympy is None:
            return False
        table = importlib.machinery.PathFinder.find_spec(_TABLE, list(package.submodule_search_locations))
    except (ImportError, ValueError):
        return False
    if table is None:
        return False
    sys.modules[_SYMPY] = _Deferred(sympy)
    sys.modules[_TABLE] = _Deferred(table)
    return True
