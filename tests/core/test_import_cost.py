"""``import plugrt`` and the light CLI commands load no onnx, onnx_ir or plugin machinery."""

from __future__ import annotations

import subprocess
import sys

import plugrt

#: Modules that cost most of a second to import, or scan installed distributions.
HEAVY = ("onnx", "onnx_ir", "ml_dtypes", "sympy", "pluggy", "importlib_metadata", "threadpoolctl")


def _loaded_after(code: str) -> list[str]:
    """The HEAVY modules a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return out.split()


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
