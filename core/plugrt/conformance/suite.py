"""The provider conformance suite: ONNX node cases for every op a provider claims, run
with fallback off, plus checks of the provider protocol itself."""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import json
import sys
import time
import warnings
from typing import Any, Iterable, Sequence

import numpy as np

from ..errors import ConformanceInputError, PlacementError, PlugrtError, UnsupportedOpError
from ..provider import Support, SupportContext
from ..registry import ProviderRegistry, default_registry
from .expectations import Expectation, match
from .node_cases import NodeCase, compare_outputs, iter_node_cases

__all__ = ["CaseOutcome", "ConformanceReport", "run_conformance"]

_STATUSES = ("passed", "failed", "unsupported", "xfailed", "xpassed", "skipped", "error")


@dataclasses.dataclass
class CaseOutcome:
    name: str
    op: str
    status: str  # one of _STATUSES
    detail: str = ""
    claimed: bool = False


@dataclasses.dataclass
class ConformanceReport:
    provider: str
    cases: list[CaseOutcome]
    protocol: dict[str, dict[str, Any]]  # check name -> {"status": "passed"/"failed"/"skipped", "detail": ...}
    seconds: float

    @property
    def ok(self) -> bool:
        """No case or protocol check failed, and at least one case passed: a run that
        checked nothing is not a pass."""
        bad = {"failed", "error", "xpassed"}
        return (
            any(c.status == "passed" for c in self.cases)
            and not any(c.status in bad for c in self.cases)
            and all(v["status"] != "failed" for v in self.protocol.values())
        )

    def problems(self) -> list[CaseOutcome]:
        """The cases that make the run fail: failed, error, unexpectedly passed."""
        return [c for c in self.cases if c.status in ("failed", "error", "xpassed")]

    def verdict(self) -> str:
        """One line: PASS or FAIL, the counts, the provider and the time."""
        totals = self.totals()
        counts = ", ".join(
            f"{totals.get(k, 0)} {k}" for k in ("passed", "failed", "error", "xfailed", "unsupported", "skipped")
        )
        return f"conformance: {'PASS' if self.ok else 'FAIL'}, {counts} (provider {self.provider}, {self.seconds:.1f} s)"

    def per_op(self) -> dict[str, collections.Counter]:
        table: dict[str, collections.Counter] = {}
        for case in self.cases:
            row = table.setdefault(case.op, collections.Counter())
            row[case.status] += 1
            if case.claimed:
                row["claimed"] += 1
        return dict(sorted(table.items()))

    def totals(self) -> collections.Counter:
        totals: collections.Counter = collections.Counter(c.status for c in self.cases)
        totals["claimed"] = sum(1 for c in self.cases if c.claimed)
        return totals

    def to_json(self) -> str:
        return json.dumps(
            {
                "provider": self.provider,
                "ok": self.ok,
                "seconds": round(self.seconds, 2),
                "totals": dict(self.totals()),
                "per_op": {op: dict(row) for op, row in self.per_op().items()},
                "protocol": self.protocol,
                "cases": [dataclasses.asdict(c) for c in self.cases],
            },
            indent=2,
        )

    def to_markdown(self) -> str:
        columns = ("claimed", "passed", "failed", "unsupported", "xfailed", "skipped")
        lines = [
            f"# Conformance of provider `{self.provider}`",
            "",
            f"Result: **{'PASS' if self.ok else 'FAIL'}** ({self.seconds:.1f} s)",
            "",
            "| op | " + " | ".join(columns) + " |",
            "|---|" + "---|" * len(columns),
        ]
        for op, row in self.per_op().items():
            lines.append(f"| {op} | " + " | ".join(str(row.get(c, 0)) for c in columns) + " |")
        totals = self.totals()
        lines.append("| **total** | " + " | ".join(f"**{totals.get(c, 0)}**" for c in columns) + " |")
        lines += ["", "## Protocol checks", "", "| check | status | detail |", "|---|---|---|"]
        for name, result in self.protocol.items():
            lines.append(f"| {name} | {result['status']} | {str(result.get('detail', '')).replace('|', '/')} |")
        problems = self.problems()
        if problems:
            lines += ["", "## Failures", "", "| case | status | detail |", "|---|---|---|"]
            for case in problems:
                lines.append(f"| `{case.name}` | {case.status} | {case.detail.replace('|', '/')} |")
        return "\n".join(lines) + "\n"


def _primary_op(case: NodeCase) -> str:
    ops = [n.op_type for n in case.model.graph.node]
    name = case.name.removeprefix("test_").lower().replace("_", "")
    for op in ops:
        if name.startswith(op.lower()):
            return op
    return ops[-1] if ops else "?"


class _Progress:
    def __init__(self, total: int, stream=None, enabled: bool = True):
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.count = 0

    def step(self, label: str) -> None:
        self.count += 1
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.count / self.total)
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.count}/{self.total} {label[:40]:40s}")
        if self.count == self.total:
            self.stream.write("\n")
        self.stream.flush()


def _session_for(provider: str, registry: ProviderRegistry, model_bytes: bytes):
    from ..session import Session

    # Fallback off: strict placement, and nothing folded ahead of time by another provider.
    return Session(model_bytes, providers=[provider], options={"strict": True, "optimization": "none"}, registry=registry)


def _feeds(case: NodeCase, inputs: Sequence[Any]) -> dict[str, Any]:
    from .node_cases import _to_numpy

    return {i.name: _to_numpy(v) for i, v in zip(case.model.graph.input, inputs)}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is b
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind in "OSU":
        return bool(np.all(a == b))
    return a.tobytes() == b.tobytes()


def run_conformance(
    provider: str,
    *,
    ops: Sequence[str] | None = None,
    xfails: Sequence[Expectation] = (),
    skips: Sequence[Expectation] = (),
    registry: ProviderRegistry | None = None,
    progress: bool = True,
    cases: Iterable[NodeCase] | None = None,
) -> ConformanceReport:
    """Run the suite against ``provider`` (raises ProviderUnavailableError if it cannot load)."""
    registry = registry or default_registry()
    target = registry.get(provider)
    started = time.perf_counter()
    all_cases = list(cases if cases is not None else iter_node_cases())
    if ops:
        all_cases = [c for c in all_cases if any(fnmatch.fnmatchcase(_primary_op(c), p) for p in ops)]
    if not all_cases:
        shown = ",".join(ops or ())
        raise ConformanceInputError(
            f"--ops {shown!r} selects no ONNX node case; op names are case-sensitive (e.g. 'Relu', 'Conv*')"
            if ops
            else "no ONNX node case to run (is onnx's backend test data installed?)",
            filter=shown or None,
        )
    bar = _Progress(len(all_cases), enabled=progress)
    outcomes: list[CaseOutcome] = []
    reasonless: list[str] = []
    nondeterministic: list[str] = []
    roundtrip: dict[str, Any] = {"checked": 0, "failed": []}
    for case in all_cases:
        op = _primary_op(case)
        bar.step(case.name)
        skipped = match(case.name, skips)
        if skipped is not None:
            outcomes.append(CaseOutcome(case.name, op, "skipped", skipped.reason))
            continue
        opsets = {o.domain or "": o.version for o in case.model.opset_import}
        ctx = SupportContext(opsets)
        claimed = False
        try:
            import onnx_ir as ir

            for node in ir.from_proto(case.model).graph:
                answer = target.supports_op(node, ctx)
                if isinstance(answer, Support) and not answer.supported and not answer.reason.strip():
                    reasonless.append(f"{case.name}:{node.op_type}")
                if node.op_type == op and bool(answer):
                    claimed = True
        except Exception as exc:  # supports_op itself raising is a protocol failure
            outcomes.append(CaseOutcome(case.name, op, "error", f"supports_op raised {type(exc).__name__}: {exc}"))
            continue
        with warnings.catch_warnings():
            # ONNX's cases probe log(0), 0/0 and overflow on purpose: their warnings are noise
            warnings.simplefilter("ignore", RuntimeWarning)
            outcome = _run_one(case, op, provider, registry, target, claimed, nondeterministic, roundtrip)
        expected_failure = match(case.name, xfails)
        if expected_failure is not None:
            if outcome.status in ("failed", "error"):
                outcome = CaseOutcome(case.name, op, "xfailed", expected_failure.reason, claimed)
            elif outcome.status == "passed":
                outcome = CaseOutcome(case.name, op, "xpassed", "passes but is listed in the xfails file", claimed)
        outcomes.append(outcome)

    protocol: dict[str, dict[str, Any]] = {
        "supports_op gives a reason for every no": {
            "status": "failed" if reasonless else "passed",
            "detail": ", ".join(reasonless[:10]) or f"{len(all_cases)} cases inspected",
        },
        "compiled output is deterministic": {
            "status": "failed" if nondeterministic else "passed",
            "detail": ", ".join(nondeterministic[:10]) or "every passing case gave identical outputs twice",
        },
    }
    if hasattr(target, "save_context") and hasattr(target, "load_context"):
        # a provider that offers EPContext must show it on at least one partition
        protocol["save_context/load_context round-trip"] = {
            "status": "passed" if roundtrip["checked"] and not roundtrip["failed"] else "failed",
            "detail": ", ".join(roundtrip["failed"][:10])
            or (
                f"{roundtrip['checked']} partitions restored with identical outputs"
                if roundtrip["checked"]
                else "0 partitions restored: the provider declares save_context/load_context but "
                "compiled no partition in the selected cases"
            ),
        }
    else:
        protocol["save_context/load_context round-trip"] = {"status": "skipped", "detail": "provider does not offer EPContext"}
    if hasattr(target, "capture"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # as for the cases themselves
            protocol["capture/replay equals eager"] = _check_capture(provider, registry, all_cases, outcomes)
    else:
        protocol["capture/replay equals eager"] = {"status": "skipped", "detail": "provider does not offer capture"}
    return ConformanceReport(provider, outcomes, protocol, time.perf_counter() - started)


def _run_one(case, op, provider, registry, target, claimed, nondeterministic, roundtrip) -> CaseOutcome:
    try:
        session = _session_for(provider, registry, case.model.SerializeToString())
    except (PlacementError, UnsupportedOpError) as exc:
        return CaseOutcome(case.name, op, "unsupported", str(exc).splitlines()[0], claimed)
    except PlugrtError as exc:
        return CaseOutcome(case.name, op, "error", f"{type(exc).__name__}: {exc}", claimed)
    except Exception as exc:
        return CaseOutcome(case.name, op, "error", f"build raised {type(exc).__name__}: {exc}", claimed)
    try:
        for inputs, expected in case.data_sets:
            feeds = _feeds(case, inputs)
            first = session.run_list(None, feeds)
            compare_outputs(expected, first, case.rtol, case.atol)
            second = session.run_list(None, feeds)
            if not all(_same(a, b) for a, b in zip(first, second)) and "random" not in op.lower() and op not in ("Bernoulli", "Multinomial", "Dropout"):
                nondeterministic.append(case.name)
        _check_roundtrip(session, target, case, roundtrip)
    except AssertionError as exc:
        return CaseOutcome(case.name, op, "failed", " ".join(str(exc).split())[:300], True)
    except UnsupportedOpError as exc:
        return CaseOutcome(case.name, op, "unsupported", str(exc).splitlines()[0], claimed)
    except Exception as exc:
        return CaseOutcome(case.name, op, "error", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}", True)
    return CaseOutcome(case.name, op, "passed", "", True)


def _check_roundtrip(session, target, case, roundtrip) -> None:
    save = getattr(target, "save_context", None)
    load = getattr(target, "load_context", None)
    if save is None or load is None:
        return
    mine = [cp for cp in session.compiled_partitions if cp.provider == target.name]
    if not mine:
        return
    try:
        restored = session.rebuilt_with(
            {cp.partition.name: load(save(cp), {"partition": cp.partition, "partition_name": cp.partition.name, "source": target.name}) for cp in mine}
        )
        for inputs, _ in case.data_sets[:1]:
            feeds = _feeds(case, inputs)
            if not all(_same(a, b) for a, b in zip(session.run_list(None, feeds), restored.run_list(None, feeds))):
                roundtrip["failed"].append(case.name)
                return
        roundtrip["checked"] += len(mine)
    except Exception as exc:
        roundtrip["failed"].append(f"{case.name} ({type(exc).__name__}: {exc})")


def _check_capture(provider, registry, cases, outcomes) -> dict[str, Any]:
    passed = {o.name for o in outcomes if o.status == "passed"}
    checked, failed = 0, []
    for case in cases:
        if case.name not in passed or checked >= 50:
            continue
        try:
            session = _session_for(provider, registry, case.model.SerializeToString())
            feeds = _feeds(case, case.data_sets[0][0])
            eager = session.run(feeds)
            captured = session.try_capture(feeds)
            if not getattr(captured, "captured", False):
                continue
            replayed = session.replay(feeds)
            if not all(_same(eager[k], replayed[k]) for k in eager):
                failed.append(case.name)
            checked += 1
        except Exception as exc:
            failed.append(f"{case.name} ({type(exc).__name__})")
    return {
        "status": "failed" if failed else ("passed" if checked else "skipped"),
        "detail": ", ".join(failed[:10]) or f"{checked} cases captured and replayed identically",
    }
