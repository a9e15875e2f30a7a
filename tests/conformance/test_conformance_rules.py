"""What makes a conformance run a pass: something checked, readable expectations, a real
EPContext round trip for a provider that offers one."""

from __future__ import annotations

import subprocess
import sys

import fake_plugins
import pytest

from plugrt.cli import main
from plugrt.conformance.expectations import shipped_expectations
from plugrt.conformance.node_cases import iter_node_cases
from plugrt.conformance.suite import run_conformance
from plugrt.errors import ConformanceInputError
from plugrt.registry import ProviderRegistry, default_registry

NEG_CASES = list(iter_node_cases(names=["test_neg", "test_neg_example"]))
RELU_CASES = list(iter_node_cases(names=["test_relu"]))


def _registry(plugin) -> ProviderRegistry:
    import plugrt_cpu.plugin

    return ProviderRegistry(entry_points=(), plugins=[plugrt_cpu.plugin, plugin], disabled=())


def test_an_ops_filter_that_selects_no_case_is_an_error_naming_it():
    with pytest.raises(ConformanceInputError, match="'Relux' selects no ONNX node case") as caught:
        run_conformance("cpu", ops=["Relux"], progress=False)
    assert caught.value.filter == "Relux"


def test_the_command_exits_non_zero_on_a_filter_that_selects_nothing(capsys):
    assert main(["conformance", "--provider", "cpu", "--ops", "Relux"]) == 2
    assert capsys.readouterr().err.startswith("plugrt: error: ConformanceInputError:")


def test_a_run_in_which_nothing_passed_is_not_a_pass():
    report = run_conformance("fakeaccel", registry=_registry(fake_plugins.good), cases=RELU_CASES, progress=False)
    assert {c.status for c in report.cases} == {"unsupported"}
    assert not report.ok and "FAIL" in report.to_markdown()


def test_the_claimed_cases_passing_is_a_pass():
    report = run_conformance("fakeaccel", registry=_registry(fake_plugins.good), cases=NEG_CASES, progress=False)
    assert report.ok and report.totals()["passed"] == len(NEG_CASES)


def test_an_epcontext_round_trip_that_restored_nothing_fails():
    cases = NEG_CASES[:1] + RELU_CASES
    report = run_conformance("ctxaccel", registry=_registry(fake_plugins.with_context), cases=cases, ops=["Relu"], progress=False)
    check = report.protocol["save_context/load_context round-trip"]
    assert check["status"] == "failed" and "0 partitions restored" in check["detail"]
    assert not report.ok


def test_an_epcontext_round_trip_on_claimed_cases_passes():
    report = run_conformance("ctxaccel", registry=_registry(fake_plugins.with_context), cases=NEG_CASES, progress=False)
    assert report.protocol["save_context/load_context round-trip"]["status"] == "passed"


@pytest.mark.parametrize(
    "content, message",
    [(None, "cannot read expectations file"), ("test_relu*\n", "has no '# reason'")],
    ids=["missing", "malformed"],
)
def test_a_bad_xfails_file_is_a_plugrt_error_line(tmp_path, capsys, content, message):
    path = tmp_path / "xfails.txt"
    if content is not None:
        path.write_text(content)
    assert main(["conformance", "--provider", "cpu", "--ops", "Relu", "--xfails-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plugrt: error: ConformanceInputError:") and message in err and "Traceback" not in err


def test_the_cpu_provider_ships_its_expectations_each_with_a_reason():
    xfails, skips = shipped_expectations(default_registry().get("cpu"))
    assert xfails and skips
    assert all(entry.reason for entry in xfails + skips)


def _pytest_plugin(tmp_path, *args: str) -> subprocess.CompletedProcess:
    # an empty folder: the only items are the plugin's
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path), *args],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )


@pytest.mark.slow
def test_the_pytest_plugin_refuses_a_filter_that_selects_nothing(tmp_path):
    done = _pytest_plugin(tmp_path, "--plugrt-provider", "cpu", "--plugrt-ops", "Relux")
    assert done.returncode == 4 and "selects no ONNX node case" in done.stderr


@pytest.mark.slow
def test_the_pytest_plugin_fails_a_run_in_which_nothing_passed(tmp_path):
    pytest.importorskip("plugrt_provider_template")
    done = _pytest_plugin(tmp_path, "--plugrt-provider", "template", "--plugrt-ops", "Conv")
    assert done.returncode == 1 and "at least one case passes" in done.stdout
