"""The execution plan: compiled steps turned into one straight-line Python function.

Each value lives in a local variable of a generated function (the fastest slot Python
has); each step is one call of a bound kernel; a value is deleted right after its last
use. The per-node cost is therefore one Python call, which is what the bare numpy loop
pays too. Errors are mapped back to the step that raised through the traceback's line
number, so the hot path carries no bookkeeping at all.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import onnx_ir as ir

from .errors import KernelError, OptionError, PlugrtError, UnsupportedOpError
from .provider import Step
from .tracing import PROFILING_OFF, complete_event, micros, node_event

__all__ = ["Plan", "StepInfo"]

_plan_ids = itertools.count()

#: Below this many elements an in-place step is not worth its guard (about 1 us).
INPLACE_MIN_ELEMENTS = 1 << 14

#: A profiled plan stops recording after this many records (onnxruntime's profiler stops
#: at a million events too): a long-running profiled session must not grow without bound.
PROFILE_RECORD_LIMIT = 1_000_000


class _Discard:
    """Where a profiled plan's records go once the limit is reached."""

    def append(self, record: tuple) -> None:
        pass


def _tensors(*values: Any) -> tuple:
    """What the profile keeps of a step's inputs or outputs: (dtype, shape, bytes) of each
    tensor, None for anything else (a sequence, a scalar): never the arrays themselves."""
    return tuple([(v.dtype, v.shape, v.nbytes) if hasattr(v, "nbytes") else None for v in values])


@functools.cache
def _local_references() -> int:
    """How many references a plan-local array has inside the kernel it is passed to
    (the plan's local, the parameter, getrefcount's argument). Measured, not assumed:
    it depends on the interpreter."""
    namespace: dict[str, Any] = {"np": np, "k": lambda x: sys.getrefcount(x)}
    exec("def probe():\n    v0 = np.empty(4)\n    v1 = k(v0)\n    del v0\n    return v1\n", namespace)
    return namespace["probe"]()


def _in_place(fn: Callable[..., Any], inplace: Callable[..., Any], keeps_first: bool = False) -> Callable[..., Any]:
    """``fn``, except that when its first argument is an array no one else can see (it
    owns its memory, only the plan's dying local refers to it) and the result has its
    shape and dtype, the result is written over it: no allocation, one buffer less.
    ``keeps_first``: the result always has the first argument's shape and dtype (see
    ``Step.inplace_keeps_first``), so the other arguments are not looked at."""
    ndarray, getrefcount, broadcast_shapes = np.ndarray, sys.getrefcount, np.broadcast_shapes
    references = _local_references()

    def run(x, *rest):
        if (
            type(x) is ndarray
            and x.size >= INPLACE_MIN_ELEMENTS
            and x.base is None
            and getrefcount(x) == references
            and x.flags.writeable
            and (
                keeps_first
                or all(type(r) is ndarray and r.dtype == x.dtype for r in rest)
                and (all(r.shape == x.shape for r in rest) or broadcast_shapes(x.shape, *[r.shape for r in rest]) == x.shape)
            )
        ):
            inplace(x, x, *rest)
            return x
        return fn(x, *rest)

    return run


def _may_be_large(value: ir.Value) -> bool:
    """Whether a value can reach INPLACE_MIN_ELEMENTS, judging by its inferred shape."""
    shape = value.shape
    if shape is None:
        return False
    known = 1
    for dim in shape:
        if isinstance(dim, int):
            known *= dim
    symbolic = any(not isinstance(d, int) for d in shape)
    return known >= INPLACE_MIN_ELEMENTS or (symbolic and known >= 64)


class StepInfo:
    """What the plan remembers about a step for error messages, profiles and reports."""

    __slots__ = ("name", "op_type", "provider", "domain", "opset", "nodes")

    def __init__(self, name: str, op_type: str, provider: str, domain: str = "", opset: int = 0, nodes=()):
        self.name = name
        self.op_type = op_type
        self.provider = provider
        self.domain = domain
        self.opset = opset
        self.nodes = tuple(nodes)


class Plan:
    """Runs ``steps`` over values: ``run(*inputs) -> list of outputs``.

    ``inputs``: the values the caller supplies, in order (graph inputs, then outer-scope
    values for a subgraph). ``constants``: values with a fixed array (initializers).
    ``outputs``: the values returned, in order.
    """

    def __init__(
        self,
        inputs: Sequence[ir.Value],
        outputs: Sequence[ir.Value],
        steps: Sequence[Step],
        constants: dict[ir.Value, Any],
        step_infos: Sequence[StepInfo],
        *,
        profile: bool = False,
    ) -> None:
        self.inputs = list(inputs)
        self.input_positions = {value.name: i for i, value in enumerate(self.inputs)}
        self.outputs = list(outputs)
        self.steps = list(steps)
        self.infos = list(step_infos)
        # (step, start, end, thread, inputs, outputs) per kernel run and (-1, start, end,
        # thread, (), ()) per run, when profiling
        self.profile_records: list[tuple] | None = [] if profile else None
        self.exported_records = 0  # records already sent to OpenTelemetry
        # per step, whether each of its present inputs is a constant (a parameter), when profiling
        self.parameter_inputs: list[tuple[bool, ...]] = []
        self._constants = constants
        # which of a session's plans this is, named in its profile's model_run events (a
        # session that starts on the CPU while its device plan compiles has two)
        self.label = ""
        self._fn, self._line_to_step, self.source = self._generate(profile)
        # generated again for each set of outputs stored as soon as they are final (run_storing)
        self._storing: dict[tuple[tuple[int, int | None], ...], tuple[Callable[..., list], dict[int, int]]] = {}

    def profiled(self) -> "Plan":
        """The same steps generated again with the recording lines of a profiled plan (an
        unprofiled plan carries none, so that its runs pay nothing for profiling)."""
        plan = Plan(self.inputs, self.outputs, self.steps, self._constants, self.infos, profile=True)
        plan.label = self.label
        return plan

    @property
    def constants(self) -> dict[ir.Value, Any]:
        """Values with a fixed array (initializers), as the plan binds them."""
        return dict(self._constants)

    # -- code generation -------------------------------------------------------------------

    def _generate(
        self, profile: bool, stores: Sequence[tuple[int, int | None]] = ()
    ) -> tuple[Callable[..., list], dict[int, int], str]:
        """The plan's function. ``stores``: (output index, input index or None) pairs: the
        function then takes a tuple of store functions first, one per pair, and hands each
        such output to its store as soon as it is final (made, read by no later step, and
        the paired input read by no later step either), returning None in its place."""
        names: dict[ir.Value, str] = {}
        env: dict[str, Any] = {}
        counter = itertools.count()

        def local(value: ir.Value) -> str:
            name = names.get(value)
            if name is None:
                name = f"v{next(counter)}"
                names[value] = name
            return name

        params = [local(v) for v in self.inputs]
        for value, array in self._constants.items():
            if value not in names:
                cname = f"c{next(counter)}"
                names[value] = cname
                env[cname] = array

        # Last use of each value, so it can be released right after.
        last_use: dict[ir.Value, int] = {}
        for index, step in enumerate(self.steps):
            for read in step.inputs:
                if read is not None:
                    last_use[read] = index
        keep = set(self.outputs)
        is_constant = set(self._constants)
        releases: dict[int, list[str]] = {}
        for value, index in last_use.items():
            if value not in keep and value not in is_constant:
                releases.setdefault(index, []).append(local(value))
        for index, step in enumerate(self.steps):
            for output in step.outputs:
                if output is not None and output not in last_use and output not in keep:
                    releases.setdefault(index, []).append(local(output))

        # where each stored output goes to its store: after the step from which nothing reads it
        # (nor the input whose memory the store may overwrite)
        produced = {v: i for i, step in enumerate(self.steps) for v in step.outputs if v is not None}
        store_after: dict[int, list[tuple[int, ir.Value]]] = {}
        for slot, (position, paired) in enumerate(stores):
            value = self.outputs[position]
            if value not in produced or sum(v is value for v in self.outputs) != 1:
                continue  # an input or constant passed through, or an output listed twice: stored after the run
            point = max(produced[value], last_use.get(value, -1))
            if paired is not None:
                point = max(point, last_use.get(self.inputs[paired], -1))
            store_after.setdefault(point, []).append((slot, value))
        if stores:
            params = ["_stores", *params]

        lines = [f"def _plan({', '.join(params)}):"]
        line_to_step: dict[int, int] = {}
        if profile:
            env.update(
                _clock=time.perf_counter,
                _records=self.profile_records,
                _limit=PROFILE_RECORD_LIMIT,
                _discard=_Discard(),
                _thread=threading.get_native_id,
                _tensors=_tensors,
            )
            lines.append("    _rec = _records if len(_records) < _limit else _discard")
            lines.append("    _tid = _thread()")
            lines.append("    _t0 = _clock()")
        plan_inputs = set(self.inputs)
        for index, step in enumerate(self.steps):
            kname = f"k{index}"
            env[kname] = step.fn
            first = step.inputs[0] if step.inputs else None
            if (
                step.inplace is not None
                and not step.multi_output
                and first is not None
                and last_use.get(first) == index
                and first not in keep
                and first not in is_constant
                and first not in plan_inputs
                and sum(v is first for v in step.inputs) == 1
                and _may_be_large(first)
            ):
                env[kname] = _in_place(step.fn, step.inplace, step.inplace_keeps_first)
            args = ", ".join("None" if v is None else local(v) for v in step.inputs)
            outs = [local(v) if v is not None else "_" for v in step.outputs]
            call = f"{kname}({args})"
            if step.multi_output:
                target = ", ".join(outs) + ("," if len(outs) == 1 else "")
                call = f"{call}[:{len(outs)}]"
            else:
                target = outs[0] if outs else "_"
            if profile:
                lines.append("    _t = _clock()")
            line_to_step[len(lines) + 1] = index
            lines.append(f"    {target} = {call}")
            if profile:
                present = [v for v in step.inputs if v is not None]
                self.parameter_inputs.append(tuple(v in is_constant for v in present))
                reads = ", ".join(local(v) for v in present)
                writes = ", ".join(o for o in outs if o != "_")
                lines.append(f"    _rec.append(({index}, _t, _clock(), _tid, _tensors({reads}), _tensors({writes})))")
            dead = releases.get(index)
            if dead:
                lines.append(f"    del {', '.join(dead)}")
            for slot, value in store_after.get(index, ()):
                lines.append(f"    _stores[{slot}]({local(value)}); {local(value)} = None")
        outputs = []
        for value in self.outputs:
            if value not in names:
                raise PlugrtError(f"plan output {value.name!r} is computed by no step")
            outputs.append(names[value])
        if profile:
            lines.append("    _rec.append((-1, _t0, _clock(), _tid, (), ()))")
        lines.append(f"    return [{', '.join(outputs)}]")
        source = "\n".join(lines) + "\n"
        filename = f"<plugrt-plan-{next(_plan_ids)}>"
        code = compile(source, filename, "exec")
        namespace: dict[str, Any] = dict(env)
        exec(code, namespace)
        fn = namespace["_plan"]
        return fn, line_to_step, source

    def chrome_trace(self, origin: float = 0.0) -> list[dict]:
        """The runs so far as onnxruntime's profile events: a ``model_run`` event per run
        and a ``<node>_kernel_time`` event per step, ``ts`` in microseconds after ``origin``
        (a ``perf_counter`` reading). The plan must be built with ``profile``."""
        records = self.profile_records
        if records is None:
            raise OptionError(PROFILING_OFF, key="profiling")
        pid = os.getpid()
        infos, parameters = self.infos, self.parameter_inputs
        events = []
        for record in records:
            index, start, end, tid = record[:4]
            if index < 0:
                args = {"plan": self.label} if self.label else {}
                events.append(complete_event("model_run", "Session", pid, tid, start, end, origin, args))
                continue
            info = infos[index]
            events.append(node_event(origin, pid, info.name, info.op_type, info.provider, record, parameters[index]))
        if len(records) >= PROFILE_RECORD_LIMIT:
            last = max(record[2] for record in records)
            events.append(
                {
                    "cat": "Session",
                    "pid": pid,
                    "tid": records[-1][3],
                    "ts": micros(last, origin),
                    "ph": "i",
                    "s": "g",
                    "name": "profiling_limit_reached",
                    "args": {"records": PROFILE_RECORD_LIMIT},
                }
            )
        return events

    # -- running -----------------------------------------------------------------------

    def run(self, *args: Any) -> list:
        return self._call(self._fn, self._line_to_step, args)

    def run_storing(self, stores: Sequence[tuple[int, int | None, Callable[[Any], None]]], *args: Any) -> list:
        """``run``, handing each output named in ``stores`` (output index, the index of an
        input whose memory its store may overwrite or None, the store) to its store as soon
        as it is final, so that it need not stay alive to the end of the run (a KV cache's
        presents, stored into their bindings). Those outputs come back as None, except one
        the plan does not make (an input passed through, an output listed twice): that one
        comes back for the caller to store. A run that fails may have stored some."""
        key = tuple((output, paired) for output, paired, _ in stores)
        generated = self._storing.get(key)
        if generated is None:
            fn, line_to_step, _ = self._generate(self.profile_records is not None, key)
            generated = self._storing[key] = (fn, line_to_step)
        fn, line_to_step = generated
        return self._call(fn, line_to_step, (tuple(store for _, _, store in stores), *args))

    def _call(self, fn: Callable[..., list], line_to_step: dict[int, int], args: tuple) -> list:
        """``fn(*args)``, one of this plan's functions, its errors mapped to the step that
        raised them."""
        try:
            return fn(*args)
        except PlugrtError:
            raise  # already typed and naming its node (e.g. raised inside a subgraph)
        except Exception as exc:
            index = self._failed_step(exc, fn, line_to_step)
            if index is None:
                raise
            raise self._wrap(index, exc) from exc

    def _failed_step(self, exc: BaseException, fn: Callable[..., list], line_to_step: dict[int, int]) -> int | None:
        tb = exc.__traceback__
        code = fn.__code__
        while tb is not None:
            if tb.tb_frame.f_code is code:
                return line_to_step.get(tb.tb_lineno)
            tb = tb.tb_next
        return None

    def _wrap(self, index: int, exc: BaseException) -> PlugrtError:
        info = self.infos[index]
        if isinstance(exc, NotImplementedError):
            return UnsupportedOpError(
                info.domain,
                info.op_type,
                info.opset,
                node=info.name,
                providers_consulted=[info.provider],
                reasons={info.provider: str(exc) or "not implemented for these inputs"},
            )
        return KernelError(info.name, info.op_type, info.provider, exc)
