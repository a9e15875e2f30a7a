"""plugrt explain: the placement page, checked as data and as a real browser renders it."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import numpy as np
import onnx
import pytest

import plugrt
from helpers import model_bytes
from plugrt.cli import main
from plugrt.explain import explain_data, explain_html

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
DENSENET = os.path.join(LIGHT, "light_densenet121.onnx")
CHROMIUM = "/usr/bin/chromium"

# Relu and Add are template ops; Softmax is not, so it falls back to the CPU provider
MIXED = """
<ir_version: 8, opset_import: ["" : 17]>
mixed (float[2, 4] x) => (float[2, 4] y) {
    r = Relu(x)
    s = Softmax(r)
    y = Add(s, r)
}
"""


@pytest.fixture(scope="module")
def mixed_session():
    pytest.importorskip("plugrt_provider_template")
    return plugrt.load(model_bytes(MIXED), device="template")


def _providers_by_op(data: dict) -> dict[str, str]:
    return {node["op"]: node["provider"] for node in data["nodes"]}


def test_nodes_carry_the_provider_they_run_on(mixed_session) -> None:
    data = explain_data(mixed_session)
    assert _providers_by_op(data) == {"Relu": "template", "Softmax": "cpu", "Add": "template"}
    assert [p["provider"] for p in data["partitions"]] == ["template", "cpu", "template"]


def test_fallback_reason_is_attached_to_its_node(mixed_session) -> None:
    data = explain_data(mixed_session)
    softmax = next(n["name"] for n in data["nodes"] if n["op"] == "Softmax")
    [(declined_by, reason, placed_on)] = data["fallbacks"][softmax]
    assert (declined_by, placed_on) == ("template", "cpu") and "Softmax" in reason


def test_seams_of_a_provider_without_capture_are_kept_by_partition(mixed_session) -> None:
    result = mixed_session.try_capture({"x": np.ones((2, 4), np.float32)})
    mixed_session.reset()
    data = explain_data(mixed_session, result)
    seams = set(data["partition_seams"]) | {n["partition"] for n in data["nodes"] if n["name"] in data["seams"]}
    assert seams == {p["name"] for p in data["partitions"] if p["provider"] == "template"}


def test_page_is_one_file_that_fetches_nothing(mixed_session) -> None:
    page = explain_html(mixed_session)
    assert "<svg" not in page  # drawn by the inline script, not pre-rendered
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|@import|url\((?!#)", page)  # url(#id) is in-page
    # the only address is the SVG namespace, an identifier that is never fetched
    assert set(re.findall(r"https?://[^\s'\"]+", page)) == {"http://www.w3.org/2000/svg"}


def test_cli_writes_the_page_and_prints_the_summary(tmp_path, capsys) -> None:
    out = tmp_path / "tiny.html"
    assert main(["explain", plugrt.cli.EXAMPLE_MODEL, "--device", "cpu", "--html", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "placement:" in printed and f"wrote {out}" in printed
    assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


SQUEEZENET = os.path.join(LIGHT, "light_squeezenet.onnx")


def _feeds_of(monkeypatch, method: str, argv: list[str]) -> dict:
    """The feeds the command ``argv`` passes to ``Session.<method>`` (the first call)."""
    from plugrt.session import Session

    seen: list[dict] = []
    original = getattr(Session, method)

    def spy(self, feeds=None, *args, **kwargs):
        seen.append({name: np.array(value) for name, value in dict(feeds or {}).items()})
        return original(self, feeds, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Session, method, spy)
        assert main(argv) == 0
    return seen[0]


def test_explain_captures_on_the_inputs_plugrt_run_generates(monkeypatch, capsys) -> None:
    captured_on = _feeds_of(monkeypatch, "try_capture", ["explain", SQUEEZENET, "--device", "cpu"])
    run_on = _feeds_of(monkeypatch, "run", ["run", SQUEEZENET, "--device", "cpu"])
    capsys.readouterr()
    assert list(captured_on) == list(run_on) == ["data_0"]
    np.testing.assert_array_equal(captured_on["data_0"], run_on["data_0"])
    assert np.count_nonzero(captured_on["data_0"]) > 0.99 * captured_on["data_0"].size  # not zeros


def test_explain_reports_the_seams_a_capture_on_runs_inputs_has(monkeypatch, capsys) -> None:
    run_on = _feeds_of(monkeypatch, "run", ["run", SQUEEZENET, "--device", "cpu"])
    capsys.readouterr()
    session = plugrt.load(SQUEEZENET, device="cpu")
    result = session.try_capture(run_on)
    assert main(["explain", SQUEEZENET, "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    match = re.search(r"^capture: (\d+) segment\(s\), (\d+) seam\(s\) run eagerly$", printed, re.M)
    assert match, printed
    assert (int(match[1]), int(match[2])) == (len(result.report.segments), len(result.report.seams))


def test_explain_without_capture_prints_no_seam_count(capsys) -> None:
    assert main(["explain", plugrt.cli.EXAMPLE_MODEL, "--device", "cpu", "--no-capture"]) == 0
    assert "capture:" not in capsys.readouterr().out


# -- in a real browser -----------------------------------------------------------------


def _chromium(*args: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [
                CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}", *args,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


needs_chromium = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Chromium is not installed")


@pytest.fixture(scope="module")
def densenet_page(tmp_path_factory):
    pytest.importorskip("plugrt_provider_template")
    path = tmp_path_factory.mktemp("explain") / "densenet.html"
    assert main(["explain", DENSENET, "--device", "template", "--html", str(path)]) == 0
    session = plugrt.load(DENSENET, device="template")  # what the page should show, built apart
    return path, session.placement


@needs_chromium
def test_browser_draws_one_box_per_partition_of_densenet(densenet_page) -> None:
    path, report = densenet_page
    dom = _chromium("--dump-dom", path.as_uri())
    drawn = re.findall(r'<g class="item part[^"]*"[^>]*data-partition="([^"]+)"', dom)
    # a big model opens with every partition collapsed to one box
    assert sorted(drawn) == sorted(p.name for p in report.partitions) and len(drawn) > 200


@needs_chromium
def test_browser_expanded_densenet_shows_every_node(densenet_page) -> None:
    path, report = densenet_page
    dom = _chromium("--dump-dom", path.as_uri() + "#expand-all")
    drawn = set(re.findall(r'data-node="([^"]+)"', dom))
    assert drawn == {name for p in report.partitions for name in p.node_names}


@needs_chromium
def test_browser_fallback_node_has_its_reason_on_hover(densenet_page) -> None:
    path, report = densenet_page
    dom = _chromium("--dump-dom", path.as_uri() + "#expand-all")
    fallback = report.fallbacks[0]
    node = re.search(rf'<g class="item node fallback[^"]*"[^>]*data-node="{re.escape(fallback.node)}"[^>]*><title>([^<]*)', dom)
    assert node is not None and fallback.reason in node.group(1).replace("&amp;", "&")


@needs_chromium
def test_browser_marks_a_transfer_edge_with_its_value(tmp_path) -> None:
    import types

    import onnx_ir as ir

    from plugrt.placement import PartitionInfo, PlacementReport, Transfer

    model = ir.from_onnx_text(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2] x) => (float[2] y) { r = Relu(x) y = Neg(r) }
        """
    )
    for node, name in zip(model.graph, ("relu", "neg")):
        node.name = name
    # a device provider's partition feeding a host one: the report lists the transfer
    report = PlacementReport(
        ["device", "cpu"],
        {"device": 1, "cpu": 1},
        [PartitionInfo("device_0", "device", 1, ("relu",)), PartitionInfo("cpu_1", "cpu", 1, ("neg",))],
        [],
        [Transfer("r", "device", "cpu")],
    )
    page = tmp_path / "transfer.html"
    page.write_text(explain_html(types.SimpleNamespace(placement=report, model=model)), encoding="utf-8")
    dom = _chromium("--dump-dom", page.as_uri())
    transfers = re.findall(r'<path class="edge transfer"[^>]*><title>([^<]*)', dom)
    assert transfers == ["r\ntransfer r: device → cpu"]
    assert len(re.findall(r'<path class="edge"', dom)) == 2  # x into relu, neg into the output


@needs_chromium
def test_browser_screenshot_is_an_image(densenet_page, tmp_path) -> None:
    path, _ = densenet_page
    shot = tmp_path / "shot.png"
    _chromium("--window-size=1100,1300", f"--screenshot={shot}", path.as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
