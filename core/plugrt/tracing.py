"""Profiles in onnxruntime's Chrome-trace format, mirrored to OpenTelemetry when it is configured.

A session built with ``profiling=True`` owns a :class:`Recorder`. While the session is
built the recorder is the *active* one, so build code anywhere marks its phases with
:func:`span` and :func:`instant` without being handed it; with no active recorder they
do nothing. After the build the session passes its recorder to what needs it (capture
slots, the decode loop). Per-node events are recorded by the plan itself (see
``Plan._generate``) and turned into events here.

Events follow onnxruntime's profile: a JSON array of complete events (``"ph": "X"``)
with ``ts`` and ``dur`` in microseconds from the session's start, category ``"Session"``
for session phases and ``"Node"`` for kernels, named ``<node>_kernel_time``, whose
``args`` hold ``op_name``, ``provider``, ``input_type_shape``, ``output_type_shape`` and
the byte counts ``activation_size``, ``parameter_size``, ``output_size`` as strings.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import functools
import json
import os
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import numpy as np

from .errors import OptionError

__all__ = [
    "GenerationTrace",
    "PROFILING_OFF",
    "ProfiledSession",
    "Recorder",
    "complete_event",
    "duration",
    "instant",
    "loading_span_name",
    "micros",
    "node_event",
    "span",
    "span_of",
    "spanned",
    "trace_generation",
    "traced",
    "traced_capture",
    "traced_replay",
    "traced_session",
    "type_name",
    "with_provider_names",
]

T = TypeVar("T")

_clock = time.perf_counter
_active: contextvars.ContextVar["Recorder | None"] = contextvars.ContextVar("plugrt_recorder", default=None)


def micros(moment: float, origin: float) -> float:
    """A ``perf_counter`` reading in microseconds after ``origin`` (to the nanosecond)."""
    return round((moment - origin) * 1e6, 3)


def duration(start: float, end: float, origin: float) -> float:
    """``end - start`` in microseconds, such that ``ts + dur`` is ``end``'s ``ts``: spans
    that follow each other never overlap after rounding."""
    return round(micros(end, origin) - micros(start, origin), 3)


def complete_event(
    name: str, cat: str, pid: int, tid: int, start: float, end: float, origin: float, args: Mapping[str, Any]
) -> dict[str, Any]:
    """A complete event (``"ph": "X"``) as onnxruntime writes it, its fields in its order."""
    return {
        "cat": cat,
        "pid": pid,
        "tid": tid,
        "dur": duration(start, end, origin),
        "ts": micros(start, origin),
        "ph": "X",
        "name": name,
        "args": dict(args),
    }


def _tracer() -> Any:
    """OpenTelemetry's tracer for plugrt, or None when the API is not installed or no
    tracer provider is configured (spans would go nowhere: skip the work)."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    return trace.get_tracer("plugrt")


def _attribute(value: Any) -> Any:
    """An event argument as an OpenTelemetry attribute value (primitives and lists of them)."""
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, bool, int, float)) for v in value):
        types = {type(v) for v in value}
        return list(value) if len(types) <= 1 else [str(v) for v in value]
    return json.dumps(value, default=str)


def _attributes(args: Mapping[str, Any]) -> dict[str, Any]:
    return {(k if k.startswith(("gen_ai.", "plugrt.")) else f"plugrt.{k}"): _attribute(v) for k, v in args.items()}


class Recorder:
    """One session's profile: spans and instant events on a monotonic clock, as Chrome-trace
    events with ``ts`` in microseconds from the recorder's creation; each span also goes to
    OpenTelemetry when a tracer provider is configured."""

    def __init__(self) -> None:
        self.origin = _clock()
        self.origin_ns = time.time_ns()  # wall time at ``origin``, for OpenTelemetry timestamps
        self.pid = os.getpid()
        self.events: list[dict[str, Any]] = []
        self.tracer = _tracer()

    def micros(self, moment: float) -> float:
        """``moment`` (a ``perf_counter`` reading) in microseconds since the origin."""
        return micros(moment, self.origin)

    def epoch_ns(self, moment: float) -> int:
        return self.origin_ns + int((moment - self.origin) * 1e9)

    def complete(
        self, name: str, start: float, end: float, args: Mapping[str, Any] | None = None, *, cat: str = "Session"
    ) -> None:
        """A finished span from ``start`` to ``end`` (``perf_counter`` readings)."""
        self.events.append(
            complete_event(name, cat, self.pid, threading.get_native_id(), start, end, self.origin, args or {})
        )

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "Session", **args: Any) -> Iterator[dict[str, Any]]:
        """Time the block as one event; the yielded dict is its ``args`` (add results to it)."""
        otel = self.tracer.start_as_current_span(name) if self.tracer is not None else contextlib.nullcontext()
        start = _clock()
        with otel as otel_span:
            try:
                yield args
            except BaseException as exc:
                args["error"] = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                self.complete(name, start, _clock(), args, cat=cat)
                if otel_span is not None:
                    otel_span.set_attributes(_attributes(args))

    def instant(self, name: str, cat: str = "Session", **args: Any) -> None:
        """A moment (``"ph": "i"``): a fallback, a seam."""
        moment = _clock()
        self.events.append(
            {
                "cat": cat,
                "pid": self.pid,
                "tid": threading.get_native_id(),
                "ts": self.micros(moment),
                "ph": "i",
                "s": "t",
                "name": name,
                "args": args,
            }
        )
        if self.tracer is not None:
            from opentelemetry import trace

            current = trace.get_current_span()
            if current.is_recording():
                current.add_event(name, _attributes(args), timestamp=self.epoch_ns(moment))
            else:
                self.tracer.start_span(name, attributes=_attributes(args), start_time=self.epoch_ns(moment)).end(
                    end_time=self.epoch_ns(moment)
                )

    def export(self, name: str, start: float, end: float, args: Mapping[str, Any], parent: Any = None) -> Any:
        """Send a span recorded earlier (timestamps given) to OpenTelemetry; returns it."""
        if self.tracer is None:
            return None
        from opentelemetry import trace

        context = trace.set_span_in_context(parent) if parent is not None else None
        otel_span = self.tracer.start_span(
            name, context=context, attributes=_attributes(args), start_time=self.epoch_ns(start)
        )
        otel_span.end(end_time=self.epoch_ns(end))
        return otel_span


# -- the active recorder (build phase) -----------------------------------------------------


def span(name: str, **args: Any) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """A span in the active recorder's profile; does nothing when none is active."""
    recorder = _active.get()
    if recorder is None:
        return contextlib.nullcontext(args)
    return recorder.span(name, **args)


def span_of(owner: Any, name: str, **args: Any) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """A span in the profile of ``owner`` (a session: its ``_trace``), else in the active
    recorder's; does nothing when neither records."""
    recorder = getattr(owner, "_trace", None) or _active.get()
    if recorder is None:
        return contextlib.nullcontext(args)
    return recorder.span(name, **args)


def instant(name: str, **args: Any) -> None:
    """An instant event in the active recorder's profile; nothing when none is active."""
    recorder = _active.get()
    if recorder is not None:
        recorder.instant(name, **args)


def traced(name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` inside a span called ``name``."""
    with span(name):
        return fn(*args, **kwargs)


def spanned(name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """A decorator running the function inside a span called ``name``."""

    def decorate(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> T:
            with span(name):
                return fn(*args, **kwargs)

        return run

    return decorate


def loading_span_name(model: Any) -> str:
    """onnxruntime's name for loading ``model``: from a path or from bytes."""
    return "model_loading_array" if isinstance(model, (bytes, bytearray, memoryview)) else "model_loading_uri"


def _profiling_requested(options: Mapping[str, Any] | None) -> bool:
    from .options import parse_options

    try:
        return bool(parse_options({"profiling": (options or {}).get("profiling", False)})["profiling"])
    except OptionError:
        return False  # the session's own option parsing reports it


def traced_session(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap a session's ``__init__``: with ``profiling`` among its options, the build runs
    with a new :class:`Recorder` active, inside a ``session_initialization`` span, and the
    recorder is kept as ``self._trace`` (None when profiling is off)."""

    @functools.wraps(init)
    def build(self: Any, *args: Any, **kwargs: Any) -> None:
        recorder = self._trace = Recorder() if _profiling_requested(kwargs.get("options")) else None
        # set even when None: a session built while another one builds records into its own profile only
        token = _active.set(recorder)
        try:
            with recorder.span("session_initialization") if recorder is not None else contextlib.nullcontext():
                init(self, *args, **kwargs)
        finally:
            _active.reset(token)

    return build


# -- per-node events -----------------------------------------------------------------------


@functools.cache
def type_name(dtype: Any) -> str:
    """An element type as onnxruntime's profile names it (ONNX's names: float, int64, bool)."""
    import onnx_ir as ir

    try:
        return ir.DataType.from_numpy(np.dtype(dtype)).name.lower()
    except (TypeError, ValueError):
        kind = getattr(dtype, "kind", "")
        return "string" if kind in ("O", "U", "S") else str(dtype)


def _type_shapes(tensors: Sequence[Any]) -> list[dict[str, list[int]]]:
    return [{type_name(t[0]): [int(d) for d in t[1]]} for t in tensors if t is not None]


def node_event(
    recorder_origin: float,
    pid: int,
    name: str,
    op_name: str,
    provider: str,
    record: tuple,
    parameters: Sequence[bool],
) -> dict[str, Any]:
    """One kernel's event from a plan's profile record ``(step, start, end, tid, inputs,
    outputs)``, where inputs and outputs are ``(dtype, shape, nbytes)`` or None (not a
    tensor) and ``parameters`` says which inputs are constants (initializers)."""
    _, start, end, tid, inputs, outputs = record
    activation = parameter = 0
    for tensor, is_parameter in zip(inputs, parameters):
        if tensor is not None:
            if is_parameter:
                parameter += tensor[2]
            else:
                activation += tensor[2]
    args = {
        "op_name": op_name,
        "provider": provider,
        "input_type_shape": _type_shapes(inputs),
        "output_type_shape": _type_shapes(outputs),
        "activation_size": str(activation),
        "parameter_size": str(parameter),
        "output_size": str(sum(t[2] for t in outputs if t is not None)),
    }
    return complete_event(f"{name}_kernel_time", "Node", pid, tid, start, end, recorder_origin, args)


def _export_runs(recorder: Recorder, plan: Any) -> None:
    """Send the plan's runs not yet sent to OpenTelemetry: a ``model_run`` span per run with
    its kernels as children (after the fact: a live span per kernel would cost more than
    most kernels do)."""
    records = plan.profile_records or []
    done = plan.exported_records
    pending: list[tuple] = []
    for record in records[done:]:
        if record[0] >= 0:
            pending.append(record)
            continue
        run = recorder.export("model_run", record[1], record[2], {})
        for step in pending:
            info = plan.infos[step[0]]
            event = node_event(
                recorder.origin, recorder.pid, info.name, info.op_type, info.provider, step, plan.parameter_inputs[step[0]]
            )
            recorder.export(event["name"], step[1], step[2], event["args"], parent=run)
        pending = []
    plan.exported_records = len(records) - len(pending)


#: What profile() says when profiling is off, and how to switch it on.
PROFILING_OFF = (
    "profiling is off; call session.start_profiling() first, or build the session with profiling=True"
)


class ProfiledSession:
    """The profiling half of a session: ``start_profiling()``, ``profile()`` and ``end_profiling()``."""

    _trace: Recorder | None
    _plan: Any  # the session's Plan (plan.py imports this module)
    _built: Any  # the session's BuiltGraph, which holds the plan too
    _captures: Any  # the session's CaptureSlots
    _retired_plans: Any = ()  # plans the session ran before it switched to its device plan

    @property
    def profiling(self) -> bool:
        """Whether this session records a profile (``profiling=True``, or ``start_profiling()``)."""
        return self._trace is not None

    def start_profiling(self) -> None:
        """Switch profiling on for a session built without ``profiling=True``: from now on
        runs record per-node events, and captures and replays their spans, as a session
        built with it does (the build's own spans were not recorded). Times count from
        this call. Does nothing when profiling is already on."""
        if self._trace is not None:
            return
        recorder = Recorder()
        self._built.plan = self._plan = self._plan.profiled()
        self._captures.record_into(recorder)
        self._trace = recorder

    def profile(self) -> list[dict[str, Any]]:
        """The profile so far, in time order: build phases, captures and replays
        (``"cat": "Session"``) and one event per kernel run (``"cat": "Node"``), in
        onnxruntime's format. Needs ``profiling=True``."""
        recorder = self._trace
        if recorder is None:
            raise OptionError(PROFILING_OFF, key="profiling")
        events = list(recorder.events)
        for plan in [*self._retired_plans, self._plan]:  # a plan switched out keeps its runs
            events += plan.chrome_trace(recorder.origin)
        if recorder.tracer is not None:
            _export_runs(recorder, self._plan)
        events.sort(key=lambda e: e["ts"])
        return events

    def end_profiling(self, path: str | os.PathLike[str] | None = None) -> str:
        """Write :meth:`profile` as a JSON array (opens in Perfetto and chrome://tracing)
        to ``path`` (default ``plugrt_profile_<date>_<time>.json`` in the working folder);
        returns the path. Recording goes on. Without profiling on, OptionError says how to
        switch it on."""
        events = self.profile()
        if path is None:
            path = f"plugrt_profile_{datetime.datetime.now():%Y-%m-%d_%H-%M-%S}.json"
        with open(path, "w", encoding="utf-8") as f:
            json.dump(events, f)
        return os.fspath(path)


def with_provider_names(events: list[dict[str, Any]], names: Mapping[str, str]) -> list[dict[str, Any]]:
    """``events`` with each node's provider renamed through ``names`` (e.g. onnxruntime's
    ``CPUExecutionProvider`` for ``cpu``)."""
    renamed = []
    for event in events:
        provider = event.get("args", {}).get("provider")
        if provider in names:
            event = {**event, "args": {**event["args"], "provider": names[provider]}}
        renamed.append(event)
    return renamed


# -- capture and replay --------------------------------------------------------------------


def traced_capture(recorder: Recorder, capture: Callable[..., Any]) -> Callable[..., Any]:
    """``CaptureSlots.capture`` recording a ``capture`` span (segments, seams and why) and a
    ``capture_seam`` instant event per node run eagerly."""

    @functools.wraps(capture)
    def run(slot: str, record: Callable[[], Any]) -> Any:
        with recorder.span("capture", slot=slot) as args:
            result = capture(slot, record)
            report = getattr(result, "report", None)
            seams = getattr(report, "seams", report) or []
            segments = getattr(report, "segments", [])
            args.update(
                captured=bool(getattr(result, "captured", False)),
                segments=len(segments),
                segment_nodes=[len(s) for s in segments],
                seams=[f"{node}: {reason}" for node, reason in seams],
                staged=list(getattr(report, "staged", [])),
            )
            for node, reason in seams:
                recorder.instant("capture_seam", slot=slot, node=node, reason=reason)
        return result

    return run


def traced_replay(recorder: Recorder, replay: Callable[..., Any]) -> Callable[..., Any]:
    """``CaptureSlots.replay`` recording a ``replay`` span (whether it replayed, and why not)
    and an ``eager_fallback`` instant event when it ran the plain way."""

    @functools.wraps(replay)
    def run(slot: str, *rest: Any, **kwargs: Any) -> Any:
        with recorder.span("replay", slot=slot) as args:
            result = replay(slot, *rest, **kwargs)
            args["replayed"] = bool(result.replayed)
            if not result.replayed:
                args["reason"] = result.reason
                recorder.instant("eager_fallback", slot=slot, reason=result.reason)
        return result

    return run


# -- decode --------------------------------------------------------------------------------


class GenerationTrace:
    """One generation's span (``text_completion <model>``) with OpenTelemetry's ``gen_ai.*``
    attributes: prompt and generated tokens, time to first token, time per output token and
    tokens per second, from the trace's creation to the last token. Call :meth:`token`
    after each generated token; the span is written when ``done``."""

    def __init__(self, recorder: Recorder, model: str, max_length: int, request: Mapping[str, Any]) -> None:
        self.recorder = recorder
        self.model = model
        self.max_length = max_length
        self.request = dict(request)
        self.start = _clock()
        self.first: float | None = None
        self.tokens = 0
        self.input_tokens = 0

    def token(self, sequence_length: int, done: bool) -> None:
        moment = _clock()
        if self.first is None:
            self.first = moment
            self.input_tokens = sequence_length - 1
        self.tokens += 1
        if done:
            self.end(moment, sequence_length)

    def end(self, moment: float, sequence_length: int) -> None:
        first = self.first if self.first is not None else moment
        total = moment - self.start
        args: dict[str, Any] = {
            "gen_ai.operation.name": "text_completion",
            "gen_ai.provider.name": "plugrt",
            "gen_ai.request.model": self.model,
            **{f"gen_ai.request.{k}": v for k, v in self.request.items() if v is not None},
            "gen_ai.usage.input_tokens": self.input_tokens,
            "gen_ai.usage.output_tokens": self.tokens,
            "gen_ai.response.finish_reasons": ["length" if sequence_length >= self.max_length else "stop"],
            "gen_ai.server.time_to_first_token": first - self.start,
            "gen_ai.server.time_per_output_token": (moment - first) / (self.tokens - 1) if self.tokens > 1 else 0.0,
            "plugrt.tokens_per_second": self.tokens / total if total > 0 else 0.0,
        }
        name = f"text_completion {self.model}"
        self.recorder.complete(name, self.start, moment, args)
        self.recorder.export(name, self.start, moment, args)


class _NoGeneration:
    """What a generator traces with when its session is not profiling: nothing."""

    def token(self, sequence_length: int, done: bool) -> None:
        pass


_NO_GENERATION = _NoGeneration()


def trace_generation(session: Any, max_length: int, options: Any = None) -> "GenerationTrace | _NoGeneration":
    """A trace for one generation over ``session``, a no-op unless the session was built
    with ``profiling=True``. ``options`` (search options) give the ``gen_ai.request.*``
    attributes: ``temperature``, ``top_k`` and ``top_p`` when sampling, and ``seed``."""
    recorder = getattr(session, "_trace", None)
    if recorder is None:
        return _NO_GENERATION
    model = session.metadata.graph_name or os.path.basename(session.model_path or "") or "model"
    request: dict[str, Any] = {"seed": getattr(options, "seed", None)}
    if getattr(options, "do_sample", False):
        request.update(temperature=options.temperature, top_k=options.top_k, top_p=options.top_p)
    return GenerationTrace(recorder, model, max_length, request)
