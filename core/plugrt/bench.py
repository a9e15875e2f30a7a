"""``plugrt bench``: latency percentiles, throughput and peak memory, beside onnxruntime."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import resource
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

__all__ = ["BenchResult", "bench", "format_table", "add_parser"]

#: The runtimes ``--compare`` accepts.
COMPARABLE = ("onnxruntime",)


@dataclasses.dataclass
class BenchResult:
    """One runtime's figures. Latencies in milliseconds; memory in MiB."""

    runtime: str
    runs: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    runs_per_s: float
    peak_rss_mib: float | None  # peak RSS increase for build + runs, in a fresh process
    max_abs_diff: float | None = None  # largest difference of its outputs from plugrt's


def _plugrt_runner(model: str, device: str, options: Mapping[str, Any]) -> Callable[[dict], Any]:
    from .session import load

    session = load(model, device=device, **dict(options))
    run = session.run
    return lambda feeds: list(run(feeds).values())


def _import_onnxruntime() -> Any:
    """onnxruntime, or MissingDependencyError saying how to install it."""
    from .errors import MissingDependencyError

    try:
        import onnxruntime
    except ImportError as exc:
        raise MissingDependencyError(
            "onnxruntime", "comparing with onnxruntime (--compare onnxruntime)",
            "pip install onnxruntime (or leave out --compare onnxruntime)",
        ) from exc
    return onnxruntime


def _ort_runner(model: str, device: str, options: Mapping[str, Any]) -> Callable[[dict], Any]:
    onnxruntime = _import_onnxruntime()

    session_options = onnxruntime.SessionOptions()
    # its pool threads otherwise spin after each run, taking the cores from the runtime
    # measured next (the runs alternate); benchmarks/compare.py does the same
    session_options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = onnxruntime.InferenceSession(model, session_options, providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(None, feeds)


_RUNNERS = {"plugrt": _plugrt_runner, "onnxruntime": _ort_runner}


def _rss_mib() -> float:
    """This process's peak resident set so far, in MiB."""
    try:  # Linux: VmHWM starts afresh with each exec, where ru_maxrss keeps the parent's peak
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux, bytes on macOS


def _peak_memory_child(kind: str, model: str, device: str, options: dict, feeds: dict, runs: int, queue: Any) -> None:
    """In a fresh process: peak RSS after building and running, less the peak before."""
    try:
        if kind == "onnxruntime":
            import onnxruntime  # noqa: F401  (imported before the baseline: not the runtime's cost)
        else:
            from . import session  # noqa: F401
        baseline = _rss_mib()
        run = _RUNNERS[kind](model, device, options)
        for _ in range(runs):
            run(feeds)
        queue.put(_rss_mib() - baseline)
    except BaseException as exc:  # reported in the parent, never a hang
        queue.put(f"{type(exc).__name__}: {exc}")


def peak_memory(kind: str, model: str, device: str, options: Mapping[str, Any], feeds: dict, runs: int) -> float | None:
    """Peak RSS increase (MiB) of building ``kind`` and running it ``runs`` times, in a
    fresh process so that one runtime's memory never counts against another's."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(
        target=_peak_memory_child, args=(kind, model, device, dict(options), feeds, runs, queue)
    )
    child.start()
    try:
        answer = queue.get(timeout=600)
    except Exception:
        answer = None
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
    return answer if isinstance(answer, float) else None


def _percentiles(times: Sequence[float], count: int, total: float, kind: str, memory: float | None) -> BenchResult:
    ms = np.asarray(times) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return BenchResult(kind, count, float(p50), float(p90), float(p99), float(ms.mean()), count / total, memory)


def bench(
    model: str,
    feeds: dict[str, np.ndarray],
    *,
    device: str = "auto",
    compare: Sequence[str] = (),
    warmup: int = 5,
    runs: int = 50,
    memory: bool = True,
    options: Mapping[str, Any] | None = None,
) -> list[BenchResult]:
    """Time plugrt (and each runtime in ``compare``) in this process, one run of each in
    turn so that a change in machine load hits all of them alike."""
    kinds = ["plugrt", *compare]
    options = dict(options or {})
    runners = {kind: _RUNNERS[kind](model, device, options) for kind in kinds}
    for run in runners.values():
        for _ in range(warmup):
            run(feeds)
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    clock = time.perf_counter
    for _ in range(runs):
        for kind, run in runners.items():
            start = clock()
            run(feeds)
            times[kind].append(clock() - start)
    reference = runners["plugrt"](feeds)
    results = []
    for kind in kinds:
        used = peak_memory(kind, model, device, options, feeds, max(1, min(runs, 3))) if memory else None
        result = _percentiles(times[kind], runs, sum(times[kind]), kind, used)
        if kind != "plugrt":  # a comparison of speed means little if the answers differ
            result.max_abs_diff = _max_abs_diff(reference, runners[kind](feeds))
        results.append(result)
    return results


def _max_abs_diff(expected: Sequence[Any], actual: Sequence[Any]) -> float:
    worst = 0.0
    for a, b in zip(expected, actual):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return float("inf")
        if a.size and a.dtype.kind in "fciub" and b.dtype.kind in "fciub":
            worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))))
    return worst


def format_table(results: Sequence[BenchResult]) -> str:
    header = (
        f"{'runtime':<12} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'mean ms':>9} {'runs/s':>9} {'peak MiB':>9}"
        f" {'max |diff|':>11}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        memory = f"{r.peak_rss_mib:9.1f}" if r.peak_rss_mib is not None else f"{'n/a':>9}"
        diff = f"{r.max_abs_diff:11.3g}" if r.max_abs_diff is not None else f"{'-':>11}"
        lines.append(
            f"{r.runtime:<12} {r.p50_ms:9.3f} {r.p90_ms:9.3f} {r.p99_ms:9.3f} {r.mean_ms:9.3f} {r.runs_per_s:9.1f}"
            f" {memory} {diff}"
        )
    base = results[0]
    for other in results[1:]:
        lines.append(
            f"p50 plugrt / {other.runtime}: {base.p50_ms / other.p50_ms:.2f} (above 1: plugrt is slower)"
        )
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    """The ``plugrt bench`` subcommand."""
    bench_parser = sub.add_parser("bench", help="latency percentiles, throughput and peak memory (optionally beside onnxruntime)")
    bench_parser.add_argument("model", help="path to an .onnx file")
    bench_parser.add_argument("--device", default="auto", help="auto, cpu, gpu, gpu:N, cuda:N, a provider name or a policy")
    bench_parser.add_argument("--compare", action="append", default=[], choices=COMPARABLE, help="also time this runtime")
    bench_parser.add_argument("--warmup", type=int, default=5, help="untimed runs first (default 5)")
    bench_parser.add_argument("--runs", type=int, default=50, help="timed runs per runtime (default 50)")
    bench_parser.add_argument("--fast", action="store_true", help="a quick look: 1 warm-up and 5 timed runs")
    bench_parser.add_argument("--dim", action="append", default=[], metavar="SYMBOL=SIZE", help="size of a symbolic input dimension (default 1)")
    bench_parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement (a child process per runtime)")
    bench_parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    bench_parser.set_defaults(func=_cmd_bench)


def _cmd_bench(args: Any) -> int:
    from .errors import CommandLineError
    from .inputs import example_inputs
    from .session import load

    dims = {}
    for pair in args.dim:
        symbol, _, size = pair.partition("=")
        if not symbol or not size.isdigit() or int(size) < 1:
            raise CommandLineError("bench", f"--dim takes SYMBOL=SIZE with SIZE >= 1, got {pair!r}", option="--dim")
        dims[symbol] = int(size)
    warmup, runs = (1, 5) if args.fast else (args.warmup, args.runs)
    if runs < 1 or warmup < 0:
        raise CommandLineError("bench", f"--runs must be at least 1 and --warmup at least 0, got {runs} and {warmup}")
    if "onnxruntime" in args.compare:
        _import_onnxruntime()  # before anything is built or timed
    feeds = example_inputs(load(args.model, device=args.device).inputs, dims=dims)
    load_before = os.getloadavg()
    results = bench(
        args.model, feeds, device=args.device, compare=args.compare, warmup=warmup, runs=runs, memory=not args.no_memory
    )
    load_after = os.getloadavg()
    shapes = ", ".join(f"{name} {list(value.shape)}" for name, value in feeds.items())
    print(f"model: {args.model}  device: {args.device}  inputs: {shapes}")
    print(
        f"{warmup} warm-up and {runs} timed runs each, runtimes alternating run by run; "
        f"{os.cpu_count()} cores, load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print(format_table(results))
    print("peak MiB: peak RSS increase of building and running, each runtime in a fresh process")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "model": args.model,
                    "device": args.device,
                    "inputs": {name: list(value.shape) for name, value in feeds.items()},
                    "warmup": warmup,
                    "runs": runs,
                    "cores": os.cpu_count(),
                    "load_average": [load_before[0], load_after[0]],
                    "python": sys.version.split()[0],
                    "memory_measure": "peak RSS increase (VmHWM) of build + runs in a fresh process",
                    "results": [dataclasses.asdict(r) for r in results],
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0
