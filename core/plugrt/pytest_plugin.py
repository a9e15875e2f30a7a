"""pytest plugin: ``pytest --plugrt-provider NAME`` runs the conformance suite as tests.

Each ONNX node case becomes one test item; a case the provider declines is skipped as
unsupported, an expected failure (the provider's shipped ``conformance_xfails.txt``,
plus ``--plugrt-xfails FILE``) is an xfail, and the protocol checks are one item each. A
run in which no case passed fails, and a filter that selects nothing is a usage error.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("plugrt", "plugrt provider conformance")
    group.addoption("--plugrt-provider", default=None, help="run the conformance suite against this provider")
    group.addoption("--plugrt-ops", default=None, help="comma-separated op patterns (fnmatch)")
    group.addoption("--plugrt-xfails", default=None, help="xfails file: a case pattern per line, then '# reason'")
    group.addoption("--plugrt-skips", default=None, help="skips file: a case pattern per line, then '# reason'")


class _CaseItem(pytest.Item):
    def __init__(self, *, outcome, **kwargs):
        super().__init__(**kwargs)
        self.outcome = outcome

    def runtest(self) -> None:
        status, detail = self.outcome["status"], self.outcome["detail"]
        if status in ("unsupported", "skipped"):
            pytest.skip(f"{status}: {detail}")
        if status == "xfailed":
            pytest.xfail(detail)
        if status != "passed":
            raise AssertionError(f"{status}: {detail}")

    def reportinfo(self):
        return "plugrt-conformance", None, self.name

    def repr_failure(self, excinfo, style=None):
        return str(excinfo.value)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    provider = config.getoption("--plugrt-provider")
    if not provider:
        return
    from .conformance.expectations import read_expectations, shipped_expectations
    from .conformance.suite import run_conformance
    from .errors import PlugrtError
    from .registry import default_registry

    xfails_path = config.getoption("--plugrt-xfails")
    skips_path = config.getoption("--plugrt-skips")
    ops = [p for p in (config.getoption("--plugrt-ops") or "").split(",") if p]
    try:
        # the provider's shipped expectations, then the files given
        xfails, skips = shipped_expectations(default_registry().get(provider))
        report = run_conformance(
            provider,
            ops=ops or None,
            xfails=xfails + (read_expectations(xfails_path) if xfails_path else []),
            skips=skips + (read_expectations(skips_path) if skips_path else []),
            progress=False,
        )
    except PlugrtError as exc:
        raise pytest.UsageError(f"plugrt conformance: {type(exc).__name__}: {exc}") from exc
    if not any(case.status == "passed" for case in report.cases):
        # a run that checked nothing must not look green
        items.append(
            _CaseItem.from_parent(
                session, name=f"conformance[{provider}]::at least one case passes",
                outcome={"status": "failed", "detail": f"no case passed out of {len(report.cases)}"},
            )
        )
    for case in report.cases:
        items.append(
            _CaseItem.from_parent(
                session, name=f"conformance[{provider}]::{case.name}", outcome={"status": case.status, "detail": case.detail}
            )
        )
    for check, result in report.protocol.items():
        status = {"passed": "passed", "skipped": "skipped", "failed": "failed"}[result["status"]]
        items.append(
            _CaseItem.from_parent(
                session, name=f"protocol[{provider}]::{check}", outcome={"status": status, "detail": str(result.get("detail", ""))}
            )
        )
