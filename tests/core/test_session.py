from __future__ import annotations

import numpy as np
import pytest

import plugrt
from plugrt.errors import (
    InputDtypeError,
    InputRankError,
    InputShapeError,
    InvalidInputError,
    InvalidOptionValueError,
    KernelError,
    MissingInputError,
    SymbolConflictError,
    UnknownInputError,
    UnknownOptionError,
    UnsupportedOpError,
)

from helpers import model_bytes

X = np.arange(8, dtype=np.float32).reshape(2, 4) - 4
Y = np.ones((2, 4), np.float32)


def test_load_runs_and_returns_outputs_by_name(add_relu_model):
    session = plugrt.load(add_relu_model)
    out = session.run({"x": X, "y": Y})
    np.testing.assert_array_equal(out["z"], np.maximum(X + Y, 0))


def test_inference_session_matches_onnxruntime_api(add_relu_model):
    ort = pytest.importorskip("onnxruntime")
    ours = plugrt.InferenceSession(add_relu_model, providers=["CPUExecutionProvider"])
    theirs = ort.InferenceSession(add_relu_model, providers=["CPUExecutionProvider"])
    feeds = {"x": X, "y": Y}
    np.testing.assert_array_equal(ours.run(None, feeds)[0], theirs.run(None, feeds)[0])
    assert [(i.name, i.type, i.shape) for i in ours.get_inputs()] == [
        (i.name, i.type, i.shape) for i in theirs.get_inputs()
    ]
    assert [(o.name, o.type, o.shape) for o in ours.get_outputs()] == [
        (o.name, o.type, o.shape) for o in theirs.get_outputs()
    ]
    assert ours.get_providers() == ["CPUExecutionProvider"]
    assert ours.get_modelmeta().producer_name == theirs.get_modelmeta().producer_name == "tests"
    assert ours.run(["z"], feeds)[0].shape == (2, 4)


def test_session_builder_builds_with_options_and_warmup(add_relu_model):
    session = (
        plugrt.SessionBuilder().model_bytes(add_relu_model).device("cpu").option("optimization", "basic").warmup().build()
    )
    assert session.options["optimization"] == "basic"
    assert session.providers == ["cpu"]


def test_metadata_reports_symbolic_dims(add_relu_model):
    session = plugrt.load(add_relu_model)
    (x, y) = session.inputs
    assert (x.name, x.dtype, x.shape, x.type_string) == ("x", np.dtype(np.float32), ("N", 4), "tensor(float)")
    assert session.outputs[0].shape == ("N", 4)
    assert session.metadata.producer_name == "tests"
    assert session.metadata.opset_imports == {"ai.onnx": 17}


@pytest.mark.parametrize("level", ["none", "basic", "all"])
def test_every_optimization_level_is_accepted(add_relu_model, level):
    out = plugrt.load(add_relu_model, optimization=level).run({"x": X, "y": Y})["z"]
    np.testing.assert_array_equal(out, np.maximum(X + Y, 0))


def test_unknown_option_key_is_rejected(add_relu_model):
    with pytest.raises(UnknownOptionError) as info:
        plugrt.load(add_relu_model, optimisation="all")
    assert info.value.key == "optimisation"
    assert "optimization" in info.value.known


def test_unknown_option_key_suggests_the_closest_option(add_relu_model):
    with pytest.raises(UnknownOptionError) as info:
        plugrt.load(add_relu_model, optimisation="all")
    assert info.value.suggestions == ("optimization",)
    assert "did you mean 'optimization'?" in str(info.value)


def test_invalid_option_value_lists_the_choices(add_relu_model):
    with pytest.raises(InvalidOptionValueError) as info:
        plugrt.load(add_relu_model, optimization="max")
    assert info.value.key == "optimization" and info.value.value == "max"
    assert "'none', 'basic', 'all'" in info.value.choices


def test_unknown_device_is_rejected(add_relu_model):
    with pytest.raises(InvalidOptionValueError) as info:
        plugrt.load(add_relu_model, device="tpu-9000")
    assert info.value.key == "device"


class TestInputErrors:
    @pytest.fixture
    def session(self, add_relu_model):
        return plugrt.load(add_relu_model)

    def test_unknown_input(self, session):
        with pytest.raises(UnknownInputError) as info:
            session.run({"x": X, "y": Y, "w": Y})
        assert info.value.input_name == "w" and info.value.expected == ("x", "y")

    def test_missing_input(self, session):
        with pytest.raises(MissingInputError) as info:
            session.run({"x": X})
        assert info.value.input_name == "y"

    def test_wrong_dtype(self, session):
        with pytest.raises(InputDtypeError) as info:
            session.run({"x": X.astype(np.float64), "y": Y})
        assert (info.value.input_name, info.value.expected, info.value.actual) == ("x", "float32", "float64")

    def test_wrong_rank(self, session):
        with pytest.raises(InputRankError) as info:
            session.run({"x": X.ravel(), "y": Y})
        assert (info.value.expected, info.value.actual) == (2, 1)

    def test_wrong_static_dim(self, session):
        with pytest.raises(InputShapeError) as info:
            session.run({"x": np.zeros((2, 5), np.float32), "y": Y})
        assert (info.value.axis, info.value.expected, info.value.actual) == (1, 4, 5)

    def test_symbol_bound_to_two_sizes(self, session):
        with pytest.raises(SymbolConflictError) as info:
            session.run({"x": np.zeros((3, 4), np.float32), "y": Y})
        err = info.value
        assert err.symbol == "N"
        assert err.first == ("x", 0, 3) and err.second == ("y", 0, 2)
        assert "'N'" in str(err) and "3" in str(err) and "2" in str(err)

    def test_checks_run_again_for_a_new_signature(self, session):
        session.run({"x": X, "y": Y})
        with pytest.raises(SymbolConflictError):
            session.run({"x": np.zeros((5, 4), np.float32), "y": Y})


def test_kernel_failure_names_the_node():
    data = model_bytes(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N] x, int64[1] shape) => (float[M] y) {
            y = Reshape <allowzero = 0> (x, shape)
        }
        """
    )
    session = plugrt.load(data)
    with pytest.raises(KernelError) as info:
        session.run({"x": np.zeros(6, np.float32), "shape": np.array([4], np.int64)})
    assert info.value.op_type == "Reshape"
    assert info.value.provider == "cpu"
    assert "Reshape" in info.value.node


def test_unsupported_op_lists_each_provider_and_reason():
    data = model_bytes(
        """
        <ir_version: 8, opset_import: ["" : 17, "com.acme" : 1]>
        g (float[2] x) => (float[2] y) {
            y = com.acme.Frobnicate(x)
        }
        """,
        check=False,
    )
    with pytest.raises(UnsupportedOpError) as info:
        plugrt.load(data)
    err = info.value
    assert (err.domain, err.op_type, err.opset) == ("com.acme", "Frobnicate", 1)
    assert err.providers_consulted == ("cpu",)
    assert "no kernel" in err.reasons["cpu"]
    assert "fix:" in str(err)


def test_intermediates_are_released_after_their_last_use(add_relu_model):
    session = plugrt.load(add_relu_model, optimization="none")
    source = session.plan_source
    assert "del " in source  # the Add result dies right after Relu reads it


def test_outputs_never_alias_constants():
    data = model_bytes(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g () => (float[2] y) <float[2] w = {1.0, 2.0}> {
            y = Identity(w)
        }
        """
    )
    session = plugrt.load(data)
    first = session.run()["y"]
    first[:] = 0
    np.testing.assert_array_equal(session.run()["y"], [1, 2])


def test_profiling_records_a_span_per_node(add_relu_model):
    session = plugrt.load(add_relu_model, profiling=True, optimization="none")
    session.run({"x": X, "y": Y})
    events = session.profile()
    nodes = [e for e in events if e["cat"] == "Node"]
    assert [e["args"]["op_name"] for e in nodes] == ["Add", "Relu"]
    assert all(e["dur"] >= 0 for e in nodes)


class TestInPlace:
    """Large elementwise results are written over a first input that dies at that step."""

    MODEL = model_bytes(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[128, 256] x) => (float[128, 256] y, float[256, 128] t) <int64[2] shape = {256, 128}> {
            a = Exp(x)
            view = Reshape(a, shape)
            b = Neg(a)
            c = Relu(b)
            y = Add(c, x)
            t = Sqrt(view)
        }
        """
    )

    def test_results_match_numpy_whether_or_not_steps_run_in_place(self):
        x = np.random.default_rng(0).standard_normal((128, 256)).astype(np.float32)
        out = plugrt.load(self.MODEL, optimization="all").run({"x": x})
        a = np.exp(x)
        np.testing.assert_array_equal(out["y"], np.maximum(-a, 0) + x)
        # Neg's input 'a' dies there but its Reshape view is read later: it must survive
        np.testing.assert_array_equal(out["t"], np.sqrt(a.reshape(256, 128)))

    def test_a_dying_intermediate_is_reused(self):
        session = plugrt.load(self.MODEL, optimization="all")
        wrapped = [k for k, v in session._plan._fn.__globals__.items() if getattr(v, "__qualname__", "").startswith("_in_place")]
        assert wrapped  # Relu over Neg's result, Add over Relu's


IDENTITY_AND_VIEW = model_bytes(
    """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 3] x) => (float[2, 3] same, float[6] flat) <int64[1] minus_one = {-1}> {
        same = Identity(x)
        flat = Reshape(x, minus_one)
    }
    """
)


def test_outputs_never_alias_the_callers_input():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    outputs = plugrt.load(IDENTITY_AND_VIEW).run({"x": x})
    for output in outputs.values():
        assert type(output) is np.ndarray and output.flags.writeable
        assert not np.shares_memory(output, x)
    outputs["same"][0, 0] = 100
    outputs["flat"][1] = 100
    np.testing.assert_array_equal(x, np.arange(6, dtype=np.float32).reshape(2, 3))


def test_matrix_input_reaches_the_kernels_as_a_plain_array():
    data = model_bytes(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 2] x) => (float[2, 2] y) { y = Mul(x, x) }
        """
    )
    session = plugrt.load(data)
    with pytest.warns(PendingDeprecationWarning):
        x = np.matrix([[1, 2], [3, 4]], dtype=np.float32)
    for _ in range(2):  # the second run goes through the signature cache
        y = session.run({"x": x})["y"]
        assert type(y) is np.ndarray
        np.testing.assert_array_equal(y, np.array([[1, 4], [9, 16]], np.float32))  # elementwise, not x @ x


def test_an_array_of_no_known_memory_is_refused(add_relu_model):
    class Foreign:
        dtype = np.dtype(np.float32)
        shape = (2, 4)

    with pytest.raises(InvalidInputError, match="must be a numpy array"):
        plugrt.load(add_relu_model).run({"x": Foreign(), "y": np.ones((2, 4), np.float32)})
