"""Warm-up: run a session on generated inputs of given shapes before real requests."""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, Union

import numpy as np

from .errors import UnknownInputError, WarmupShapeError
from .inputs import example_inputs
from .tracing import span_of

if TYPE_CHECKING:
    from .options import SessionOptions
    from .signature import TensorInfo

__all__ = ["WarmupShapes", "warmup_session", "warmup_feeds"]

#: Input name -> shape, or a list of them (one warm-up per entry).
WarmupShapes = Union[Mapping[str, Sequence[int]], Sequence[Mapping[str, Sequence[int]]]]


class _Runnable(Protocol):
    """What warm-up needs of a :class:`plugrt.Session`."""

    inputs: list["TensorInfo"]
    options: "SessionOptions"

    def run(self, feeds: Any = None) -> Any: ...


def warmup_session(session: _Runnable, shapes: WarmupShapes | None = None, *, runs: int = 1) -> None:
    """Run the model ``runs`` times on generated inputs of each shape set in ``shapes``, so
    that kernels build their per-shape plans before the first real request.

    ``shapes`` maps input names to shapes, or is a list of such mappings, one warm-up each:
    ``[{"images": (1, 3, 224, 224)}, {"images": (8, 3, 224, 224)}]`` warms batches of 1 and 8.
    An input not named takes its declared shape, a symbolic dimension the size a named
    input gives that symbol (else 1): a decoder needs its cache inputs named too (a past
    length of 0 for a prefill). Floats are uniform in [0, 1), integers are ones. None: once on the declared shapes. Raises
    UnknownInputError for a name the model has no input of, WarmupShapeError for what is
    not a shape (or too large), and the run's own InvalidInputError (rank, fixed size, a
    symbol bound to two sizes) for a shape the model does not accept.
    """
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 0:
        raise WarmupShapeError("*", runs, "runs must be a non-negative integer")
    entries: Sequence[Mapping[str, Sequence[int]]]
    if shapes is None:
        entries = [{}]
    elif isinstance(shapes, Mapping):
        entries = [shapes]
    else:
        entries = list(shapes)
    limit = session.options["limits.tensor_bytes"]
    all_feeds = [warmup_feeds(session.inputs, entry, limit) for entry in entries]  # every entry checked first
    with span_of(session, "warmup", shape_sets=len(all_feeds), runs=runs):
        for feeds in all_feeds:
            for _ in range(runs):
                session.run(feeds)


def warmup_feeds(inputs: Sequence["TensorInfo"], shapes: Mapping[str, Any], max_bytes: int) -> dict[str, Any]:
    """Generated inputs: those named in ``shapes`` of that shape, the others of their
    declared shape with symbols bound by the named ones."""
    if not isinstance(shapes, Mapping):
        raise WarmupShapeError("*", shapes, "each warm-up entry must map input names to shapes")
    by_name = {info.name: info for info in inputs}
    dims: dict[str, int] = {}
    infos = list(inputs)
    for name, shape in shapes.items():
        info = by_name.get(name)
        if info is None:
            raise UnknownInputError(name, list(by_name))
        given = _shape(name, shape)
        itemsize = info.dtype.itemsize if info.dtype is not None else 8
        if math.prod(given) * itemsize > max_bytes:
            raise WarmupShapeError(
                name, shape, f"{math.prod(given) * itemsize} bytes exceed the limits.tensor_bytes option ({max_bytes})"
            )
        declared = info.shape or ()
        if len(declared) == len(given):
            for dim, size in zip(declared, given):
                if isinstance(dim, str):
                    dims.setdefault(dim, size)  # a conflict is the run's SymbolConflictError
        infos[infos.index(info)] = dataclasses.replace(info, shape=given)
    feeds = example_inputs(infos, dims=dims)
    # Integers are ones, not random: token ids, positions and attention masks of ones are
    # valid for every vocabulary and mean "attend everywhere", where a random mask would
    # contradict the shapes a decoder's attention checks.
    for name, value in feeds.items():
        if value.dtype.kind in "iu":
            feeds[name] = np.ones_like(value)
    return feeds


def _shape(name: str, shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise WarmupShapeError(name, shape, "not a sequence of sizes")
    sizes = []
    for size in shape:
        if isinstance(size, bool):
            raise WarmupShapeError(name, shape, f"size {size!r} is not an integer")
        try:
            sizes.append(operator.index(size))
        except TypeError:
            raise WarmupShapeError(name, shape, f"size {size!r} is not an integer") from None
        if sizes[-1] < 0:
            raise WarmupShapeError(name, shape, f"size {size} is negative")
    return tuple(sizes)
