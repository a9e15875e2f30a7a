"""Time a cold start: importing plugrt, then loading SqueezeNet and running it once, in fresh processes.

    python benchmarks/startup.py --repeat 5
    python benchmarks/startup.py --against /path/to/old/checkout   # old and new, alternating

Each repeat starts a new Python process, so nothing (modules, numba's in-memory
dispatchers, BLAS pools) is warm except the operating system's file cache, which the
first, untimed, process fills. With ``--against`` the other checkout's ``core`` and
``providers/cpu`` come first on ``PYTHONPATH`` in every other process, so both see the
same machine load. Prints medians and minima in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

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


def _child(checkout: str | None) -> dict[str, float]:
    environment = dict(os.environ)
    if checkout is not None:
        paths = [os.path.join(checkout, "core"), os.path.join(checkout, "providers", "cpu")]
        environment["PYTHONPATH"] = os.pathsep.join(paths + [environment.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run([sys.executable, "-c", _CHILD], env=environment, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"the timed process failed ({checkout or 'this checkout'}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="fresh processes per checkout (5)")
    parser.add_argument("--against", metavar="CHECKOUT", help="another checkout to time alternately")
    parser.add_argument("--this", metavar="CHECKOUT", help="time this checkout instead of the installed plugrt")
    args = parser.parse_args(argv)
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
    print("| checkout | step | median ms | min ms |")
    print("|---|---|---:|---:|")
    for label, runs in samples.items():
        for step in runs[0]:
            values = [run[step] * 1e3 for run in runs]
            print(f"| {label} | {step} | {statistics.median(values):.0f} | {min(values):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
