"""Measure what a second session of one model costs in RSS, with and without a shared WeightStore.

    python benchmarks/shared_weights.py                       # alexnet, vgg19, a generated model
    python benchmarks/shared_weights.py --models vgg19 --json out.json

Each case runs in a fresh process: it builds two sessions of the model one after the
other and reads ``VmRSS`` from ``/proc/self/status`` (after a garbage collection) before
the first, after the first and after the second. Cases:

- ``plugrt``: two ``plugrt.load`` calls, nothing shared;
- ``plugrt shared``: both with ``weights=plugrt.WeightStore()`` (the second session takes
  the first one's initializers and prepared weights);
- ``onnxruntime``: two ``InferenceSession`` (each holds its own weights; the light models'
  weights are folded ConstantOfShape results, which ``add_initializer`` cannot share).

Models: onnx's light AlexNet and VGG-19 (their weights, all 0.02, are built by
ConstantOfShape nodes that both runtimes fold at load: 233 MiB and 548 MiB), and
``dense_external``: a generated model of four 4096x4096 float32 Gemm weights (256 MiB,
transB=1) stored as external data, which plugrt memory-maps. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import gc, json, sys, time

def rss():
    gc.collect()
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

case, path = sys.argv[1], sys.argv[2]
if case.startswith("plugrt"):
    import plugrt
    options = {"weights": plugrt.WeightStore()} if case == "plugrt shared" else {}
    make = lambda: plugrt.load(path, device="cpu", **options)
else:
    import onnxruntime
    make = lambda: onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
before = rss()
started = time.perf_counter()
first = make()
first_seconds = time.perf_counter() - started
after_first = rss()
started = time.perf_counter()
second = make()
second_seconds = time.perf_counter() - started
after_second = rss()
print(json.dumps({
    "first_bytes": after_first - before, "second_bytes": after_second - after_first,
    "first_seconds": first_seconds, "second_seconds": second_seconds,
}))
"""

CASES = ("plugrt", "plugrt shared", "onnxruntime")
MIB = 2**20


def _light(name: str) -> str:
    from plugrt.conformance.light_models import light_model_dir

    return os.path.join(light_model_dir(), f"light_{name}.onnx")


def _dense_external(folder: str) -> str:
    """Four (4096, 4096) float32 Gemm weights (transB=1), saved as external data."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    n, layers = 4096, 4
    rng = np.random.default_rng(0)
    nodes, weights = [], []
    for i in range(layers):
        source = "x" if i == 0 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [source, f"w{i}"], [f"h{i + 1}" if i + 1 < layers else "y"], transB=1))
        weights.append(numpy_helper.from_array(rng.standard_normal((n, n), dtype=np.float32), f"w{i}"))
    graph = helper.make_graph(
        nodes, "dense", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, n])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, n])], weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = os.path.join(folder, "dense_external.onnx")
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="dense_external.bin")
    return path


def _run(case: str, path: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", _CHILD, case, path], capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise SystemExit(f"{case} on {path} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bvlc_alexnet,vgg19,dense_external", help="comma-separated")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        raise SystemExit("reads VmRSS from /proc/self/status: Linux only")
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            path = _dense_external(folder) if name == "dense_external" else _light(name)
            for case in CASES:
                result = {"model": name, "case": case, **_run(case, path)}
                results.append(result)
    load = os.getloadavg()
    print(f"load averages {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, {os.cpu_count()} cores\n")
    print("| model | runtime | 1st session ΔRSS MiB | 2nd session ΔRSS MiB | 2nd / 1st | build s (1st, 2nd) |")
    print("|---|---|---:|---:|---:|---|")
    for r in results:
        ratio = r["second_bytes"] / r["first_bytes"] if r["first_bytes"] > 0 else float("nan")
        print(
            f"| {r['model']} | {r['case']} | {r['first_bytes'] / MIB:.0f} | {r['second_bytes'] / MIB:.0f} | "
            f"{ratio:.2f} | {r['first_seconds']:.2f}, {r['second_seconds']:.2f} |"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
