#!/usr/bin/env bash
# Check the CUDA provider on a GPU machine: install what it needs, run the GPU tests,
# `plugrt conformance --provider cuda`, the nine light models against the CPU provider,
# and a latency comparison with onnxruntime-gpu (eager and with CUDA graphs, the encoder
# at batch 1 and 8). Writes gpu_report.md (and logs) to $OUT, or to a temporary folder.
#
#   bash scripts/gpu_check.sh                 # from the repository root
#   WHEELHOUSE=/path/to/wheels bash scripts/gpu_check.sh   # offline: install from local wheels
#   GPU_CHECK_QUICK=1 bash scripts/gpu_check.sh            # fewer timed runs
#   GPU_CHECK_VENV=.venv GPU_CHECK_NO_INSTALL=1 bash scripts/gpu_check.sh   # an existing environment
#
# Exit status: 0 when every step passed, 1 when any failed (the report says which).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$(mktemp -d -t plugrt-gpu-XXXXXX)}
mkdir -p "$OUT"
REPORT="$OUT/gpu_report.md"
LOG="$OUT/gpu_check.log"
RUNS=${GPU_CHECK_RUNS:-50}
[ -n "${GPU_CHECK_QUICK:-}" ] && RUNS=10
STATUS=0
: >"$LOG"

say() { echo "$*" | tee -a "$REPORT"; }
step() { echo; echo "== $*" | tee -a "$LOG"; }
fail() { STATUS=1; say "- **FAIL** $*"; }

echo "# plugrt CUDA provider: GPU check" >"$REPORT"
say ""
say "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
say "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if command -v nvidia-smi >/dev/null 2>&1; then
    say "- GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
else
    say "- GPU: nvidia-smi not found"
fi

# -- 1. environment ----------------------------------------------------------------------
step "install"
PYTHON=${PYTHON:-python3}
VENV=${GPU_CHECK_VENV:-/tmp/plugrt-gpu-venv}
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV" >>"$LOG" 2>&1 || { fail "could not create $VENV"; exit 1; }
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
PIP=(python -m pip install --quiet --disable-pip-version-check)
if [ -n "${WHEELHOUSE:-}" ]; then
    PIP+=(--no-index --find-links "$WHEELHOUSE")
fi
# onnxruntime (CPU) and onnxruntime-gpu install the same module: keep only the GPU one.
if [ -n "${GPU_CHECK_NO_INSTALL:-}" ]; then
    say "- install: skipped (GPU_CHECK_NO_INSTALL), using $VENV"
elif "${PIP[@]}" ".[test]" ./providers/template ./providers/cuda "cupy-cuda12x[ctk]" >>"$LOG" 2>&1 \
    && python -m pip uninstall --quiet -y onnxruntime >>"$LOG" 2>&1 \
    && "${PIP[@]}" "onnxruntime-gpu[cuda,cudnn]" >>"$LOG" 2>&1; then
    say "- install: ok ($(python -c 'import cupy, onnxruntime; print("cupy", cupy.__version__, "onnxruntime", onnxruntime.__version__)' 2>&1))"
else
    fail "install (see gpu_check.log); continuing with what is installed"
fi

# -- 2. discovery ------------------------------------------------------------------------
step "providers"
plugrt providers 2>&1 | tee "$OUT/providers.txt" | tee -a "$LOG"
if grep -Eq '^ *cuda .*\[available\]' "$OUT/providers.txt"; then
    say "- providers: cuda available"
else
    fail "providers: cuda is not available: $(grep -E '^ *cuda' "$OUT/providers.txt" | head -1)"
fi

# -- 3. GPU tests (a run where every GPU test skipped counts as a failure) -----------------
step "gpu tests"
python -m pytest -q -p no:cacheprovider -m gpu tests/cuda -rs --junitxml="$OUT/gpu_tests.xml" >"$OUT/gpu_tests.txt" 2>&1
tail -5 "$OUT/gpu_tests.txt" | tee -a "$LOG"
python - "$OUT/gpu_tests.xml" >>"$REPORT" 2>>"$LOG" <<'EOF' || STATUS=1
import sys, xml.etree.ElementTree as ET
suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
total, failed = int(suite.get("tests")), int(suite.get("failures")) + int(suite.get("errors"))
skipped = int(suite.get("skipped"))
ok = failed == 0 and skipped == 0 and total > 0
print(f"- GPU tests: {'ok' if ok else '**FAIL**'}: {total} tests, {failed} failed, {skipped} skipped")
sys.exit(0 if ok else 1)
EOF

# -- 4. conformance ----------------------------------------------------------------------
step "conformance"
if plugrt conformance --provider cuda --report "$OUT/conformance_cuda.md" >"$OUT/conformance.txt" 2>&1; then
    say "- conformance: $(tail -1 "$OUT/conformance.txt")"
else
    fail "conformance: $(tail -1 "$OUT/conformance.txt") (conformance_cuda.md)"
fi

# -- 5 and 6. light models against the CPU provider, latency against onnxruntime-gpu -------
step "light models and latency"
python - "$OUT" "$RUNS" >>"$REPORT" 2>>"$LOG" <<'EOF' || fail "light models or latency (traceback in gpu_check.log)"
"""Light models on cuda against the CPU provider; latency of plugrt (eager, CUDA graphs)
against onnxruntime-gpu (eager, enable_cuda_graph), alternating runtimes run by run."""
import json, math, os, statistics, sys, tempfile, time

import numpy as np
import onnx

import plugrt
from plugrt.conformance.light_models import light_models

sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from make_encoder import encoder_inputs, make_encoder  # noqa: E402

out, runs = sys.argv[1], int(sys.argv[2])
import cupy as cp
import onnxruntime as ort

if hasattr(ort, "preload_dlls"):
    ort.preload_dlls()
ok = True


def sync():
    cp.cuda.get_current_stream().synchronize()


print("\n## Light models on cuda against the CPU provider (rtol 1e-3, atol 1e-3)\n")
print("| model | max abs diff | ok |\n|---|---|---|")
for light in light_models():
    gpu = plugrt.load(light.path, device="cuda")
    cpu = plugrt.load(light.path, device="cpu")
    got, want = gpu.run(light.inputs), cpu.run(light.inputs)
    diff = max(float(np.max(np.abs(got[k] - want[k]))) for k in want)
    close = all(np.allclose(got[k], want[k], rtol=1e-3, atol=1e-3) for k in want)
    ok &= close
    fallbacks = len(gpu.placement.fallbacks)
    print(f"| {light.name} | {diff:.2e} | {'yes' if close else '**no**'}{f' ({fallbacks} fallbacks)' if fallbacks else ''} |")

cases = [(m.name, m.path, m.inputs) for m in light_models()]
folder = tempfile.mkdtemp()
for batch in (1, 8):
    path = os.path.join(folder, f"encoder_b{batch}.onnx")
    onnx.save(make_encoder(), path)
    cases.append((f"encoder_b{batch}", path, encoder_inputs(batch)))


def median_ms(fn):
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def ort_session(path, graphs):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    provider = ("CUDAExecutionProvider", {"enable_cuda_graph": "1"} if graphs else {})
    return ort.InferenceSession(path, options, providers=[provider])


rows = []
for name, path, feeds in cases:
    row = {"model": name}
    # plugrt eager: host inputs and outputs, as session.run gives them
    session = plugrt.load(path, device="cuda")
    row["plugrt_eager"] = median_ms(lambda: session.run(feeds))
    # plugrt with CUDA graphs: inputs and outputs bound on the device
    bindings = [session.allocate_binding(input=k, shape=v.shape, dtype=v.dtype) for k, v in feeds.items()]
    for b, v in zip(bindings, feeds.values()):
        b.write(v)
    outs = [session.allocate_binding(output=o.name, shape=session.run(feeds)[o.name].shape) for o in session.outputs]
    captured = session.try_capture(bindings=bindings + outs)
    row["plugrt_seams"] = len(captured.report.seams) if captured.captured else None
    if captured.captured:
        row["plugrt_graphs"] = median_ms(lambda: (session.replay(bindings=bindings + outs), sync()))
    # onnxruntime-gpu eager, then with its CUDA graphs (inputs and outputs bound on the device)
    try:
        eager = ort_session(path, False)
        row["ort_eager"] = median_ms(lambda: eager.run(None, feeds))
        graphed = ort_session(path, True)
        binding = graphed.io_binding()
        values = {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for k, v in feeds.items()}
        results = eager.run(None, feeds)
        for k, v in values.items():
            binding.bind_ortvalue_input(k, v)
        for o, r in zip(graphed.get_outputs(), results):
            binding.bind_ortvalue_output(o.name, ort.OrtValue.ortvalue_from_numpy(np.empty_like(r), "cuda", 0))
        row["ort_graphs"] = median_ms(lambda: graphed.run_with_iobinding(binding))
    except Exception as exc:  # e.g. a node onnxruntime cannot put on CUDA under graphs
        row["ort_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    rows.append(row)

with open(os.path.join(out, "gpu_latency.json"), "w") as f:
    json.dump(rows, f, indent=1)


def fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else ("-" if v is None else str(v))


print("\n## Latency (median ms over %d runs)\n" % runs)
print("| model | plugrt eager | plugrt graphs | seams | ort-gpu eager | ort-gpu graphs | eager ratio | graphs ratio |")
print("|---|---|---|---|---|---|---|---|")
eager_ratios, graph_ratios = [], []
for r in rows:
    er = r["plugrt_eager"] / r["ort_eager"] if "ort_eager" in r else None
    gr = r["plugrt_graphs"] / r["ort_graphs"] if "plugrt_graphs" in r and "ort_graphs" in r else None
    if er:
        eager_ratios.append(er)
    if gr:
        graph_ratios.append(gr)
    print(f"| {r['model']} | {fmt(r['plugrt_eager'])} | {fmt(r.get('plugrt_graphs'))} | {fmt(r.get('plugrt_seams'))} | "
          f"{fmt(r.get('ort_eager'))} | {fmt(r.get('ort_graphs'))} | {fmt(er)} | {fmt(gr)} |"
          + (f" {r['ort_error']}" if "ort_error" in r else ""))


def geomean(values):
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


print(f"\n- geomean plugrt/onnxruntime-gpu: eager {geomean(eager_ratios):.2f}, graphs {geomean(graph_ratios):.2f} (target <= 1.3)")
encoder = next(r for r in rows if r["model"] == "encoder_b1")
if "plugrt_graphs" in encoder:
    speedup = encoder["plugrt_eager"] / encoder["plugrt_graphs"]
    print(f"- encoder batch 1: graph replay {speedup:.2f}x faster than eager (target >= 1.5)")
sys.exit(0 if ok else 1)
EOF

# -- 7. benchmarks/compare.py, when it has a GPU mode ------------------------------------
step "compare.py"
if python benchmarks/compare.py --help 2>/dev/null | grep -q -- "--device"; then
    python benchmarks/compare.py --device cuda --models 'encoder|resnet' --runs "$RUNS" --skip-reference \
        --json "$OUT/compare_cuda.json" >"$OUT/compare_cuda.md" 2>>"$LOG" || fail "benchmarks/compare.py --device cuda"
    say "- benchmarks/compare.py --device cuda: compare_cuda.md"
else
    say "- benchmarks/compare.py has no --device option; the latency table above is this script's own"
fi

say ""
say "overall: $([ "$STATUS" = 0 ] && echo PASS || echo FAIL)"
echo "report: $REPORT"
exit "$STATUS"
