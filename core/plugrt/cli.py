"""The ``plugrt`` command: run a model, list providers, check a provider's conformance."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable, NoReturn, Sequence

import numpy as np

__all__ = ["main", "EXAMPLE_MODEL", "USAGE_ERROR"]

#: The model ``plugrt run`` uses when given none.
EXAMPLE_MODEL = os.path.join(os.path.dirname(__file__), "examples", "tiny_cnn.onnx")


def _parse_inputs(pairs: Sequence[str]) -> dict[str, np.ndarray]:
    from .errors import CommandLineError

    feeds = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise CommandLineError("run", f"--input takes NAME=FILE.npy, got {pair!r}", option="--input")
        try:
            feeds[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise CommandLineError(
                "run",
                f"cannot read {path!r} for input {name!r} ({exc}); give the path of a .npy file "
                "(numpy.save writes one)",
                option="--input",
            ) from exc
    return feeds


def _format_values(array: np.ndarray, count: int = 6) -> str:
    flat = np.asarray(array).ravel()
    shown = ", ".join(
        f"{v:.6g}" if isinstance(v, (float, np.floating)) else str(v) for v in flat[:count].tolist()
    )
    return f"[{shown}{', ...' if flat.size > count else ''}]"


def _cmd_run(args: argparse.Namespace) -> int:
    from . import load
    from .errors import CommandLineError
    from .inputs import DEFAULT_DIM, example_inputs

    model = args.model or EXAMPLE_MODEL
    options = {"optimization": args.optimization, "profiling": args.profile is not None}
    with _Status(f"building {os.path.basename(model)}"):
        session = load(model, device=args.device, **options)
    feeds = _parse_inputs(args.input)
    generated = [i for i in session.inputs if i.name not in feeds and i.kind == "tensor"]
    feeds.update(example_inputs(generated))
    print(f"model: {model}{'  (bundled example)' if not args.model else ''}")
    print(f"providers: {', '.join(f'{n} [{d}]' for n, d in session.devices.items())}")
    print(f"build: {session.build_seconds * 1e3:.1f} ms")
    for info in session.inputs:
        value = feeds.get(info.name)
        source = "generated" if info in generated else "given"
        if value is not None:
            print(f"input  {info.name}: {value.dtype} {list(value.shape)} ({source})")
    if generated:
        print(f"  (generated inputs: declared shapes, symbolic dims = {DEFAULT_DIM}, seed 0)")
    times = []
    outputs: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        for _ in range(args.repeat):
            start = time.perf_counter()
            outputs = session.run(feeds)
            times.append(time.perf_counter() - start)
    if any(issubclass(w.category, RuntimeWarning) for w in caught):
        _warn_by_node(session, feeds)
    for name, value in outputs.items():
        if isinstance(value, np.ndarray):
            print(f"output {name}: {value.dtype} {list(value.shape)} {_format_values(value)}")
        else:
            print(f"output {name}: {type(value).__name__} {value!r:.80}")
    report = session.placement
    if args.explain:  # the full report starts with the same per-provider counts
        print(report.summary())
    else:
        print("placement: " + ", ".join(f"{p}: {n} node(s)" for p, n in report.nodes_per_provider.items()))
    if len(times) > 1:
        print(
            f"latency: median {statistics.median(times) * 1e3:.3f} ms, min {min(times) * 1e3:.3f} ms "
            f"over {len(times)} runs"
        )
    else:
        print(f"latency: {times[0] * 1e3:.3f} ms (first run; use --repeat N for a median)")
    if args.profile is not None:
        try:
            path = session.end_profiling(args.profile)
        except OSError as exc:
            raise CommandLineError(
                "run", f"cannot write the profile to {args.profile!r} ({exc}); give a path in a writable folder",
                option="--profile",
            ) from exc
        print(f"profile: {path} (onnxruntime's format; open it in Perfetto or chrome://tracing)")
    return 0


def _cmd_providers(args: argparse.Namespace) -> int:
    from .registry import default_registry

    registry = default_registry()
    providers = registry.providers()
    failures = registry.failures()
    print("providers (highest priority first):")
    if not providers:
        print("  none installed")
    for name, provider in providers.items():
        devices = registry.devices(name)
        reason = registry.unavailable_reason(name)
        shown = ", ".join(str(d) for d in devices) if devices else "no device"
        status = "available" if reason is None else f"unavailable: {reason}"
        print(f"  {name:12s} priority {getattr(provider, 'priority', 0):<4} {shown}  [{status}]")
    failures = registry.failures()
    if failures:
        print("failed to load:")
        for failure in failures.values():
            print(f"  {failure}")
    if registry.disabled:
        print("disabled: " + ", ".join(sorted(registry.disabled)))
    return 0


def _cmd_conformance(args: argparse.Namespace) -> int:
    from .conformance.expectations import read_expectations, shipped_expectations
    from .conformance.suite import run_conformance
    from .errors import CommandLineError
    from .registry import default_registry

    # the provider's shipped expectations, then the files given (which add to them)
    xfails, skips = ([], []) if args.no_shipped_expectations else shipped_expectations(default_registry().get(args.provider))
    xfails = xfails + (read_expectations(args.xfails_file) if args.xfails_file else [])
    skips = skips + (read_expectations(args.skips_file) if args.skips_file else [])
    ops = [p.strip() for p in (args.ops or "").split(",") if p.strip()]
    if args.ops is not None and not ops:
        raise CommandLineError(
            "conformance", "--ops needs at least one op pattern, e.g. --ops 'Conv*,Relu'", option="--ops"
        )
    report = run_conformance(
        args.provider, ops=ops or None, xfails=xfails, skips=skips, progress=not args.no_progress and sys.stderr.isatty()
    )
    markdown = report.to_markdown()
    if args.markdown:
        print(markdown)
    else:  # the problems, if any; the full table is one flag (or --report FILE.md) away
        for name, check in report.protocol.items():
            if check["status"] == "failed":
                print(f"protocol check failed: {name}: {check.get('detail', '')}")
        problems = report.problems()
        for case in problems[:_PROBLEMS_SHOWN]:
            print(f"{case.status}: {case.name}: {case.detail}")
        if len(problems) > _PROBLEMS_SHOWN:
            print(f"... and {len(problems) - _PROBLEMS_SHOWN} more (--markdown or --report FILE.md lists them all)")
    for path in args.report:
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(report.to_json() if path.endswith(".json") else markdown)
        except OSError as exc:
            raise CommandLineError(
                "conformance", f"cannot write the report to {path!r} ({exc}); give a path in a writable folder",
                option="--report",
            ) from exc
        print(f"wrote {path}")
    print(report.verdict())
    return 0 if report.ok else 1


#: Failing cases ``plugrt conformance`` lists before its verdict without ``--markdown``.
_PROBLEMS_SHOWN = 20


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_run(sub: Any) -> None:
    run = sub.add_parser("run", help="run a model (the bundled example when none is given)")
    run.add_argument("model", nargs="?", help="path to an .onnx file (default: the bundled example)")
    run.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", help="an input from a .npy file")
    run.add_argument("--device", default="auto", help="auto, cpu, gpu, gpu:N, cuda:N, a provider name or a policy")
    run.add_argument("--repeat", type=_positive_int, default=1, help="run N times (N >= 1) and report the median latency")
    run.add_argument("--optimization", default="all", choices=["none", "basic", "all"])
    run.add_argument("--explain", action="store_true", help="print the full placement report")
    run.add_argument(
        "--profile", metavar="OUT.json",
        help="write a profile of the build and the runs (Chrome trace JSON, onnxruntime's format)",
    )
    run.set_defaults(func=_cmd_run)


def _add_providers(sub: Any) -> None:
    providers = sub.add_parser("providers", help="list installed providers, their devices and failures")
    providers.set_defaults(func=_cmd_providers)


def _add_conformance(sub: Any) -> None:
    conformance = sub.add_parser(
        "conformance", help="run ONNX's node cases and protocol checks against one provider, fallback off"
    )
    conformance.add_argument("--provider", required=True, help="the provider to check, e.g. cpu")
    conformance.add_argument("--ops", help="comma-separated op patterns (fnmatch), e.g. 'Conv*,Relu'")
    conformance.add_argument(
        "--report", action="append", default=[], metavar="FILE.json|FILE.md",
        help="write the report (repeatable): JSON for .json, else the Markdown table",
    )
    conformance.add_argument(
        "--markdown", action="store_true",
        help="print the full Markdown table (per op, protocol checks, failures) before the verdict",
    )
    conformance.add_argument(
        "--xfails-file", help="more cases expected to fail: a pattern per line, then '# reason' (adds to the provider's own)"
    )
    conformance.add_argument("--skips-file", help="more cases not to run: a pattern per line, then '# reason'")
    conformance.add_argument(
        "--no-shipped-expectations", action="store_true",
        help="ignore the xfails and skips the provider's package ships",
    )
    conformance.add_argument("--no-progress", action="store_true", help="no progress bar (there is none unless stderr is a terminal)")
    conformance.set_defaults(func=_cmd_conformance)


def _add_explain(sub: Any) -> None:
    from .explain import add_parser

    add_parser(sub)


def _add_bench(sub: Any) -> None:
    from .bench import add_parser

    add_parser(sub)


def _add_compile_cache(sub: Any) -> None:
    from .compile_cache import add_parser

    add_parser(sub)


#: One function per subcommand, each adding its parser: add a subcommand by adding one here.
SUBCOMMANDS: list[Callable[[Any], None]] = [_add_run, _add_providers, _add_conformance, _add_explain, _add_bench, _add_compile_cache]


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in the format of every other ``plugrt`` error."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(USAGE_ERROR, f"plugrt: error: {message} (see '{self.prog} --help')\n")


#: The exit status of every user error (a bad argument, a missing file, a model that
#: does not load), as argparse exits on a bad argument.
USAGE_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="plugrt", description="plugrt: ONNX inference, every provider a plugin")
    parser.add_argument("--version", action="version", version=f"plugrt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


class _Status:
    """One status line on stderr while something slow runs, only when stderr is a
    terminal (nothing in logs or pipes); cleared when done."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.shown = sys.stderr.isatty()

    def __enter__(self) -> "_Status":
        if self.shown:
            sys.stderr.write(f"plugrt: {self.message} ...")
            sys.stderr.flush()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def _warn_by_node(session: Any, feeds: dict[str, np.ndarray]) -> None:
    """Name the node behind a run's RuntimeWarnings (overflow, invalid value): one more
    run with warnings as errors stops at it, and the plan names the step that raised."""
    from .errors import KernelError

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        try:
            session.run(feeds)
        except KernelError as exc:
            print(
                f"plugrt: warning: node {exc.node!r} ({exc.op_type}, provider {exc.provider}): {exc.cause}",
                file=sys.stderr,
            )
            return
    print("plugrt: warning: the run raised RuntimeWarnings outside any node", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    from .errors import CommandLineError, PlugrtError

    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)
        sys.stdout.flush()  # inside the try: a reader that went away is noticed here
        return status
    except CommandLineError as exc:
        print(f"plugrt: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except PlugrtError as exc:
        print(f"plugrt: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except BrokenPipeError:
        # the reader went away (``plugrt ... | head``): stop quietly, as other tools do;
        # stdout is pointed at devnull so the interpreter's final flush does not complain
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
