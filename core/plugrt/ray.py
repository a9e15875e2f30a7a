"""Batch inference on Ray Data: a callable class for ``Dataset.map_batches``.

This module never imports Ray: Ray imports it inside each actor.

```python
import ray
from plugrt.ray import OnnxPredictor, map_batches_kwargs

ds = ray.data.from_numpy(images).rename_columns({"data": "image"})
ds = ds.map_batches(OnnxPredictor, **map_batches_kwargs("model.onnx", concurrency=2, batch_size=64))
```
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import BatchColumnError, BatchRowError, InvalidInputError, PlugrtError

__all__ = ["OnnxPredictor", "map_batches_kwargs", "wants_gpu"]


def wants_gpu(device: str | None) -> bool:
    """Whether a device intent asks for a GPU (so each Ray actor must be given one)."""
    if not isinstance(device, str):
        return False
    intent = device.strip().lower()
    return intent in ("gpu", "cuda", "prefer_gpu") or intent.startswith(("gpu:", "cuda:"))


def map_batches_kwargs(
    model: str | os.PathLike,
    device: str = "auto",
    *,
    concurrency: int = 1,
    batch_size: int = 64,
    num_gpus: float | None = None,
    **predictor_kwargs: Any,
) -> dict[str, Any]:
    """Keyword arguments for ``ds.map_batches(OnnxPredictor, **...)``.

    ``num_gpus`` defaults to 1 per actor when ``device`` asks for a GPU (``"gpu"``,
    ``"cuda"``, ``"gpu:N"``, ``"prefer_gpu"``) and to none otherwise. Ray picks the GPU
    and makes it the actor's only visible one, so inside the actor it is device 0:
    prefer ``device="gpu"`` to ``"gpu:N"``.
    """
    kwargs: dict[str, Any] = {
        "fn_constructor_kwargs": {"model": os.fspath(model), "device": device, **predictor_kwargs},
        "batch_size": batch_size,
        "batch_format": "numpy",
    }
    try:
        from ray.data import ActorPoolStrategy
    except ImportError:  # Ray before 2.9, or absent: the older spelling
        kwargs["concurrency"] = concurrency
    else:  # ``concurrency`` is deprecated since Ray 2.51
        kwargs["compute"] = ActorPoolStrategy(size=concurrency)
    gpus = num_gpus if num_gpus is not None else (1 if wants_gpu(device) else 0)
    if gpus:
        kwargs["num_gpus"] = gpus
    return kwargs


@dataclasses.dataclass(frozen=True)
class _InputPlan:
    """How one model input is fed from one column."""

    name: str
    column: str
    dtype: np.dtype | None
    dims: tuple[int | str | None, ...] | None


class OnnxPredictor:
    """Runs one plugrt session per Ray actor over batches of numpy columns.

    - Each model input reads the column of the same name, or ``input_columns[input]``.
    - Each model output (or those in ``outputs``) is added as a column, named
      ``output_columns.get(output, output)``; the batch's columns are kept unless
      ``keep_columns=False``.
    - A column of ``n`` rows feeds an input of rank ``r`` either as one array of rank
      ``r`` (the rows are the batch axis) or, when each row already has rank ``r``, one
      run per row. A symbolic batch axis takes the whole batch in one run; a fixed one
      of size ``k`` is fed in chunks of ``k`` (the last one padded, its padding dropped).
    - A row that cannot be run raises :class:`plugrt.errors.BatchRowError` naming the
      row (and its ``id_column`` value) and the column; the actor stays usable.
    """

    def __init__(
        self,
        model: str | os.PathLike | bytes,
        device: str = "auto",
        *,
        input_columns: Mapping[str, str] | None = None,
        outputs: Sequence[str] | None = None,
        output_columns: Mapping[str, str] | None = None,
        id_column: str | None = None,
        keep_columns: bool = True,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        from .session import load

        self.session = load(model, device=device, **dict(options or {}))
        columns = dict(input_columns or {})
        names = [info.name for info in self.session.inputs]
        unknown = sorted(set(columns) - set(names))
        if unknown:
            raise InvalidInputError(
                f"input_columns names {unknown}, which are not inputs of the model; its inputs are {names}",
                input_name=unknown[0],
            )
        self._inputs = [
            _InputPlan(info.name, columns.get(info.name, info.name), info.dtype, info.shape)
            for info in self.session.inputs
            if info.kind == "tensor"
        ]
        all_outputs = [info.name for info in self.session.outputs]
        self._outputs = list(outputs) if outputs is not None else all_outputs
        missing = [name for name in self._outputs if name not in all_outputs]
        if missing:
            raise InvalidInputError(f"unknown output(s) {missing}; the model's outputs are {all_outputs}")
        renames = dict(output_columns or {})
        self._output_columns = [renames.get(name, name) for name in self._outputs]
        self._id_column = id_column
        self._keep_columns = keep_columns

    # -- one batch ---------------------------------------------------------------------

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
        rows = _row_count(batch)
        ids = batch.get(self._id_column) if self._id_column is not None else None
        arrays: list[np.ndarray] = []
        per_row: list[bool] = []
        chunk: int | None = None
        for plan in self._inputs:
            array, row_wise = self._column_array(plan, batch, rows, ids)
            arrays.append(array)
            per_row.append(row_wise)
            size = 1 if row_wise else _fixed_batch(plan)
            if size is not None:
                if chunk is not None and chunk != size:
                    raise BatchColumnError(
                        plan.column, plan.name, f"its batch size {size} differs from another input's {chunk}"
                    )
                chunk = size
        results = self._run_rows(arrays, per_row, chunk, rows, ids)
        out: dict[str, np.ndarray] = dict(batch) if self._keep_columns else {}
        for column, values in zip(self._output_columns, results):
            out[column] = values
        return out

    def _column_array(
        self, plan: _InputPlan, batch: Mapping[str, Any], rows: int, ids: Any
    ) -> tuple[np.ndarray, bool]:
        """The column as one array with the rows on axis 0, checked row by row where it is
        ragged; and whether each row is a whole model input (one run per row)."""
        if plan.column not in batch:
            raise BatchColumnError(
                plan.column, plan.name, f"the batch has no such column (its columns are {sorted(batch)})"
            )
        column = batch[plan.column]
        rank = len(plan.dims) if plan.dims is not None else None
        if isinstance(column, np.ndarray) and column.dtype != object:
            array = column
        else:
            array = self._stack_rows(plan, column, rows, ids, rank)
        if plan.dtype is not None and array.dtype != plan.dtype:
            if not np.can_cast(array.dtype, plan.dtype, "same_kind"):
                raise BatchColumnError(
                    plan.column,
                    plan.name,
                    f"its dtype {array.dtype} cannot be cast safely to the model's {plan.dtype}; convert the column",
                )
            array = array.astype(plan.dtype)
        if rank is None or array.ndim == rank:
            row_wise = False
        elif array.ndim == rank + 1:
            row_wise = True
        else:
            raise BatchColumnError(
                plan.column,
                plan.name,
                f"each row has shape {list(array.shape[1:])}, but the model input has shape "
                f"{_declared(plan.dims)}: a row must be the input without its batch axis, or the whole input",
            )
        expected = () if plan.dims is None else plan.dims if row_wise else plan.dims[1:]
        for axis, (want, got) in enumerate(zip(expected, array.shape[1:])):
            if isinstance(want, int) and want >= 0 and want != got:
                raise BatchColumnError(
                    plan.column,
                    plan.name,
                    f"every row has size {got} on axis {axis}, the model expects {want} "
                    f"(input shape {_declared(plan.dims)})",
                )
        return array, row_wise

    def _stack_rows(self, plan: _InputPlan, column: Any, rows: int, ids: Any, rank: int | None) -> np.ndarray:
        """Stack a ragged (object) column, naming the first row that does not fit."""
        converted = []
        first_shape: tuple[int, ...] | None = None
        for index in range(rows):
            try:
                row = np.asarray(column[index], dtype=plan.dtype)
            except (TypeError, ValueError) as exc:
                raise BatchRowError(
                    index, plan.column, f"cannot be read as {plan.dtype}: {exc}", row_id=_row_id(ids, index),
                    input_name=plan.name,
                ) from exc
            if first_shape is None:
                first_shape = row.shape
            problem = _row_shape_problem(plan.dims, row.shape, first_shape)
            if problem:
                raise BatchRowError(index, plan.column, problem, row_id=_row_id(ids, index), input_name=plan.name)
            converted.append(row)
        if not converted:
            return np.zeros((0,), dtype=plan.dtype)
        return np.stack(converted)

    def _run_rows(
        self, arrays: list[np.ndarray], per_row: list[bool], chunk: int | None, rows: int, ids: Any
    ) -> list[np.ndarray]:
        """Run the batch in chunks (the whole batch when every batch axis is symbolic)."""
        step = chunk or max(rows, 1)
        pieces: list[list[np.ndarray]] = [[] for _ in self._outputs]
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            feeds = {
                plan.name: _chunk(array, start, stop, step if chunk else stop - start, row_wise)
                for plan, array, row_wise in zip(self._inputs, arrays, per_row)
            }
            try:
                values = self.session.run(feeds, self._outputs)
            except PlugrtError as exc:
                raise self._locate_failure(arrays, per_row, chunk, start, stop, ids, exc) from exc
            for index, name in enumerate(self._outputs):
                value = values[name]
                if not isinstance(value, np.ndarray):
                    raise InvalidInputError(
                        f"output {name!r} is a {type(value).__name__}, not a tensor: it cannot be a column; "
                        "leave it out with outputs=[...]"
                    )
                if all(per_row):
                    value = value[np.newaxis]
                elif value.ndim == 0 or value.shape[0] != (step if chunk else stop - start):
                    raise InvalidInputError(
                        f"output {name!r} has shape {list(value.shape)}, with no batch axis matching the "
                        f"{stop - start} row(s) fed: it cannot be a column; leave it out with outputs=[...]"
                    )
                pieces[index].append(value[: stop - start])
        if rows == 0:
            return [self._empty_output(name) for name in self._outputs]
        return [np.concatenate(parts) if len(parts) > 1 else parts[0] for parts in pieces]

    def _empty_output(self, name: str) -> np.ndarray:
        """An output column of no rows, shaped as declared where the model says."""
        info = next(i for i in self.session.outputs if i.name == name)
        dims = info.shape[1:] if info.shape else ()
        shape = [d if isinstance(d, int) and d >= 0 else 0 for d in dims]
        return np.zeros((0, *shape), dtype=info.dtype if info.dtype is not None else np.float32)

    def _locate_failure(
        self,
        arrays: list[np.ndarray],
        per_row: list[bool],
        chunk: int | None,
        start: int,
        stop: int,
        ids: Any,
        exc: PlugrtError,
    ) -> PlugrtError:
        """The first row in [start, stop) that fails on its own; the original error when
        every row runs alone (the failure belongs to the batch, not to a row)."""
        column = self._inputs[0].column if len(self._inputs) == 1 else getattr(exc, "input_name", None)
        column = next((p.column for p in self._inputs if p.name == column), column)
        if stop - start == 1:
            return BatchRowError(start, column, f"{type(exc).__name__}: {exc}", row_id=_row_id(ids, start))
        width = chunk or 1
        for row in range(start, stop):
            feeds = {
                plan.name: _chunk(array, row, row + 1, width, row_wise)
                for plan, array, row_wise in zip(self._inputs, arrays, per_row)
            }
            try:
                self.session.run(feeds, self._outputs)
            except PlugrtError as row_exc:
                return BatchRowError(row, column, f"{type(row_exc).__name__}: {row_exc}", row_id=_row_id(ids, row))
        return exc


def _row_count(batch: Mapping[str, Any]) -> int:
    counts = {len(column) for column in batch.values()}
    if len(counts) > 1:
        raise InvalidInputError(f"the batch's columns have different lengths {sorted(counts)}")
    return counts.pop() if counts else 0


def _fixed_batch(plan: _InputPlan) -> int | None:
    if plan.dims and isinstance(plan.dims[0], int) and plan.dims[0] > 0:
        return plan.dims[0]
    return None


def _chunk(array: np.ndarray, start: int, stop: int, width: int, row_wise: bool) -> np.ndarray:
    """Rows [start, stop) as one model input: the row itself when rows are whole inputs,
    else padded to ``width`` rows by repeating the last (a fixed batch axis)."""
    if row_wise:
        return array[start]
    piece = array[start:stop]
    if stop - start < width:
        padding = np.repeat(piece[-1:], width - (stop - start), axis=0)
        piece = np.concatenate([piece, padding])
    return piece


def _row_id(ids: Any, index: int) -> Any:
    if ids is None:
        return None
    value = ids[index]
    return value.item() if isinstance(value, np.generic) else value


def _declared(dims: tuple[int | str | None, ...] | None) -> str:
    if dims is None:
        return "[any]"
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def _row_shape_problem(
    dims: tuple[int | str | None, ...] | None, shape: tuple[int, ...], first_shape: tuple[int, ...]
) -> str | None:
    """Why a ragged row's shape cannot be stacked or fed, or None."""
    if shape != first_shape:
        return f"has shape {list(shape)}, unlike the batch's first row {list(first_shape)}; rows must agree"
    if dims is None:
        return None
    for expected in (dims[1:], dims):
        if len(expected) == len(shape) and all(
            not isinstance(want, int) or want < 0 or want == got for want, got in zip(expected, shape)
        ):
            return None
    return f"has shape {list(shape)}, which does not fit the model input {_declared(dims)}"
