"""The guide's smallest provider, built from its own code blocks in an empty folder,
installed offline into a fresh virtual environment, listed by plugrt and run."""

from __future__ import annotations

import os
import re
import subprocess

from helpers import fresh_venv
from plugrt.provider import op_version_in_effect

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GUIDE = os.path.join(ROOT, "docs", "writing-a-provider.md")
_FILE_BLOCK = re.compile(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", re.S)


def guide_files() -> dict[str, str]:
    """path -> text of each block the guide's from-scratch section marks as a file."""
    with open(GUIDE, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## The smallest provider, from scratch") : text.index("## 1. Copy the template")]
    return dict(_FILE_BLOCK.findall(section))


def test_the_guide_gives_every_file_of_the_smallest_provider() -> None:
    assert sorted(guide_files()) == [
        "check_tiny.py",
        "plugrt-provider-tiny/plugrt_provider_tiny/__init__.py",
        "plugrt-provider-tiny/pyproject.toml",
    ]


def test_the_smallest_provider_from_the_guide_installs_is_listed_and_runs_a_model(tmp_path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    for path, text in guide_files().items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text, encoding="utf-8")
    python = fresh_venv(str(tmp_path / "venv"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PLUGRT_DISABLE_PROVIDERS")}

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([python, *argv], capture_output=True, text=True, env=env, cwd=folder, timeout=180)

    # the guide's "pip install ./plugrt-provider-tiny", offline: plugrt is already installed
    installed = run("-m", "pip", "install", "--quiet", "--no-index", "--no-build-isolation", "--no-deps", "./plugrt-provider-tiny")
    assert installed.returncode == 0, installed.stderr[-2000:]
    listed = run("-m", "plugrt", "providers")
    assert re.search(r"^\s+tiny\s+priority -1 .*\[available\]", listed.stdout, re.M), listed.stdout + listed.stderr
    checked = run("check_tiny.py")
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert checked.stdout.splitlines() == ["{'tiny': 2}", "[[2.0, 0.0, 4.0], [0.0, 6.0, 0.0]]"]
    where = run("-c", "import plugrt_provider_tiny; print(plugrt_provider_tiny.__file__)")
    assert where.stdout.startswith(str(tmp_path / "venv")), where.stdout  # the installed copy ran


def test_op_version_in_effect_is_the_newest_version_at_or_below_the_opset() -> None:
    # from onnx's Changelog.md: Add-7, Add-13, Add-14; Relu-6, Relu-13, Relu-14; GroupNormalization-18
    assert op_version_in_effect("Add", 17) == 14
    assert op_version_in_effect("Add", 13) == 13
    assert op_version_in_effect("Relu", 12) == 6
    assert op_version_in_effect("GroupNormalization", 17) == 0  # not yet in opset 17


def test_the_guides_copy_commands_run_as_written_in_a_new_home(tmp_path) -> None:
    with open(GUIDE, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## 1. Copy the template") : text.index("## 2. The protocol")]
    (commands,) = re.findall(r"```bash\n(mkdir.*?)```", section, re.S)
    home = tmp_path / "home"
    home.mkdir()  # ~/src does not exist yet
    env = {**os.environ, "HOME": str(home)}
    done = subprocess.run(["bash", "-e", "-c", commands], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    provider = home / "src" / "plugrt-provider-acme" / "plugrt_provider_acme" / "_provider.py"
    assert "class AcmeProvider" in provider.read_text(encoding="utf-8")
