"""Sequence and optional kernels: Sequence*, SplitToSequence, ConcatFromSequence, Optional*.

A sequence is a Python list of numpy arrays (never mutated in place: every op that
changes one returns a new list); an empty optional is ``None`` and a non-empty optional
is its value (a tensor or a list). The later opset versions of these ops (SplitToSequence
24, Optional* 18/28) only widen the accepted types, except OptionalHasElement 18 and
OptionalGetElement 18, which also accept a plain tensor or sequence; one kernel each
covers every version.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._registry import KernelContext, kernel, kernel_builder


def _index(value: Any, what: str) -> int:
    array = np.asarray(value)
    if array.size != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"{what} must be a single integer, got {array.dtype} of shape {array.shape}")
    return int(array.reshape(-1)[0])


def _sequence(value: Any, op: str) -> list:
    if not isinstance(value, list):
        raise TypeError(f"{op} expects a sequence, got {type(value).__name__}")
    return value


@kernel("SequenceConstruct", 11)
def sequence_construct(*inputs):
    return list(inputs)


@kernel("SequenceEmpty", 11)
def sequence_empty(*, dtype=None):
    return []


@kernel("SequenceLength", 11)
def sequence_length(seq):
    return np.array(len(_sequence(seq, "SequenceLength")), dtype=np.int64)


@kernel("SequenceAt", 11)
def sequence_at(seq, position):
    seq = _sequence(seq, "SequenceAt")
    i = _index(position, "SequenceAt's position")
    if not -len(seq) <= i < len(seq):
        raise IndexError(f"SequenceAt position {i} is out of range for a sequence of {len(seq)}")
    return seq[i]


@kernel("SequenceInsert", 11)
def sequence_insert(seq, tensor, position=None):
    seq = _sequence(seq, "SequenceInsert")
    n = len(seq)
    i = n if position is None else _index(position, "SequenceInsert's position")
    if not -n <= i <= n:
        raise IndexError(f"SequenceInsert position {i} is out of range [-{n}, {n}]")
    if i < 0:
        i += n
    return seq[:i] + [tensor] + seq[i:]


@kernel("SequenceErase", 11)
def sequence_erase(seq, position=None):
    seq = _sequence(seq, "SequenceErase")
    n = len(seq)
    i = n - 1 if position is None else _index(position, "SequenceErase's position")
    if not -n <= i < n:
        raise IndexError(f"SequenceErase position {i} is out of range for a sequence of {n}")
    if i < 0:
        i += n
    return seq[:i] + seq[i + 1:]


@kernel("SplitToSequence", 11)
def split_to_sequence(x, split=None, *, axis=0, keepdims=1):
    x = np.asarray(x)
    rank = x.ndim
    if not -rank <= axis < rank:
        raise ValueError(f"SplitToSequence axis {axis} is out of range for rank {rank}")
    axis = axis + rank if axis < 0 else axis
    dim = x.shape[axis]
    if split is None:
        parts = np.split(x, dim, axis=axis) if dim else []
        if not keepdims:
            parts = [np.squeeze(p, axis=axis) for p in parts]
        return parts
    split = np.asarray(split)
    if split.ndim == 0:
        size = int(split)
        if size <= 0:
            raise ValueError(f"SplitToSequence split must be positive, got {size}")
        points = list(range(size, dim, size))
    elif split.ndim == 1:
        lengths = [int(v) for v in split]
        if any(v < 0 for v in lengths) or sum(lengths) != dim:
            raise ValueError(f"SplitToSequence split {lengths} does not sum to the axis length {dim}")
        points = list(np.cumsum(lengths[:-1])) if lengths else []
        if not lengths:
            return []
    else:
        raise ValueError(f"SplitToSequence split must be a scalar or 1-D, got rank {split.ndim}")
    return np.split(x, points, axis=axis)


@kernel("ConcatFromSequence", 11)
def concat_from_sequence(seq, *, axis, new_axis=0):
    seq = _sequence(seq, "ConcatFromSequence")
    if not seq:
        raise ValueError("ConcatFromSequence needs a non-empty sequence")
    rank = np.ndim(seq[0])
    if new_axis:
        if not -rank - 1 <= axis <= rank:
            raise ValueError(f"ConcatFromSequence axis {axis} is out of range [{-rank - 1}, {rank}]")
        return np.stack(seq, axis=axis)
    if not -rank <= axis < rank:
        raise ValueError(f"ConcatFromSequence axis {axis} is out of range for rank {rank}")
    return np.concatenate(seq, axis=axis)


@kernel_builder("SequenceMap", 17, multi_output=True)
def sequence_map(ctx: KernelContext):
    graph = ctx.attributes.get("body")
    if graph is None:
        raise NotImplementedError("SequenceMap needs the graph attribute 'body'")
    if ctx.compile_subgraph is None:
        raise RuntimeError("SequenceMap needs a provider that compiles subgraphs")
    body = ctx.compile_subgraph(graph)
    names = ctx.implicit_inputs
    num_declared = ctx.num_inputs
    if len(body.input_names) != num_declared:
        raise NotImplementedError(
            f"SequenceMap has {num_declared} inputs but its body takes {len(body.input_names)}"
        )
    n_out = len(body.output_names)

    def run(seq, *args):
        seq = _sequence(seq, "SequenceMap")
        extra = args[: num_declared - 1]
        outer = dict(zip(names, args[num_declared - 1:]))
        for a in extra:
            if isinstance(a, list) and len(a) != len(seq):
                raise ValueError(f"SequenceMap's sequences differ in length ({len(seq)} and {len(a)})")
        results: list[list[Any]] = [[] for _ in range(n_out)]
        for i, item in enumerate(seq):
            outs = body.run([item] + [a[i] if isinstance(a, list) else a for a in extra], outer)
            for j in range(n_out):
                results[j].append(outs[j])
        return results

    return run


@kernel("Optional", 15)
def optional(x=None, *, type=None):  # noqa: A002 - the ONNX attribute's name
    return x


@kernel("OptionalHasElement", 15)
def optional_has_element(x=None):
    return np.array(x is not None)


@kernel("OptionalGetElement", 15)
def optional_get_element(x):
    if x is None:
        raise ValueError("OptionalGetElement: the optional input is empty")
    return x
