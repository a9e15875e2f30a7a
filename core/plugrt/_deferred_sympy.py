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

__all__ = ["defer", "install", "undefer"]

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


def defer(name: str) -> types.ModuleType | None:
    """Put a stand-in for module ``name`` (dotted: ``"scipy.linalg.cython_blas"``) in
    ``sys.modules`` when neither it nor its parent package is imported and it is
    installed, found without importing anything (``PathFinder`` from the top-level
    package's locations down). ``import name`` then gets the stand-in, and its first
    attribute read imports the real module, parents included. For providers whose
    dependencies import a module at load that the process may never use (numba imports
    ``scipy.linalg.cython_blas`` to learn that a BLAS exists). Returns the stand-in, or None
    where it put none.

    Until it is read from, the stand-in is not an attribute of its parent package: code
    that reaches it as ``a.b.c`` after ``import a.b.c`` (rather than through the import's
    own binding or ``from a.b import c``) fails. Callers keep it in place only while the
    import they defer runs (``undefer``)."""
    parts = name.split(".")
    if name in sys.modules or (len(parts) > 1 and ".".join(parts[:-1]) in sys.modules):
        return None
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level spec: nothing is imported
        for depth in range(2, len(parts) + 1):
            if spec is None or spec.submodule_search_locations is None:
                return None
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), list(spec.submodule_search_locations))
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    stand_in = _Deferred(spec)
    sys.modules[name] = stand_in
    return stand_in


def undefer(stand_in: types.ModuleType | None) -> None:
    """Take ``defer``'s stand-in out of ``sys.modules`` if it is still there, unread: a
    later import then imports the real module as usual."""
    if stand_in is not None and sys.modules.get(stand_in.__name__) is stand_in:
        del sys.modules[stand_in.__name__]
