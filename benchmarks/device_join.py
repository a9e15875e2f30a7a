"""An accelerator that compiles for 5 s: the first run against an all-CPU session's, and the switch.

usage: python benchmarks/device_join.py [--models squeezenet,resnet50] [--compile-seconds 5]

With the test provider ``slowaccel`` (``tests/fake_plugins.py``: Relu and Add stated far
faster than the CPU, a compiler that takes ``--compile-seconds`` to start) registered through a
faked entry point, loads each light model with ``device="auto"`` and with
``device="cpu"`` (profiling on in both); prints the load and first-run times of both and their ratios, then
waits for the device plan, runs again and prints where that run ran, whether its outputs
equal the first run's, and the profile's ``plan_switch`` and per-run ``model_run`` plans.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import plugrt
from plugrt.conformance.light_models import light_models

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from placement import registry_with  # noqa: E402  (the benchmarks folder is not a package)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="squeezenet,resnet50")
    parser.add_argument("--compile-seconds", type=float, default=5.0)
    args = parser.parse_args()
    registry_with("reluadd")  # puts tests/ on the path
    import fake_plugins

    fake_plugins.SlowCompileProvider.compile_seconds = args.compile_seconds
    plugins = {"slowaccel": "fake_plugins:with_slow_compile"}
    from placement import _PLUGINS

    _PLUGINS.update(plugins)
    by_name = {m.name: m for m in light_models()}
    for name in args.models.split(","):
        model = by_name[name]
        plugrt.load(model.path, device="cpu").run(model.inputs)  # imports and first-use costs, untimed
        registry = registry_with("slowaccel")  # a provider whose compiler has not started yet
        start = time.perf_counter()
        cpu = plugrt.load(model.path, device="cpu", profiling=True)
        cpu_load = time.perf_counter() - start
        cpu.run(model.inputs)
        cpu_first = time.perf_counter() - start - cpu_load
        start = time.perf_counter()
        auto = plugrt.load(model.path, device="auto", registry=registry, profiling=True)
        auto_load = time.perf_counter() - start
        state = auto.device_join.state if auto.device_join else "none"
        first = auto.run(model.inputs)
        auto_first = time.perf_counter() - start - auto_load
        print(f"{name}: compile {args.compile_seconds:.1f} s; after load the device plan is {state!r}")
        print(
            f"  load: cpu {cpu_load * 1e3:.0f} ms, auto {auto_load * 1e3:.0f} ms; first run: cpu {cpu_first * 1e3:.1f} ms, "
            f"auto {auto_first * 1e3:.1f} ms ({auto_first / cpu_first:.2f}x); load + first run "
            f"{(auto_load + auto_first) / (cpu_load + cpu_first):.2f}x"
        )
        start = time.perf_counter()
        status = auto.wait_for_device_plan(timeout=args.compile_seconds * 20)
        waited = time.perf_counter() - start
        later = auto.run(model.inputs)
        same = all(np.allclose(later[k], first[k], rtol=1e-5, atol=1e-6) for k in first)
        used = {p: n for p, n in auto.placement.nodes_per_provider.items() if n}
        print(f"  waited {waited:.1f} s: {status.state} at run {status.switched_at_run} {status.reason}; placement now {used}")
        events = auto.profile()
        plans = [e["args"].get("plan") for e in events if e["name"] == "model_run"]
        switch = [e["args"] for e in events if e["name"] == "plan_switch"]
        print(f"  outputs equal to the first run's: {same}; profile: model_run plans {plans}, plan_switch {switch}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
