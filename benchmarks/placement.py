"""Placement by estimate against the CPU alone: device="auto" with a small vendor provider installed.

usage: python benchmarks/placement.py [--provider reluadd|template10|both] [--runs 20] [--models REGEX]
                                      [--placement estimate|priority] [--json PATH]

For each light model (``plugrt.conformance.light_models``), builds ``device="auto"`` with a
test provider at priority 10 registered through a faked entry point (``tests/fake_plugins.py``:
``reluadd`` runs only Relu and Add; ``template10`` is the template provider at priority 10),
and ``device="cpu"``, in one process; times ``run`` alternating the two sessions and prints
the ratio of their medians, the partitions, whether the generated plan is the CPU
session's own (same kernels, same order), and why the nodes the provider could run stayed
on the CPU (the placement report's fallbacks by cause). ``--placement priority`` shows what
the node-by-node priority order gave before placement by estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

import importlib_metadata

import plugrt
from plugrt.conformance.light_models import light_models
from plugrt.registry import ProviderRegistry

_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
_PLUGINS = {"reluadd": "fake_plugins:with_relu_add", "template10": "fake_plugins:with_template_10"}


def registry_with(provider: str) -> ProviderRegistry:
    """The installed providers plus the test provider, as if its distribution were installed."""
    if _TESTS not in sys.path:
        sys.path.insert(0, _TESTS)
    group = "plugrt.providers"
    installed = list(importlib_metadata.entry_points(group=group))
    return ProviderRegistry(entry_points=installed + [importlib_metadata.EntryPoint(provider, _PLUGINS[provider], group)])


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def measure(model, registry: ProviderRegistry, provider: str, runs: int, placement: str) -> dict:
    start = time.perf_counter()
    auto = plugrt.load(model.path, device="auto", registry=registry, placement=placement)
    auto.run(model.inputs)
    auto_first = time.perf_counter() - start
    start = time.perf_counter()
    cpu = plugrt.load(model.path, device="cpu")
    cpu.run(model.inputs)
    cpu_first = time.perf_counter() - start
    times: dict[str, list[float]] = {"auto": [], "cpu": []}
    for _ in range(2):
        auto.run(model.inputs), cpu.run(model.inputs)
    for _ in range(runs):
        for label, session in (("auto", auto), ("cpu", cpu)):
            begin = time.perf_counter()
            session.run(model.inputs)
            times[label].append(time.perf_counter() - begin)
    report = auto.placement
    causes: dict[str, int] = {}
    for fb in report.fallbacks:
        if fb.declined_by == provider:
            causes[fb.cause] = causes.get(fb.cause, 0) + 1
    example = next((fb.reason for fb in report.fallbacks if fb.declined_by == provider and fb.cause == "estimate"), "")
    return {
        "model": model.name,
        "auto_ms": _median_ms(times["auto"]),
        "cpu_ms": _median_ms(times["cpu"]),
        "ratio": statistics.median(times["auto"]) / statistics.median(times["cpu"]),
        "auto_first_s": auto_first,
        "cpu_first_s": cpu_first,
        "partitions": len(report.partitions),
        # the same generated plan as device="cpu": the same kernels in the same order
        "same_plan": auto.plan_source == cpu.plan_source,
        "nodes": dict(report.nodes_per_provider),
        "declined": causes,
        "example_reason": example,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=["reluadd", "template10", "both"], default="both")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--models", default="", help="regular expression the model names must match")
    parser.add_argument("--placement", choices=["estimate", "priority"], default="estimate")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    providers = ["reluadd", "template10"] if args.provider == "both" else [args.provider]
    models = [m for m in light_models() if re.search(args.models, m.name)]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.runs} alternating runs per model, placement={args.placement}, load average {load:.2f}")
    results = []
    worst = 0.0
    for provider in providers:
        registry = registry_with(provider)
        print(f"\nprovider {provider} (priority 10) installed; device='auto' against device='cpu'")
        print(f"{'model':14s} {'auto ms':>9s} {'cpu ms':>9s} {'ratio':>6s} {'parts':>5s} {'plan':>5s}  nodes; {provider}'s declines by cause")
        for model in models:
            row = measure(model, registry, provider, args.runs, args.placement)
            row["provider"] = provider
            results.append(row)
            worst = max(worst, row["ratio"])
            nodes = ", ".join(f"{k}: {v}" for k, v in row["nodes"].items())
            declined = ", ".join(f"{k}: {v}" for k, v in sorted(row["declined"].items()))
            print(
                f"{row['model']:14s} {row['auto_ms']:9.2f} {row['cpu_ms']:9.2f} {row['ratio']:6.3f} "
                f"{row['partitions']:5d} {'same' if row['same_plan'] else 'other':>5s}  {nodes}; {declined or '-'}"
            )
        reason = next((r["example_reason"] for r in results if r["provider"] == provider and r["example_reason"]), "")
        if reason:
            print(f"  e.g. {reason}")
    print(f"\nhighest auto/cpu median ratio: {worst:.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
