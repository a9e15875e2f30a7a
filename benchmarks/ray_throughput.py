"""Rows per second of plugrt.ray.OnnxPredictor on 1 and 2 Ray actors against one in-process session.

    python benchmarks/ray_throughput.py [--model M.onnx] [--rows N] [--batch-size B]

Two Ray figures: "with start" includes starting the actors (a process and a session
each), what a user pays for one ``map_batches`` pass; "steady" counts only rows whose
batch finished after the first batch did, over the time from then to the last batch.
The input dataset is materialised in the object store first, so making it is not
counted. Ray gives each 1-CPU actor one BLAS thread (OMP_NUM_THREADS=1); the
in-process session uses the default thread count.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import onnx

import plugrt
from plugrt.inputs import example_inputs
from plugrt.ray import OnnxPredictor, map_batches_kwargs

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def _rows(session: plugrt.Session, count: int) -> tuple[str, np.ndarray]:
    """``count`` rows for the first input: the input without its batch axis."""
    info = session.inputs[0]
    one = example_inputs([info])[info.name]
    rng = np.random.default_rng(0)
    return info.name, rng.random((count, *one.shape[1:]), dtype=np.float32).astype(one.dtype)


def in_process(path: str, name: str, rows: np.ndarray, batch_size: int) -> float:
    """The plain-Python loop: one session, batches fed through the same predictor."""
    predictor = OnnxPredictor(path, device="cpu", keep_columns=False)
    predictor({name: rows[:1]})  # warm-up, as an actor's first batch would not be
    start = time.perf_counter()
    for first in range(0, len(rows), batch_size):
        predictor({name: rows[first : first + batch_size]})
    return len(rows) / (time.perf_counter() - start)


class _Timed(OnnxPredictor):
    """Stamps each batch with the wall-clock time it finished."""

    def __call__(self, batch):
        out = super().__call__(batch)
        out["finished"] = np.full(len(out[next(iter(out))]), time.time())
        return out


def on_ray(ray, path: str, name: str, rows: np.ndarray, batch_size: int, actors: int) -> tuple[float, float]:
    """(rows/s with actor start, steady rows/s)."""
    ds = ray.data.from_numpy(list(np.array_split(rows, 8))).rename_columns({"data": name}).materialize()
    kwargs = map_batches_kwargs(path, device="cpu", concurrency=actors, batch_size=batch_size, keep_columns=False)
    start = time.perf_counter()
    result = ds.map_batches(_Timed, **kwargs).materialize()
    elapsed = time.perf_counter() - start
    finished = np.concatenate([b["finished"] for b in result.iter_batches(batch_format="numpy", batch_size=None)])
    assert len(finished) == len(rows)
    first = finished.min()
    later = finished > first
    steady = later.sum() / (finished.max() - first) if later.any() else float("nan")
    return len(rows) / elapsed, float(steady)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(LIGHT, "light_squeezenet.onnx"))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    import ray

    session = plugrt.load(args.model, device="cpu")
    name, rows = _rows(session, args.rows)
    print(f"model: {os.path.basename(args.model)}, {args.rows} rows of {list(rows.shape[1:])}, batch size {args.batch_size}")
    print(f"machine: {os.cpu_count()} cores; ray {ray.__version__}; load average before: {_load()}")
    base = in_process(args.model, name, rows, args.batch_size)
    results = [("in-process session", base, base)]
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        for actors in (1, 2):
            results.append((f"ray, {actors} actor(s)", *on_ray(ray, args.model, name, rows, args.batch_size, actors)))
    finally:
        ray.shutdown()
    print(f"{'runner':<20} {'rows/s with start':>18} {'steady rows/s':>14} {'steady vs in-process':>21}")
    for label, with_start, steady in results:
        print(f"{label:<20} {with_start:>18.1f} {steady:>14.1f} {steady / base:>20.2f}x")
    print(f"load average after: {_load()}")


if __name__ == "__main__":
    main()
