from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnx.parser
import pytest

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


def test_version_prints_the_package_version(capsys):
    import plugrt

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"plugrt {plugrt.__version__}"


def test_negative_repeat_is_refused(capsys):
    with pytest.raises(SystemExit) as done:
        main(["run", "--repeat", "-1"])
    assert done.value.code == 2 and "--repeat: must be at least 1" in capsys.readouterr().err


def test_a_reader_that_goes_away_ends_the_command_quietly():
    process = subprocess.Popen(
        [sys.executable, "-m", "plugrt", "providers"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    process.stdout.close()  # as `| head` does once it has its lines
    _, err = process.communicate(timeout=120)
    assert process.returncode == 141 and err.decode().strip() == ""


def test_nothing_is_animated_when_stderr_is_not_a_terminal(capsys):
    assert main(["run"]) == 0
    assert capsys.readouterr().err == ""


def test_report_files_keep_stdout_to_the_verdict(tmp_path, capsys):
    report = tmp_path / "relu.md"
    assert main(["conformance", "--provider", "cpu", "--ops", "Relu", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("conformance: PASS") and "| op |" not in out
    assert "| Relu |" in report.read_text()


def test_runtime_warnings_name_the_node(tmp_path, capsys):
    model = onnx.parser.parse_model(
        '<ir_version: 8, opset_import: ["" : 17]> g (float[2] x) => (float[2] y) { h = Neg(x)  y = Exp(h) }'
    )
    onnx.save(model, tmp_path / "exp.onnx")
    np.save(tmp_path / "x.npy", np.array([-1000.0, 0.0], np.float32))
    assert main(["run", str(tmp_path / "exp.onnx"), "--input", f"x={tmp_path / 'x.npy'}"]) == 0
    err = capsys.readouterr().err
    assert "plugrt: warning: node" in err and "(Exp, provider cpu)" in err and "overflow" in err


def test_a_terminal_sees_a_status_line_while_the_model_builds():
    import os
    import pty

    controller, terminal = pty.openpty()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "plugrt", "run"], stdout=subprocess.PIPE, stderr=terminal, timeout=120
        )
        os.close(terminal)
        seen = b""
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # the terminal is closed and drained
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(controller)
    assert done.returncode == 0
    assert b"plugrt: building tiny_cnn.onnx ..." in seen and b"\r\x1b[K" in seen


def test_a_missing_input_file_exits_2_in_the_common_error_format(tmp_path, capsys):
    missing = tmp_path / "missing.npy"
    assert main(["run", "--input", f"image={missing}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plugrt: error: ") and str(missing) in err and ".npy" in err


def test_a_malformed_input_pair_exits_2_in_the_common_error_format(capsys):
    assert main(["run", "--input", "image"]) == 2
    assert capsys.readouterr().err.startswith("plugrt: error: --input takes NAME=FILE.npy")


def test_an_argument_error_uses_the_common_error_format(capsys):
    with pytest.raises(SystemExit) as done:
        main(["run", "--optimization", "most"])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.splitlines()[-1].startswith("plugrt: error: argument --optimization: invalid choice")


def test_run_explain_prints_the_placement_once(capsys):
    assert main(["run", "--explain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("placement")] == ["placement:"]
    assert any(line.strip().startswith("partitions:") for line in lines)
