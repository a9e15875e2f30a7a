"""A transposed view copied in C order by tiles transposed in registers
(``tensor.transposed_copy``): the same bits as numpy's copy over the layouts models make
(NCHW <-> NHWC, a sequence of channels, patches unfolded and folded, a pixel shuffle,
partial tiles, a sliced source, batch axes), every 4- and 8-byte dtype, NaN payloads and
signed zeros moved as they are; layouts it does not take are declined with nothing
written. Through a session, with the compiled loops and without: Transpose, and Reshape of
a transposed view, give numpy's values, readers other than matrix products get C order,
and a capture replays without allocating."""

from __future__ import annotations

import numpy as np
import pytest

import plugrt
from plugrt_cpu.kernels import tensor
from plugrt_cpu.kernels._compiled import compiled_module

from cpu.numba_paths import PATHS, compiled_or_skip, numba_or_numpy
from cpu.test_into import check_captured, one_node


def _loops():
    return compiled_module("_numba_transpose")


@pytest.fixture
def loops():
    return compiled_or_skip(_loops)


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    yield from numba_or_numpy(request, monkeypatch, _loops)


def _values(shape, dtype, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return (rng.standard_normal(shape) * 1000).astype(dtype)


# (source shape, perm, a slice of the source's last axis or None) of views the tiles take
TAKEN = {
    "nchw-to-nhwc": ((1, 96, 14, 14), (0, 2, 3, 1), None),
    "nhwc-to-nchw": ((1, 14, 14, 96), (0, 3, 1, 2), None),
    "sequence-of-channels": ((2, 64, 49), (0, 2, 1), None),
    "partial-tiles": ((3, 17, 33), (0, 2, 1), None),
    # MobileViT: (C * patch rows, ph, patch columns, pw) with its 2 x 2 patches, both ways
    # (pairs of values that stay together move as 8-byte values)
    "patches-unfolded": ((384, 2, 16, 2), (0, 2, 1, 3), None),
    "patches-folded": ((384, 16, 2, 2), (0, 2, 1, 3), None),
    # (B, C, patches, ph*pw) -> (B, ph*pw, patches, C): a short contiguous axis whose
    # neighbour in the source lengthens the tile's columns, and the way back
    "patch-pixels-first": ((1, 96, 64, 4), (0, 3, 2, 1), None),
    "patch-pixels-last": ((1, 4, 64, 96), (0, 3, 2, 1), None),
    # a pixel shuffle by 2 of 8 channels: three axes besides the tile's
    "pixel-shuffle": ((1, 2, 2, 2, 24, 24), (0, 1, 4, 2, 5, 3), None),
    "reversed-axes": ((5, 6, 7, 9), (3, 2, 1, 0), None),
    # three values a pixel: not pairs
    "rgb-to-pixels": ((1, 3, 32, 24), (0, 2, 3, 1), None),
    "pixels-to-rgb": ((1, 32, 24, 3), (0, 3, 1, 2), None),
    "sliced-source": ((64, 40), (1, 0), 37),
}
DTYPES = [np.float32, np.int32, np.int64, np.float64, np.complex64]


def _view(shape, perm, cut, dtype, seed=0) -> np.ndarray:
    x = _values(shape, dtype, seed)
    if cut is not None:
        x = x[..., :cut]
    return x.transpose(perm)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", list(TAKEN))
def test_tiles_give_numpy_s_copy(loops, case, dtype):
    view = _view(*TAKEN[case], dtype)
    expected = np.ascontiguousarray(view)  # numpy's copy, value by value
    out = np.zeros(view.shape, view.dtype)
    if case.startswith("patches-") and view.itemsize == 8:
        # pairs of 8-byte values would move as 16-byte ones, which the tiles do not take
        assert not tensor.transposed_copy(view, out)
        assert not out.any()
        return
    assert tensor.transposed_copy(view, out)
    assert out.tobytes() == expected.tobytes()


def test_every_permutation_of_a_small_4d_tensor(loops):
    """All 24 orders of a (3, 5, 8, 16) tensor: those it takes match numpy, those it
    declines leave the output as it was."""
    import itertools

    x = _values((3, 5, 8, 16), np.float32)
    taken = 0
    for perm in itertools.permutations(range(4)):
        view = x.transpose(perm)
        out = np.full(view.shape, -7.0, np.float32)
        if tensor.transposed_copy(view, out):
            taken += 1
            np.testing.assert_array_equal(out, view)
        else:
            assert (out == -7.0).all(), perm
    assert taken >= 18  # every order that moves the last axis (18 of 24)


def test_a_broadcast_view(loops):
    """An Expand's view (a zero stride) transposed: the repeated rows read as they lie."""
    x = _values((8, 1, 40), np.float32)
    for perm in [(2, 0, 1), (2, 1, 0), (1, 2, 0)]:
        view = np.broadcast_to(x, (8, 6, 40)).transpose(perm)
        out = np.zeros(view.shape, np.float32)
        assert tensor.transposed_copy(view, out)
        np.testing.assert_array_equal(out, view)


def test_bits_move_unchanged(loops):
    x = np.zeros((48, 40), np.float32)
    bits = x.view(np.uint32)
    bits[::3] = 0x7FC01234  # a NaN with a payload
    bits[1::3] = 0xFFA00001  # a negative signalling-NaN pattern
    x[2, ::2] = -0.0
    x[5, 1::2] = np.inf
    out = np.empty((40, 48), np.float32)
    assert tensor.transposed_copy(x.T, out)
    assert out.view(np.uint32).tobytes() == np.ascontiguousarray(x.T).view(np.uint32).tobytes()


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: _values((64, 64), np.float32)[:, ::-1].T, id="negative-strides"),
        pytest.param(lambda: _values((3, 5, 3, 5, 3, 5, 17), np.float32).transpose(6, 4, 2, 0, 5, 3, 1), id="four-other-axes"),
        pytest.param(lambda: _values((1, 12, 64, 32), np.float32).transpose(0, 2, 1, 3), id="last-axis-contiguous"),
        pytest.param(lambda: _values((64, 64), np.float16).T, id="2-byte-values"),
        pytest.param(lambda: _values((8, 8), np.float32).T, id="too-few-values"),
        pytest.param(lambda: _values((64, 64), np.float32)[:, ::2].T, id="no-contiguous-axis"),
    ],
)
def test_views_it_does_not_take_are_declined_untouched(loops, make):
    view = make()
    out = np.full(view.shape, 3, view.dtype)
    assert not tensor.transposed_copy(view, out)
    assert (out == 3).all()


def test_a_non_contiguous_output_is_declined(loops):
    view = _values((64, 48), np.float32).T
    out = np.zeros((48, 128), np.float32)[:, ::2]
    assert not tensor.transposed_copy(view, out)
    assert (out == 0).all()


# -- through a session ----------------------------------------------------------------


def _nhwc_layer_norm() -> bytes:
    """ConvNeXt's block middle: NCHW to NHWC, LayerNorm over the channels, and back."""
    c = 32
    return one_node(
        "t = Transpose<perm = [0, 2, 3, 1]>(x)\n"
        "    n = LayerNormalization<axis = -1, epsilon = 0.00001>(t, scale, bias)\n"
        "    y = Transpose<perm = [0, 3, 1, 2]>(n)",
        {"x": _values((2, c, 9, 11), np.float32)},
        {"y": "float"},
        constants={"scale": _values((c,), np.float32, 1) / 1000, "bias": _values((c,), np.float32, 2) / 1000},
    )


def _layer_norm_nhwc(x, scale, bias):
    t = x.transpose(0, 2, 3, 1).astype(np.float64)
    mean = t.mean(-1, keepdims=True)
    var = ((t - mean) ** 2).mean(-1, keepdims=True)
    return ((t - mean) / np.sqrt(var + 1e-5) * scale + bias).transpose(0, 3, 1, 2)


def test_transposes_around_a_layer_norm(path):
    x = _values((2, 32, 9, 11), np.float32, 5)
    session = plugrt.load(_nhwc_layer_norm())
    scale, bias = _values((32,), np.float32, 1) / 1000, _values((32,), np.float32, 2) / 1000
    y = session.run({"x": x})["y"]
    np.testing.assert_allclose(y, _layer_norm_nhwc(x, scale, bias), rtol=1e-4, atol=1e-4)


def _unfold_fold() -> bytes:
    """MobileViT's patches (2 x 2 of a 16 x 32 plane of 24 channels) unfolded to tokens,
    scaled, and folded back: Reshape of transposed views both ways."""
    shapes = {"s1": [192, 2, 16, 2], "s2": [1, 24, 128, 4], "s3": [192, 16, 2, 2], "s4": [1, 24, 16, 32]}
    return one_node(
        "a = Reshape(x, s1)\n"
        "    b = Transpose<perm = [0, 2, 1, 3]>(a)\n"
        "    c = Reshape(b, s2)\n"
        "    d = Transpose<perm = [0, 3, 2, 1]>(c)\n"
        "    e = Mul(d, k)\n"
        "    f = Transpose<perm = [0, 3, 2, 1]>(e)\n"
        "    g = Reshape(f, s3)\n"
        "    h = Transpose<perm = [0, 2, 1, 3]>(g)\n"
        "    y = Reshape(h, s4)",
        {"x": _values((1, 24, 16, 32), np.float32)},
        {"y": "float"},
        constants={"k": _values((24,), np.float32, 3), **{name: np.array(shape, np.int64) for name, shape in shapes.items()}},
    )


def test_patches_unfolded_and_folded(path):
    x = _values((1, 24, 16, 32), np.float32, 6)
    k = _values((24,), np.float32, 3)
    tokens = x.reshape(192, 2, 16, 2).transpose(0, 2, 1, 3).reshape(1, 24, 128, 4).transpose(0, 3, 2, 1) * k
    expected = tokens.transpose(0, 3, 2, 1).reshape(192, 16, 2, 2).transpose(0, 2, 1, 3).reshape(1, 24, 16, 32)
    y = plugrt.load(_unfold_fold()).run({"x": x})["y"]
    np.testing.assert_array_equal(y, expected)


def test_a_transpose_read_only_by_matrix_products_stays_a_view(loops):
    """K^T for attention: BLAS reads the swapped matrix with a transpose flag, so the
    Transpose copies nothing; one read by anything else gives C order."""
    from plugrt_cpu.kernels.tensor import transpose

    class Context:
        attributes = {"perm": [0, 1, 3, 2]}

        def __init__(self, node):
            self.node = node

    import onnx_ir as ir

    def node_read_by(op_type: str):
        producer = ir.node("Transpose", inputs=[ir.Value(name="k")], attributes={"perm": [0, 1, 3, 2]})
        ir.node(op_type, inputs=[ir.Value(name="q"), producer.outputs[0]])
        return producer

    k = _values((1, 4, 64, 32), np.float32)
    by_matmul = transpose(Context(node_read_by("MatMul")))(k)
    by_softmax = transpose(Context(node_read_by("Add")))(k)
    np.testing.assert_array_equal(by_matmul, k.transpose(0, 1, 3, 2))
    np.testing.assert_array_equal(by_softmax, k.transpose(0, 1, 3, 2))
    assert np.shares_memory(by_matmul, k)
    assert by_softmax.flags.c_contiguous and not np.shares_memory(by_softmax, k)


@pytest.mark.parametrize("model", ["nhwc-layer-norm", "unfold-fold"])
def test_captured_and_replayed_without_allocating(path, model):
    if model == "nhwc-layer-norm":
        # the numpy path keeps the view, and its LayerNorm of a strided view makes
        # temporaries on every replay (as it did before the tiles)
        check_captured(
            _nhwc_layer_norm(), lambda rng: {"x": rng.standard_normal((2, 32, 9, 11)).astype(np.float32)},
            allocates=path == "numpy",
        )
    else:
        check_captured(_unfold_fold(), lambda rng: {"x": rng.standard_normal((1, 24, 16, 32)).astype(np.float32)})
