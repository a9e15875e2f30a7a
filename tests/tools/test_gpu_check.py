"""The GPU check's two halves without a GPU: `gpu_check.sh prep` writes a carried folder
under its size limit, and `.gpucheck/run.sh` in dry mode, under a Python like the lent GPU
machine's image (prep makes it: .venv-gpu-image), installs from the carried
wheels only, finds cuda unavailable with its reason, compiles every kernel with that
image's NVRTC and checks the references; and the summary's comparison lines."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = os.path.join(ROOT, "scripts", "gpucheck", "driver.py")


def _driver(monkeypatch, out):
    """The driver module, writing its records under ``out``."""
    spec = importlib.util.spec_from_file_location("gpucheck_driver", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "OUT", str(out))
    monkeypatch.setattr(module, "RESULTS", str(out / "results.jsonl"))
    monkeypatch.setattr(module, "SUMMARY", str(out / "summary.md"))
    return module


def test_the_summary_prints_the_geomean_of_plugrt_over_torch(monkeypatch, tmp_path):
    driver = _driver(monkeypatch, tmp_path)
    driver.record("latency", model="a", status="ok", plugrt_plain=1.0, plugrt_eager=2.0, plugrt_replay=0.5,
                  torch_eager=1.0, torch_graph=0.5)
    driver.record("latency", model="b", status="ok", plugrt_plain=1.0, plugrt_eager=8.0, plugrt_replay=1.0,
                  torch_eager=1.0, torch_graph=2.0)
    driver.record("latency", model="light x", status="ok", plugrt_plain=1.0, plugrt_eager=3.0, plugrt_replay=1.0)
    summary = (tmp_path / "summary.md").read_text()
    # the plain run (graphs on) over torch's graph: 2.0 and 0.5 -> geomean 1.00 (the light model has no peer);
    # eager ratios 2.0 and 8.0 -> 4.00; bound replays 1.0 and 0.5 -> 0.71; replay speed-ups 4, 8 and 3
    assert "graphs vs torch graphs: geomean 1.00 (over 2 models;" in summary
    assert "eager vs torch eager: geomean 4.00 (over 2 models)" in summary
    assert "bound replay vs torch graphs: geomean 0.71" in summary
    assert "replay speed-up over plugrt eager: smallest 3.00" in summary


def test_a_stage_that_failed_is_listed_as_not_measured(monkeypatch, tmp_path):
    driver = _driver(monkeypatch, tmp_path)
    driver.record("light", model="resnet50", variant="random", status="fail", logits_rel=0.2)
    driver.record("exports", kind="stage", status="timeout", detail="stopped at its 150 s limit")
    summary = (tmp_path / "summary.md").read_text()
    tail = summary.split("## Not measured or failed", 1)[1]
    assert "light: fail: resnet50" in tail and "exports: timeout" in tail and "latency: not run" in tail
    assert "**fail**" in summary  # the failing row is marked in its table


def test_records_are_appended_one_json_object_a_line(monkeypatch, tmp_path):
    driver = _driver(monkeypatch, tmp_path)
    driver.record("environment", kind="versions", status="ok", python="3.12.3")
    driver.record("gpu_tests", status="ok", tests=42, failed=0, skipped=0, seconds=3.0)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(line)["stage"] for line in lines] == ["environment", "gpu_tests"]
    assert "GPU tests: ok: 42 tests, 0 failed, 0 skipped" in (tmp_path / "summary.md").read_text()


def test_the_engines_summary_names_the_fastest_captured_engine(monkeypatch, tmp_path):
    driver = _driver(monkeypatch, tmp_path)
    driver.record("engines", kind="libraries", status="ok", cublaslt="version 130100", cudnn_frontend="1.12.0",
                  cudnn="usable")
    driver.record("engines", kind="gemm", case="vgg fc6", status="ok", engines={
        "own 64x64": {"precision": "fp32", "eager": 1.6, "replay": 1.5, "rel_err": 1e-7, "status": "ok"},
        "cuBLASLt fp32": {"precision": "fp32", "eager": 0.2, "replay": 0.12, "rel_err": 1e-7, "status": "ok"},
        "cuBLASLt tf32": {"precision": "tf32", "eager": 0.1, "replay": 0.05, "rel_err": 1e-3, "status": "ok"},
    })
    driver.record("engines", kind="conv", case="3x3", status="fail", engines={
        "im2col fp32": {"precision": "fp32", "eager": 0.3, "replay": 0.2, "rel_err": 0.5, "status": "fail"},
    })
    summary = (tmp_path / "summary.md").read_text()
    assert "- cuBLASLt: version 130100; cuDNN frontend: 1.12.0; cuDNN: usable" in summary
    assert "| gemm | vgg fc6 | cuBLASLt fp32 | 0.200 | 0.120 |" in summary
    # the TF32 engine is faster but not the same precision: the fastest FP32 one is named
    assert "Fastest captured FP32 engine per case: vgg fc6: cuBLASLt fp32 (0.120 ms)" in summary
    assert "**fail**" in summary and "engines: fail" in summary.split("## Not measured or failed", 1)[1]


def test_the_engines_stage_is_skipped_in_a_rehearsal(monkeypatch, tmp_path):
    driver = _driver(monkeypatch, tmp_path)
    monkeypatch.setattr(driver, "DEVICE", "cpu")
    assert driver.stage_engines() is True
    (line,) = (tmp_path / "results.jsonl").read_text().splitlines()
    assert json.loads(line)["status"] == "skipped"


def _prep_module():
    spec = importlib.util.spec_from_file_location("gpucheck_prep", os.path.join(ROOT, "scripts", "gpucheck", "prep.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_prep_then_the_dry_run_under_the_image_python_exit_zero(tmp_path):
    prep_module = _prep_module()
    if prep_module.find_python312() is None:
        pytest.skip("no CPython 3.12 here to stand in for the GPU machine's image")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    carried = str(tmp_path / ".gpucheck")  # not the checkout's own .gpucheck
    prep = subprocess.run(["bash", "scripts/gpu_check.sh", "prep", "--out", carried], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert prep.returncode == 0, prep.stdout[-3000:] + prep.stderr[-3000:]
    image_python = os.path.join(prep_module.IMAGE_VENV, "bin", "python")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(carried) for f in files)
    assert size <= 8 * 1024 * 1024
    out = tmp_path / "out"
    dry_env = dict(
        env, OUT=str(out), GPU_CHECK_DRY="1", GPU_CHECK_PYTHON=image_python,
        GPU_CHECK_SITE=str(tmp_path / "site"), GPU_CHECK_WORK=str(tmp_path / "work"),
    )
    dry_env.pop("PYTHONPATH", None)
    dry = subprocess.run(["bash", os.path.join(carried, "run.sh")], cwd=tmp_path, env=dry_env, capture_output=True,
                         text=True)
    assert dry.returncode == 0, dry.stdout[-3000:] + dry.stderr[-3000:]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    by_kind = {(r["stage"], r.get("kind")): r for r in records}
    versions = by_kind[("environment", "versions")]
    # plugrt came from the carried wheels; the rest is the image's own
    assert versions["packages"]["plugrt"] == "0.1.0" and "cupy-cuda13x" in versions["packages"]
    assert versions["python"].startswith("3.12")
    discovery = by_kind[("environment", "discovery")]
    assert discovery["status"] == "ok" and discovery["cuda"] == "unavailable" and "reason: " in discovery["detail"]
    assert by_kind[("environment", "nvrtc")]["status"] == "ok" and by_kind[("environment", "nvrtc")]["nvrtc"].startswith("13.")
    assert by_kind[("references", "load")]["status"] == "ok"
    assert by_kind[("references", "cpu provider here")]["status"] == "ok"
    assert (out / "summary.md").read_text().startswith("# plugrt CUDA provider: GPU check")


def test_building_the_wheels_removes_only_setuptools_folders_from_build(monkeypatch, tmp_path):
    # build/ in a checkout also holds what benchmarks made there (decoder and export models)
    prep_module = _prep_module()
    monkeypatch.setattr(prep_module, "ROOT", str(tmp_path))
    build = tmp_path / "build"
    for folder in ("lib", "bdist.linux-x86_64", "decoder_models/smollm2-135m", "bench_models"):
        (build / folder).mkdir(parents=True)
    (build / "bench_models" / "manifest.json").write_text("{}")
    prep_module._remove_setuptools_output(".")
    assert sorted(p.name for p in build.iterdir()) == ["bench_models", "decoder_models"]
    assert (build / "bench_models" / "manifest.json").is_file()
