"""Stand plugrt in for onnxruntime: ``import onnxruntime`` (and its submodules) gives plugrt's.

Two ways, one mechanism (a meta-path finder placed first on ``sys.meta_path``):

- in code, before the client library is imported::

      import plugrt
      plugrt.install_as_onnxruntime()
      from optimum.onnxruntime import ORTModelForCausalLM  # now runs on plugrt

- without changing the program: ``python -m plugrt.ort_shim script.py [args]`` or
  ``python -m plugrt.ort_shim -m module [args]``.

The finder serves ``onnxruntime`` and the submodules clients import
(``onnxruntime.capi.onnxruntime_pybind11_state``, ``onnxruntime.capi._pybind_state``,
``onnxruntime.capi.onnxruntime_inference_collection``,
``onnxruntime.transformers.io_binding_helper``) from ``plugrt._onnxruntime``, and answers
``importlib.metadata`` for the ``onnxruntime`` distribution with :data:`ORT_API_VERSION`,
so version checks (``importlib.metadata.version("onnxruntime")``, ``find_spec``) agree
with ``onnxruntime.__version__``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import runpy
import sys
from types import ModuleType
from typing import Any, Sequence

from ._ort_env import ORT_API_VERSION
from .errors import StandInError

__all__ = ["install_as_onnxruntime", "uninstall", "is_installed", "ORT_API_VERSION", "main"]


_ORT = "onnxruntime"
_TARGET = "plugrt._onnxruntime"


def _target(fullname: str) -> str | None:
    if fullname == _ORT:
        return _TARGET
    if fullname.startswith(_ORT + "."):
        return _TARGET + fullname[len(_ORT):]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads ``onnxruntime.x`` as the already imported ``plugrt._onnxruntime.x``."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self._module

    def exec_module(self, module: ModuleType) -> None:
        pass  # already executed under its plugrt name


class _StandInDistribution(importlib.metadata.Distribution):
    """The ``onnxruntime`` distribution's metadata, as the stand-in reports it."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return f"Metadata-Version: 2.1\nName: {_ORT}\nVersion: {ORT_API_VERSION}\nSummary: plugrt standing in for onnxruntime\n"
        return None

    def locate_file(self, path: Any) -> Any:
        import pathlib

        return pathlib.Path(__file__).parent / "_onnxruntime" / str(path)


class OnnxruntimeFinder(importlib.abc.MetaPathFinder):
    """Serves ``onnxruntime`` and its submodules from ``plugrt._onnxruntime``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        name = _target(fullname)
        if name is None:
            return None
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            return None  # a submodule onnxruntime has and the stand-in does not: ImportError as usual
        is_package = hasattr(module, "__path__")
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(module), is_package=is_package)
        if is_package:
            spec.submodule_search_locations = list(module.__path__)
        return spec

    def find_distributions(self, context: Any = None) -> list:
        name = getattr(context, "name", None)
        if name is None or name.replace("-", "_").lower() == _ORT:
            return [_StandInDistribution()]
        return []


_finder: OnnxruntimeFinder | None = None


def is_installed() -> bool:
    """Whether plugrt is standing in for onnxruntime in this process."""
    return _finder is not None and _finder in sys.meta_path


def install_as_onnxruntime() -> None:
    """Make ``import onnxruntime`` (and its submodules clients use) import plugrt's
    implementations from now on; call it before importing the library that uses onnxruntime.

    Raises StandInError when the real onnxruntime is already imported: objects made from
    it would mix with plugrt's. Calling it twice is harmless."""
    global _finder
    if is_installed():
        return
    already = sorted(n for n in sys.modules if n == _ORT or n.startswith(_ORT + "."))
    real = [n for n in already if not getattr(sys.modules[n], "__name__", "").startswith(_TARGET)]
    if real:
        raise StandInError(
            "onnxruntime is already imported", module=real[0],
            hint="call plugrt.install_as_onnxruntime() before anything imports onnxruntime "
            "(or run the program with python -m plugrt.ort_shim)",
        )
    _finder = OnnxruntimeFinder()
    sys.meta_path.insert(0, _finder)
    from . import ort

    ort._STANDING_IN = True  # onnxruntime's leniencies (any config key) for its clients


def uninstall() -> None:
    """Undo :func:`install_as_onnxruntime`: the finder goes and ``onnxruntime`` modules
    already imported through it leave ``sys.modules``."""
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None
    for name in [n for n in sys.modules if n == _ORT or n.startswith(_ORT + ".")]:
        if getattr(sys.modules[name], "__name__", "").startswith(_TARGET):
            del sys.modules[name]
    from . import ort

    ort._STANDING_IN = False


_USAGE = "usage: python -m plugrt.ort_shim script.py [args] | -m module [args]"


def main(argv: Sequence[str] | None = None) -> int:
    """Run a script or module (``-m``) with plugrt standing in for onnxruntime."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if args else 2
    install_as_onnxruntime()
    if args[0] == "-m":
        if len(args) < 2:
            print(_USAGE, file=sys.stderr)
            return 2
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
