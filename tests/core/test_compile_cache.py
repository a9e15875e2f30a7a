"""``plugrt compile-cache``: each provider with compiled code builds its cache, with progress on stderr."""

from __future__ import annotations

import io

import pytest

from plugrt.cli import main
from plugrt.compile_cache import progress_printer
from plugrt.registry import reset_default_registry

from helpers import fake_entry_points


@pytest.fixture
def caching_provider(monkeypatch):
    """``fakecache`` installed (faked entry point) beside the real providers."""
    import fake_plugins

    fake_entry_points(monkeypatch, ("fakecache", "fake_plugins:with_cache"))
    reset_default_registry()
    fake_plugins.CachingProvider.prepared.clear()
    yield fake_plugins.CachingProvider
    reset_default_registry()


def test_compile_cache_prepares_the_named_provider_with_a_line_per_unit(caching_provider, capsys):
    assert main(["compile-cache", "--provider", "fakecache"]) == 0
    captured = capsys.readouterr()
    assert caching_provider.prepared == ["alpha", "beta", "gamma"]
    lines = captured.err.splitlines()
    assert [line.split(" (")[0] for line in lines[:3]] == [
        "plugrt: fakecache: compiling 1 of 3: alpha",
        "plugrt: fakecache: compiling 2 of 3: beta",
        "plugrt: fakecache: compiling 3 of 3: gamma",
    ]
    assert lines[3].startswith("plugrt: fakecache: 3 of 3 compiled in ")
    assert captured.out == "fakecache: 3 of 3 compiled units in the cache (/fake/cache)\n"


def test_compile_cache_refuses_a_provider_that_is_not_installed(caching_provider, capsys):
    assert main(["compile-cache", "--provider", "nonesuch"]) == 2
    assert "'nonesuch' is unavailable: not installed" in capsys.readouterr().err
    assert caching_provider.prepared == []


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_sees_one_progress_bar_redrawn_in_place():
    terminal = _Terminal()
    progress = progress_printer("cpu", terminal)
    progress(0, 2, "first")
    progress(1, 2, "second")
    progress(2, 2, "")
    shown = terminal.getvalue()
    assert shown.count("\r\033[K") == 3 and shown.endswith("\n") and shown.count("\n") == 1
    assert "[" + "#" * 12 + "." * 12 + "] 1/2" in shown and "[" + "#" * 24 + "] 2/2" in shown
