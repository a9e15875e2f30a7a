"""The session: build a model once for a device intent, then run it many times."""

from __future__ import annotations

import os
import time
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from . import passes
from ._guard import protect_inputs, tensor_limit, typed_load_errors, typed_run_errors
from .bindings import DeviceBinding, bound_feeds, deliver, deliver_outputs
from .build import BuiltGraph, build_graph
from .capture import DEFAULT_SLOT, Captured, CapturedPlan, CaptureReport, CaptureSlots, CaptureStats, ReplayResult
from .epcontext import export_context_model, required_providers, restore_context_nodes
from .errors import InvalidInputError, InvalidOptionValueError, OptionError, UnknownInputError
from .intent import Selection, resolve_device
from .ir_utils import tensor_array
from .loader import LoadLimits, ModelSource, load_model
from .options import SessionOptions, parse_options
from .placement import PlacementReport
from .provider import Device, DeviceKind, NotCapturable, memory_of
from .registry import ProviderRegistry, default_registry
from .signature import InputSignature, InputSpec, ModelMetadata, TensorInfo, model_metadata, tensor_info
from .threads import begin_run
from .transfers import MemorySpaces, TransferCounter

__all__ = ["TensorInfo", "ModelMetadata", "Session", "SessionBuilder", "load"]


class Session:
    """A model built for a device; ``run`` it many times.

    Use :func:`plugrt.load` or :class:`SessionBuilder` rather than this constructor.
    """

    @typed_load_errors
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
        limits = LoadLimits(
            model_bytes=self.options["limits.model_bytes"],
            tensor_bytes=self.options["limits.tensor_bytes"],
            nodes=self.options["limits.nodes"],
            subgraph_depth=self.options["limits.subgraph_depth"],
            context_bytes=self.options["limits.context_bytes"],
        )
        # this session's limit, set on the running thread at each run (0: every free core)
        self._intra_op_threads = self.options["intra_op_num_threads"]
        loaded = load_model(model, limits)
        self.model_path = loaded.source if loaded.base_dir else None
        self._model = loaded.model
        self.selection: Selection = resolve_device(device, providers, registry)
        ir_model = loaded.model

        # Metadata is read before passes change the graph.
        self.inputs: list[TensorInfo] = [tensor_info(v) for v in ir_model.graph.inputs]
        self.outputs: list[TensorInfo] = [tensor_info(v) for v in ir_model.graph.outputs]
        self.metadata: ModelMetadata = model_metadata(ir_model)

        opsets = {("" if d == "ai.onnx" else d): v for d, v in ir_model.opset_imports.items()}
        context_path = self.options["ep.context_file_path"]
        # a model given as bytes has no folder: blobs are read only from one named explicitly
        context_dir = loaded.base_dir or (os.path.dirname(os.path.abspath(context_path)) if context_path else "")
        restored = restore_context_nodes(
            ir_model.graph, registry, context_dir, opsets, max_blob_bytes=limits.context_bytes
        )
        if restored:
            needed = [p for p in required_providers(ir_model.graph, registry) if p not in self.selection.providers]
            # a context node runs only on the provider that made it: add it ahead of the fallback
            self.selection.providers[-1:-1] = needed
            for provider in needed:
                self.selection.devices.setdefault(provider.name, registry.devices(provider.name)[0])

        chosen = self.selection.providers
        passes.inline_functions(ir_model, chosen)
        passes.expand_unsupported_functions(ir_model, chosen)
        if len(chosen) > 1 or self.options["optimization"] == "all":
            # providers decide on dtypes, and the plan writes large elementwise results
            # in place: both need value types and shapes
            passes.infer_types(ir_model)
        # constants fold on the host fallback wherever the list puts it: an accelerator
        # listed last would evaluate few ops and leave every later pass nothing to fuse
        host = [p for p in chosen if self.selection.devices[p.name].kind == DeviceKind.CPU]
        fold_provider = host[-1] if host else (chosen[-1] if chosen else None)
        self.optimization_stats = passes.optimize(
            ir_model,
            self.options["optimization"],
            fold_provider,
            chosen,
            # a folded constant is no bigger than what every run would compute anyway
            max_fold_bytes=self.options["limits.tensor_bytes"],
        )
        # Unique node names: placement reports, errors and EPContext export refer to them.
        passes.name_nodes(ir_model)
        opsets = {("" if d == "ai.onnx" else d): v for d, v in ir_model.opset_imports.items()}
        self._spaces = MemorySpaces([m for m in map(memory_of, chosen) if m is not None])
        with tensor_limit(self.options["limits.tensor_bytes"]):  # kernel outputs above it are refused
            self._built: BuiltGraph = build_graph(
                ir_model.graph,
                chosen,
                opsets,
                registry=registry,
                strict=self.options["strict"],
                pinned=self.selection.pinned,
                profile=self.options["profiling"],
                devices=self.selection.devices,
                restored=restored,
                spaces=self._spaces,
            )
        self._plan = self._built.plan
        specs = []
        for info, value in zip(self.inputs, ir_model.graph.inputs):
            default = tensor_array(value.const_value) if value.const_value is not None else None
            home = self._built.input_homes.get(value)
            if default is not None and home is not None:  # an initializer input read on one device: moved once
                default = home.to_device(default, home.default_device)
            specs.append(InputSpec(info, default))
        self._signature = InputSignature(specs, self._spaces)
        self._output_names = [info.name for info in self.outputs]
        self._output_index = {name: i for i, name in enumerate(self._output_names)}
        self._captures = CaptureSlots()
        self.context_model_path: str | None = None
        if self.options["ep.context_enable"]:
            self.context_model_path = self._export_context(model)
        self.build_seconds = time.perf_counter() - started

    def _export_context(self, source: ModelSource) -> str:
        path = self.options["ep.context_file_path"]
        if path is None:
            if self.model_path is None:
                raise InvalidOptionValueError(
                    "ep.context_file_path", None, "a file path when the model is given as bytes"
                )
            stem, _ = os.path.splitext(self.model_path)
            path = f"{stem}_ctx.onnx"
        written, _ = export_context_model(self, path, self.options["ep.context_embed_mode"], source=self.model_path)
        return written

    # -- introspection ---------------------------------------------------------------------

    @property
    def initializer_inputs(self) -> list[str]:
        """Inputs that have an initializer as default (may be omitted or overridden)."""
        return [s.name for s in self._signature.specs if s.default is not None]

    @property
    def transfers(self) -> TransferCounter:
        """Copies between memory spaces so far (``snapshot()`` / ``since()`` for one run)."""
        return self._spaces.counter

    @property
    def capture_stats(self) -> CaptureStats:
        """Replays, eager fallbacks with their reasons, bytes allocated during replays."""
        return self._captures.stats

    def __repr__(self) -> str:
        model = self.model_path or f"<{self.metadata.graph_name or 'model'} given as bytes>"
        nodes = ", ".join(f"{p}: {n}" for p, n in self.placement.nodes_per_provider.items())
        return f"Session(model={model!r}, providers={self.providers}, placement={{{nodes}}})"

    @property
    def placement(self) -> PlacementReport:
        """Where each node runs, fallbacks with their reasons, and transfers."""
        return self._built.report

    @property
    def providers(self) -> list[str]:
        """The providers this session uses, in priority order."""
        return [p.name for p in self.selection.providers]

    @property
    def devices(self) -> dict[str, Device]:
        return dict(self.selection.devices)

    @property
    def compiled_partitions(self) -> list:
        """The compiled partitions, in execution order (restored ones included)."""
        return list(self._built.compiled)

    @property
    def model(self) -> ir.Model:
        """The model as built: after inlining, expansion and optimisation passes."""
        return self._model

    def rebuilt_with(self, replacements: Mapping[str, Any]) -> "Session":
        """A copy of this session whose partitions named in ``replacements`` are the given
        compiled partitions (e.g. restored from an EPContext); the rest are reused."""
        compiled = [replacements.get(cp.partition.name, cp) for cp in self._built.compiled]
        clone = object.__new__(Session)
        clone.__dict__.update(self.__dict__)
        opsets = {("" if d == "ai.onnx" else d): v for d, v in self._model.opset_imports.items()}
        clone._built = build_graph(
            self._model.graph,
            self.selection.providers,
            opsets,
            registry=self.registry,
            precompiled=compiled,
            profile=self.options["profiling"],
            devices=self.selection.devices,
            spaces=self._spaces,
        )
        clone._plan = clone._built.plan
        clone._signature = InputSignature(self._signature.specs, self._spaces)
        clone._captures = CaptureSlots()
        return clone

    @property
    def plan_source(self) -> str:
        """The generated Python of the execution plan (for debugging)."""
        return self._plan.source

    def profile(self) -> list[dict]:
        """Chrome-trace events of the runs so far (needs ``profiling=True``)."""
        records = self._plan.profile_records
        if records is None:
            raise OptionError("profiling is off; build the session with profiling=True", key="profiling")
        infos = self._plan.infos
        return [
            {
                "name": infos[i].name,
                "cat": infos[i].op_type,
                "ph": "X",
                "ts": start * 1e6,
                "dur": (end - start) * 1e6,
                "pid": os.getpid(),
                "tid": 0,
                "args": {"provider": infos[i].provider, "op_type": infos[i].op_type},
            }
            for i, start, end in records
        ]

    # -- running ---------------------------------------------------------------------------

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
        begin_run(self._intra_op_threads)
        if bindings:
            feeds = bound_feeds(feeds, bindings)
        args = self._signature.arguments(feeds or {})
        values = self._plan.run(*(args if bindings else protect_inputs(args)))
        if bindings:
            return deliver_outputs(self._output_names, values, bindings, args, self._spaces)
        if output_names is None:
            return {name: deliver(v, args, self._spaces) for name, v in zip(self._output_names, values)}
        return {name: deliver(values[self._output_index_of(name)], args, self._spaces) for name in output_names}

    def run_list(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any]) -> list:
        begin_run(self._intra_op_threads)
        args = self._signature.arguments(feeds)
        values = self._plan.run(*protect_inputs(args))
        if not output_names:
            return [deliver(v, args, self._spaces) for v in values]
        return [deliver(values[self._output_index_of(name)], args, self._spaces) for name in output_names]

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
        dtype = np.dtype(dtype if dtype is not None else info.dtype)
        if shape is None:
            if info.shape is None or not all(isinstance(d, int) for d in info.shape):
                raise InvalidInputError(f"binding {info.name!r} has symbolic dims {info.shape}; pass shape=", input_name=input)
            shape = [int(d) for d in info.shape]  # type: ignore[arg-type]
        capacity = tuple(capacity) if capacity is not None else tuple(shape)
        memory = self._spaces.memories[0] if self._spaces else None
        device = memory.default_device if memory is not None else self.devices.get(self.providers[-1])
        buffer = memory.allocate(capacity, dtype, device) if memory is not None else np.zeros(capacity, dtype)
        return DeviceBinding(
            input=input, output=output, buffer=buffer, shape=shape, device=device, memory=memory, spaces=self._spaces
        )

    def bind_array(self, array: np.ndarray, *, input: str | None = None, output: str | None = None) -> DeviceBinding:
        """Bind caller-owned host memory (a numpy array) to an input and/or output."""
        self._info_for(input, output)
        if not isinstance(array, np.ndarray):
            raise InvalidInputError("bind_array needs a numpy array", input_name=input)
        device = self.devices.get(self.providers[-1])
        return DeviceBinding(
            input=input, output=output, buffer=array, shape=array.shape, device=device, spaces=self._spaces,
            caller_owned=True,
        )

    def _info_for(self, input: str | None, output: str | None) -> TensorInfo:
        if input is None and output is None:
            raise InvalidInputError("name an input, an output, or both")
        if input is not None and input not in self._signature.names:
            raise UnknownInputError(input, self._signature.names)
        if output is not None and output not in self._output_index:
            raise InvalidInputError(f"unknown output {output!r}; the model's outputs are {self._output_names}")
        if input is not None:
            return self.inputs[self._signature.names.index(input)]
        return self.outputs[self._output_index[output]]  # type: ignore[index]

    # -- capture and replay --------------------------------------------------------------

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
        with self._captures.lock:
            self._captures.slots.pop(slot, None)
            captured = CapturedPlan(
                self._built, self._signature, self._output_names, self.selection.providers, dict(feeds or {}), bindings
            )
            if not captured.report.segments:
                return NotCapturable(captured.report.seams)
            self._captures.slots[slot] = captured
            return Captured(captured.report)

    def replay(
        self,
        feeds: Mapping[str, Any] | None = None,
        *,
        bindings: Sequence[DeviceBinding] | None = None,
        slot: str = DEFAULT_SLOT,
    ) -> ReplayResult:
        """Re-run the capture in ``slot``. ``feeds`` refill the captured input buffers (same
        shapes, else StaleCaptureError); bound inputs are read from their buffers as they
        are now. The result says whether it replayed or ran eagerly, and why."""
        begin_run(self._intra_op_threads)
        return self._captures.replay(
            slot, dict(feeds or {}), bindings, lambda feeds, bound: self.run(feeds, bindings=bound)
        )

    def reset(self, slot: str | None = None) -> None:
        """Drop the capture in ``slot``, or every capture (required before shapes change
        or bindings are freed)."""
        with self._captures.lock:
            if slot is None:
                self._captures.slots.clear()
            else:
                self._captures.slots.pop(slot, None)

    @property
    def capture_report(self) -> "CaptureReport | None":
        captured = self._captures.slots.get(DEFAULT_SLOT)
        return captured.report if captured is not None else None


class SessionBuilder:
    """Fluent construction: ``SessionBuilder().model(p).device("gpu").option(k, v).build()``."""

    def __init__(self) -> None:
        self._model: ModelSource | None = None
        self._device: str | None = "auto"
        self._providers: list[str] | None = None
        self._options: dict[str, Any] = {}
        self._warmup: int = 0
        self._registry: ProviderRegistry | None = None

    def model(self, path: str | os.PathLike) -> "SessionBuilder":
        self._model = path
        return self

    def model_bytes(self, data: bytes) -> "SessionBuilder":
        self._model = bytes(data)
        return self

    def device(self, device: str) -> "SessionBuilder":
        self._device = device
        return self

    def provider(self, name: str) -> "SessionBuilder":
        """Add an explicit provider (in priority order); the CPU fallback is added last."""
        self._providers = (self._providers or []) + [name]
        return self

    def option(self, key: str, value: Any) -> "SessionBuilder":
        self._options[key] = value
        return self

    def options(self, **options: Any) -> "SessionBuilder":
        self._options.update(options)
        return self

    def registry(self, registry: ProviderRegistry) -> "SessionBuilder":
        self._registry = registry
        return self

    def warmup(self, runs: int = 1) -> "SessionBuilder":
        """Run the model ``runs`` times on inputs of the declared shapes after building."""
        self._warmup = runs
        return self

    def build(self) -> Session:
        if self._model is None:
            raise OptionError("SessionBuilder needs a model: call .model(path) or .model_bytes(data)", key="model")
        session = Session(
            self._model,
            device=self._device,
            providers=self._providers,
            options=self._options,
            registry=self._registry,
        )
        if self._warmup:
            from .inputs import example_inputs

            feeds = example_inputs(session.inputs)
            for _ in range(self._warmup):
                session.run(feeds)
        return session


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
