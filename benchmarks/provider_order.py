"""Optimisation against provider order: node count and latency of ResNet-50 per provider list.

usage: python benchmarks/provider_order.py [--model resnet50] [--runs 20]

Builds the light model with ``providers=plugrt.get_available_providers()`` (every
installed provider, the template among them when installed), with ``["cpu"]`` and with
the available list reversed, then times ``run`` alternating the sessions in one process.
The optimised graph must not depend on where the host provider sits in the list.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

import plugrt
from plugrt.conformance.light_models import light_models


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", help="a light model name (default resnet50)")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    (model,) = [m for m in light_models() if m.name == args.model]
    available = plugrt.get_available_providers()
    lists = {"get_available_providers()": available, '["cpu"]': ["cpu"], "reversed": list(reversed(available))}
    sessions = {}
    rows = {}
    for label, providers in lists.items():
        start = time.perf_counter()
        session = plugrt.InferenceSession(model.path, providers=providers)
        build = time.perf_counter() - start
        sessions[label] = session
        rows[label] = {
            "providers": session.get_providers(),
            "nodes": len(list(session.session.model.graph)),
            "folded": session.session.optimization_stats.get("folded", 0),
            "build_s": build,
            "times": [],
        }
    expected = None
    for label, session in sessions.items():
        out = session.run(None, model.inputs)[0]
        expected = out if expected is None else expected
        rows[label]["max_abs_diff"] = float(np.max(np.abs(out - expected)))
    for _ in range(args.runs):
        for label, session in sessions.items():
            start = time.perf_counter()
            session.run(None, model.inputs)
            rows[label]["times"].append(time.perf_counter() - start)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{model.name}: {args.runs} alternating runs, load average {load:.2f}")
    print(f"{'providers':28s} {'nodes':>6s} {'folded':>7s} {'build s':>8s} {'median ms':>10s} {'min ms':>8s}  in use")
    base = statistics.median(rows['["cpu"]']["times"])
    for label, row in rows.items():
        median = statistics.median(row["times"])
        row["median_ms"], row["min_ms"] = median * 1e3, min(row["times"]) * 1e3
        row["ratio_to_cpu"] = median / base
        print(
            f"{label:28s} {row['nodes']:6d} {row['folded']:7d} {row['build_s']:8.2f} {row['median_ms']:10.2f} "
            f"{row['min_ms']:8.2f}  {', '.join(row['providers'])} (x{row['ratio_to_cpu']:.2f})"
        )
        del row["times"]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
