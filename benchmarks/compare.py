"""Time plugrt's CPU provider against onnxruntime and onnx.reference, side by side in one process.

For each model: session build time, median and p90 latency over ``--runs`` runs after
``--warmup`` runs (the runtimes alternate run by run, so load from other processes hits
them alike; ``--back-to-back`` times each runtime's runs one after another instead, as an
application's loop calls it, so that what one run leaves running slows the next), peak memory, the ratios plugrt/onnxruntime and plugrt/reference, and a
correctness check. Markdown goes to stdout, JSON to ``--json PATH``.

    python benchmarks/compare.py --models 'resnet|encoder' --runs 20 --json out.json
    python benchmarks/compare.py --load 1    # one busy background process the whole time

Models (``--set light``, the default): the nine light models from onnx, a transformer
encoder (benchmarks/make_encoder.py) at batch 1 and 8, and a chain of 1,000 elementwise
nodes next to a bare numpy loop doing the same calls (the floor for per-node overhead).
``--set exports`` times the models benchmarks/models.py exported (``--exports DIR``):
current architectures as users export them, checked against onnxruntime; ``--set all``
both. With OpenVINO installed (the ``bench`` extra) its CPU plugin runs beside them, in
float32 (``INFERENCE_PRECISION_HINT`` f32: on CPUs with bf16 it would otherwise compute in
bf16). Every run prints the machine: CPU model, the vector features the kernels choose
from, cores. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from typing import Any, Callable

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper, numpy_helper

import plugrt
from plugrt.conformance.light_models import light_models, with_logits
from plugrt_cpu import CPUProvider

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_encoder import encoder_inputs, make_encoder  # noqa: E402

# The reference evaluator needs from seconds to minutes per run on these CNNs; it runs by
# default only where one run takes a few seconds at most (timed on a 2-core Zen3).
_REFERENCE_TOO_SLOW = frozenset({"vgg19", "zfnet512", "bvlc_alexnet", "resnet50", "densenet121", "inception_v2"})
_BLAS_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT")
_CHAIN_LENGTH = 1000
_CHAIN_WIDTH = 16
_LIGHT_TOLERANCE = {"rtol": 1e-3, "atol": 1e-7}  # what onnx's backend tests use for these models
_LOGIT_TOLERANCE = {"rtol": 1e-4, "scaled_atol": 1e-4}  # atol: that times the largest logit
_EXPORT_TOLERANCE = {"rtol": 1e-3, "scaled_atol": 1e-4}  # random weights, float32: against onnxruntime
_ENCODER_TOLERANCE = {"rtol": 1e-3, "atol": 1e-5}

# A busy background process: pure Python arithmetic (one core, no memory traffic to speak
# of), ending by itself at its deadline or as soon as its parent is gone.
_BUSY_LOOP = r"""
import os, sys, time
deadline = time.monotonic() + float(sys.argv[1])
parent = os.getppid()
while time.monotonic() < deadline and os.getppid() == parent:
    total = 0
    for i in range(100000):
        total += i
"""


class BackgroundLoad:
    """``count`` busy processes, each a CPU-bound loop, for at most ``seconds``; stopped
    on exit from the ``with`` block, whatever ends it (an exception, Ctrl-C, SIGTERM)."""

    def __init__(self, count: int, seconds: float):
        self.count = count
        self.seconds = seconds
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> "BackgroundLoad":
        try:
            for _ in range(self.count):
                self.processes.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _BUSY_LOOP, str(self.seconds)],
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    )
                )
        except BaseException:
            self.stop()
            raise
        if self.processes:
            time.sleep(0.5)  # let the scheduler see them before the first measurement
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def running(self) -> int:
        return sum(p.poll() is None for p in self.processes)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds the with blocks: the busy processes are stopped


# ---------------------------------------------------------------------------------------
# Cases: a model, its feeds and what its plugrt output is checked against


@dataclasses.dataclass
class Case:
    name: str
    path: str
    feeds: dict[str, np.ndarray]
    expected: list[np.ndarray] | None = None  # None: check plugrt against onnxruntime
    tolerance: dict[str, float] = dataclasses.field(default_factory=lambda: dict(_ENCODER_TOLERANCE))
    reference_by_default: bool = True
    floor: Callable[[dict[str, np.ndarray]], list[np.ndarray]] | None = None  # a bare numpy version
    light: bool = False
    checked_outputs: tuple[int, ...] | None = None  # the outputs the check compares (None: all)


def _chain_model(path: str) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
    """``_CHAIN_LENGTH`` alternating Add/Mul nodes with constants on float[1, 16]; returns
    the bare numpy loop that does the same calls."""
    rng = np.random.default_rng(0)
    shift = (rng.standard_normal(_CHAIN_WIDTH) * 0.1).astype(np.float32)
    scale = np.full(_CHAIN_WIDTH, 0.5, np.float32)
    nodes, previous = [], "x"
    for index in range(_CHAIN_LENGTH):
        op, constant = ("Add", "shift") if index % 2 == 0 else ("Mul", "scale")
        output = "y" if index == _CHAIN_LENGTH - 1 else f"t{index}"
        nodes.append(helper.make_node(op, [previous, constant], [output], name=f"n{index}"))
        previous = output
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, _CHAIN_WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, _CHAIN_WIDTH])],
        [numpy_helper.from_array(shift, "shift"), numpy_helper.from_array(scale, "scale")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="plugrt")
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)

    add, multiply, half = np.add, np.multiply, _CHAIN_LENGTH // 2

    def numpy_loop(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        x = feeds["x"]
        for _ in range(half):
            x = add(x, shift)
            x = multiply(x, scale)
        return [x]

    return numpy_loop


def _cases(workdir: str) -> list[Case]:
    cases = []
    for m in light_models():
        # Their weights are one constant, so a final Softmax saturates: equal logits of up to
        # 1e31, where one ulp between two classes flips a one-hot. Such models are timed with
        # their logits as a second output and checked on those against onnxruntime, relative
        # to their largest value; the others against onnx's expected outputs.
        model, logits = with_logits(onnx.load(m.path))
        if not logits:
            cases.append(Case(m.name, m.path, m.inputs, m.expected, dict(_LIGHT_TOLERANCE),
                              reference_by_default=m.name not in _REFERENCE_TOO_SLOW, light=True))
            continue
        path = os.path.join(workdir, f"light_{m.name}_logits.onnx")
        onnx.save(model, path)
        cases.append(Case(m.name, path, m.inputs, None, dict(_LOGIT_TOLERANCE),
                          reference_by_default=m.name not in _REFERENCE_TOO_SLOW, light=True, checked_outputs=(1,)))
    encoder_path = os.path.join(workdir, "encoder.onnx")
    onnx.save(make_encoder(), encoder_path)
    for batch in (1, 8):
        cases.append(Case(f"encoder_b{batch}", encoder_path, encoder_inputs(batch)))
    chain_path = os.path.join(workdir, "chain.onnx")
    floor = _chain_model(chain_path)
    feeds = {"x": np.random.default_rng(1).standard_normal((1, _CHAIN_WIDTH)).astype(np.float32)}
    tolerance = {"rtol": 1e-5, "atol": 1e-6}
    cases.append(Case(f"chain{_CHAIN_LENGTH}", chain_path, feeds, floor=floor, tolerance=tolerance))
    return cases


# ---------------------------------------------------------------------------------------
# Runtimes: each builds a runner ``feeds -> list of outputs``


def _threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _build_plugrt(case: Case, optimization: str) -> Callable[[dict], list]:
    session = plugrt.load(case.path, device="cpu", optimization=optimization)
    run = session.run
    return lambda feeds: list(run(feeds).values())


def _build_ort(case: Case) -> Callable[[dict], list]:
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = _threads()
    options.inter_op_num_threads = 1
    # onnxruntime's pool threads otherwise spin for a while after each run, and on a
    # loaded machine they take the cores from the next runtime's BLAS threads.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3  # not the light models' "unused initializer" warnings
    session = onnxruntime.InferenceSession(case.path, options, providers=["CPUExecutionProvider"])
    run = session.run
    return lambda feeds: run(None, feeds)


def _build_openvino(case: Case) -> Callable[[dict], list]:
    import openvino

    core = openvino.Core()
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": _threads(), "INFERENCE_PRECISION_HINT": "f32"}
    compiled = core.compile_model(case.path, "CPU", config)
    request = compiled.create_infer_request()
    outputs = list(compiled.outputs)

    def run(feeds: dict) -> list:
        results = request.infer(feeds)
        return [results[o] for o in outputs]

    return run


def _openvino_available() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


def cpu_features() -> str:
    """The vector features kernels choose between, as /proc/cpuinfo names them."""
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile")
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return ", ".join(w for w in wanted if w in flags) or "none of " + ", ".join(wanted)
    except OSError:
        pass
    return "unknown"


def _export_cases(folder: str) -> list[Case]:
    """The models benchmarks/models.py exported, fed RandomState(0) inputs, checked against onnxruntime."""
    manifest_path = os.path.join(folder, "manifest.json")
    if not os.path.exists(manifest_path):
        raise SystemExit(f"no {manifest_path}: run python benchmarks/models.py --out {folder} first")
    with open(manifest_path, encoding="utf-8") as f:
        entries = json.load(f)["models"]
    cases = []
    for entry in entries:
        if "file" not in entry:
            print(f"... {entry['name']}: not exported ({entry.get('error', '?')})", file=sys.stderr)
            continue
        rng = np.random.RandomState(0)
        feeds = {}
        for name, shape in entry["inputs"].items():
            if name == "input_ids":
                feeds[name] = rng.randint(0, 1000, shape).astype(np.int64)
            elif name == "attention_mask":
                feeds[name] = np.ones(shape, np.int64)
            else:
                feeds[name] = rng.standard_normal(shape).astype(np.float32)
        cases.append(Case(entry["name"], os.path.join(folder, entry["file"]), feeds, None, dict(_EXPORT_TOLERANCE),
                          reference_by_default=False))
    return cases


def _build_reference(case: Case) -> Callable[[dict], list]:
    from onnx.reference import ReferenceEvaluator

    evaluator = ReferenceEvaluator(case.path)
    return lambda feeds: list(evaluator.run(None, feeds))


# ---------------------------------------------------------------------------------------
# Memory


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark (VmHWM) to the current RSS (Linux only)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclasses.dataclass
class Measurement:
    runtime: str
    build_s: float | None = None
    times_s: list[float] = dataclasses.field(default_factory=list)
    rss_peak_delta_mib: float | None = None  # VmHWM - VmRSS before: build + first run
    python_peak_mib: float | None = None  # tracemalloc peak of one run after warm-up
    check: str = ""
    error: str = ""

    @property
    def median_ms(self) -> float | None:
        return float(np.median(self.times_s)) * 1e3 if self.times_s else None

    @property
    def p90_ms(self) -> float | None:
        return float(np.percentile(self.times_s, 90)) * 1e3 if self.times_s else None

    def as_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(median_ms=self.median_ms, p90_ms=self.p90_ms, runs=len(self.times_s))
        return data


def _build_and_first_run(
    name: str, make: Callable[[], Callable], feeds: dict
) -> tuple[Callable | None, Measurement, list | None]:
    """Build a runner and run it once, measuring build time and the RSS high-water delta."""
    measurement = Measurement(name)
    gc.collect()
    rss_before = _status_kib("VmRSS")
    can_reset = _reset_peak_rss()
    try:
        started = time.perf_counter()
        runner = make()
        measurement.build_s = time.perf_counter() - started
        outputs = runner(feeds)
    except Exception as exc:  # a runtime that cannot run a model is reported, not fatal
        measurement.error = f"{type(exc).__name__}: {exc}"[:300]
        return None, measurement, None
    peak = _status_kib("VmHWM")
    if can_reset and rss_before is not None and peak is not None:
        measurement.rss_peak_delta_mib = max(0, peak - rss_before) / 1024
    return runner, measurement, outputs


def _python_peak_mib(runner: Callable, feeds: dict) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        runner(feeds)
        return tracemalloc.get_traced_memory()[1] / (1 << 20)
    finally:
        tracemalloc.stop()


# ---------------------------------------------------------------------------------------
# One case


def _compare(actual: list, expected: list, tolerance: dict[str, float], checked: tuple[int, ...] | None = None) -> str:
    if len(actual) != len(expected):
        return f"FAIL: {len(actual)} outputs, expected {len(expected)}"
    worst = 0.0
    for index, (got, want) in enumerate(zip(actual, expected)):
        if checked is not None and index not in checked:
            continue
        got, want = np.asarray(got), np.asarray(want)
        if got.shape != want.shape:
            return f"FAIL: shape {got.shape}, expected {want.shape}"
        error = float(np.abs(got.astype(np.float64) - want).max()) if got.size else 0.0
        close = dict(tolerance)
        if "scaled_atol" in close:
            close["atol"] = close.pop("scaled_atol") * (float(np.max(np.abs(want))) if want.size else 1.0)
        if not np.allclose(got, want, **close):
            return f"FAIL: max abs error {error:.3g}"
        worst = max(worst, error)
    return f"ok (max abs error {worst:.2g})"


def run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    with_reference = not args.skip_reference and (case.reference_by_default or args.reference == "all")
    makers: dict[str, Callable[[], Callable]] = {
        "plugrt": lambda: _build_plugrt(case, args.optimization),
        "onnxruntime": lambda: _build_ort(case),
    }
    if args.openvino:
        makers["openvino"] = lambda: _build_openvino(case)
    if with_reference:
        makers["reference"] = lambda: _build_reference(case)
    if case.floor is not None:
        makers["numpy loop"] = lambda: case.floor

    load_before = os.getloadavg()
    runners: dict[str, Callable] = {}
    measurements: dict[str, Measurement] = {}
    first_outputs: dict[str, list] = {}
    for name, make in makers.items():
        runner, measurement, outputs = _build_and_first_run(name, make, case.feeds)
        measurements[name] = measurement
        if runner is not None:
            runners[name] = runner
            first_outputs[name] = outputs

    # Correctness: plugrt against the expected outputs, or against onnxruntime.
    expected = case.expected if case.expected is not None else first_outputs.get("onnxruntime")
    if "plugrt" in first_outputs and expected is not None:
        measurements["plugrt"].check = _compare(first_outputs["plugrt"], expected, case.tolerance, case.checked_outputs)
    if case.floor is not None and "numpy loop" in first_outputs and "plugrt" in first_outputs:
        floor = first_outputs["numpy loop"]
        measurements["numpy loop"].check = _compare(first_outputs["plugrt"], floor, case.tolerance)
    del first_outputs

    for name, runner in runners.items():
        if name != "onnxruntime":  # tracemalloc does not see onnxruntime's C++ allocations
            measurements[name].python_peak_mib = _python_peak_mib(runner, case.feeds)

    # Warm-up and timed runs, alternating runtimes and rotating their order.
    order = list(runners)
    runs = {name: args.runs for name in order}
    if "reference" in runs:
        runs["reference"] = min(args.runs, args.reference_runs)
    for _ in range(max(0, args.warmup - 1)):  # the first run above was one warm-up
        for name in order:
            if name != "reference":
                runners[name](case.feeds)
    if args.back_to_back:  # each runtime's runs one after another, as an application's loop calls it
        for name in order:
            for _ in range(runs[name]):
                started = time.perf_counter()
                runners[name](case.feeds)
                measurements[name].times_s.append(time.perf_counter() - started)
    for index in range(0 if args.back_to_back else args.runs):
        shift = index % len(order)
        for name in order[shift:] + order[:shift]:
            if len(measurements[name].times_s) >= runs[name]:
                continue
            started = time.perf_counter()
            runners[name](case.feeds)
            measurements[name].times_s.append(time.perf_counter() - started)

    runners.clear()
    gc.collect()
    return {
        "model": case.name,
        "light": case.light,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "runtimes": {name: m.as_json() for name, m in measurements.items()},
        "exported": case.expected is None and not case.light and case.floor is None
        and not case.name.startswith("encoder_b"),
        "plugrt_over_ort": _ratio(measurements, "plugrt", "onnxruntime"),
        "plugrt_over_openvino": _ratio(measurements, "plugrt", "openvino"),
        "plugrt_over_reference": _ratio(measurements, "plugrt", "reference"),
        "plugrt_over_floor": _ratio(measurements, "plugrt", "numpy loop"),
    }


def _ratio(measurements: dict[str, Measurement], numerator: str, denominator: str) -> float | None:
    a, b = measurements.get(numerator), measurements.get(denominator)
    if a is None or b is None or a.median_ms is None or not b.median_ms:
        return None
    return a.median_ms / b.median_ms


# ---------------------------------------------------------------------------------------
# Reporting


def _fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown(results: list[dict[str, Any]], environment: dict[str, Any]) -> str:
    lines = [
        "# plugrt vs onnxruntime, OpenVINO and onnx.reference (CPU)",
        "",
        f"{environment['cpu']}, {environment['threads']} thread(s) for onnxruntime; "
        f"numpy {environment['numpy']}, onnxruntime {environment['onnxruntime']}, onnx {environment['onnx']}; "
        f"plugrt optimization={environment['optimization']!r}; {environment['runs']} runs after "
        f"{environment['warmup']} warm-up (reference: at most {environment['reference_runs']} runs); "
        f"BLAS environment: {environment['blas_environment'] or 'unset (numpy default)'}.",
        f"CPU features: {environment.get('cpu_features', '?')}; OpenVINO: {environment.get('openvino') or 'not run'}.",
        f"Machine: {environment['cores']} core(s), {environment['usable_cores']} usable by this process; "
        f"background load: {environment['background_load']} busy process(es) (`--load`).",
        f"Load average before: {_loads(environment['load_before'])}, after: {_loads(environment['load_after'])} "
        "(1, 5 and 15 minutes; the busy processes count; above the core count, latencies are noisy).",
        "",
        "| model | runtime | build s | median ms | p90 ms | runs | RSS Δ MiB | py peak MiB | check |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for result in results:
        for name, m in result["runtimes"].items():
            check = m["error"] or m["check"]
            lines.append(
                f"| {result['model']} | {name} | {_fmt(m['build_s'], 3)} | {_fmt(m['median_ms'])} | "
                f"{_fmt(m['p90_ms'])} | {m['runs']} | {_fmt(m['rss_peak_delta_mib'], 1)} | "
                f"{_fmt(m['python_peak_mib'], 1)} | {check} |"
            )
    lines += [
        "",
        "| model | plugrt/onnxruntime | plugrt/openvino | plugrt/reference | plugrt/numpy loop | load 1-min |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        lines.append(
            f"| {result['model']} | {_fmt(result['plugrt_over_ort'])} | {_fmt(result.get('plugrt_over_openvino'))} | "
            f"{_fmt(result['plugrt_over_reference'])} | {_fmt(result['plugrt_over_floor'])} | "
            f"{result['load_before'][0]:.2f} |"
        )
    exported = [r for r in results if r.get("exported") and r["plugrt_over_ort"]]
    if exported:
        worst = max(exported, key=lambda r: r["plugrt_over_ort"])
        line = (f"Geometric mean of plugrt/onnxruntime over {len(exported)} exported model(s): "
                f"**{_geomean([r['plugrt_over_ort'] for r in exported]):.2f}**; highest: {worst['model']} "
                f"{worst['plugrt_over_ort']:.2f}")
        vino = [r["plugrt_over_openvino"] for r in exported if r.get("plugrt_over_openvino")]
        if vino:
            line += f"; plugrt/openvino over {len(vino)}: **{_geomean(vino):.2f}**"
        lines += ["", line]
    light = [r["plugrt_over_ort"] for r in results if r["light"] and r["plugrt_over_ort"]]
    if light:
        mean = _geomean(light)
        lines += ["", f"Geometric mean of plugrt/onnxruntime over {len(light)} light model(s): **{mean:.2f}**"]
    scored = [r for r in results if (r["light"] or r["model"].startswith("encoder")) and r["plugrt_over_ort"]]
    if scored:
        worst = max(scored, key=lambda r: r["plugrt_over_ort"])
        lines += [
            "",
            f"Geometric mean of plugrt/onnxruntime over {len(scored)} model(s) (light models and encoders): "
            f"**{_geomean([r['plugrt_over_ort'] for r in scored]):.2f}**; "
            f"highest: {worst['model']} {worst['plugrt_over_ort']:.2f}",
        ]
    lines += [
        "",
        "RSS Δ: the process's peak resident memory (VmHWM, reset before each build) minus the RSS "
        "before the build, over build + first run. py peak: tracemalloc's peak over one run after "
        "warm-up (numpy buffers and Python objects; onnxruntime's own allocator is invisible to it).",
    ]
    return "\n".join(lines) + "\n"


def _loads(values: tuple[float, ...]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def _openvino_version() -> str:
    import openvino

    return str(getattr(openvino, "__version__", "?"))


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="regular expression (re.search) the model names must match")
    parser.add_argument("--runs", type=int, default=20, help="timed runs per runtime (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up runs per runtime, the first included (3)")
    parser.add_argument("--skip-reference", action="store_true", help="never run onnx.reference")
    parser.add_argument(
        "--reference", choices=("default", "all"), default="default",
        help="'default' skips onnx.reference on the slow CNNs; 'all' runs it everywhere (minutes on VGG)",
    )
    parser.add_argument("--reference-runs", type=int, default=3, help="timed runs of onnx.reference at most (3)")
    parser.add_argument(
        "--back-to-back", action="store_true",
        help="time each runtime's runs one after another (as an application's loop) instead of alternating "
        "runtimes run by run: what one run leaves behind (threads still spinning) then slows the next",
    )
    parser.add_argument("--optimization", default="all", choices=("none", "basic", "all"), help="plugrt's level")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--set", choices=("light", "exports", "all"), default="light",
                        help="the light models and encoders (default), the exports of benchmarks/models.py, or both")
    parser.add_argument("--exports", default="build/bench_models", metavar="DIR",
                        help="where benchmarks/models.py wrote its exports (build/bench_models)")
    parser.add_argument("--no-openvino", dest="openvino", action="store_false",
                        help="leave OpenVINO out even when it is installed")
    parser.add_argument(
        "--load", type=int, default=0, metavar="N",
        help="N busy background processes (one core each) during the whole measurement (0)",
    )
    parser.add_argument(
        "--load-seconds", type=float, default=1800, metavar="S",
        help="the busy processes end by themselves after S seconds at the latest (1800)",
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if not 0 <= args.load <= 64:
        parser.error("--load must lie in [0, 64]")
    # the steady state: numba's compiled loops (where installed) from the first run, as before
    # they were built in the background (the timed runs would otherwise start on numpy)
    os.environ.setdefault("PLUGRT_NUMBA", "wait")

    pattern = re.compile(args.models) if args.models else None
    args.openvino = args.openvino and _openvino_available()
    environment = {
        "cpu": CPUProvider().devices()[0].name,
        "threads": _threads(),
        "cores": os.cpu_count(),
        "usable_cores": _threads(),
        "background_load": args.load,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "onnxruntime": onnxruntime.__version__,
        "onnx": onnx.__version__,
        "plugrt": plugrt.__version__,
        "cpu_features": cpu_features(),
        "openvino": _openvino_version() if args.openvino else None,
        "optimization": args.optimization,
        "runs": args.runs,
        "warmup": args.warmup,
        "reference_runs": args.reference_runs,
        "load_before": os.getloadavg(),
        # numpy's BLAS threads: with two threads on a loaded machine, every GEMM can stall.
        "blas_environment": {k: os.environ[k] for k in _BLAS_VARIABLES if k in os.environ},
    }
    results = []
    previous_handler = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        with tempfile.TemporaryDirectory(prefix="plugrt-bench-") as workdir:
            cases = _cases(workdir) if args.set in ("light", "all") else []
            if args.set in ("exports", "all"):
                cases += _export_cases(args.exports)
            cases = [c for c in cases if pattern is None or pattern.search(c.name)]
            with BackgroundLoad(args.load, args.load_seconds) as load:
                environment["load_before"] = os.getloadavg()
                for case in cases:
                    print(f"... {case.name} (load average {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
                    results.append(run_case(case, args))
                    if load.running() < args.load:
                        print("warning: a busy background process ended early", file=sys.stderr)
            environment["load_after"] = os.getloadavg()
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    sys.stdout.write(markdown(results, environment))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"environment": environment, "results": results}, f, indent=1)
    plugrt_results = [r["runtimes"]["plugrt"] for r in results]
    return 1 if any(m["error"] or m["check"].startswith("FAIL") for m in plugrt_results) else 0


if __name__ == "__main__":
    sys.exit(main())
