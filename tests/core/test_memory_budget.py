"""The memory_limit option and session.stats().memory_plan: what a session needs, checked at build."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import plugrt
from plugrt import memory_budget
from plugrt.errors import InvalidOptionValueError, MemoryLimitError, ModelLoadError

from helpers import model_bytes, text_model

ROW = 1024 * 4  # one float32 row of 1024 values: 4096 bytes

RELU_CHAIN = model_bytes(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, 1024] x) => (float[N, 1024] y) {
        a = Relu(x)
        b = Relu(a)
        c = Relu(b)
        y = Relu(c)
    }
    """
)

WEIGHT = np.arange(256 * 1024, dtype=np.float32).reshape(256, 1024) / 1e6


def _matmul_model() -> onnx.ModelProto:
    """y[1, 1024] = x[1, 256] @ W[256, 1024], W an initializer of WEIGHT.nbytes (1 MiB)."""
    model = text_model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 256] x, float[256, 1024] w) => (float[1, 1024] y) {
            y = MatMul(x, w)
        }
        """
    )
    model.graph.initializer.append(numpy_helper.from_array(WEIGHT, "w"))
    del model.graph.input[1]  # w is an initializer only: a weight, not an input
    return model


MATMUL = _matmul_model().SerializeToString()
# what the MatMul model needs: its weight, and y (its one value: 1024 float32)
MATMUL_NEEDS = WEIGHT.nbytes + ROW


def _relus(n: int) -> dict[str, np.ndarray]:
    return {"x": np.ones((n, 1024), np.float32)}


# -- the option ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("512MiB", 512 * 2**20),
        ("2GiB", 2 * 2**30),
        ("2gib", 2 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("800000KB", 800_000_000),
        ("64 kib", 64 * 1024),
    ],
)
def test_memory_limit_takes_bytes_or_a_size_with_a_binary_or_decimal_unit(given, expected):
    assert plugrt.options.parse_options({"memory_limit": given})["memory_limit"] == expected


@pytest.mark.parametrize("given", [0, -1, True, 1.5, "", "2 gigs", "GiB", "0MiB", "1e9", [1]])
def test_a_bad_memory_limit_is_rejected_with_the_valid_forms(given):
    with pytest.raises(InvalidOptionValueError) as info:
        plugrt.options.parse_options({"memory_limit": given})
    assert info.value.key == "memory_limit"
    assert "'2GiB'" in info.value.choices and "KiB" in info.value.choices


def test_memory_limit_defaults_to_no_limit():
    assert plugrt.options.parse_options({})["memory_limit"] is None


@pytest.mark.parametrize("given", [{"batch": 8, "sequence": 128}, "batch=8, sequence=128"])
def test_memory_limit_dims_takes_a_mapping_or_a_string(given):
    assert plugrt.options.parse_options({"memory_limit.dims": given})["memory_limit.dims"] == {"batch": 8, "sequence": 128}


@pytest.mark.parametrize("given", [{"batch": 0}, {"batch": "8"}, "batch:8", "batch=-1", ["batch"]])
def test_a_bad_memory_limit_dims_is_rejected(given):
    with pytest.raises(InvalidOptionValueError) as info:
        plugrt.options.parse_options({"memory_limit.dims": given})
    assert info.value.key == "memory_limit.dims"


# -- refusal at build ----------------------------------------------------------------------


def test_a_session_needing_more_than_its_memory_limit_is_refused():
    with pytest.raises(MemoryLimitError):
        plugrt.load(MATMUL, device="cpu", memory_limit=WEIGHT.nbytes - 1)


def test_a_session_needing_exactly_its_memory_limit_is_built():
    session = plugrt.load(MATMUL, device="cpu", memory_limit=MATMUL_NEEDS)
    assert session.run({"x": np.ones((1, 256), np.float32)})["y"].shape == (1, 1024)


def test_a_session_needing_one_byte_over_its_memory_limit_is_refused():
    with pytest.raises(MemoryLimitError):
        plugrt.load(MATMUL, device="cpu", memory_limit=MATMUL_NEEDS - 1)


def test_the_memory_limit_error_says_what_is_needed_and_where_it_goes():
    with pytest.raises(MemoryLimitError) as info:
        plugrt.load(MATMUL, device="cpu", memory_limit="1MiB")
    error = info.value
    assert (error.needed, error.limit) == (MATMUL_NEEDS, 2**20)
    assert error.breakdown == {"weights": WEIGHT.nbytes, "activations": ROW, "state": 0}
    # 1 MiB + 4 KiB = 1.0039 MiB
    assert "needs 1 MiB (weights 1 MiB, activations 4 KiB) but memory_limit is 1 MiB" in str(error)
    assert "raise memory_limit" in str(error)


def test_a_memory_limit_error_is_a_model_load_error():
    with pytest.raises(ModelLoadError):
        plugrt.load(MATMUL, device="cpu", memory_limit=1)


def test_weights_in_external_data_count_against_the_memory_limit(tmp_path):
    path = tmp_path / "matmul.onnx"
    onnx.save(_matmul_model(), path, save_as_external_data=True, location="matmul.data", size_threshold=0)
    with pytest.raises(MemoryLimitError) as info:
        plugrt.load(path, device="cpu", memory_limit=WEIGHT.nbytes)
    assert info.value.breakdown["weights"] == WEIGHT.nbytes


def test_weights_a_store_prepares_for_the_session_count_against_the_memory_limit():
    gemm = text_model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 1024] x, float[256, 1024] w) => (float[1, 256] y) {
            y = Gemm <transB = 1> (x, w)
        }
        """
    )
    gemm.graph.initializer.append(numpy_helper.from_array(WEIGHT, "w"))
    del gemm.graph.input[1]
    store = plugrt.WeightStore()
    with pytest.raises(MemoryLimitError) as info:
        plugrt.load(gemm.SerializeToString(), device="cpu", weights=store, memory_limit=1)
    prepared = store.stats().transform_bytes
    assert prepared > 0, "the CPU provider prepared no form of the Gemm weight: the test checks nothing"
    assert info.value.breakdown["weights"] == WEIGHT.nbytes + prepared


def test_symbolic_dims_are_planned_as_1_at_build():
    # 4 Relus on [1, 1024]: two buffers of 4096 bytes, and no weights
    with pytest.raises(MemoryLimitError) as info:
        plugrt.load(RELU_CHAIN, device="cpu", memory_limit=2 * ROW - 1)
    assert info.value.breakdown["activations"] == 2 * ROW


def test_memory_limit_dims_sizes_the_plan_checked_at_build():
    # N = 8: two buffers of 8 rows each
    with pytest.raises(MemoryLimitError) as info:
        plugrt.load(RELU_CHAIN, device="cpu", memory_limit=2 * ROW, **{"memory_limit.dims": {"N": 8}})
    assert info.value.breakdown["activations"] == 2 * 8 * ROW


def test_memory_limit_is_an_onnxruntime_session_config_entry():
    options = plugrt.SessionOptions()
    options.add_session_config_entry("memory_limit", "1KiB")
    with pytest.raises(MemoryLimitError) as info:
        plugrt.InferenceSession(MATMUL, options, providers=["CPUExecutionProvider"])
    assert info.value.limit == 1024


# -- stats().memory_plan -------------------------------------------------------------------


def test_stats_memory_plan_is_empty_before_any_run():
    assert plugrt.load(RELU_CHAIN, device="cpu").stats().memory_plan == {}


def test_stats_memory_plan_is_the_plan_of_the_latest_runs_shapes():
    session = plugrt.load(RELU_CHAIN, device="cpu")
    session.run(_relus(3))
    session.run(_relus(5))
    plan = session.stats().memory_plan
    # 5 rows per value, two buffers alternating, four values
    assert (plan["peak_bytes"], plan["total_bytes"]) == (2 * 5 * ROW, 4 * 5 * ROW)
    assert (plan["buffers"], plan["buffers_reused"], plan["values"], plan["unsized"]) == (2, 2, 4, 0)
    assert (plan["inputs"], plan["dims"]) == ({"x": [5, 1024]}, {"N": 5})


def test_stats_show_the_plan_checked_at_build_before_any_run():
    session = plugrt.load(RELU_CHAIN, device="cpu", memory_limit="1MiB")
    assert session.stats().memory_plan["dims"] == {"N": 1}


def test_a_model_with_no_intermediate_values_has_an_empty_memory_plan():
    session = plugrt.load(
        model_bytes(
            """
            <ir_version: 8, opset_import: ["" : 17]>
            g (float[2] x) => (float[2] x) {
            }
            """,
            check=False,
        ),
        device="cpu",
    )
    session.run({"x": np.ones(2, np.float32)})
    assert session.stats().memory_plan == {}


def test_runs_plan_no_memory(monkeypatch):
    planned = []
    monkeypatch.setattr(memory_budget, "plan_memory", lambda *a, **k: planned.append(a))
    session = plugrt.load(RELU_CHAIN, device="cpu")
    for n in (1, 2, 3):
        session.run(_relus(n))
    assert planned == []


def test_the_memory_plan_of_a_signature_is_made_once(monkeypatch):
    planned = []

    def plan_memory(*args, **kwargs):
        planned.append(kwargs)
        return real(*args, **kwargs)

    real = memory_budget.plan_memory
    monkeypatch.setattr(memory_budget, "plan_memory", plan_memory)
    session = plugrt.load(RELU_CHAIN, device="cpu")
    session.run(_relus(2))
    session.stats()
    session.run(_relus(2))
    session.stats()
    assert len(planned) == 1
    session.run(_relus(3))
    session.stats()
    assert len(planned) == 2


def test_a_replayed_plain_run_graph_is_the_latest_run():
    session = plugrt.load(RELU_CHAIN, device="cpu", graphs=True)
    session.run(_relus(2))
    session.run(_relus(2))  # recorded
    session.run(_relus(4))
    session.run(_relus(2))  # replayed
    assert session.stats().graph_hits == 1, "no replay: the test checks nothing"
    assert session.stats().memory_plan["dims"] == {"N": 2}
