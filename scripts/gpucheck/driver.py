"""The GPU check's stages, run by ``.gpucheck/run.sh`` with the image's python3.

Without arguments it runs every stage in order of value, each as its own process with its
own time limit inside the total budget (``GPU_CHECK_BUDGET`` seconds, default 480), so a
hung kernel costs one stage, not the run. Each stage appends records to
``$OUT/results.jsonl`` as it measures and the summary (``$OUT/summary.md``) is rewritten
after every record. ``--stage NAME`` runs one stage; ``--summary`` rewrites the summary.

Stages: environment (versions, driver, runtime, NVRTC, providers, onnxruntime's providers);
light (onnx's light models and their random-weight variants on the CUDA provider against the
CPU provider's references, on logits); exports (torchvision networks built here with a fixed
seed and exported here, against PyTorch's own output); latency (plugrt eager and graph
replay per model, beside PyTorch eager and ``torch.cuda.CUDAGraph`` replays on the same GPU,
TF32 off and on); decoder (the tiny builder-made Llama decoders carried in ``decoder/``: 16
greedy steps on the device, each decode step replayed from one captured graph with 0 seams,
tokens against the CPU provider's, per-token latency beside PyTorch eager decode of the same
Llama with the same weights, and float16 decoding's tokens against float32's); engines (the
GEMM and convolution engines on network shapes: the own GEMM, cuBLASLt, cuDNN, im2col, TF32
on and off, eager and replayed); gpu_tests (``pytest -m gpu tests/cuda``); conformance (the
ops the CUDA provider claims, in batches, within what is left of the budget).

``GPU_CHECK_DEVICE=cpu`` rehearses the GPU stages on another device (plugrt's CPU provider,
no PyTorch peer) to try the check's own code on a machine without a GPU; its figures mean
nothing. ``GPU_CHECK_DRY=1`` runs what needs no GPU: the environment, discovery (cuda unavailable,
with its reason), NVRTC on every kernel source, and the references (inputs and random
weights regenerated and checked against their digests, the CPU provider on one model
against its reference) and the decoder stage's host side (the carried decoders' CPU tokens
against prep's, the PyTorch twin's weights read from the float32 model); it exits 0 when
all of that holds.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.environ.get("OUT") or os.path.join(HERE, "out")
WORK = os.environ.get("GPU_CHECK_WORK", "/tmp/plugrt-gpucheck-work")
RESULTS = os.path.join(OUT, "results.jsonl")
SUMMARY = os.path.join(OUT, "summary.md")
DRY = os.environ.get("GPU_CHECK_DRY", "") not in ("", "0")
BUDGET = float(os.environ.get("GPU_CHECK_BUDGET", "480"))
RUNS = int(os.environ.get("GPU_CHECK_RUNS", "30"))
#: torchvision networks built, exported and timed beside PyTorch (in this order, budget allowing)
EXPORTS = [n for n in os.environ.get("GPU_CHECK_EXPORTS", "resnet50,mobilenet_v2,densenet121,vit_b_16").split(",") if n]
#: relative tolerance on logits (and outputs): max |got - want| <= TOLERANCE * max(1, max |want|)
TOLERANCE = 1e-3
ARCH = "sm_90"
#: the plugrt device the GPU stages use; another one only rehearses them (no figure counts)
DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")

#: (stage, time limit in seconds, needs a GPU)
STAGES = [
    ("environment", 90, False),
    ("references", 120, False),
    ("light", 120, True),
    ("exports", 150, True),
    ("latency", 180, True),
    ("decoder", 150, False),  # its host side runs in a dry run too
    ("engines", 120, True),
    ("gpu_tests", 120, True),
    ("conformance", 600, True),
]


# -- records and the summary ---------------------------------------------------------------


def record(stage: str, **fields: Any) -> None:
    """Append one record to results.jsonl and rewrite the summary."""
    os.makedirs(OUT, exist_ok=True)
    with open(RESULTS, "a", encoding="utf-8") as f:
        f.write(json.dumps({"stage": stage, "time": round(time.time(), 3), **fields}, default=str) + "\n")
    try:
        write_summary()
    except Exception:  # a summary bug must not lose the measurement just recorded
        traceback.print_exc()


def read_records() -> list[dict]:
    if not os.path.exists(RESULTS):
        return []
    records = []
    with open(RESULTS, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    records.append({"stage": "?", "status": "fail", "detail": f"unreadable record: {line[:200]}"})
    return records


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.2e}"
        return f"{value:.{digits}f}"
    return str(value)


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def write_summary() -> None:
    records = read_records()
    by_stage: dict[str, list[dict]] = {}
    for r in records:
        by_stage.setdefault(r.get("stage", "?"), []).append(r)
    lines = ["# plugrt CUDA provider: GPU check", ""]
    env = next((r for r in by_stage.get("environment", []) if r.get("kind") == "versions"), {})
    manifest = _manifest()
    lines += [
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime(env.get('time', time.time())))}",
        f"- commit: {manifest.get('commit', '?')} (prepared {manifest.get('prepared', '?')})",
        f"- mode: {'dry run (no GPU used)' if DRY else 'GPU' if DEVICE == 'cuda' else f'REHEARSAL on {DEVICE}: no figure counts'}",
        f"- GPU: {env.get('gpu', '?')}; driver {env.get('driver', '?')}; CUDA runtime {env.get('cuda_runtime', '?')}; "
        f"NVRTC {env.get('nvrtc', '?')}",
        f"- python {env.get('python', '?')}; " + ", ".join(f"{k} {v}" for k, v in (env.get("packages") or {}).items()),
        f"- providers: {env.get('providers', '?')}",
        f"- onnxruntime's providers here: {env.get('onnxruntime_providers', '?')} "
        "(a CPU-only onnxruntime is never compared with plugrt on the GPU; the peer is PyTorch on the same GPU)",
        "",
    ]
    for stage, *_ in STAGES:
        rows = by_stage.get(stage, [])
        lines += _section(stage, rows)
    failures = [r for r in records if r.get("status") in ("fail", "timeout", "error")]
    lines += ["## Not measured or failed"]
    ran = {r.get("stage") for r in records}
    for stage, _, gpu in STAGES:
        if stage not in ran:
            lines.append(f"- {stage}: not run" + (" (dry run: needs a GPU)" if DRY and gpu else ""))
    for r in failures:
        lines.append(f"- {r.get('stage')}: {r.get('status')}: {r.get('model') or r.get('kind') or ''} "
                     f"{str(r.get('detail', ''))[:300]}")
    if lines[-1] == "## Not measured or failed":
        lines.append("- nothing")
    lines.append("")
    tmp = SUMMARY + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    os.replace(tmp, SUMMARY)


def _section(stage: str, rows: list[dict]) -> list[str]:
    if not rows:
        return []
    out = [f"## {stage}", ""]
    if stage == "environment":
        for r in rows:
            if r.get("kind") == "nvrtc":
                out.append(f"- NVRTC {r.get('nvrtc')} compiles every kernel source for {ARCH}: "
                           f"{r.get('status')} ({len(r.get('compiled', []))} modules) {r.get('detail', '')}")
            elif r.get("kind") == "discovery":
                out.append(f"- discovery: cuda {r.get('cuda')}; {r.get('detail', '')}")
            elif r.get("kind") == "cubin load":
                out.append(f"- loading a cubin: {r.get('status')}: {r.get('detail', '')}")
    elif stage == "references":
        for r in rows:
            out.append(f"- {r.get('kind')}: {r.get('status')} {r.get('detail', '')}")
    elif stage in ("light", "exports"):
        out += ["| model | variant | on cuda / nodes | partitions | max abs diff (logits) | relative | "
                "max abs diff (outputs) | ok |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if "model" not in r:  # a stage record: said below the table
                continue
            out.append(
                f"| {r['model']} | {r.get('variant', '')} | {r.get('cuda_nodes', '-')} / {r.get('nodes', '-')} | "
                f"{r.get('partitions', '-')} | {_fmt(r.get('logits_abs'))} | {_fmt(r.get('logits_rel'))} | "
                f"{_fmt(r.get('outputs_abs'))} | {'yes' if r.get('status') == 'ok' else '**' + str(r.get('status')) + '**'} |"
            )
        passed = sum(1 for r in rows if r.get("status") == "ok")
        out += ["", f"- {stage}: {passed} of {sum(1 for r in rows if 'model' in r)} within {TOLERANCE:g} "
                f"(relative to each tensor's largest value) of the {'CPU provider' if stage == 'light' else 'PyTorch'}"]
    elif stage == "latency":
        out += ["Median ms over up to %d runs, batch 1, exact float32 unless tf32 is named. plugrt plain: "
                "session.run with numpy in and out and the defaults' graphs (captured at the second run, "
                "replayed from the third); host: the same with graphs=False; eager: graphs=False, inputs and "
                "outputs bound on the device; replay: try_capture then replay with those bindings; plain tf32: "
                "a session with every default (cuda.tf32 on, graphs on). PyTorch: the same network (exports "
                "only), input on the device, TF32 off and on." % RUNS, "",
                "| model | plugrt plain | graph hits | plugrt host | plugrt eager | plugrt replay | seams | "
                "replay speed-up | plugrt plain tf32 | torch eager | torch graph | torch eager tf32 | "
                "torch graph tf32 | plain / torch graph | eager / torch eager | replay / torch graph | "
                "plain tf32 / torch graph tf32 |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        eager_ratios, graph_ratios, replay_ratios, tf32_ratios, speedups = [], [], [], [], []
        for r in rows:
            if "model" not in r:  # a stage record: said below the table
                continue
            er = _ratio(r.get("plugrt_eager"), r.get("torch_eager"))
            gr = _ratio(r.get("plugrt_plain"), r.get("torch_graph"))
            rr = _ratio(r.get("plugrt_replay"), r.get("torch_graph"))
            tr = _ratio(r.get("plugrt_plain_tf32"), r.get("torch_graph_tf32"))
            speedup = _ratio(r.get("plugrt_eager"), r.get("plugrt_replay"))
            for bucket, value in ((eager_ratios, er), (graph_ratios, gr), (replay_ratios, rr), (tf32_ratios, tr),
                                  (speedups, speedup)):
                bucket += [value] if value else []
            out.append(
                f"| {r['model']} | {_fmt(r.get('plugrt_plain'))} | {_fmt(r.get('graph_hits'))} | "
                f"{_fmt(r.get('plugrt_host'))} | {_fmt(r.get('plugrt_eager'))} | "
                f"{_fmt(r.get('plugrt_replay'))} | {_fmt(r.get('seams'))} | {_fmt(speedup, 2)} | "
                f"{_fmt(r.get('plugrt_plain_tf32'))} | {_fmt(r.get('torch_eager'))} | "
                f"{_fmt(r.get('torch_graph'))} | {_fmt(r.get('torch_eager_tf32'))} | {_fmt(r.get('torch_graph_tf32'))} | "
                f"{_fmt(gr, 2)} | {_fmt(er, 2)} | {_fmt(rr, 2)} | {_fmt(tr, 2)} |"
            )
        out += ["",
                f"graphs vs torch graphs: geomean {_fmt(geomean(graph_ratios), 2)} (over {len(graph_ratios)} models; "
                "plugrt's plain run against torch.cuda.CUDAGraph replay)",
                f"eager vs torch eager: geomean {_fmt(geomean(eager_ratios), 2)} (over {len(eager_ratios)} models)",
                f"bound replay vs torch graphs: geomean {_fmt(geomean(replay_ratios), 2)}; plain tf32 vs torch graphs "
                f"tf32: geomean {_fmt(geomean(tf32_ratios), 2)}",
                f"replay speed-up over plugrt eager: smallest {_fmt(min(speedups) if speedups else None, 2)} "
                f"(acceptance: at least 1.5 on every model)",
                "", "Light models have no PyTorch module: their rows have no peer."]
    elif stage == "decoder":
        out += ["Greedy decoding of the prompt, batch 1. per token: median ms of the decode steps after the "
                "first (which captures); graphs/seams: of the decode step's capture. torch eager: the same Llama "
                "built by hand in PyTorch from the float32 model's weights, static KV cache, on the same GPU.", "",
                "| model | device / nodes | tokens = CPU provider's | decode graphs | seams | replayed / eager steps | "
                "per token ms | first decode ms | prefill ms | torch eager per token ms | plugrt / torch | "
                "float16 tokens = float32's | ok |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if "model" not in r:
                continue
            if r.get("kind") == "dry":
                out.append(f"| {r['model']} | dry run: CPU tokens as prep's: {r.get('cpu_tokens_as_prep')}; "
                           f"{r.get('detail', '')} ||||||||||| {'yes' if r.get('status') == 'ok' else '**' + str(r.get('status')) + '**'} |")
                continue
            out.append(
                f"| {r['model']} | {r.get('cuda_nodes', '-')} / {r.get('nodes', '-')} | {_fmt(r.get('tokens_equal'))} | "
                f"{_fmt(r.get('decode_graphs'))} | {_fmt(r.get('decode_seams'))} | {_fmt(r.get('replayed_steps'))} / "
                f"{_fmt(r.get('eager_steps'))} | {_fmt(r.get('per_token_ms'))} | {_fmt(r.get('first_decode_ms'))} | "
                f"{_fmt(r.get('prefill_ms'))} | {_fmt(r.get('torch_per_token_ms'))} | "
                f"{_fmt(_ratio(r.get('per_token_ms'), r.get('torch_per_token_ms')), 2)} | "
                f"{_fmt(r.get('float16_tokens_equal'))} | {'yes' if r.get('status') == 'ok' else '**' + str(r.get('status')) + '**'} |"
            )
        for r in rows:
            for key in ("torch_peer", "eager_reasons", "seam_reasons", "float16_detail"):
                if r.get(key):
                    out.append(f"- {r.get('model')}: {key.replace('_', ' ')}: {str(r[key])[:400]}")
    elif stage == "engines":
        out += _engines_section(rows)
    elif stage == "gpu_tests":
        for r in rows:
            out.append(f"- GPU tests: {r.get('status')}: {r.get('tests', 0)} tests, {r.get('failed', 0)} failed, "
                       f"{r.get('skipped', 0)} skipped ({_fmt(r.get('seconds'), 1)} s) {str(r.get('detail', ''))[:300]}")
    elif stage == "conformance":
        totals: dict[str, int] = {}
        for r in rows:
            for key, value in (r.get("totals") or {}).items():
                totals[key] = totals.get(key, 0) + int(value)
        ops = sum(len(r.get("ops", [])) for r in rows if r.get("status") in ("ok", "fail"))
        claimed = rows[0].get("claimed_ops") if rows else None
        out.append(f"- conformance on {ops} of {claimed or '?'} claimed ops: "
                   + ", ".join(f"{v} {k}" for k, v in sorted(totals.items())))
        for r in rows:
            if r.get("status") not in ("ok",):
                out.append(f"  - batch {r.get('batch')}: {r.get('status')} {str(r.get('detail', ''))[:300]}")
        failing = [c for r in rows for c in r.get("failing", [])]
        if failing:
            out.append("- failing cases: " + ", ".join(failing[:60]) + (" ..." if len(failing) > 60 else ""))
    for r in rows:
        if r.get("kind") == "stage" and r.get("status") != "ok":
            out.append(f"- stage {r.get('status')}: {str(r.get('detail', ''))[:300]}")
    out.append("")
    return out


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None


def _manifest() -> dict:
    try:
        with open(os.path.join(HERE, "manifest.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


# -- shared pieces -------------------------------------------------------------------------


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def light_inputs(name: str) -> dict:
    from plugrt.conformance.light_models import light_models

    return next(m for m in light_models() if m.name == name).inputs


def compare(got: Any, want: Any) -> tuple[float, float]:
    """(max abs difference, that over max(1, max |want|))."""
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return math.inf, math.inf
    diff = float(np.max(np.abs(got - want))) if got.size else 0.0
    if not math.isfinite(diff):
        return math.inf, math.inf
    return diff, diff / max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)


def placement_fields(session: Any) -> dict:
    report = session.placement
    counts = dict(report.nodes_per_provider)
    fields = {"nodes": sum(counts.values()), "cuda_nodes": counts.get(DEVICE, 0), "partitions": len(report.partitions)}
    reasons = sorted({f"{f.op_type}: {f.reason}" for f in report.fallbacks})
    if reasons:
        fields["fallbacks"] = reasons[:12]
    return fields


def light_variant(entry: dict, variant: str) -> tuple[bytes, str]:
    """A light model's bytes for ``variant`` ("constant" or "random"), and the digest of the
    random weights made here (to be equal to the one prep recorded)."""
    import onnx

    from plugrt.conformance.light_models import with_random_weights

    model = onnx.load(os.path.join(HERE, entry["file"]))
    if variant == "constant":
        return model.SerializeToString(), ""
    expected = entry["variants"]["random"]["weights_sha256"]
    cached = os.path.join(WORK, f"light_{entry['name']}_random.onnx")
    if os.path.exists(cached):  # written below only once its digest matched prep's
        with open(cached, "rb") as f:
            return f.read(), expected
    random_model, digest = with_random_weights(model, seed=entry["variants"]["random"]["seed"])
    data = random_model.SerializeToString()
    if digest == expected:
        with open(cached + ".tmp", "wb") as f:
            f.write(data)
        os.replace(cached + ".tmp", cached)
    return data, digest


def sync() -> None:
    if DEVICE != "cuda":
        return
    import cupy

    cupy.cuda.get_current_stream().synchronize()


def median_ms(fn: Callable[[], Any], runs: int = RUNS, warmup: int = 3, cap_s: float = 8.0) -> float:
    for _ in range(warmup):
        fn()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < runs and (time.perf_counter() - started < cap_s or len(times) < 5):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


# -- stages --------------------------------------------------------------------------------


def stage_environment() -> bool:
    packages = {name: _version(name) for name in (
        "plugrt", "plugrt-cuda", "plugrt-provider-template", "numpy", "onnx", "onnx-ir", "cupy-cuda13x", "cupy-cuda12x",
        "nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12", "torch", "torchvision", "onnxruntime", "onnxruntime-gpu",
        "pluggy", "ml-dtypes", "importlib-metadata", "google-re2",
    )}
    fields: dict[str, Any] = {"python": platform.python_version(), "packages": {k: v for k, v in packages.items() if v}}
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )
        fields["gpu"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else "none"
    except (OSError, subprocess.TimeoutExpired):
        fields["gpu"] = "none (no nvidia-smi)"
    try:
        import cupy

        runtime = cupy.cuda.runtime
        fields["cuda_runtime"] = _cuda_text(runtime.runtimeGetVersion())
        try:
            driver = int(runtime.driverGetVersion())
            fields["driver"] = _cuda_text(driver) if driver else "none (no libcuda)"
        except Exception as exc:
            fields["driver"] = f"none ({type(exc).__name__})"
    except Exception as exc:
        fields["cuda_runtime"] = f"cupy does not import: {type(exc).__name__}: {exc}"
    try:
        from plugrt_cuda import _sources

        fields["nvrtc"] = "%d.%d" % _sources.nvrtc_version()
    except Exception as exc:
        fields["nvrtc"] = f"unavailable ({type(exc).__name__}: {exc})"
    try:
        import onnxruntime

        fields["onnxruntime_providers"] = onnxruntime.get_available_providers()
    except Exception as exc:
        fields["onnxruntime_providers"] = f"onnxruntime does not import ({type(exc).__name__})"
    from plugrt.registry import default_registry

    registry = default_registry()
    shown = []
    for name in registry.providers():
        reason = registry.unavailable_reason(name)
        shown.append(f"{name} ({'available' if reason is None else 'unavailable'})")
    fields["providers"] = ", ".join(shown)
    record("environment", kind="versions", status="ok", **fields)

    ok = True
    cuda_reason = registry.unavailable_reason("cuda") if "cuda" in registry.providers() else "plugrt-cuda not found"
    if DRY:
        # no GPU here: cuda must be listed, unavailable, with its reason
        listed = "cuda" in registry.providers()
        status = "ok" if listed and cuda_reason else "fail"
        record("environment", kind="discovery", status=status, cuda="unavailable" if cuda_reason else "available",
               detail=f"reason: {cuda_reason}")
        ok &= status == "ok"
    else:
        status = "ok" if cuda_reason is None else "fail"
        record("environment", kind="discovery", status=status, cuda="available" if cuda_reason is None else "unavailable",
               detail=f"reason: {cuda_reason}" if cuda_reason else f"devices: {registry.devices('cuda')}")
        ok &= status == "ok"
        if status == "ok":
            ok &= _cubin_load_check(registry.get("cuda"))
    ok &= _nvrtc_check()
    return ok


def _cubin_load_check(provider: Any) -> bool:
    """Whether the driver loads the cubins NVRTC makes here (else cupy compiles each module)."""
    try:
        backend = provider.backend()
        backend.kernel("gemm", "float32", "gemm")
        refused = dict(getattr(backend, "cubins_refused", {}))
        record("environment", kind="cubin load", status="ok" if not refused else "fallback",
               detail=f"architecture {getattr(backend, 'arch', '?')}: "
               + ("the driver loads NVRTC's cubins" if not refused else f"refused, cupy compiles instead: {refused}"))
        return True
    except Exception as exc:
        record("environment", kind="cubin load", status="fail", detail=f"{type(exc).__name__}: {exc}"[:1500])
        return False


def _cuda_text(version: int) -> str:
    return f"{version} ({version // 1000}.{version % 1000 // 10})"


def _nvrtc_check() -> bool:
    try:
        from plugrt_cuda import _sources

        compiled = []
        for module in sorted(_sources.SOURCES):
            for dtype in sorted(_sources.DTYPES):
                _sources.compile_cubin(module, dtype, ARCH)
                compiled.append(f"{module}/{dtype}")
        record("environment", kind="nvrtc", status="ok", nvrtc="%d.%d" % _sources.nvrtc_version(), compiled=compiled)
        return True
    except Exception as exc:
        record("environment", kind="nvrtc", status="fail", detail=f"{type(exc).__name__}: {exc}"[:2000])
        return False


def stage_references() -> bool:
    """The carried references load, and this machine regenerates the same inputs and random
    weights (digests); the CPU provider reproduces one model's reference here."""
    import numpy as np

    import plugrt
    from plugrt.conformance.light_models import arrays_digest

    manifest = _manifest()
    references = np.load(os.path.join(HERE, "references.npz"))
    ok = True
    mismatched = []
    for entry in manifest["models"]:
        if arrays_digest(light_inputs(entry["name"])) != entry["inputs_sha256"]:
            mismatched.append(f"{entry['name']} inputs")
        for variant, info in entry["variants"].items():
            for output in entry["outputs"]:
                if f"{entry['name']}/{variant}/{output}" not in references:
                    mismatched.append(f"{entry['name']}/{variant}/{output} missing")
            if variant == "random":
                _, digest = light_variant(entry, variant)
                if digest != info["weights_sha256"]:
                    mismatched.append(f"{entry['name']} random weights")
    record("references", kind="load", status="fail" if mismatched else "ok",
           detail=("differ from prep: " + ", ".join(mismatched)) if mismatched
           else f"{len(references.files)} reference tensors; inputs and random weights regenerated identically")
    ok &= not mismatched
    # the CPU provider (numpy path) on this machine's numpy/onnx reproduces a reference
    entry = next(e for e in manifest["models"] if e["name"] == "squeezenet")
    worst = 0.0
    for variant in ("constant", "random"):
        data, _ = light_variant(entry, variant)
        outputs = plugrt.load(data, device="cpu").run(light_inputs("squeezenet"))
        for name in entry["logits"] + ([entry["outputs"][0]] if variant == "random" else []):
            worst = max(worst, compare(outputs[name], references[f"squeezenet/{variant}/{name}"])[1])
    status = "ok" if worst <= TOLERANCE else "fail"
    record("references", kind="cpu provider here", status=status,
           detail=f"squeezenet on the CPU provider here against the carried reference: relative {worst:.2e}")
    return ok and status == "ok"


def stage_light() -> bool:
    import numpy as np

    import plugrt

    manifest = _manifest()
    references = np.load(os.path.join(HERE, "references.npz"))
    ok = True
    for entry in manifest["models"]:
        for variant in ("constant", "random"):
            name = entry["name"]
            fields: dict[str, Any] = {"model": name, "variant": variant}
            try:
                data, _ = light_variant(entry, variant)
                started = time.perf_counter()
                session = plugrt.load(data, device=DEVICE)
                fields["build_s"] = round(time.perf_counter() - started, 2)
                fields.update(placement_fields(session))
                outputs = session.run(light_inputs(name))
                worst_abs = worst_rel = 0.0
                for logits in entry["logits"]:
                    a, r = compare(outputs[logits], references[f"{name}/{variant}/{logits}"])
                    worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, r)
                final = entry["outputs"][0]
                out_abs, out_rel = compare(outputs[final], references[f"{name}/{variant}/{final}"])
                if not entry["logits"]:  # no final Softmax: the output is what is compared
                    worst_abs, worst_rel = out_abs, out_rel
                fields.update(logits_abs=worst_abs, logits_rel=worst_rel, outputs_abs=out_abs)
                # constant weights saturate the Softmax (one ulp flips a one-hot): logits decide;
                # random weights do not: their probabilities must agree too
                good = worst_rel <= TOLERANCE and (variant == "constant" or out_rel <= TOLERANCE)
                fields["status"] = "ok" if good else "fail"
            except Exception as exc:
                fields.update(status="error", detail=f"{type(exc).__name__}: {exc}"[:1500])
            ok &= fields["status"] == "ok"
            record("light", **fields)
    return ok


def _torch_model(name: str) -> Any:
    import torch
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None)
    return model.eval()


def _torch_input() -> Any:
    import numpy as np

    return np.random.RandomState(0).standard_normal((1, 3, 224, 224)).astype(np.float32)


def _export(model: Any, x: Any, path: str) -> str:
    """Export with the TorchScript exporter, or the dynamo one where that is all there is."""
    import torch

    try:
        torch.onnx.export(model, (x,), path, input_names=["input"], output_names=["logits"], opset_version=17,
                          dynamo=False)
        return "torchscript"
    except TypeError:  # a torch without the dynamo keyword
        torch.onnx.export(model, (x,), path, input_names=["input"], output_names=["logits"], opset_version=17)
        return "torchscript"
    except Exception:
        torch.onnx.export(model, (x,), path, input_names=["input"], output_names=["logits"], dynamo=True)
        return "dynamo"


def stage_exports() -> bool:
    import numpy as np
    import torch

    import plugrt

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(WORK, exist_ok=True)
    x = _torch_input()
    ok = True
    for name in EXPORTS:
        fields: dict[str, Any] = {"model": name, "variant": "torchvision, seed 0"}
        try:
            path = os.path.join(WORK, f"{name}.onnx")
            model = _torch_model(name)
            started = time.perf_counter()
            fields["exporter"] = _export(model, torch.from_numpy(x), path)
            fields["export_s"] = round(time.perf_counter() - started, 2)
            with torch.no_grad():
                want = model.cuda()(torch.from_numpy(x).cuda()).float().cpu().numpy()  # FP32, TF32 off
            np.save(os.path.join(WORK, f"{name}.torch.npy"), want)
            session = plugrt.load(path, device=DEVICE)
            fields.update(placement_fields(session))
            got = session.run({session.inputs[0].name: x})[session.outputs[0].name]
            a, r = compare(got, want)
            fields.update(logits_abs=a, logits_rel=r, status="ok" if r <= TOLERANCE else "fail")
        except Exception as exc:
            fields.update(status="error", detail=f"{type(exc).__name__}: {exc}"[:1500])
        ok &= fields["status"] == "ok"
        record("exports", **fields)
    return ok


def _plugrt_latency(data: Any, feeds: dict) -> dict:
    import plugrt

    # exact float32, as PyTorch's TF32-off runs; the default session (TF32 on) is timed last
    exact = {"cuda.tf32": False}
    plain = plugrt.load(data, device=DEVICE, **exact)  # graphs="auto": replays from the third run
    fields: dict[str, Any] = {"plugrt_plain": median_ms(lambda: plain.run(feeds))}
    stats = plain.stats()
    fields.update(graph_hits=stats.graph_hits, graph_misses=stats.graph_misses, graph_captures=stats.graph_captures)
    if stats.graph_refusals:
        fields["graph_refusals"] = {str(k)[:200]: v for k, v in stats.graph_refusals.items()}
    session = plugrt.load(data, device=DEVICE, graphs=False, **exact)
    fields["plugrt_host"] = median_ms(lambda: session.run(feeds))
    outputs = session.run(feeds)
    bindings = []
    for name, value in feeds.items():
        binding = session.allocate_binding(input=name, shape=value.shape, dtype=value.dtype)
        binding.write(value)
        bindings.append(binding)
    for info in session.outputs:
        bindings.append(session.allocate_binding(output=info.name, shape=outputs[info.name].shape,
                                                 dtype=outputs[info.name].dtype))
    fields["plugrt_eager"] = median_ms(lambda: (session.run(bindings=bindings), sync()))
    captured = session.try_capture(bindings=bindings)
    if captured.captured:
        fields["seams"] = len(captured.report.seams)
        if captured.report.seams:
            fields["seam_reasons"] = sorted({f"{n}: {w}" for n, w in captured.report.seams})[:8]
        fields["plugrt_replay"] = median_ms(lambda: (session.replay(bindings=bindings), sync()))
    else:
        fields["capture"] = "not capturable: " + "; ".join(f"{n}: {w}" for n, w in captured.report[:5])[:500]
    default = plugrt.load(data, device=DEVICE)  # what a user gets: TF32 on, graphs on
    fields["plugrt_plain_tf32"] = median_ms(lambda: default.run(feeds))
    return fields


def _torch_latency(name: str) -> dict:
    import torch

    fields: dict[str, Any] = {}
    model = _torch_model(name).cuda()
    x = torch.from_numpy(_torch_input()).cuda()

    def timed(tf32: bool) -> tuple[float, float]:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        with torch.no_grad():
            eager = median_ms(lambda: (model(x), torch.cuda.synchronize()))
            static = x.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    model(static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model(static)
            replay = median_ms(lambda: (graph.replay(), torch.cuda.synchronize()))
        return eager, replay

    fields["torch_eager"], fields["torch_graph"] = timed(False)
    fields["torch_eager_tf32"], fields["torch_graph_tf32"] = timed(True)
    return fields


def stage_latency() -> bool:
    manifest = _manifest()
    ok = True
    cases: list[tuple[str, Callable[[], tuple[Any, dict]], bool]] = []
    for entry in manifest["models"]:
        cases.append((f"light {entry['name']}",
                      lambda entry=entry: (light_variant(entry, "constant")[0], light_inputs(entry["name"])), False))
    for name in EXPORTS:
        path = os.path.join(WORK, f"{name}.onnx")
        if os.path.exists(path):
            cases.append((name, lambda path=path: (path, {"input": _torch_input()}), True))
    for label, make, peer in cases:
        fields: dict[str, Any] = {"model": label}
        try:
            data, feeds = make()
            fields.update(_plugrt_latency(data, feeds))
            if peer:
                fields.update(_torch_latency(label))
            fields["status"] = "ok"
        except Exception as exc:
            fields.update(status="error", detail=f"{type(exc).__name__}: {exc}"[:1500])
            ok = False
        record("latency", **fields)
    return ok


def _decoder_weights(folder: str) -> dict:
    """The float32 decoder's initializers by name (numpy), checked against the layout the
    PyTorch twin assumes: fused QKV projection, gate/up/down MLP, RMS norms, rotary caches."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(os.path.join(folder, "model.onnx"))
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    with open(os.path.join(folder, "genai_config.json"), encoding="utf-8") as f:
        config = json.load(f)["model"]["decoder"]
    layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    heads, kv_heads, size = int(config["num_attention_heads"]), int(config["num_key_value_heads"]), int(config["head_size"])
    for layer in range(layers):
        qkv = weights[f"model.layers.{layer}.attn.qkv_proj.MatMul.weight"]
        if qkv.shape != (hidden, (heads + 2 * kv_heads) * size):
            raise ValueError(f"layer {layer}'s qkv projection is {qkv.shape}, not ({hidden}, {(heads + 2 * kv_heads) * size})")
    weights["config"] = {"layers": layers, "heads": heads, "kv_heads": kv_heads, "size": size}
    return weights


def _torch_decode(weights: dict, prompt: list[int], steps: int) -> tuple[list[int], float]:
    """Greedy tokens and the median ms per decode step of the hand-built PyTorch Llama
    (eager, batch 1, a static KV cache of the whole sequence) with ``weights``."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    config = weights["config"]
    layers, heads, kv_heads, size = config["layers"], config["heads"], config["kv_heads"], config["size"]
    w = {k: torch.from_numpy(v).cuda() for k, v in weights.items() if k != "config"}
    total = len(prompt) + steps
    keys = torch.zeros(layers, kv_heads, total, size, device="cuda")
    values = torch.zeros_like(keys)
    cos, sin = w["cos_cache"], w["sin_cache"]
    group = heads // kv_heads

    def rms(x: Any, name: str) -> Any:
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w[name]

    def rotate(x: Any, at: Any) -> Any:  # (n, S, D), non-interleaved halves
        c, s_ = cos[at][None], sin[at][None]
        half = c.shape[-1]
        first, second = x[..., :half], x[..., half:2 * half]
        return torch.cat([first * c - second * s_, first * s_ + second * c, x[..., 2 * half:]], -1)

    @torch.no_grad()
    def forward(tokens: Any, start: int) -> Any:
        seq = tokens.shape[0]
        at = torch.arange(start, start + seq, device="cuda")
        h = w["model.embed_tokens.weight"][tokens]
        for layer in range(layers):
            p = f"model.layers.{layer}"
            x = rms(h, f"{p}.input_layernorm.weight")
            qkv = x @ w[f"{p}.attn.qkv_proj.MatMul.weight"]
            q = rotate(qkv[:, : heads * size].reshape(seq, heads, size).transpose(0, 1), at)
            k = rotate(qkv[:, heads * size : (heads + kv_heads) * size].reshape(seq, kv_heads, size).transpose(0, 1), at)
            v = qkv[:, (heads + kv_heads) * size :].reshape(seq, kv_heads, size).transpose(0, 1)
            keys[layer, :, start:start + seq] = k
            values[layer, :, start:start + seq] = v
            end = start + seq
            kk = keys[layer, :, :end].repeat_interleave(group, 0)
            vv = values[layer, :, :end].repeat_interleave(group, 0)
            scores = (q @ kk.transpose(1, 2)) / math.sqrt(size)
            mask = torch.arange(end, device="cuda")[None, :] > at[:, None]
            scores = scores.masked_fill(mask, float("-inf"))
            attended = (torch.softmax(scores, -1) @ vv).transpose(0, 1).reshape(seq, heads * size)
            h = h + attended @ w[f"{p}.attn.o_proj.MatMul.weight"]
            x = rms(h, f"{p}.post_attention_layernorm.weight")
            gate = x @ w[f"{p}.mlp.gate_proj.MatMul.weight"]
            h = h + (torch.nn.functional.silu(gate) * (x @ w[f"{p}.mlp.up_proj.MatMul.weight"])) @ w[
                f"{p}.mlp.down_proj.MatMul.weight"]
        return rms(h[-1:], f"model.layers.{layers}.final_norm_layernorm.weight") @ w["lm_head.MatMul.weight"]

    tokens = [int(forward(torch.tensor(prompt, device="cuda"), 0).argmax())]
    times = []
    while len(tokens) < steps:
        t = time.perf_counter()
        tokens.append(int(forward(torch.tensor(tokens[-1:], device="cuda"), len(prompt) + len(tokens) - 1).argmax()))
        times.append(time.perf_counter() - t)
    return tokens, statistics.median(times) * 1e3


def _plugrt_decode(folder: str, prompt: list[int], steps: int, **options: Any) -> dict:
    """16 greedy steps on DEVICE with captured decode steps: tokens, capture and timings."""
    from plugrt import genai

    model = genai.Model(folder, device=DEVICE, **options)
    fields: dict[str, Any] = placement_fields(model.session)
    generator = genai.Generator(model, max_length=len(prompt) + steps)
    generator.append_tokens(prompt)
    t = time.perf_counter()
    tokens = [generator.generate_next_token()]
    fields["prefill_ms"] = (time.perf_counter() - t) * 1e3
    times = []
    while not generator.is_done():
        t = time.perf_counter()
        tokens.append(generator.generate_next_token())  # its logits reach the host: the step is done
        times.append(time.perf_counter() - t)
    use = generator.capture_use
    report = use.reports.get("decode")
    fields.update(
        tokens=tokens, first_decode_ms=times[0] * 1e3 if times else None,
        per_token_ms=statistics.median(times[1:]) * 1e3 if len(times) > 1 else None,
        replayed_steps=use.replayed.get("decode", 0), eager_steps=use.eager.get("decode", 0),
        decode_graphs=len(report.segments) if report is not None else None,
        decode_seams=len(report.seams) if report is not None else None,
    )
    if use.eager_reasons:
        fields["eager_reasons"] = dict(use.eager_reasons)
    if report is not None and report.seams:
        fields["seam_reasons"] = sorted({f"{n}: {w}" for n, w in report.seams})[:8]
    return fields


def stage_decoder() -> bool:
    from plugrt import genai

    entry = _manifest().get("decoder")
    if not entry:
        record("decoder", kind="stage", status="fail", detail="prep carried no decoder (manifest.json has no 'decoder')")
        return False
    prompt, steps = list(entry["prompt"]), int(entry["steps"])
    ok = True
    for precision in ("fp32", "int4"):
        folder = os.path.join(HERE, "decoder", precision)
        fields: dict[str, Any] = {"model": f"tiny llama {precision}"}
        try:
            cpu = genai.generate(genai.Model(folder, device="cpu"), prompt, max_length=len(prompt) + steps)
            fields["cpu_tokens_as_prep"] = cpu == entry["cpu_tokens"][precision]
            if DRY:  # no GPU: the host side of the stage
                detail = ""
                if precision == "fp32":
                    weights = _decoder_weights(folder)
                    detail = f"PyTorch twin's weights: {len(weights) - 1} tensors, {weights['config']}"
                fields.update(kind="dry", detail=detail, status="ok" if fields["cpu_tokens_as_prep"] else "fail")
            else:
                fields.update(_plugrt_decode(folder, prompt, steps))
                fields["tokens_equal"] = fields["tokens"] == cpu
                good = fields["tokens_equal"] and fields["decode_seams"] == 0 and fields["decode_graphs"] == 1
                good = good and fields["eager_steps"] == 0
                if precision == "fp32":
                    half = _plugrt_decode(folder, prompt, steps, **{"cuda.float16_decoding": True})
                    fields["float16_tokens_equal"] = half["tokens"] == fields["tokens"]
                    fields["float16_detail"] = (f"per token {_fmt(half.get('per_token_ms'))} ms, seams "
                                                f"{half.get('decode_seams')}, tokens {half['tokens']}")
                    if DEVICE == "cuda":
                        try:  # the peer failing must not lose plugrt's figures
                            torch_tokens, fields["torch_per_token_ms"] = _torch_decode(
                                _decoder_weights(folder), prompt, steps)
                            fields["torch_peer"] = f"tokens equal plugrt's: {torch_tokens == fields['tokens']}"
                        except Exception as exc:
                            fields["torch_peer"] = f"failed: {type(exc).__name__}: {exc}"[:500]
                    else:
                        fields["torch_peer"] = f"not run: a rehearsal on {DEVICE} has no GPU for PyTorch"
                fields["status"] = "ok" if good and fields["cpu_tokens_as_prep"] else "fail"
        except Exception as exc:
            fields.update(status="error", detail=f"{type(exc).__name__}: {exc}"[:1500] + traceback.format_exc()[-800:])
        ok &= fields["status"] == "ok"
        record("decoder", **fields)
    return ok


def stage_gpu_tests(limit: float) -> bool:
    import xml.etree.ElementTree as ET

    junit = os.path.join(WORK, "gpu_tests.xml")
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/cuda", "-rs",
             f"--junitxml={junit}"],
            cwd=ROOT, capture_output=True, text=True, timeout=max(10.0, limit - 5),
        )
    except subprocess.TimeoutExpired:
        record("gpu_tests", status="timeout", detail=f"pytest ran past {limit:.0f} s")
        return False
    with open(os.path.join(OUT, "gpu_tests.txt"), "w", encoding="utf-8") as f:
        f.write(done.stdout[-200_000:] + done.stderr[-50_000:])
    try:
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        tests, skipped = int(suite.get("tests")), int(suite.get("skipped"))
        failed = int(suite.get("failures")) + int(suite.get("errors"))
    except Exception as exc:
        record("gpu_tests", status="error", detail=f"no junit report ({exc}): {done.stdout[-800:]}")
        return False
    good = failed == 0 and skipped == 0 and tests > 0  # every GPU test skipped is a failure here
    record("gpu_tests", status="ok" if good else "fail", tests=tests, failed=failed, skipped=skipped,
           seconds=time.perf_counter() - started, detail="" if good else done.stdout[-1500:])
    return good


def stage_conformance(limit: float) -> bool:
    from plugrt_cuda._ops import OPS

    ops = sorted({op for domain, op in OPS if domain == ""})
    deadline = time.monotonic() + limit - 5
    ok = True
    size = 8
    for batch, start in enumerate(range(0, len(ops), size)):
        chosen = ops[start : start + size]
        left = deadline - time.monotonic()
        if left < 15:
            record("conformance", batch=batch, ops=chosen, claimed_ops=len(ops), status="skipped",
                   detail="out of budget")
            continue
        report = os.path.join(WORK, f"conformance_{batch}.json")
        try:
            done = subprocess.run(
                [sys.executable, "-m", "plugrt", "conformance", "--provider", DEVICE, "--ops", ",".join(chosen),
                 "--report", report, "--no-progress"],
                cwd=ROOT, capture_output=True, text=True, timeout=left,
            )
        except subprocess.TimeoutExpired:
            record("conformance", batch=batch, ops=chosen, claimed_ops=len(ops), status="timeout",
                   detail=f"batch ran past the {left:.0f} s left")
            ok = False
            continue
        try:
            with open(report, encoding="utf-8") as f:
                result = json.load(f)
        except (OSError, json.JSONDecodeError):
            record("conformance", batch=batch, ops=chosen, claimed_ops=len(ops), status="error",
                   detail=(done.stdout + done.stderr)[-1500:])
            ok = False
            continue
        failing = [c["name"] for c in result.get("cases", []) if c.get("status") in ("failed", "error")]
        status = "ok" if result.get("ok") else "fail"
        ok &= status == "ok"
        record("conformance", batch=batch, ops=chosen, claimed_ops=len(ops), status=status,
               totals=result.get("totals", {}), failing=failing, seconds=result.get("seconds"))
    return ok


# -- the engines stage: cuBLASLt against the own GEMM, cuDNN against im2col, TF32 on and off ----
#
# Each GEMM and convolution of a few batch-1 network shapes runs on every engine the CUDA
# provider has, eager and replayed from a CUDA graph, beside PyTorch's cuBLAS/cuDNN on the same
# GPU, with its error against a float64 reference: what decides the default engine (the own
# GEMM stays only where it is measured faster) and what TF32 costs in accuracy.

#: (label, m, n, k): row-major (m, k) @ (k, n)
ENGINE_GEMMS = [
    ("vgg fc6", 1, 4096, 25088),
    ("resnet fc", 1, 1000, 2048),
    ("encoder qkv", 128, 2304, 768),
    ("encoder ffn", 128, 3072, 768),
    ("im2col 3x3x64 56x56", 64, 3136, 576),
    ("square 1024", 1024, 1024, 1024),
]
#: (label, x shape, w shape, Conv attributes); each with a bias and a ReLU
ENGINE_CONVS = [
    ("resnet conv1 7x7/2", (1, 3, 224, 224), (64, 3, 7, 7), {"strides": [2, 2], "pads": [3, 3, 3, 3]}),
    ("resnet 3x3 64 56x56", (1, 64, 56, 56), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]}),
    ("resnet 1x1 64->256 56x56", (1, 64, 56, 56), (256, 64, 1, 1), {}),
    ("resnet 3x3/2 128 56x56", (1, 128, 56, 56), (128, 128, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("resnet 3x3 512 7x7", (1, 512, 7, 7), (512, 512, 3, 3), {"pads": [1, 1, 1, 1]}),
    ("mobilenet depthwise 3x3 144", (1, 144, 56, 56), (144, 1, 3, 3), {"group": 144, "pads": [1, 1, 1, 1]}),
]
#: relative error (max |got - want| / max |want|) allowed against float64: exact FP32, TF32
ENGINE_TOLERANCE = {"fp32": 1e-4, "tf32": 1e-2}
ENGINE_RUNS = 20


def _engine_ms(fn: Callable[[], Any]) -> float:
    return median_ms(fn, runs=ENGINE_RUNS, warmup=2, cap_s=2.0)


def _engine_replay_ms(cp: Any, backend: Any, fn: Callable[[], Any]) -> tuple[float, Any]:
    """(median ms of a replay, the recorded output) of ``fn`` captured into one CUDA graph on a
    stream of its own, warmed first (kernels compiled, plans chosen), as the provider captures."""
    fn()
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    backend.prepare_capture(stream)
    pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture()
        try:
            out = fn()
        finally:
            graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    ms = _engine_ms(lambda: (graph.launch(stream), stream.synchronize()))
    _engine_replay_ms.keep = (graph, pool, stream)  # type: ignore[attr-defined]
    return ms, out


def _engine_error(got: Any, want: Any) -> float:
    import numpy as np

    got = np.asarray(got, dtype=np.float64)
    return float(np.max(np.abs(got - want)) / max(1e-30, float(np.max(np.abs(want)))))


def _engine_run(cp: Any, backend: Any, fn: Callable[[], Any], want: Any, precision: str, capture: bool = True) -> dict:
    fields: dict[str, Any] = {"precision": precision}
    try:
        fields["eager"] = _engine_ms(lambda: (fn(), cp.cuda.get_current_stream().synchronize()))
        fields["rel_err"] = _engine_error(cp.asnumpy(fn()), want)
        if capture:
            fields["replay"], out = _engine_replay_ms(cp, backend, fn)
            fields["replay_rel_err"] = _engine_error(cp.asnumpy(out), want)
        fields["status"] = "ok" if max(fields["rel_err"], fields.get("replay_rel_err", 0.0)) <= \
            ENGINE_TOLERANCE[precision] else "fail"
    except Exception as exc:
        fields.update(status="error", detail=f"{type(exc).__name__}: {exc}"[:600])
    return fields


def _torch_run(fn: Callable[[], Any], want: Any, precision: str) -> dict:
    import torch

    fields: dict[str, Any] = {"precision": precision, "capture": False}
    try:
        tf32 = precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        with torch.no_grad():
            fields["eager"] = _engine_ms(lambda: (fn(), torch.cuda.synchronize()))
            fields["rel_err"] = _engine_error(fn().cpu().numpy(), want)
        fields["status"] = "ok" if fields["rel_err"] <= ENGINE_TOLERANCE[precision] else "fail"
    except Exception as exc:
        fields.update(status="error", detail=f"{type(exc).__name__}: {exc}"[:600])
    return fields


def _engines_backend() -> tuple[Any, Any]:
    import cupy

    from plugrt_cuda._provider import CUDAProvider

    provider = CUDAProvider()
    if not provider.devices():
        raise RuntimeError(f"the CUDA provider is unavailable: {provider.unavailable_reason}")
    return cupy, provider.backend()


def _engines_gemm_case(cp: Any, backend: Any, torch: Any, rng: Any, label: str, m: int, n: int, k: int) -> bool:
    import numpy as np

    exact, fast = backend.configured(tf32=False), backend.configured(tf32=True)
    a_host = rng.standard_normal((m, k)).astype(np.float32)
    b_host = (rng.standard_normal((k, n)) / math.sqrt(k)).astype(np.float32)
    want = a_host.astype(np.float64) @ b_host.astype(np.float64)
    a, b = cp.asarray(a_host), cp.asarray(b_host)
    engines: dict[str, dict] = {
        "own 64x64": _engine_run(cp, exact, lambda: exact.gemm(a, b), want, "fp32"),
        "cuBLASLt fp32": _engine_run(cp, exact, lambda: exact.lt_gemm(a, b), want, "fp32"),
        "cuBLASLt tf32": _engine_run(cp, fast, lambda: fast.lt_gemm(a, b), want, "tf32"),
        "cupy cuBLAS fp32": _engine_run(cp, exact, lambda: cp.matmul(a, b), want, "fp32", capture=False),
    }
    if torch is not None:
        ta, tb = torch.from_numpy(a_host).cuda(), torch.from_numpy(b_host).cuda()
        engines["torch fp32"] = _torch_run(lambda: ta @ tb, want, "fp32")
        engines["torch tf32"] = _torch_run(lambda: ta @ tb, want, "tf32")
    status = "ok" if all(e["status"] == "ok" for e in engines.values()) else "fail"
    record("engines", kind="gemm", case=label, shape=[m, n, k], engines=engines, status=status)
    return status == "ok"


def _engines_gemm(cp: Any, backend: Any) -> bool:
    import numpy as np

    try:
        import torch
    except ImportError:
        torch = None
    rng = np.random.default_rng(25)
    results = [_engines_gemm_case(cp, backend, torch, rng, *case) for case in ENGINE_GEMMS]
    return all(results)


def _engines_conv_case(cp: Any, backend: Any, torch: Any, rng: Any, label: str, x_shape: tuple, w_shape: tuple,
                       attributes: dict) -> bool:
    import copy

    import numpy as np

    from plugrt_cuda import _conv, _xp

    cudnn_reason = backend.cudnn().unavailable_reason

    def forced(engine: str, tf32: bool) -> Any:
        view = copy.copy(backend)
        view.tf32 = tf32
        view.conv_plan = lambda *args, **kw: _conv.ConvPlan(engine, "chosen by the engines stage")
        return view

    x_host = rng.standard_normal(x_shape).astype(np.float32)
    w_host = (rng.standard_normal(w_shape) / math.sqrt(float(np.prod(w_shape[1:])))).astype(np.float32)
    b_host = rng.standard_normal(w_shape[0]).astype(np.float32)
    group = int(attributes.get("group", 1))
    strides = list(attributes.get("strides", [1, 1]))
    x, w, b = cp.asarray(x_host), cp.asarray(w_host), cp.asarray(b_host)
    begin, end, _ = _xp.conv_pads(x_shape[2:], w_shape[2:], strides, [1, 1], attributes.get("pads"), "NOTSET")
    if torch is not None:
        import torch.nn.functional as F

        padded = np.pad(x_host.astype(np.float64), [(0, 0), (0, 0), (begin[0], end[0]), (begin[1], end[1])])
        want = torch.relu(F.conv2d(torch.from_numpy(padded), torch.from_numpy(w_host.astype(np.float64)),
                                   torch.from_numpy(b_host.astype(np.float64)), stride=strides, groups=group)).numpy()
    else:
        want = np.maximum(_xp.conv(np, x_host.astype(np.float64), w_host.astype(np.float64),
                                   b_host.astype(np.float64), **attributes), 0)
    names = [("im2col", _conv.IM2COL)]
    if tuple(w_shape[2:]) == (1, 1) and group == 1 and strides == [1, 1]:
        names.append(("1x1 GEMM", _conv.GEMM_1X1))
    if group == x_shape[1] == w_shape[0] and w_shape[1] == 1:
        names.append(("own depthwise", _conv.DEPTHWISE))
    if cudnn_reason is None:
        names.append(("cuDNN", _conv.CUDNN))
    engines: dict[str, dict] = {}
    for name, engine in names:
        for precision in ("fp32", "tf32") if engine != _conv.DEPTHWISE else ("fp32",):
            view = forced(engine, precision == "tf32")
            engines[f"{name} {precision}"] = _engine_run(
                cp, view, functools.partial(view.conv, x, w, b, True, attributes), want, precision)
    if torch is not None:
        import torch.nn.functional as F

        tx, tw, tb = (torch.from_numpy(v).cuda() for v in (x_host, w_host, b_host))
        widths = (begin[1], end[1], begin[0], end[0])

        def peer() -> Any:
            return torch.relu(F.conv2d(F.pad(tx, widths), tw, tb, stride=strides, groups=group))

        for precision in ("fp32", "tf32"):
            engines[f"torch {precision}"] = _torch_run(peer, want, precision)
    status = "ok" if all(e["status"] == "ok" for e in engines.values()) else "fail"
    record("engines", kind="conv", case=label, x=list(x_shape), w=list(w_shape), engines=engines, status=status,
           cudnn="used" if cudnn_reason is None else f"not used: {cudnn_reason}")
    return status == "ok"


def _engines_conv(cp: Any, backend: Any) -> bool:
    import numpy as np

    try:
        import torch
    except ImportError:
        torch = None
    rng = np.random.default_rng(26)
    results = [_engines_conv_case(cp, backend, torch, rng, *case) for case in ENGINE_CONVS]
    return all(results)


def stage_engines() -> bool:
    if DEVICE != "cuda":
        record("engines", kind="stage", status="skipped", detail=f"needs the CUDA provider (device {DEVICE})")
        return True
    cp, backend = _engines_backend()
    lt = backend.lt()
    cudnn = backend.cudnn()
    record("engines", kind="libraries", status="ok",
           cublaslt=f"version {lt.version}" if lt is not None else f"not used: {backend.lt_reason}",
           cudnn_frontend=_version("nvidia-cudnn-frontend") or "not installed",
           cudnn="usable" if cudnn.available else f"not used: {cudnn.unavailable_reason}")
    ok = _engines_gemm(cp, backend)
    return _engines_conv(cp, backend) and ok


def _engines_section(rows: list[dict]) -> list[str]:
    out = ["Median ms of one call (eager: call and synchronise; replay: one CUDA graph of it), and the error "
           "against float64 (max |diff| / max |reference|). Batch-1 network shapes; convolutions with bias and "
           "ReLU.", ""]
    for r in rows:
        if r.get("kind") == "libraries":
            out.append(f"- cuBLASLt: {r.get('cublaslt')}; cuDNN frontend: {r.get('cudnn_frontend')}; "
                       f"cuDNN: {r.get('cudnn')}")
    out += ["", "| kind | case | engine | eager ms | replay ms | rel err | ok |", "|---|---|---|---|---|---|---|"]
    fastest: list[str] = []
    for r in rows:
        if r.get("kind") not in ("gemm", "conv"):
            continue
        best: tuple[float, str] | None = None
        for name, e in (r.get("engines") or {}).items():
            ok = "yes" if e.get("status") == "ok" else f"**{e.get('status')}** {str(e.get('detail', ''))[:120]}"
            out.append(f"| {r['kind']} | {r.get('case')} | {name} | {_fmt(e.get('eager'))} | {_fmt(e.get('replay'))} | "
                       f"{_fmt(e.get('rel_err'))} | {ok} |")
            if e.get("status") == "ok" and isinstance(e.get("replay"), float) and e.get("precision") == "fp32":
                if best is None or e["replay"] < best[0]:
                    best = (e["replay"], name)
        if best is not None:
            fastest.append(f"{r.get('case')}: {best[1]} ({_fmt(best[0])} ms)")
    if fastest:
        out += ["", "Fastest captured FP32 engine per case: " + "; ".join(fastest)]
    return out


# -- the run -------------------------------------------------------------------------------


def run_stage(name: str, limit: float) -> bool:
    functions: dict[str, Callable[[], bool]] = {
        "environment": stage_environment,
        "references": stage_references,
        "light": stage_light,
        "exports": stage_exports,
        "latency": stage_latency,
        "decoder": stage_decoder,
        "engines": stage_engines,
        "gpu_tests": lambda: stage_gpu_tests(limit),
        "conformance": lambda: stage_conformance(limit),
    }
    try:
        return functions[name]()
    except Exception as exc:
        record(name, kind="stage", status="error", detail=traceback.format_exc()[-2000:])
        print(f"stage {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the GPU check's stages")
    parser.add_argument("--stage", help="run one stage (in this process)")
    parser.add_argument("--limit", type=float, default=120.0, help="the stage's time limit in seconds")
    parser.add_argument("--summary", action="store_true", help="rewrite summary.md from results.jsonl")
    args = parser.parse_args(argv)
    os.makedirs(OUT, exist_ok=True)
    os.makedirs(WORK, exist_ok=True)
    if args.summary:
        write_summary()
        return 0
    if args.stage:
        return 0 if run_stage(args.stage, args.limit) else 1
    started = time.monotonic()
    ok = True
    for name, limit, needs_gpu in STAGES:
        if DRY and needs_gpu:
            continue
        left = BUDGET - (time.monotonic() - started)
        if left < 20:
            record(name, kind="stage", status="skipped", detail=f"{left:.0f} s of the {BUDGET:.0f} s budget left")
            continue
        timeout = min(limit, left)
        print(f"gpu check: {name} (up to {timeout:.0f} s)", flush=True)
        t = time.monotonic()
        try:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--stage", name, "--limit", str(timeout)],
                                  timeout=timeout, cwd=ROOT)
            passed = done.returncode == 0
        except subprocess.TimeoutExpired:
            record(name, kind="stage", status="timeout", detail=f"stopped at its {timeout:.0f} s limit")
            passed = False
        print(f"gpu check: {name} {'ok' if passed else 'FAILED'} in {time.monotonic() - t:.0f} s", flush=True)
        ok &= passed
        if name == "environment" and not DRY and not passed:
            # without a working device every later stage fails the same way: say it once
            record("environment", kind="stage", status="fail", detail="the CUDA provider is not usable here; "
                   "later stages still run and say how they fail")
    write_summary()
    with open(SUMMARY, encoding="utf-8") as f:
        print(f.read())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
