"""Time a cold start: importing plugrt, then loading SqueezeNet and running it once, in fresh processes.

    python benchmarks/startup.py --repeat 5
    python benchmarks/startup.py --against /path/to/old/checkout   # old and new, alternating
    python benchmarks/startup.py --numba --repeat 3                # numba's first run, empty cache

Each repeat starts a new Python process, so nothing (modules, numba's in-memory
dispatchers, BLAS pools) is warm except the operating system's file cache, which the
first, untimed, process fills. With ``--against`` the other checkout's ``core`` and
``providers/cpu`` come first on ``PYTHONPATH`` in every other process, so both see the
same machine load. Prints medians and minima in milliseconds.

``--numba`` (numba installed: ``pip install -e ".[accelerate]"``) times instead, in
alternation, the default install's first run (``PLUGRT_NUMBA=0``, or the interpreter of a
venv without numba given by ``--default-python``) and numba's with an empty on-disk cache
(``NUMBA_CACHE_DIR`` a new temporary directory per process), and prints the ratio of the
two; that process then waits for the background build and times the steady state (p50 of
``--steady-runs`` runs). One more process per repeat finds the cache that one built.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, time
started = time.perf_counter()
import plugrt
imported = time.perf_counter()
import plugrt_cpu.kernels
kernels = time.perf_counter()
from plugrt.conformance.light_models import light_models
model = next(m for m in light_models() if m.name == "squeezenet")
ready = time.perf_counter()
session = plugrt.load(model.path, device="cpu")
built = time.perf_counter()
session.run(model.inputs)
first = time.perf_counter()
session.run(model.inputs)
second = time.perf_counter()
print(json.dumps({
    "import plugrt": imported - started,
    "import kernels": kernels - imported,
    "load squeezenet": built - ready,
    "first run": first - built,
    "second run": second - first,
    "import + load + first run": (imported - started) + (kernels - imported) + (first - ready),
}))
"""

# After _CHILD's runs (same process): wait for the compiled loops, then time the steady state.
_STEADY = r"""
import statistics
from plugrt_cpu.kernels import _compiled
waited = time.perf_counter()
_compiled.wait_ready()
built = time.perf_counter()
for _ in range(5):
    session.run(model.inputs)
times = []
for _ in range(STEADY_RUNS):
    began = time.perf_counter()
    session.run(model.inputs)
    times.append(time.perf_counter() - began)
print(json.dumps({"build after the second run": built - waited, "steady p50": statistics.median(times)}))
"""


def _child(
    checkout: str | None, environment_extra: dict[str, str] | None = None, python: str | None = None, steady_runs: int = 0
) -> dict[str, float]:
    environment = dict(os.environ)
    environment.update(environment_extra or {})
    if checkout is not None:
        paths = [os.path.join(checkout, "core"), os.path.join(checkout, "providers", "cpu")]
        environment["PYTHONPATH"] = os.pathsep.join(paths + [environment.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    code = _CHILD + (_STEADY.replace("STEADY_RUNS", str(steady_runs)) if steady_runs else "")
    done = subprocess.run([python or sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"the timed process failed ({checkout or 'this checkout'}):\n{done.stderr[-3000:]}")
    figures: dict[str, float] = {}
    for line in done.stdout.strip().splitlines():
        if line.startswith("{"):
            figures.update(json.loads(line))
    return figures


def _print_table(samples: dict[str, list[dict[str, float]]]) -> None:
    print("| process | step | median ms | min ms |")
    print("|---|---|---:|---:|")
    for label, runs in samples.items():
        for step in runs[0]:
            values = [run[step] * 1e3 for run in runs]
            print(f"| {label} | {step} | {statistics.median(values):.0f} | {min(values):.0f} |")


def _numba_first_runs(args: argparse.Namespace) -> int:
    """The default install's first run against numba's with an empty cache (see the module)."""
    checkout = os.path.abspath(args.this) if args.this else None
    default_env = {} if args.default_python else {"PLUGRT_NUMBA": "0"}
    numba_env = {"PLUGRT_NUMBA": "1"}
    _child(checkout, default_env, args.default_python)  # fill the file cache
    labels = ("default (no numba)", "numba, empty cache", "numba, cache it built")
    samples: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    for _ in range(args.repeat):
        samples[labels[0]].append(_child(checkout, default_env, args.default_python))
        cache = tempfile.mkdtemp(prefix="plugrt-numba-cache-")
        try:
            cold = dict(numba_env, NUMBA_CACHE_DIR=cache)
            samples[labels[1]].append(_child(checkout, cold, steady_runs=args.steady_runs))
            samples[labels[2]].append(_child(checkout, cold))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    print(f"load average: {' '.join(f'{v:.2f}' for v in os.getloadavg())}; {args.repeat} fresh processes each")
    _print_table(samples)
    for step in ("first run", "import + load + first run"):
        default = statistics.median(run[step] for run in samples[labels[0]])
        cold = statistics.median(run[step] for run in samples[labels[1]])
        print(f"{step}: numba with an empty cache {cold * 1e3:.0f} ms, default {default * 1e3:.0f} ms: {cold / default:.2f}x")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="fresh processes per checkout (5)")
    parser.add_argument("--against", metavar="CHECKOUT", help="another checkout to time alternately")
    parser.add_argument("--this", metavar="CHECKOUT", help="time this checkout instead of the installed plugrt")
    parser.add_argument("--numba", action="store_true", help="numba's first run with an empty cache against the default install's")
    parser.add_argument("--default-python", metavar="PYTHON", help="with --numba: the default install's interpreter (a venv without numba)")
    parser.add_argument("--steady-runs", type=int, default=30, help="with --numba: timed runs after the build (30)")
    args = parser.parse_args(argv)
    if args.numba:
        return _numba_first_runs(args)
    labels = {"this checkout": os.path.abspath(args.this) if args.this else None}
    if args.against:
        labels["--against"] = os.path.abspath(args.against)
    for checkout in labels.values():
        _child(checkout)  # fill the file cache and write any on-disk compile caches
    samples: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    for _ in range(args.repeat):
        for label, checkout in labels.items():
            samples[label].append(_child(checkout))
    print(f"load average: {' '.join(f'{v:.2f}' for v in os.getloadavg())}; {args.repeat} fresh processes each")
    _print_table(samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
