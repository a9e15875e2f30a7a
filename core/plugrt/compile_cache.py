"""``plugrt compile-cache``: build the providers' on-disk caches of compiled code ahead of the first session."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

__all__ = ["add_parser", "progress_printer"]

_BAR = 24  # characters of the progress bar on a terminal


def add_parser(sub: Any) -> None:
    """The ``plugrt compile-cache`` subcommand."""
    parser = sub.add_parser(
        "compile-cache",
        help="compile every provider's compiled code (the CPU provider's numba loops) into its on-disk cache now",
        description=(
            "Compile ahead what providers otherwise build in the background on first use (with numba "
            "installed: the CPU provider's compiled loops), so that every later process starts with "
            "them ready. For images and CI; progress goes to stderr."
        ),
    )
    parser.add_argument(
        "--provider", action="append", default=[], metavar="NAME", help="only this provider (default: every one with compiled code)"
    )
    parser.set_defaults(func=_cmd_compile_cache)


def progress_printer(label: str, stream: TextIO | None = None) -> Callable[[int, int, str], None]:
    """A ``progress(done, total, unit)`` for ``prepare_cache``: a bar redrawn in place on a
    terminal, else one line per unit (CI logs), each with the seconds since the start."""
    out = stream if stream is not None else sys.stderr
    bar = out.isatty()
    started = time.perf_counter()

    def progress(done: int, total: int, unit: str) -> None:
        seconds = time.perf_counter() - started
        if bar:
            filled = _BAR * done // max(total, 1)
            doing = f" {unit}" if unit else ""
            out.write(f"\r\033[Kplugrt: {label}: [{'#' * filled}{'.' * (_BAR - filled)}] {done}/{total} {seconds:.0f}s{doing}")
            if not unit:
                out.write("\n")
        elif unit:
            out.write(f"plugrt: {label}: compiling {done + 1} of {total}: {unit} ({seconds:.1f} s so far)\n")
        else:
            out.write(f"plugrt: {label}: {done} of {total} compiled in {seconds:.1f} s\n")
        out.flush()

    return progress


def _cmd_compile_cache(args: Any) -> int:
    from .errors import ProviderUnavailableError
    from .provider import CompiledCacheCapability
    from .registry import default_registry

    providers = default_registry().providers()
    unknown = [name for name in args.provider if name not in providers]
    if unknown:
        raise ProviderUnavailableError(unknown[0], f"not installed (installed: {', '.join(providers) or 'none'})")
    chosen = {
        name: provider
        for name, provider in providers.items()
        if isinstance(provider, CompiledCacheCapability) and (not args.provider or name in args.provider)
    }
    if not chosen:
        print("no provider here compiles code ahead: nothing to do")
        return 0
    status = 0
    for name, provider in chosen.items():
        report = provider.prepare_cache(progress_printer(name))
        where = f" ({report.location})" if report.location else ""
        if report.ready or not report.note:
            print(f"{name}: {report.ready} of {report.total} compiled units in the cache{where}")
        if report.note:
            print(f"{name}: {report.note}")
        if report.ready and report.ready < report.total:
            status = 1
    return status
