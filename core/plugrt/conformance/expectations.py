"""xfail and skip files: one case-name pattern per line, then ``# reason``.

The format array-api-tests and onnx-tests use::

    test_bernoulli*          # random: expected values come from another RNG
    test_image_decoder_*jpeg*  # JPEG needs an image codec library

Blank lines and lines starting with ``#`` are ignored. A pattern without a reason is an
error: every expectation must say why.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os

__all__ = ["Expectation", "read_expectations", "match"]


@dataclasses.dataclass(frozen=True)
class Expectation:
    pattern: str
    reason: str


def read_expectations(path: str | os.PathLike) -> list[Expectation]:
    entries = []
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            pattern, sep, reason = line.partition("#")
            pattern, reason = pattern.strip(), reason.strip()
            if not sep or not reason:
                raise ValueError(f"{path}:{number}: {pattern!r} has no '# reason'; every entry must say why")
            entries.append(Expectation(pattern, reason))
    return entries


def match(name: str, expectations: list[Expectation]) -> Expectation | None:
    for entry in expectations:
        if fnmatch.fnmatchcase(name, entry.pattern):
            return entry
    return None
