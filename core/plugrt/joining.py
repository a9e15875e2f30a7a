"""An accelerator that joins when ready: the device plan built in the background, checked, switched in.

A session placed by estimate whose plan puts nodes on an accelerator starts serving on its
fallback (the CPU provider) alone; a thread builds the plan by estimate on a copy of the
model meanwhile. When it is built, it runs once on the inputs and outputs of the session's
first run (kept for this), and only when its outputs equal the CPU plan's does the session
switch to it. ``Session.device_join`` says where that stands; each profiled run's
``model_run`` event names the plan that ran it, and a ``plan_switch`` event marks the switch.
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .tracing import span

if TYPE_CHECKING:
    import onnx_ir as ir

    from .build import BuiltGraph
    from .transfers import MemorySpaces

__all__ = ["DeviceJoin", "JoinStatus", "outputs_agree"]

#: Tolerances of the check before the switch (an accelerator's arithmetic may round differently).
RTOL, ATOL = 1e-3, 1e-5


@dataclasses.dataclass(frozen=True)
class JoinStatus:
    """Where a session's device plan stands: ``state`` is "compiling" (the CPU plan serves),
    "checking" (built; waiting for the first run's inputs to compare on), "switched" (the
    device plan serves from run ``switched_at_run`` on) or "kept" (the CPU plan serves for
    good; ``reason`` says why)."""

    state: str
    reason: str = ""
    compile_seconds: float | None = None
    switched_at_run: int | None = None


def outputs_agree(got: list[Any], expected: list[Any], to_host: Callable[[Any], Any]) -> str:
    """"" when ``got`` (a plan's outputs, maybe in device memory) equals ``expected`` (host
    arrays) within RTOL/ATOL; else which output differs and how."""
    for index, (value, want) in enumerate(zip(got, expected)):
        have = to_host(value)
        if not isinstance(want, np.ndarray) or not isinstance(have, np.ndarray):
            if type(have) is not type(want):
                return f"output {index} is a {type(have).__name__}, the CPU plan's a {type(want).__name__}"
            continue
        if have.shape != want.shape or have.dtype != want.dtype:
            return f"output {index} is {have.dtype}{list(have.shape)}, the CPU plan's {want.dtype}{list(want.shape)}"
        if have.dtype.kind in "fc":
            if not np.allclose(have, want, rtol=RTOL, atol=ATOL, equal_nan=True):
                worst = float(np.nanmax(np.abs(have.astype(np.float64) - want.astype(np.float64))))
                return f"output {index} differs from the CPU plan's by up to {worst:.3g}"
        elif not np.array_equal(have, want):
            return f"output {index} differs from the CPU plan's"
    return ""


def _host_copy(value: Any) -> Any:
    return value.copy() if isinstance(value, np.ndarray) else value


class DeviceJoin:
    """The background build of one session's device plan, and the check before its switch.

    ``build()`` (run on the thread) returns the device plan's BuiltGraph and the model it
    was placed on; ``switch(built, model)`` is called with the session's lock held when its
    outputs agree; ``spaces`` brings device outputs to the host for the check."""

    def __init__(
        self,
        build: Callable[[], "tuple[BuiltGraph, ir.Model]"],
        switch: Callable[["BuiltGraph", "ir.Model"], int],
        spaces: "MemorySpaces",
        fallback: str,
    ) -> None:
        self._build: "Callable[[], tuple[BuiltGraph, ir.Model]] | None" = build
        # weakly: a session dropped before its first run is not kept alive by the thread
        self._switch = weakref.WeakMethod(switch) if hasattr(switch, "__self__") else (lambda: switch)
        self._spaces = spaces
        self._fallback = fallback
        self._status = JoinStatus("compiling")
        self._sample: tuple[list, list] | None = None
        self._sampled = threading.Event()
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._fallback_serving = False
        self._early: "tuple[BuiltGraph, ir.Model] | None" = None
        context = contextvars.copy_context()  # the session's recorder: the build's spans go to its profile
        self._thread = threading.Thread(target=context.run, args=(self._work,), name="plugrt-device-join", daemon=True)
        self._thread.start()

    @property
    def status(self) -> JoinStatus:
        return self._status

    @property
    def wants_sample(self) -> bool:
        return self._sample is None and not self.done.is_set()

    def fallback_ready(self) -> "tuple[BuiltGraph, ir.Model] | None":
        """Called once the fallback's plan is built: the device plan and its model when it
        was built first (the session uses it from the first run, unchecked: nothing ran on
        the fallback to check it against), else None (the fallback serves until the switch)."""
        with self._lock:
            self._fallback_serving = self._early is None
            return self._early

    def record(self, args: list, values: list) -> None:
        """Keep copies of a CPU run's inputs and outputs to check the device plan on."""
        if self._sample is None:
            self._sample = ([_host_copy(a) for a in args], [_host_copy(v) for v in values])
            self._sampled.set()

    def wait(self, timeout: float | None = None) -> JoinStatus:
        """Block until the device plan is switched in or kept out (or ``timeout`` seconds)."""
        self.done.wait(timeout)
        return self._status

    def _finish(self, status: JoinStatus) -> None:
        self._status = status
        self.done.set()

    def _work(self) -> None:
        started = time.perf_counter()
        build, self._build = self._build, None  # the build closure holds the session: drop it once built
        assert build is not None
        try:
            built, model = build()
        except Exception as exc:  # the CPU plan goes on serving: say why
            self._finish(JoinStatus("kept", f"the device plan failed to build: {type(exc).__name__}: {exc}"))
            return
        seconds = time.perf_counter() - started
        with self._lock:
            if not self._fallback_serving:  # built before the fallback's plan: used from the start
                self._early = (built, model)
                self._finish(JoinStatus("switched", "built before the fallback's plan", seconds, 1))
                return
        placed = {p for p, n in built.report.nodes_per_provider.items() if n}
        if placed <= {self._fallback}:
            self._finish(JoinStatus("kept", f"placement by estimate put every node on {self._fallback}", seconds))
            return
        self._status = JoinStatus("checking", "", seconds)
        del build
        while not self._sampled.wait(1.0):
            if self._switch() is None:  # the session is gone, unrun
                return
        assert self._sample is not None
        args, expected = self._sample
        records = built.plan.profile_records
        mark = len(records) if records is not None else 0
        with span("device_plan_check", plan=built.plan.label) as check:
            try:
                got = built.plan.run(*args)
                problem = outputs_agree(got, expected, self._spaces.to_host)
            except Exception as exc:
                problem = f"the device plan raised {type(exc).__name__}: {exc}"
            check["agrees"] = not problem
        if records is not None:
            del records[mark:]  # the check is this span, not one of the session's runs
        if problem:
            self._finish(JoinStatus("kept", f"checked against the CPU plan: {problem}", seconds))
            return
        switch = self._switch()
        if switch is None:
            return
        at = switch(built, model)
        self._finish(JoinStatus("switched", "", seconds, at))
