"""Time ``import plugrt`` against ``import onnxruntime``, each in fresh processes.

    python benchmarks/import_time.py              # 5 processes each, alternating
    python benchmarks/import_time.py --repeat 9 --top 10

Each process times its one import with ``time.perf_counter`` (interpreter start-up is
not counted); a first, untimed, process of each fills the operating system's file cache.
Prints the median and minimum of each in milliseconds and the ratio of the medians
(the target: plugrt at most 0.5 s, and at most twice onnxruntime). ``--top N`` also
lists the N modules that take longest under ``python -X importtime -c "import plugrt"``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys

_CHILD = "import time\nstarted = time.perf_counter()\nimport {module}\nprint(time.perf_counter() - started)"


def import_seconds(module: str) -> float:
    code = _CHILD.format(module=module)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out)


def top_imports(module: str, count: int) -> list[tuple[float, str]]:
    """(cumulative milliseconds, module) of the ``count`` slowest imports under -X importtime."""
    err = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"], capture_output=True, text=True, check=True
    ).stderr
    rows = []
    for line in err.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line[len("import time:"):].split("|")
        rows.append((int(cumulative) / 1000, name.rstrip()))
    # the module's own import is the last top-level row; its imports are the indented
    # rows just before it (the interpreter's start-up, site and the like, come earlier)
    end = max(i for i, (_, name) in enumerate(rows) if name.strip() == module and not name.startswith("  "))
    start = end
    while start > 0 and rows[start - 1][1].startswith("  "):
        start -= 1
    return sorted(((ms, name.strip()) for ms, name in rows[start : end + 1]), reverse=True)[:count]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="fresh processes per module (default 5)")
    parser.add_argument("--top", type=int, default=0, help="also list the N slowest imports of plugrt")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    args = parser.parse_args(argv)
    modules = ["plugrt", "onnxruntime"]
    if importlib.util.find_spec("onnxruntime") is None:
        print("onnxruntime is not installed (pip install onnxruntime): timing import plugrt alone")
        modules = ["plugrt"]
    for module in modules:
        import_seconds(module)  # untimed: fills the file cache
    times: dict[str, list[float]] = {m: [] for m in modules}
    for _ in range(args.repeat):
        for module in modules:  # alternating, so both see the same machine load
            times[module].append(import_seconds(module))
    medians = {m: statistics.median(t) for m, t in times.items()}
    ratio = medians["plugrt"] / medians["onnxruntime"] if "onnxruntime" in medians else None
    if args.json:
        print(json.dumps({"seconds": times, "median": medians, "ratio": ratio}))
    else:
        for module in modules:
            print(f"import {module:12s} median {medians[module] * 1000:7.1f} ms   min {min(times[module]) * 1000:7.1f} ms")
        if ratio is not None:
            print(f"plugrt / onnxruntime: {ratio:.2f}")
    if args.top:
        print("slowest imports of plugrt (cumulative ms, -X importtime):")
        for millis, name in top_imports("plugrt", args.top):
            print(f"  {millis:8.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
