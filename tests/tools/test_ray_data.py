"""OnnxPredictor on a local Ray cluster: two actors give what one process gives."""

from __future__ import annotations

import os

import numpy as np
import onnx.parser
import pytest

import plugrt
from plugrt.conformance.light_models import light_models
from plugrt.ray import OnnxPredictor, map_batches_kwargs

ray = pytest.importorskip("ray")

ROWS = 200

LOOKUP = """
<ir_version: 8, opset_import: ["" : 17]>
lookup (int64[N] i) => (float[N] v) <float[3] table = {0.0, 1.0, 2.0}> { v = Gather(table, i) }
"""


@pytest.fixture(scope="module")
def cluster():
    # The actors take the compiled loops (where numba is installed) from their first batch, as
    # this process does (built before the first test), not once their background build is
    # done: SqueezeNet's Softmax is ill-conditioned, and the two paths differ in the last bits.
    numba = os.environ.get("PLUGRT_NUMBA") or "wait"
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
        runtime_env={"env_vars": {"PLUGRT_NUMBA": numba}},
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def test_two_actors_give_the_single_process_outputs(cluster) -> None:
    squeezenet = next(m for m in light_models() if m.name == "squeezenet")  # IR 3, fixed batch of 1
    (input_name,) = squeezenet.inputs
    images = np.random.default_rng(11).random((ROWS, 3, 224, 224), dtype=np.float32)
    # eight blocks, so that both actors get work; the key restores the row order
    ds = ray.data.from_items([{input_name: images[i], "key": i} for i in range(ROWS)], override_num_blocks=8)
    kwargs = map_batches_kwargs(squeezenet.path, device="cpu", concurrency=2, batch_size=25, id_column="key")
    rows = sorted(ds.map_batches(OnnxPredictor, **kwargs).take_all(), key=lambda row: row["key"])
    assert [row["key"] for row in rows] == list(range(ROWS))
    session = plugrt.load(squeezenet.path, device="cpu")  # the plain-Python loop, one process
    (output_name,) = (info.name for info in session.outputs)
    got = np.stack([row[output_name] for row in rows])
    expected = np.concatenate([session.run({input_name: images[i : i + 1]})[output_name] for i in range(ROWS)])
    np.testing.assert_array_equal(got, expected)


def test_bad_row_fails_the_dataset_with_the_row_and_column_named(cluster) -> None:
    index = np.arange(ROWS) % 3
    index[123] = 99
    ds = ray.data.from_items([{"i": int(v), "name": f"item{n}"} for n, v in enumerate(index)], override_num_blocks=4)
    kwargs = map_batches_kwargs("lookup.onnx", device="cpu", concurrency=2, batch_size=32, id_column="name")
    kwargs["fn_constructor_kwargs"]["model"] = onnx.parser.parse_model(LOOKUP).SerializeToString()
    with pytest.raises(Exception) as info:
        ds.map_batches(OnnxPredictor, **kwargs).take_all()
    message = str(info.value)
    # Ray wraps the error raised in the actor; its text carries ours, and the actor did not die
    assert "BatchRowError" in message and "(id 'item123'), column 'i'" in message
    assert "actor died" not in message.lower()
