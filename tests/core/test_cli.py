from __future__ import annotations

import subprocess
import sys

import numpy as np

from plugrt.cli import main


def test_run_without_a_model_runs_the_bundled_example(capsys):
    assert main(["run"]) == 0
    out = capsys.readouterr().out
    assert "tiny_cnn.onnx" in out and "(bundled example)" in out
    assert "output probabilities: float32 [1, 10]" in out
    assert "placement: cpu: 9 node(s)" in out or "placement: cpu:" in out
    assert "latency:" in out


def test_run_reads_inputs_from_npy_and_repeats(tmp_path, capsys):
    image = np.zeros((2, 3, 32, 32), np.float32)
    np.save(tmp_path / "image.npy", image)
    assert main(["run", "--input", f"image={tmp_path / 'image.npy'}", "--repeat", "3", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "input  image: float32 [2, 3, 32, 32] (given)" in out
    assert "output probabilities: float32 [2, 10]" in out
    assert "median" in out and "partitions: 1" in out


def test_run_reports_a_typed_error_with_exit_status_2(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    assert main(["run", str(bad)]) == 2
    assert "ModelLoadError" in capsys.readouterr().err


def test_providers_lists_cpu_with_its_device():
    out = subprocess.run(
        [sys.executable, "-m", "plugrt", "providers"], capture_output=True, text=True, check=True
    ).stdout
    assert "cpu" in out and "cpu:0" in out and "[available]" in out
