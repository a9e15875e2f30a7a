"""The session: build a model once for a device intent, then run it many times."""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ._guard import protect_inputs, tensor_limit, typed_load_errors, typed_run_errors
from .bindings import DeviceBinding, allocate_binding, bind_host_array, binding_info, bound_feeds, deliver, deliver_outputs
from .build import BuiltGraph, build_graph
from .capture import DEFAULT_SLOT, Captured, CapturedPlan, CaptureReport, CaptureSlots, ReplayResult
from .epcontext import export_context_model
from .errors import InvalidInputError
from .intent import Selection, resolve_device
from .introspection import SessionIntrospection
from .joining import DeviceJoin, JoinStatus
from .loader import ModelSource, load_model
from .memory_budget import SessionMemory
from .graphs import PlainRunGraphs, graphs_wanted, replay_tolerance
from .options import SessionOptions, parse_options
from .prepare import context_export_path, load_limits, prepare_model
from .provider import ExecutionProvider, NotCapturable, memory_of
from .registry import ProviderRegistry, default_registry
from .signature import InputSignature, ModelMetadata, TensorInfo, input_specs, model_metadata, tensor_info
from .stats import session_stats
from .threads import begin_run
from .tracing import ProfiledSession, loading_span_name, traced, traced_session
from .transfers import MemorySpaces
from .warmup import warmup_session
from .weights import WeightStore, building, share_initializers

__all__ = ["TensorInfo", "ModelMetadata", "Session", "load"]


class Session(SessionIntrospection, ProfiledSession):
    """A model built for a device; ``run`` it many times.

    Use :func:`plugrt.load` or :class:`plugrt.SessionBuilder` rather than this constructor.
    """

    @typed_load_errors
    @traced_session
    def __init__(
        self,
        model: ModelSource,
        *,
        device: str | None = "auto",
        providers: Sequence[str] | None = None,
        options: Mapping[str, Any] | None = None,
        registry: ProviderRegistry | None = None,
    ) -> None:
        started = time.perf_counter()
        self.options: SessionOptions = parse_options(dict(options or {}))
        disabled = self.options["disabled_providers"]
        if registry is None:
            registry = default_registry() if not disabled else ProviderRegistry(disabled=disabled)
        self.registry = registry
        limits = load_limits(self.options)
        # this session's limit, set on the running thread at each run (0: every free core)
        self._intra_op_threads = self.options["intra_op_num_threads"]
        loaded = traced(loading_span_name(model), load_model, model, limits)
        self.model_path = loaded.source if loaded.base_dir else None
        self._model = loaded.model
        self.selection: Selection = traced("device_selection", resolve_device, device, providers, registry)

        # Metadata is read before passes change the graph.
        self.inputs: list[TensorInfo] = [tensor_info(v) for v in self._model.graph.inputs]
        self.outputs: list[TensorInfo] = [tensor_info(v) for v in self._model.graph.outputs]
        self.metadata: ModelMetadata = model_metadata(self._model)

        prepared = prepare_model(self._model, self.selection, registry, self.options, loaded.base_dir)
        self.optimization_stats = dict(prepared.optimization_stats)
        chosen = self.selection.providers
        self._spaces = MemorySpaces([m for m in map(memory_of, chosen) if m is not None])
        self._opsets = prepared.opsets
        self.weights: WeightStore | None = share_initializers(self._model, self.options["weights"])
        self._memory = SessionMemory(self.options, self.weights)  # before the build: it counts what the build prepares
        self._runs = 0  # plan runs, for stats()
        self._switch_lock = threading.Lock()
        self._retired_plans: list = []  # plans run before a switch to the device plan (their profiles)
        self._join: DeviceJoin | None = None
        self._built: BuiltGraph
        with tensor_limit(self.options["limits.tensor_bytes"]):  # kernel outputs above it are refused
            if self._measures(prepared):
                self._built = self._measured_build(model, prepared)
            elif self._joins_later(prepared):
                self._built = self._start_on_the_fallback(prepared)
            else:
                self._built = self._build_plan(
                    strict=self.options["strict"], pinned=self.selection.pinned, restored=prepared.restored
                )
        self._plan = self._built.plan
        self.optimization_stats.update(self._built.pass_stats)
        specs = input_specs(self.inputs, self._model.graph.inputs, self._built.input_homes)
        self._signature = InputSignature(specs, self._spaces)
        self._memory.check(self)  # memory_limit: MemoryLimitError before anything else is made
        self._output_names = [info.name for info in self.outputs]
        self._output_index = {name: i for i, name in enumerate(self._output_names)}
        self._captures = CaptureSlots(self._trace)
        self._graphs: PlainRunGraphs | None = self._plain_run_graphs()
        self.context_model_path: str | None = None
        if self.options["ep.context_enable"]:
            self.context_model_path = self._export_context()
        self.build_seconds = time.perf_counter() - started

    def _plain_run_graphs(self) -> "PlainRunGraphs | None":
        """The plain-run graphs of this session's plan, or None when runs stay eager
        (``graphs`` option, and whether a provider the plan uses wants them)."""
        used = [p for p in self.selection.providers if self._built.report.nodes_per_provider.get(p.name)]
        if not graphs_wanted(self.options["graphs"], used):
            return None
        return PlainRunGraphs(self, self.options["max_graphs"], replay_tolerance(used))

    def _build_plan(
        self,
        *,
        providers: Sequence[ExecutionProvider] | None = None,
        model: Any = None,
        opsets: dict[str, int] | None = None,
        **how: Any,
    ) -> BuiltGraph:
        from .costs import CostModel
        from .provider import CostContext

        model = self._model if model is None else model
        providers = list(self.selection.providers if providers is None else providers)
        opsets = self._opsets if opsets is None else opsets
        costs = CostModel(providers, CostContext(dict(opsets), model.graph))
        with building(self.weights):  # providers' prepared weights are shared through the store
            return build_graph(
                model.graph,
                providers,
                opsets,
                registry=self.registry,
                profile=self.profiling,  # profiling=True, or start_profiling() before a rebuild
                devices=self.selection.devices,
                spaces=self._spaces,
                costs=costs,
                by_estimate=self._by_estimate and len(providers) > 1,
                # the providers' own fusions run on the nodes placed on them
                passes_model=model if self.options["optimization"] == "all" else None,
                provider_options=self.options.values,
                **how,
            )

    @property
    def _by_estimate(self) -> bool:
        return self.selection.by_estimate and self.options["placement"] in ("estimate", "measure")

    # -- placement="measure" ----------------------------------------------------------------

    def _measures(self, prepared: Any) -> bool:
        options = self.options
        return (
            options["placement"] == "measure"
            and self.selection.by_estimate
            and not options["strict"]
            and not prepared.restored
        )

    def _measured_build(self, source: Any, prepared: Any) -> BuiltGraph:
        """The faster of the plan by estimate and the fallback's alone, timed on generated
        inputs once per (model, providers, devices, shapes) (``plugrt.calibration``)."""
        import dataclasses

        from . import calibration
        from .warmup import warmup_feeds

        providers = self.selection.providers
        fallback = providers[-1]
        feeds = warmup_feeds(self.inputs, {}, self.options["limits.tensor_bytes"])
        shapes = {name: tuple(getattr(value, "shape", ())) for name, value in feeds.items()}
        key = calibration.verdict_key(
            source, [p.name for p in providers], [str(self.selection.devices[p.name]) for p in providers], shapes
        )
        candidates = {"by estimate": list(providers), f"all on {fallback.name}": [fallback]}
        cached = calibration.VERDICTS.get(key) if key is not None else None
        if cached is not None:
            candidates = {cached[0]: candidates[cached[0]]}
        results: list[tuple[float, str, BuiltGraph, Any, dict[str, int], list]] = []
        for label, chosen in candidates.items():
            model, opsets = (self._model.clone(), dict(self._opsets)) if len(candidates) > 1 else (self._model, self._opsets)
            built = self._build_plan(providers=chosen, model=model, opsets=opsets)
            args = InputSignature(input_specs(self.inputs, model.graph.inputs, built.input_homes), self._spaces).arguments(feeds)
            seconds = calibration.time_runs(functools.partial(built.plan.run, *args)) if cached is None else 0.0
            results.append((seconds, label, built, model, opsets, args))
        measured: tuple[tuple[str, float], ...]
        if cached is None:
            measured = tuple((label, seconds) for seconds, label, *_ in results)
            best = min(results, key=lambda r: r[0])
            if key is not None:
                calibration.VERDICTS[key] = (best[1], measured)
        else:
            measured, best = cached[1], results[0]
        _, label, built, model, opsets, args = best
        self._model, self._opsets = model, opsets
        times = calibration.partition_times(built, args)
        report = built.report
        report.partitions = [dataclasses.replace(p, measured_s=t) for p, t in zip(report.partitions, times)]
        report.estimate = dataclasses.replace(report.estimate, strategy="measure", measured=measured)
        return built

    # -- an accelerator that joins when ready ----------------------------------------------

    def _joins_later(self, prepared: Any) -> bool:
        """Whether this session starts on its fallback while its device plan builds: placed
        by estimate, the estimate gives an accelerator nodes, and nothing needs the device
        plan at once (``wait_for_device``, strict, an EPContext export or restore)."""
        options = self.options
        if options["wait_for_device"] or options["strict"] or options["ep.context_enable"] or prepared.restored:
            return False
        if options["memory_limit"] is not None:  # the limit is checked on the plan that serves, before load returns
            return False
        if not self._by_estimate:
            return False
        from .costs import CostModel
        from .placement import assign, assign_by_estimate
        from .provider import CostContext, SupportContext

        providers = self.selection.providers
        graph = self._model.graph
        try:  # the fallback must be able to run everything alone, and the estimate must want more
            assign(list(graph), providers[-1:], SupportContext(dict(self._opsets), graph))
            placed, _, _ = assign_by_estimate(
                list(graph), providers, SupportContext(dict(self._opsets), graph),
                CostModel(providers, CostContext(dict(self._opsets), graph)), graph.outputs,
            )
        except Exception:  # the build proper says what is wrong
            return False
        return any(name != providers[-1].name for name in placed)

    def _start_on_the_fallback(self, prepared: Any) -> BuiltGraph:
        """Start building the device plan on a copy of the model in the background, and
        build the plan of the fallback provider alone; the device plan is used at once
        when it was built first, else it joins when built and checked."""
        fallback = self.selection.providers[-1]
        device_model = self._model.clone()
        device_opsets = dict(self._opsets)
        limit = self.options["limits.tensor_bytes"]

        def build() -> tuple[BuiltGraph, Any]:
            with tensor_limit(limit):
                built = self._build_plan(model=device_model, opsets=device_opsets)
            used = [p.name for p in self.selection.providers if built.report.nodes_per_provider.get(p.name)]
            built.plan.label = "+".join(used)
            return built, device_model

        started = time.perf_counter()
        join = DeviceJoin(build, self._switch_plan, self._spaces, fallback.name)
        self._join = join
        built = self._build_plan(providers=[fallback], restored=prepared.restored)
        built.plan.label = fallback.name
        # half as long again for the device plan: an accelerator that compiles about as fast
        # as the CPU provider serves from the first run; a slow one joins when it is ready
        join.done.wait((time.perf_counter() - started) / 2)
        early = join.fallback_ready()
        if early is not None:  # the device plan was built first: the fallback's is not needed
            built, self._model = early
            self._opsets = device_opsets
        return built

    def _switch_plan(self, built: BuiltGraph, model: Any) -> int:
        """Serve from ``built`` (the checked device plan) from the next run on; returns that run's number."""
        with self._switch_lock:
            if self._trace is not None and built.plan.profile_records is None:
                built.plan = built.plan.profiled()  # start_profiling() was called meanwhile
            self._retired_plans.append(self._plan)
            specs = input_specs(self.inputs, model.graph.inputs, built.input_homes)
            self._signature = InputSignature(specs, self._spaces)
            self._model, self._built, self._plan = model, built, built.plan
            self.optimization_stats.update(built.pass_stats)
            if self._graphs is not None:
                self._graphs.reset()  # recorded on the plan switched out
            self._graphs = self._plain_run_graphs()
            if self._trace is not None:
                self._trace.instant("plan_switch", to=built.plan.label, after_runs=self._runs)
            return self._runs + 1

    @property
    def device_join(self) -> JoinStatus | None:
        """Where the device plan of a session that started on the CPU stands (None when the
        session was built on its final plan): compiling, checking, switched or kept."""
        return self._join.status if self._join is not None else None

    def wait_for_device_plan(self, timeout: float | None = None) -> JoinStatus | None:
        """Block until the device plan is switched in or kept out (at most ``timeout``
        seconds); the status, or None for a session built on its final plan."""
        return self._join.wait(timeout) if self._join is not None else None

    def _export_context(self) -> str:
        path = context_export_path(self.options, self.model_path)
        return export_context_model(self, path, self.options["ep.context_embed_mode"], source=self.model_path)[0]

    # -- introspection ---------------------------------------------------------------------

    def rebuilt_with(self, replacements: Mapping[str, Any]) -> "Session":
        """A copy of this session whose partitions named in ``replacements`` are the given
        compiled partitions (e.g. restored from an EPContext); the rest are reused."""
        compiled = [replacements.get(cp.partition.name, cp) for cp in self._built.compiled]
        clone = object.__new__(Session)
        clone.__dict__.update(self.__dict__)
        clone._built = self._build_plan(precompiled=compiled)
        clone._plan = clone._built.plan
        clone._signature = InputSignature(self._signature.specs, self._spaces)
        clone._captures = CaptureSlots(self._trace)
        clone._join = None  # the original's device plan would switch the original in
        clone._graphs = clone._plain_run_graphs()
        return clone

    @property
    def plan_source(self) -> str:
        """The generated Python of the execution plan (for debugging)."""
        return self._plan.source

    stats = session_stats
    warmup = warmup_session

    # -- running ---------------------------------------------------------------------------

    def _early_stores(self, bindings: Sequence[DeviceBinding]) -> list[tuple[int, int | None, Any]]:
        """The bound outputs of a run, each stored into its binding as soon as it is final
        rather than all at the end (a KV cache's presents need not all stay alive to the
        end): (output index, the index of the binding's own input, read before the store
        overwrites it, or None; the store). A bound output's buffer is taken to be its
        binding's alone, as onnxruntime's IO binding takes it."""
        positions = self._plan.input_positions
        stores = []
        for binding in bindings:
            output = self._output_index.get(binding.output) if binding.output is not None else None
            if output is not None:
                paired = positions.get(binding.input) if binding.input is not None else None
                stores.append((output, paired, binding.store))
        return stores

    @typed_run_errors
    def run(
        self,
        feeds: Mapping[str, Any] | None = None,
        output_names: Iterable[str] | None = None,
        *,
        bindings: Sequence[DeviceBinding] = (),
    ) -> dict[str, Any]:
        """Run the model. ``feeds`` maps input names to arrays; returns outputs by name.

        With ``bindings``, bound inputs are read from their buffers and bound outputs are
        stored into theirs and returned as None (their bytes stay on the device).
        """
        if bindings:
            begin_run(self._intra_op_threads)
            self._runs += 1
            args = self._signature.arguments(bound_feeds(feeds, bindings))
            stores = self._early_stores(bindings)
            values = self._plan.run_storing(stores, *args) if stores else self._plan.run(*args)
            return deliver_outputs(self._output_names, values, bindings, args, self._spaces)
        graphs = self._graphs
        if graphs is not None and self._graphs_serve():
            names = self._output_names if output_names is None else list(output_names)
            indexes = None if output_names is None else [self._output_index_of(n) for n in names]
            served = graphs.run(feeds or {}, indexes)
            if served is not None:
                return dict(zip(names, served))
        args, values = self._run_host(feeds or {})
        if output_names is None:
            return {name: deliver(v, args, self._spaces) for name, v in zip(self._output_names, values)}
        return {name: deliver(values[self._output_index_of(name)], args, self._spaces) for name in output_names}

    @typed_run_errors
    def run_list(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any]) -> list:
        graphs = self._graphs
        if graphs is not None and self._graphs_serve():
            indexes = [self._output_index_of(n) for n in output_names] if output_names else None
            served = graphs.run(feeds, indexes)
            if served is not None:
                return served
        args, values = self._run_host(feeds)
        if not output_names:
            return [deliver(v, args, self._spaces) for v in values]
        return [deliver(values[self._output_index_of(name)], args, self._spaces) for name in output_names]

    def _run_host(self, feeds: Mapping[str, Any]) -> tuple[list, list]:
        """Check ``feeds`` and run the plan on read-only views of them: (arguments, values)."""
        begin_run(self._intra_op_threads)
        self._runs += 1
        args = self._signature.arguments(feeds)
        values = self._plan.run(*protect_inputs(args))
        join = self._join
        if join is not None and join.wants_sample:
            join.record(args, values)  # what the device plan is checked on before it serves
        return args, values

    def _graphs_serve(self) -> bool:
        """Whether plain runs may use graphs now: not while profiling (a replay records no
        per-node events) nor while a device plan is still joining (it is checked against
        eager runs, and replaces the plan the graphs were recorded on)."""
        join = self._join
        return self._trace is None and (join is None or join.done.is_set())

    @property
    def graph_signatures(self) -> list[str]:
        """The input signatures plain runs replay a graph for, least recently used first."""
        return self._graphs.signatures if self._graphs is not None else []

    def _output_index_of(self, name: str) -> int:
        try:
            return self._output_index[name]
        except KeyError:
            raise InvalidInputError(f"unknown output {name!r}; the model's outputs are {self._output_names}") from None

    # -- device bindings ---------------------------------------------------------------

    def allocate_binding(
        self,
        input: str | None = None,
        output: str | None = None,
        *,
        dtype: Any = None,
        shape: Sequence[int] | None = None,
        capacity: Sequence[int] | None = None,
    ) -> DeviceBinding:
        """A persistent buffer bound to ``input``, ``output`` or both (one buffer carrying
        state across runs), from the first provider with its own memory (host memory when
        none has). ``capacity`` (default ``shape``) may exceed the logical ``shape``; both
        default to the declared ones."""
        info = self._info_for(input, output)
        fallback = self.devices.get(self.providers[-1])
        return allocate_binding(info, input, output, self._spaces, fallback, dtype=dtype, shape=shape, capacity=capacity)

    def bind_array(self, array: np.ndarray, *, input: str | None = None, output: str | None = None) -> DeviceBinding:
        """Bind caller-owned host memory (a numpy array) to an input and/or output."""
        self._info_for(input, output)
        return bind_host_array(array, input, output, self._spaces, self.devices.get(self.providers[-1]))

    def _info_for(self, input: str | None, output: str | None) -> TensorInfo:
        return binding_info(self.inputs, self.outputs, input, output)

    # -- capture and replay --------------------------------------------------------------

    @typed_run_errors
    def try_capture(
        self,
        feeds: Mapping[str, Any] | None = None,
        *,
        bindings: Sequence[DeviceBinding] = (),
        slot: str = DEFAULT_SLOT,
    ) -> "Captured | NotCapturable":
        """Record the plan for these input shapes (and bindings) in ``slot`` so ``replay``
        can re-run it without checks or allocation; other slots are kept. Returns Captured
        (with a report of captured segments, eager seams and staged transfers) or
        NotCapturable (every node declined, with reasons)."""
        return self._captures.capture(
            slot,
            lambda: CapturedPlan(
                self._built, self._signature, self._output_names, self.selection.providers, dict(feeds or {}), bindings
            ),
        )

    @typed_run_errors
    def replay(
        self,
        feeds: Mapping[str, Any] | None = None,
        *,
        bindings: Sequence[DeviceBinding] | None = None,
        slot: str = DEFAULT_SLOT,
        copy_outputs: bool | None = None,
    ) -> ReplayResult:
        """Re-run the capture in ``slot``. ``feeds`` refill the captured input buffers (same
        shapes, else StaleCaptureError); bound inputs are read from their buffers as they
        are now. The result says whether it replayed or ran eagerly, and why.

        Host outputs are safe to keep by default: copies, whenever the slot is (or has
        been) replayed on a thread other than the one that captured it, so a thread pool
        can share one session. Only while the capturing thread alone replays the slot are
        they the capture's own buffers, which the next replay overwrites.
        ``copy_outputs=True`` always copies; ``copy_outputs=False`` asks for the buffers
        (zero-copy) and is refused off the capturing thread (CaptureThreadError)."""
        begin_run(self._intra_op_threads)
        return self._captures.replay(
            slot, dict(feeds or {}), bindings, lambda feeds, bound: self.run(feeds, bindings=bound), copy_outputs
        )

    def reset(self, slot: str | None = None) -> None:
        """Drop the capture in ``slot``, or every capture (before shapes change or bindings are freed)."""
        self._captures.reset(slot)

    @property
    def capture_report(self) -> "CaptureReport | None":
        """The report of the capture in the default slot (None when there is none)."""
        return self._captures.report(DEFAULT_SLOT)


def load(model: ModelSource, device: str | None = "auto", **options: Any) -> Session:
    """Build a session for ``model`` (a path, os.PathLike or bytes) on ``device``.

    ``device``: "auto", "cpu", "gpu", "gpu:N", "cuda:N", a provider name, or a policy
    ("prefer_cpu", "prefer_gpu", "prefer_npu", "max_performance", "min_power").
    Options are strict; see ``plugrt.options.OPTIONS``. ``providers=[...]`` gives an
    explicit ordered provider list instead of a device.
    """
    providers = options.pop("providers", None)
    registry = options.pop("registry", None)
    return Session(model, device=device, providers=providers, options=options, registry=registry)
