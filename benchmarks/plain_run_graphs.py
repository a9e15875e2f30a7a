"""Plain runs with graphs against plain runs without, side by side in one process.

For each light model: two sessions on ``--device`` (``graphs=False`` and ``graphs=True``),
warmed until the second has recorded its graph, then ``--runs`` runs of each, alternating
run by run so that load from other processes hits both alike. Prints the median of each,
the ratio graphs/eager (below 1: graphs are faster), the graph counters, and whether the
outputs are equal. This is the measurement behind a provider's ``capture_plain_runs``
(the CPU provider's False; the CUDA provider's True is to be confirmed on a GPU).

    python benchmarks/plain_run_graphs.py --device cpu --models 'squeeze|shuffle'
    python benchmarks/plain_run_graphs.py --device cuda --runs 50
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

import numpy as np

import plugrt
from plugrt.conformance.light_models import light_models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="the device both sessions use (cpu, cuda, auto)")
    parser.add_argument("--models", default=".", help="regular expression selecting light models by name")
    parser.add_argument("--runs", type=int, default=15, help="timed runs of each session")
    args = parser.parse_args()
    print(f"device={args.device} runs={args.runs} load={os.getloadavg()[0]:.2f}")
    ratios = []
    for model in light_models():
        if not re.search(args.models, model.name):
            continue
        eager = plugrt.load(model.path, device=args.device, graphs=False)
        graphs = plugrt.load(model.path, device=args.device, graphs=True)
        for _ in range(3):  # the graphs session records on its second run
            expected, got = eager.run(model.inputs), graphs.run(model.inputs)
        same = all(np.array_equal(expected[k], got[k]) for k in expected)
        times: dict[str, list[float]] = {"eager": [], "graphs": []}
        for _ in range(args.runs):
            for label, session in (("eager", eager), ("graphs", graphs)):
                started = time.perf_counter()
                session.run(model.inputs)
                times[label].append(time.perf_counter() - started)
        e, g = statistics.median(times["eager"]), statistics.median(times["graphs"])
        ratios.append(g / e)
        stats = graphs.stats()
        print(
            f"{model.name:14s} eager {e * 1e3:9.3f} ms  graphs {g * 1e3:9.3f} ms  graphs/eager {g / e:.3f}  "
            f"hits {stats.graph_hits} captures {stats.graph_captures} refusals {dict(stats.graph_refusals)}  "
            f"equal {same}"
        )
    if ratios:
        print(f"graphs/eager: geomean {float(np.exp(np.mean(np.log(ratios)))):.3f} over {len(ratios)} model(s)")


if __name__ == "__main__":
    main()
