"""The template as a distribution: its entry point, and the guide that quotes its code."""

from __future__ import annotations

import os
import re
import textwrap

import importlib_metadata
import pytest

import plugrt

pytest.importorskip("plugrt_provider_template", reason="pip install ./providers/template to test the template provider")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GUIDE = os.path.join(ROOT, "docs", "writing-a-provider.md")
_EXCERPT = re.compile(r"<!-- excerpt: (\S+) -->\n```\w*\n(.*?)```", re.S)


def _installed() -> bool:
    return any(ep.name == "template" for ep in importlib_metadata.entry_points(group="plugrt.providers"))


def _excerpts() -> list[tuple[str, str]]:
    """(source file, code) of each block the guide marks as an excerpt of the template."""
    with open(GUIDE, encoding="utf-8") as f:
        return _EXCERPT.findall(f.read())


def _contains_lines(text: str, excerpt: str) -> bool:
    """True when ``excerpt``'s lines appear consecutively in ``text``, give or take one
    indentation for all of them (a method may be quoted dedented)."""
    lines, wanted = text.splitlines(), textwrap.dedent(excerpt).rstrip("\n").splitlines()
    for start in range(len(lines) - len(wanted) + 1):
        first = lines[start]
        indent = first[: len(first) - len(first.lstrip())] if first.strip() == wanted[0].strip() else None
        if indent is not None and all(
            have == (indent + want if want else "") for have, want in zip(lines[start:], wanted)
        ):
            return True
    return False


@pytest.mark.skipif(not _installed(), reason="plugrt-provider-template is not installed as a distribution")
def test_installed_distribution_offers_the_template_through_its_entry_point():
    registry = plugrt.ProviderRegistry(disabled=())
    assert "template" in registry.providers()
    assert registry.unavailable_reason("template") is None


@pytest.mark.skipif(not _installed(), reason="plugrt-provider-template is not installed as a distribution")
def test_plugrt_providers_command_lists_the_template(monkeypatch, capsys):
    from plugrt.cli import main
    from plugrt.registry import DISABLE_ENV, reset_default_registry

    monkeypatch.delenv(DISABLE_ENV, raising=False)
    reset_default_registry()
    try:
        assert main(["providers"]) == 0
    finally:
        reset_default_registry()
    listing = capsys.readouterr().out
    assert re.search(r"^\s+template\s+priority -1\s+other:0 .*\[available\]$", listing, re.M), listing


def test_guide_quotes_the_template_code_verbatim():
    blocks = _excerpts()
    assert len(blocks) >= 8
    for source, code in blocks:
        with open(os.path.join(ROOT, source), encoding="utf-8") as f:
            assert _contains_lines(f.read(), code), f"the guide's excerpt of {source} is not in it:\n{code}"
