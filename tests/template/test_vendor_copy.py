"""The vendor guide followed literally: copy the template, apply the guide's rename table
by script, install the copy in a fresh virtual environment and run its conformance."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from helpers import fresh_venv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GUIDE = os.path.join(ROOT, "docs", "writing-a-provider.md")
TEMPLATE = os.path.join(ROOT, "providers", "template")
# every op the template claims: the conformance run checks all of them, quickly
CLAIMED = "Add,Sub,Mul,Div,Pow,Neg,Abs,Sqrt,Exp,Log,Tanh,Sigmoid,Relu,LeakyRelu,MatMul,Gemm"


def rename_table() -> list[tuple[str, str]]:
    """The (template, yours) columns of the guide's rename table, in its order."""
    with open(GUIDE, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## 1. Copy the template") : text.index("## 2. The protocol")]
    return re.findall(r"^\|[^|\n]*\| `([^`]+)` \| `([^`]+)` \|$", section, re.M)


def rename(text: str, table: list[tuple[str, str]]) -> str:
    for old, new in table:
        text = text.replace(old, new)
    return text


def copy_with_renames(destination: str, table: list[tuple[str, str]]) -> None:
    """What the guide's section 1 tells a vendor to do, done by script."""
    shutil.copytree(TEMPLATE, destination, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    for folder, _, files in os.walk(destination):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            with open(path, "w", encoding="utf-8") as f:
                f.write(rename(text, table))
    os.rename(os.path.join(destination, "plugrt_provider_template"), os.path.join(destination, rename("plugrt_provider_template", table)))


def test_the_rename_table_covers_every_mention_of_the_template(tmp_path):
    table = rename_table()
    assert [old for old, _ in table][-1] == "template", table
    copy_with_renames(str(tmp_path / "acme"), table)
    left = []
    for folder, _, files in os.walk(tmp_path / "acme"):
        for name in files:
            text = open(os.path.join(folder, name), encoding="utf-8").read()
            left += [f"{name}: {line.strip()}" for line in text.splitlines() if "template" in line.lower()]
    assert left == []


@pytest.mark.slow
def test_the_renamed_copy_installs_in_a_fresh_venv_and_passes_conformance(tmp_path):
    copy = str(tmp_path / "plugrt-provider-acme")
    copy_with_renames(copy, rename_table())
    python = fresh_venv(str(tmp_path / "venv"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PLUGRT_DISABLE_PROVIDERS")}
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index", copy],
        check=True, timeout=180, env=env, cwd=tmp_path,
    )
    listed = subprocess.run([python, "-m", "plugrt", "providers"], capture_output=True, text=True, env=env, timeout=120)
    assert re.search(r"^\s+acme\s+priority -1 .*\[available\]", listed.stdout, re.M), listed.stdout + listed.stderr
    report = tmp_path / "acme.json"
    done = subprocess.run(
        [python, "-m", "plugrt", "conformance", "--provider", "acme", "--ops", CLAIMED, "--report", str(report)],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(report.read_text())
    assert result["ok"] and result["totals"]["passed"] == result["totals"]["claimed"] > 0
    assert result["protocol"]["save_context/load_context round-trip"]["status"] == "passed"
    # the copy is what ran: plugrt_provider_acme from the fresh environment
    where = subprocess.run(
        [python, "-c", "import plugrt_provider_acme; print(plugrt_provider_acme.__file__)"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout
    assert where.startswith(str(tmp_path / "venv"))
