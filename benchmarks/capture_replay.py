"""Capture/replay against plain runs, in one process: latency and bytes allocated.

usage: python benchmarks/capture_replay.py [--models resnet50,densenet121] [--runs 20]

For each light model: median latency of ``session.run`` and of ``session.replay``
(alternating), and the bytes each allocates (tracemalloc peak during one call, after
warm-up). Replay outputs are checked bitwise against eager ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import tracemalloc

import numpy as np

import plugrt
from plugrt.conformance.light_models import light_models


def _allocated(call) -> int:
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def measure(model, runs: int) -> dict:
    session = plugrt.load(model.path, device="cpu")
    eager = session.run(model.inputs)
    captured = session.try_capture(model.inputs)
    if not getattr(captured, "captured", False):
        return {"model": model.name, "captured": False, "report": str(captured.report)}
    replayed = session.replay(model.inputs)
    identical = all(eager[k].tobytes() == replayed[k].tobytes() for k in eager)
    run_times, replay_times = [], []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(model.inputs)
        run_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        session.replay(model.inputs)
        replay_times.append(time.perf_counter() - start)
    run_bytes = _allocated(lambda: session.run(model.inputs))
    replay_bytes = _allocated(lambda: session.replay(model.inputs))
    report = captured.report
    return {
        "model": model.name,
        "captured": True,
        "identical": identical,
        "segments": len(report.segments),
        "seams": len(report.seams),
        "run_ms": statistics.median(run_times) * 1e3,
        "replay_ms": statistics.median(replay_times) * 1e3,
        "speedup": statistics.median(run_times) / statistics.median(replay_times),
        "run_bytes": run_bytes,
        "replay_bytes": replay_bytes,
        "replay_bytes_pct": 100.0 * replay_bytes / max(run_bytes, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet50,densenet121")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    wanted = set(args.models.split(","))
    rows = [measure(m, args.runs) for m in light_models() if m.name in wanted]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine load (1 min): {load:.2f}; numpy {np.__version__}\n")
    print("| model | identical | segments | seams | run ms | replay ms | run/replay | run MB | replay MB | replay/run bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if not row["captured"]:
            print(f"| {row['model']} | not capturable | | | | | | | | |")
            continue
        print(
            f"| {row['model']} | {row['identical']} | {row['segments']} | {row['seams']} | {row['run_ms']:.1f} | "
            f"{row['replay_ms']:.1f} | {row['speedup']:.2f}x | {row['run_bytes'] / 1e6:.2f} | "
            f"{row['replay_bytes'] / 1e6:.3f} | {row['replay_bytes_pct']:.2f}% |"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0 if all(r.get("identical", False) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
