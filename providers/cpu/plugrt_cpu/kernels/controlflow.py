"""Control-flow kernels with subgraphs: If, Loop, Scan.

Every subgraph is compiled once, in the builder, into a runner
(``run(inputs: list, outer: dict) -> list``). A step receives the node's declared
inputs followed by the values of ``ctx.implicit_inputs`` (the outer-scope values its
subgraphs read); each call zips the latter into the ``outer`` mapping the runners take.

The opset versions of If and Loop (11, 13, 16, 19, 21, 23, 24, 25) only widen the
accepted types, so one kernel serves them all; Scan 8 (batch axis 0, sequence axis 1,
``sequence_lens``, ``directions``) differs from Scan 9+ (``scan_input_axes``,
``scan_input_directions``, ``scan_output_axes``, ``scan_output_directions``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._dtypes import numpy_dtype
from .._registry import KernelContext, kernel_builder


def _as_bool(value: Any, what: str) -> bool:
    array = np.asarray(value)
    if array.size != 1:
        raise ValueError(f"{what} must hold exactly one element, got shape {array.shape}")
    return bool(array.reshape(-1)[0])


def _as_int(value: Any, what: str) -> int:
    array = np.asarray(value)
    if array.size != 1:
        raise ValueError(f"{what} must hold exactly one element, got shape {array.shape}")
    return int(array.reshape(-1)[0])


def _element_type(value) -> tuple[np.dtype, tuple[int, ...] | None]:
    """The numpy dtype and static shape (symbolic dims as 0; None when the rank is
    unknown) of a subgraph output, for scan outputs of a loop that never ran."""
    dtype = np.dtype(np.float32)
    if value.dtype is not None:
        try:
            dtype = np.dtype(numpy_dtype(int(value.dtype)))
        except (ValueError, TypeError):
            pass
    shape = value.shape
    if shape is None:
        return dtype, None
    dims = tuple(d if isinstance(d, int) else 0 for d in shape)
    return dtype, dims


def _subgraph(ctx: KernelContext, name: str):
    graph = ctx.attributes.get(name)
    if graph is None:
        raise NotImplementedError(f"{ctx.op_type} needs the graph attribute {name!r}")
    if ctx.compile_subgraph is None:
        raise RuntimeError(f"{ctx.op_type} needs a provider that compiles subgraphs")
    return ctx.compile_subgraph(graph)


# -- If ---------------------------------------------------------------------------------


@kernel_builder("If", 1, multi_output=True, data_dependent=True)
def if_(ctx: KernelContext):
    then_runner = _subgraph(ctx, "then_branch")
    else_runner = _subgraph(ctx, "else_branch")
    names = ctx.implicit_inputs

    def run(cond, *implicit):
        outer = dict(zip(names, implicit))
        runner = then_runner if _as_bool(cond, "If's cond") else else_runner
        return runner.run([], outer)

    return run


# -- Loop -------------------------------------------------------------------------------


@kernel_builder("Loop", 1, multi_output=True, data_dependent=True)
def loop(ctx: KernelContext):
    body = _subgraph(ctx, "body")
    names = ctx.implicit_inputs
    num_declared = ctx.num_inputs
    n_carried = len(body.input_names) - 2
    if n_carried < 0:
        raise NotImplementedError("Loop's body must take at least the iteration number and the condition")
    n_scan = len(body.output_names) - 1 - n_carried
    if n_scan < 0:
        raise NotImplementedError(
            f"Loop's body returns {len(body.output_names)} outputs, fewer than 1 + {n_carried} loop-carried values"
        )
    if num_declared - 2 > n_carried:
        raise NotImplementedError(
            f"Loop has {num_declared - 2} loop-carried inputs but its body takes {n_carried}"
        )
    scan_types = [_element_type(v) for v in body.graph.outputs[1 + n_carried:]]

    def run(*args):
        declared = args[:num_declared]
        outer = dict(zip(names, args[num_declared:]))
        trip = declared[0] if len(declared) > 0 else None
        cond = declared[1] if len(declared) > 1 else None
        carried = list(declared[2:])
        if len(carried) < n_carried:
            raise ValueError(f"Loop needs {n_carried} loop-carried inputs, got {len(carried)}")
        max_trip = None if trip is None else _as_int(trip, "Loop's M")
        # With no cond input the body's condition output is ignored (spec pseudo-code).
        use_cond = cond is not None
        keep_going = _as_bool(cond, "Loop's cond") if use_cond else True
        scans: list[list[Any]] = [[] for _ in range(n_scan)]
        it = 0
        while keep_going and (max_trip is None or it < max_trip):
            outs = body.run([np.array(it, dtype=np.int64), np.array(keep_going), *carried], outer)
            if use_cond:
                keep_going = _as_bool(outs[0], "Loop body's cond output")
            carried = outs[1:1 + n_carried]
            for k in range(n_scan):
                scans[k].append(outs[1 + n_carried + k])
            it += 1
        results = list(carried)
        for k in range(n_scan):
            if scans[k]:
                results.append(np.stack([np.asarray(v) for v in scans[k]]))
            else:
                dtype, dims = scan_types[k]
                results.append(np.empty((0,) + (dims or ()), dtype=dtype))
        return results

    return run


# -- Scan -------------------------------------------------------------------------------


def _scan_attr(values: list[int] | None, count: int, default: int, what: str) -> list[int]:
    if values is None:
        return [default] * count
    values = list(values)
    if len(values) != count:
        raise NotImplementedError(f"Scan's {what} has {len(values)} entries, expected {count}")
    return values


@kernel_builder("Scan", 9, multi_output=True, data_dependent=True)
def scan(ctx: KernelContext):
    body = _subgraph(ctx, "body")
    names = ctx.implicit_inputs
    num_declared = ctx.num_inputs
    m = ctx.attributes.get("num_scan_inputs")
    if m is None or m <= 0:
        raise NotImplementedError("Scan needs num_scan_inputs > 0")
    n = num_declared - m
    if n < 0 or len(body.input_names) != n + m:
        raise NotImplementedError(
            f"Scan has {num_declared} inputs with num_scan_inputs={m}, but its body takes {len(body.input_names)}"
        )
    k = len(body.output_names) - n
    if k < 0:
        raise NotImplementedError(f"Scan's body returns fewer outputs than its {n} state variables")
    in_axes = _scan_attr(ctx.attributes.get("scan_input_axes"), m, 0, "scan_input_axes")
    in_dirs = _scan_attr(ctx.attributes.get("scan_input_directions"), m, 0, "scan_input_directions")
    out_axes = _scan_attr(ctx.attributes.get("scan_output_axes"), k, 0, "scan_output_axes")
    out_dirs = _scan_attr(ctx.attributes.get("scan_output_directions"), k, 0, "scan_output_directions")
    for d in in_dirs + out_dirs:
        if d not in (0, 1):
            raise NotImplementedError(f"Scan direction {d} is not 0 (forward) or 1 (reverse)")
    scan_types = [_element_type(v) for v in body.graph.outputs[n:]]

    def run(*args):
        declared = args[:num_declared]
        outer = dict(zip(names, args[num_declared:]))
        states = list(declared[:n])
        sequences = []
        length = None
        for j, x in enumerate(declared[n:]):
            x = np.asarray(x)
            axis = in_axes[j] + x.ndim if in_axes[j] < 0 else in_axes[j]
            if not 0 <= axis < x.ndim:
                raise ValueError(f"Scan input {j}: axis {in_axes[j]} out of range for rank {x.ndim}")
            x = np.moveaxis(x, axis, 0) if axis else x
            if in_dirs[j]:
                x = x[::-1]
            if length is None:
                length = x.shape[0]
            elif x.shape[0] != length:
                raise ValueError(f"Scan inputs have different sequence lengths ({length} and {x.shape[0]})")
            sequences.append(x)
        outputs: list[list[Any]] = [[] for _ in range(k)]
        for t in range(length):
            outs = body.run(states + [x[t] for x in sequences], outer)
            states = outs[:n]
            for j in range(k):
                outputs[j].append(outs[n + j])
        results = list(states)
        for j in range(k):
            if outputs[j]:
                elems = outputs[j][::-1] if out_dirs[j] else outputs[j]
                rank = np.ndim(elems[0]) + 1
                axis = out_axes[j] + rank if out_axes[j] < 0 else out_axes[j]
                if not 0 <= axis < rank:
                    raise ValueError(f"Scan output {j}: axis {out_axes[j]} out of range for rank {rank}")
                results.append(np.stack([np.asarray(e) for e in elems], axis=axis))
            else:
                dtype, dims = scan_types[j]
                dims = list(dims or ())
                axis = out_axes[j] + len(dims) + 1 if out_axes[j] < 0 else out_axes[j]
                dims.insert(min(max(axis, 0), len(dims)), 0)
                results.append(np.empty(tuple(dims), dtype=dtype))
        return results

    return run


@kernel_builder("Scan", 8, multi_output=True, data_dependent=True)
def scan8(ctx: KernelContext):
    body = _subgraph(ctx, "body")
    names = ctx.implicit_inputs
    num_declared = ctx.num_inputs
    m = ctx.attributes.get("num_scan_inputs")
    if m is None or m <= 0:
        raise NotImplementedError("Scan needs num_scan_inputs > 0")
    n = num_declared - 1 - m
    if n < 0 or len(body.input_names) != n + m:
        raise NotImplementedError(
            f"Scan-8 has {num_declared} inputs with num_scan_inputs={m}, but its body takes {len(body.input_names)}"
        )
    k = len(body.output_names) - n
    if k < 0:
        raise NotImplementedError(f"Scan's body returns fewer outputs than its {n} state variables")
    dirs = _scan_attr(ctx.attributes.get("directions"), m, 0, "directions")
    for d in dirs:
        if d not in (0, 1):
            raise NotImplementedError(f"Scan direction {d} is not 0 (forward) or 1 (reverse)")
    scan_types = [_element_type(v) for v in body.graph.outputs[n:]]

    def run(*args):
        declared = list(args[:num_declared])
        while len(declared) < num_declared:
            declared.append(None)
        outer = dict(zip(names, args[num_declared:]))
        seq_lens = declared[0]
        states = [np.asarray(s) if not isinstance(s, list) else s for s in declared[1:1 + n]]
        inputs = [np.asarray(x) for x in declared[1 + n:]]
        for x in inputs:
            if x.ndim < 2:
                raise ValueError(f"Scan-8 inputs need a batch and a sequence axis, got rank {x.ndim}")
        batch, max_len = inputs[0].shape[:2]
        for x in inputs[1:]:
            if x.shape[:2] != (batch, max_len):
                raise ValueError("Scan-8 inputs have different batch sizes or sequence lengths")
        if seq_lens is None:
            lens = [max_len] * batch
        else:
            lens = [int(v) for v in np.asarray(seq_lens).reshape(-1)]
            if len(lens) != batch or any(not 0 <= v <= max_len for v in lens):
                raise ValueError(f"Scan-8 sequence_lens {lens} do not fit batch {batch}, max length {max_len}")
        final_states: list[list[Any]] = [[] for _ in range(n)]
        per_batch: list[list[list[Any]]] = [[] for _ in range(k)]  # [output][batch][t]
        for b in range(batch):
            state = [s[b] for s in states]
            length = lens[b]
            outputs: list[list[Any]] = [[] for _ in range(k)]
            for t in range(length):
                elems = [x[b, length - 1 - t] if dirs[j] else x[b, t] for j, x in enumerate(inputs)]
                outs = body.run(state + elems, outer)
                state = outs[:n]
                for j in range(k):
                    outputs[j].append(np.asarray(outs[n + j]))
            for i in range(n):
                final_states[i].append(state[i])
            for j in range(k):
                per_batch[j].append(outputs[j])
        results: list[Any] = []
        for i in range(n):
            results.append(np.stack(final_states[i]) if batch else states[i])
        for j in range(k):
            sample = next((o[0] for o in per_batch[j] if o), None)
            if sample is None:
                dtype, dims = scan_types[j]
                results.append(np.zeros((batch, max_len) + (dims or ()), dtype=dtype))
                continue
            rows = []
            for o in per_batch[j]:
                if len(o) == max_len:
                    rows.append(np.stack(o))
                else:  # a shorter sequence: padded with zeros to the maximum length
                    row = np.zeros((max_len,) + sample.shape, dtype=sample.dtype)
                    if o:
                        row[: len(o)] = np.stack(o)
                    rows.append(row)
            results.append(np.stack(rows))
        return results

    return run
