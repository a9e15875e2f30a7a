"""The install commands the README and docs give work from a checkout (plugrt is on no index)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# "plugrt[extra]" names a distribution on an index: pip answers "No matching distribution"
_INDEX_EXTRA = re.compile(r"""pip install\s+["']?plugrt\[|`plugrt\[\w+\]`|plugrt\[cuda\]""")


def _index_extras(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if _INDEX_EXTRA.search(line)]


def test_no_document_installs_plugrt_extras_from_an_index() -> None:
    found = {str(path.relative_to(ROOT)): _index_extras(path.read_text(encoding="utf-8")) for path in DOCUMENTS}
    assert {path: lines for path, lines in found.items() if lines} == {}


def test_the_scan_catches_an_extra_named_by_its_distribution() -> None:
    # the pattern must be able to fail, on each form the docs used to have
    for line in ('pip install "plugrt[accelerate]"', "pip install plugrt[ray]", "(`plugrt[otel]`)", "plugrt[cuda]"):
        assert _index_extras(line) == [line]
    assert _index_extras('pip install ".[accelerate]"') == []
