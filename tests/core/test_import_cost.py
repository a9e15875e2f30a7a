"""``import plugrt`` and the light CLI commands load no onnx, onnx_ir or plugin machinery;
a session never imports sympy (onnx_ir's module-level import of it is deferred)."""

from __future__ import annotations

import subprocess
import sys

import plugrt

#: Modules that cost most of a second to import, or scan installed distributions.
HEAVY = ("onnx", "onnx_ir", "ml_dtypes", "sympy", "pluggy", "importlib_metadata", "threadpoolctl")


def _loaded_after(code: str) -> list[str]:
    """The HEAVY modules a fresh interpreter has imported after running ``code`` (a deferred
    stand-in, imported on its first use, does not count)."""
    probe = (
        f"{code}\nimport sys\n"
        f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules and type(sys.modules[m]).__name__ != '_Deferred'))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return out.split()


def _printed(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_import_plugrt_imports_neither_onnx_nor_onnx_ir():
    assert _loaded_after("import plugrt") == []


def test_every_public_name_can_be_imported_from_plugrt_in_a_fresh_process():
    names = ", ".join(plugrt.__all__)
    assert "onnx_ir" in _loaded_after(f"from plugrt import {names}")  # the names that need it load it


def test_dir_of_plugrt_lists_every_public_name_before_any_is_used():
    out = subprocess.run(
        [sys.executable, "-c", "import plugrt; print(sorted(set(plugrt.__all__) - set(dir(plugrt))))"],
        capture_output=True, text=True, check=True,
    ).stdout
    assert out.strip() == "[]"


def test_cli_help_imports_no_onnx():
    code = (
        "import contextlib, io\n"
        "from plugrt.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as shown:\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "assert 'usage: plugrt' in shown.getvalue()\n"
    )
    assert _loaded_after(code) == []


def test_listing_only_the_cpu_provider_imports_no_onnx():
    # every other installed plugin disabled: what `plugrt providers` costs with the CPU provider alone
    code = (
        "import io, os, contextlib\n"
        "from importlib.metadata import entry_points\n"
        "others = [ep.name for ep in entry_points(group='plugrt.providers') if ep.name != 'cpu']\n"
        "os.environ['PLUGRT_DISABLE_PROVIDERS'] = ','.join(others)\n"
        "from plugrt.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as listing:\n"
        "    assert main(['providers']) == 0\n"
        "assert 'cpu:0' in listing.getvalue(), listing.getvalue()\n"
    )
    loaded = _loaded_after(code)
    assert "onnx" not in loaded and "onnx_ir" not in loaded and "pluggy" in loaded


_RUN_A_MODEL = (
    "import numpy as np, onnx, plugrt\n"
    "model = onnx.parser.parse_model('<ir_version: 8, opset_import: [\"\" : 17]> "
    "g (float[N, 3] x) => (float[N, 3] y) { y = Relu(x) }')\n"
    "session = plugrt.load(model.SerializeToString())\n"
    "out = session.run({'x': np.array([[-1.0, 0.0, 2.0]], np.float32)})\n"
    "assert out['y'].tolist() == [[0.0, 0.0, 2.0]], out\n"
)


def test_loading_and_running_a_model_with_a_symbolic_dimension_never_imports_sympy():
    loaded = _loaded_after(_RUN_A_MODEL)
    assert "onnx_ir" in loaded and "sympy" not in loaded


def test_symbolic_dimension_arithmetic_is_unchanged_after_import_plugrt():
    code = (
        "import onnx_ir as ir\n"
        "n, m = ir.SymbolicDim('N'), ir.SymbolicDim('M')\n"
        "print((n * 2).value, (n + m).value, (n // 2).value, ir.SymbolicDim('max(N, 4)') + 1)\n"
    )
    plain = _printed(code)
    assert plain.strip()  # the reference process printed the expressions
    assert _printed("import plugrt\n" + code) == plain


def test_sympy_imported_by_the_application_after_plugrt_is_the_real_sympy():
    code = _RUN_A_MODEL + (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('sympy').origin.endswith('__init__.py')\n"  # answers before the import
        "import sympy\n"
        "from sympy import Rational\n"
        "import sympy.polys\n"
        "print(sympy.Symbol('x') + Rational(1, 2), type(sys.modules['sympy']).__name__, sympy.polys.Poly)\n"
    )
    assert _printed(code).split() == ["x", "+", "1/2", "module", "<class", "'sympy.polys.polytools.Poly'>"]


def test_sympy_imported_before_plugrt_is_left_as_it_is():
    code = "import sympy, sys\nreal = sys.modules['sympy']\n" + _RUN_A_MODEL + "print(sys.modules['sympy'] is real)\n"
    assert _printed(code).strip() == "True"


def test_a_deferred_submodule_is_imported_with_its_parents_on_first_use():
    """``defer`` (what the CPU provider uses for numba's BLAS check): ``import a.b.c`` and
    ``importlib.import_module`` get the stand-in without importing its parent package;
    its first attribute read imports the real module, parents included, and answers from
    it. ``undefer`` takes an unread stand-in away."""
    code = (
        "import sys\n"
        "from plugrt._deferred_sympy import defer, undefer\n"
        "assert 'xml.dom' not in sys.modules\n"
        "stand_in = defer('xml.dom.minidom')\n"
        "print(type(stand_in).__name__, defer('xml.dom.minidom'), defer('no_such_package.module'))\n"
        "import importlib, xml.dom.minidom\n"
        "minidom = importlib.import_module('xml.dom.minidom')\n"
        "print(minidom is stand_in, 'xml.dom' in sys.modules)\n"
        "print(minidom.parseString('<a>b</a>').documentElement.tagName, 'xml.dom' in sys.modules)\n"
        "print(type(sys.modules['xml.dom.minidom']).__name__)\n"
        "stand_in = defer('json.tool')\n"
        "undefer(stand_in)\n"
        "import json.tool\n"
        "print(type(sys.modules['json.tool']).__name__, hasattr(json.tool, 'main'))\n"
    )
    assert _printed(code).split() == ["_Deferred", "None", "None", "True", "False", "a", "True", "module", "module", "True"]
