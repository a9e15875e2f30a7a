"""xfail and skip files: one case-name pattern per line, then ``# reason``.

The format array-api-tests and onnx-tests use::

    test_bernoulli*          # random: expected values come from another RNG
    test_image_decoder_*jpeg*  # JPEG needs an image codec library

Blank lines and lines starting with ``#`` are ignored. A pattern without a reason is an
error: every expectation must say why.

A provider ships its own expectations as ``conformance_xfails.txt`` and
``conformance_skips.txt`` in its top-level package (package data); ``plugrt
conformance`` reads them, so a provider passes out of the box.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from typing import Any, Sequence

from ..errors import ConformanceInputError

__all__ = ["Expectation", "read_expectations", "match", "shipped_expectations", "SHIPPED_XFAILS", "SHIPPED_SKIPS"]

#: The file names a provider package ships its expectations under.
SHIPPED_XFAILS = "conformance_xfails.txt"
SHIPPED_SKIPS = "conformance_skips.txt"


@dataclasses.dataclass(frozen=True)
class Expectation:
    pattern: str
    reason: str


def read_expectations(path: str | os.PathLike) -> list[Expectation]:
    """The entries of an expectations file; a missing, unreadable or malformed file is a
    ConformanceInputError naming the file (and the line)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConformanceInputError(f"cannot read expectations file {os.fspath(path)!r}: {exc}", path=os.fspath(path)) from exc
    entries = []
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pattern, sep, reason = line.partition("#")
        pattern, reason = pattern.strip(), reason.strip()
        if not sep or not reason:
            raise ConformanceInputError(
                f"{os.fspath(path)}:{number}: {pattern!r} has no '# reason'; every entry must say why",
                path=os.fspath(path),
            )
        entries.append(Expectation(pattern, reason))
    return entries


def shipped_expectations(provider: Any) -> tuple[list[Expectation], list[Expectation]]:
    """The (xfails, skips) that ``provider``'s package ships; empty when it ships none."""
    import importlib
    import importlib.resources

    package = type(provider).__module__.split(".")[0]
    try:
        root = importlib.resources.files(importlib.import_module(package))
    except (ImportError, TypeError):
        return [], []
    found = []
    for name in (SHIPPED_XFAILS, SHIPPED_SKIPS):
        resource = root / name
        found.append(read_expectations(str(resource)) if resource.is_file() else [])
    return found[0], found[1]


def match(name: str, expectations: Sequence[Expectation]) -> Expectation | None:
    for entry in expectations:
        if fnmatch.fnmatchcase(name, entry.pattern):
            return entry
    return None
