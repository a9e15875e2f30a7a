"""`plugrt conformance` as CI runs it: exit status 0 and both report formats written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _conformance(provider: str, tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, dict, str]:
    report_json = tmp_path / f"{provider}.json"
    report_md = tmp_path / f"{provider}.md"
    done = subprocess.run(
        [sys.executable, "-m", "plugrt", "conformance", "--provider", provider, "--no-progress",
         "--report", str(report_json), "--report", str(report_md), *extra],
        capture_output=True, text=True, timeout=600,
    )
    return done, json.loads(report_json.read_text()), report_md.read_text()


def test_cpu_provider_conforms_out_of_the_box(tmp_path):
    # no expectation files given: the CPU provider's own ship with plugrt_cpu
    done, report, markdown = _conformance("cpu", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    assert report["ok"] and report["totals"].get("failed", 0) == 0
    assert report["totals"]["passed"] >= 1850
    assert all(check["status"] != "failed" for check in report["protocol"].values())
    assert "| **total** |" in markdown


def test_template_provider_conforms_for_every_op_it_claims(tmp_path):
    pytest.importorskip("plugrt_provider_template")
    done, report, _ = _conformance("template", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    totals = report["totals"]
    assert totals["claimed"] > 0 and totals["passed"] == totals["claimed"]
    assert totals.get("failed", 0) == 0 and totals.get("error", 0) == 0
    assert report["protocol"]["save_context/load_context round-trip"]["status"] == "passed"


def test_installed_template_is_listed_by_plugrt_providers():
    pytest.importorskip("plugrt_provider_template")
    out = subprocess.run([sys.executable, "-m", "plugrt", "providers"], capture_output=True, text=True, check=True).stdout
    assert "template" in out and "[available]" in out


_VERDICT = r"conformance: (PASS|FAIL), (\d+) passed, (\d+) failed, \d+ error, \d+ xfailed, \d+ unsupported, \d+ skipped \(provider cpu, [\d.]+ s\)"


def test_conformance_without_a_report_prints_a_summary_ending_in_a_one_line_verdict(capsys):
    import re

    from plugrt.cli import main

    assert main(["conformance", "--provider", "cpu", "--ops", "Relu", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(_VERDICT, lines[-1]) and lines[-1].startswith("conformance: PASS")
    assert not any(line.startswith("|") for line in lines)  # the Markdown table only when asked for


def test_conformance_markdown_prints_the_full_table_then_the_verdict(capsys):
    import re

    from plugrt.cli import main

    assert main(["conformance", "--provider", "cpu", "--ops", "Relu", "--no-progress", "--markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "| Relu |" in "\n".join(lines) and any(line.startswith("| **total** |") for line in lines)
    assert re.fullmatch(_VERDICT, lines[-1])


def test_conformance_report_to_an_unwritable_path_exits_2_in_the_common_format(tmp_path, capsys):
    from plugrt.cli import main

    target = tmp_path / "no_such_folder" / "report.md"
    assert main(["conformance", "--provider", "cpu", "--ops", "Relu", "--no-progress", "--report", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plugrt: error: cannot write the report") and str(target) in err
