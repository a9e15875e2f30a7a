"""Example inputs of a model's declared shapes, for `plugrt run` and warm-up."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from .signature import TensorInfo

__all__ = ["DEFAULT_DIM", "example_inputs"]

#: Size given to a symbolic or unknown dimension when inputs are made up.
DEFAULT_DIM = 1


def example_inputs(
    infos: Sequence["TensorInfo"], *, seed: int = 0, dims: dict[str, int] | None = None
) -> dict[str, np.ndarray]:
    """Deterministic random inputs: floats in [0, 1), integers in [0, 10), True/False.

    A symbolic dimension takes ``dims[symbol]`` when given, else :data:`DEFAULT_DIM`.
    """
    rng = np.random.default_rng(seed)
    dims = dims or {}
    feeds: dict[str, np.ndarray] = {}
    for info in infos:
        if info.kind != "tensor" or info.dtype is None:
            continue
        shape = tuple(
            d if isinstance(d, int) and d >= 0 else dims.get(d, DEFAULT_DIM) if isinstance(d, str) else DEFAULT_DIM
            for d in (info.shape or ())
        )
        dtype = info.dtype
        if dtype.kind == "f" or dtype.name in ("bfloat16",) or "float8" in dtype.name:
            feeds[info.name] = rng.random(shape, dtype=np.float32).astype(dtype)
        elif dtype.kind in "iu":
            feeds[info.name] = rng.integers(0, 10, shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[info.name] = rng.random(shape) < 0.5
        elif dtype.kind == "c":
            feeds[info.name] = (rng.random(shape) + 1j * rng.random(shape)).astype(dtype)
        else:
            feeds[info.name] = np.full(shape, "text", dtype=object)
    return feeds
