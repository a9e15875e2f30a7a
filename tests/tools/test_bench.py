"""plugrt bench: figures beside onnxruntime, as a table and as JSON."""

from __future__ import annotations

import json
import re
import os

import numpy as np
import onnx
import pytest

from plugrt.bench import BenchResult, _percentiles, format_table
from plugrt.cli import main

SQUEEZENET = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light", "light_squeezenet.onnx")


@pytest.fixture(scope="module")
def squeezenet_run(tmp_path_factory):
    from plugrt.conformance.light_models import with_random_weights

    pytest.importorskip("onnxruntime")
    folder = tmp_path_factory.mktemp("bench")
    # random weights: with its constant ones the model's Softmax saturates (one ulp flips a one-hot)
    model = folder / "squeezenet_random.onnx"
    onnx.save(with_random_weights(onnx.load(SQUEEZENET))[0], str(model))
    out = folder / "squeezenet.json"
    argv = ["bench", str(model), "--device", "cpu", "--compare", "onnxruntime", "--fast", "--json", str(out)]
    return main(argv), json.loads(out.read_text(encoding="utf-8"))


def test_squeezenet_prints_a_table_with_onnxruntime(squeezenet_run, capsys) -> None:
    # the module fixture ran first; run the fast table again to read what it prints
    code = main(["bench", SQUEEZENET, "--device", "cpu", "--compare", "onnxruntime", "--fast", "--no-memory"])
    printed = capsys.readouterr().out
    assert code == 0
    assert re.search(r"^plugrt\s+\d", printed, re.M) and re.search(r"^onnxruntime\s+\d", printed, re.M)
    assert "p50 plugrt / onnxruntime" in printed and "load average" in printed


def test_squeezenet_json_has_ordered_percentiles_and_memory(squeezenet_run) -> None:
    code, report = squeezenet_run
    assert code == 0 and [r["runtime"] for r in report["results"]] == ["plugrt", "onnxruntime"]
    for result in report["results"]:
        assert result["runs"] == 5
        assert 0 < result["p50_ms"] <= result["p90_ms"] <= result["p99_ms"]
        assert result["peak_rss_mib"] is not None and result["peak_rss_mib"] > 0


def test_squeezenet_outputs_agree_with_onnxruntime(squeezenet_run) -> None:
    _, report = squeezenet_run
    assert report["results"][1]["max_abs_diff"] < 1e-4


def test_percentiles_match_numpy() -> None:
    times = [0.001 * i for i in range(1, 101)]
    result = _percentiles(times, 100, sum(times), "plugrt", None)
    expected = np.percentile(np.array(times) * 1e3, [50, 90, 99])
    assert np.allclose([result.p50_ms, result.p90_ms, result.p99_ms], expected)
    assert result.runs_per_s == pytest.approx(100 / sum(times))


def test_table_states_missing_memory_as_na() -> None:
    table = format_table([BenchResult("plugrt", 1, 1.0, 1.0, 1.0, 1.0, 1000.0, None)])
    assert "n/a" in table.splitlines()[2]


def test_compare_without_onnxruntime_installed_names_it_and_how_to_install(monkeypatch, capsys) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # "import onnxruntime" now raises ImportError
    code = main(["bench", SQUEEZENET, "--device", "cpu", "--compare", "onnxruntime", "--fast", "--no-memory"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("plugrt: error: MissingDependencyError:")
    assert "'onnxruntime'" in err and "pip install onnxruntime" in err
    assert "Traceback" not in err
