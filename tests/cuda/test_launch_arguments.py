"""Every launch of the provider's own CUDA kernels passes what the kernel's C signature takes:
as many arguments, pointers as arrays of the storage type, ints as int32, long longs as
int64, floats as float32, and a grid and block a device accepts. The launches run over a
numpy stand-in for cupy whose modules read the signatures from the CUDA C source, so a
launch that would pass a wrong argument list on a GPU fails here."""

from __future__ import annotations

import re
import types

import numpy as np
import pytest

from plugrt_cuda import _sources
from plugrt_cuda._backend import CupyBackend

_SIGNATURE = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)', re.S)
_STORAGE = {"float": np.float32, "unsigned short": np.float16}  # T per module dtype


def _parameters(code: str) -> dict[str, list[str]]:
    """kernel name -> the C type of each parameter."""
    kernels = {}
    for name, params in _SIGNATURE.findall(code):
        types_ = []
        for param in params.split(","):
            words = param.replace("__restrict__", "").replace("const", "").split()
            pointer = "*" in param
            base = " ".join(w for w in words[:-1] if w != "*").replace("*", "").strip()
            types_.append(base + "*" if pointer else base)
        kernels[name] = types_
    return kernels


class _Launches:
    """A numpy cupy whose RawModule checks each launch against the kernel's signature."""

    def __init__(self):
        self.launched: list[str] = []
        self.cuda = types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(is_capturing=lambda: True))

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(shape, dtype=np.float32):  # what a kernel would write: no garbage in the host math
        return np.zeros(shape, dtype)

    def RawModule(self, code: str, options: tuple):
        storage = re.search(r"typedef (.+?) T;", code).group(1)
        kernels = _parameters(code)

        def function(name: str):
            expected = kernels[name]

            def launch(grid, block, args):
                assert len(args) == len(expected), f"{name}: {len(args)} arguments, the kernel takes {len(expected)}"
                for position, (arg, c_type) in enumerate(zip(args, expected)):
                    where = f"{name} argument {position} ({c_type})"
                    if c_type == "T*":
                        assert isinstance(arg, np.ndarray) and arg.dtype == _STORAGE[storage], where
                        assert arg.flags.c_contiguous, f"{where}: not contiguous"
                    elif c_type == "float*":
                        assert isinstance(arg, np.ndarray) and arg.dtype == np.float32, where
                    elif c_type == "int":
                        assert type(arg) is np.int32, f"{where}: {type(arg).__name__}"
                    elif c_type == "long long":
                        assert type(arg) is np.int64, f"{where}: {type(arg).__name__}"
                    elif c_type == "float":
                        assert type(arg) is np.float32, f"{where}: {type(arg).__name__}"
                    else:
                        raise AssertionError(f"{where}: a parameter type this test does not know")
                assert all(isinstance(g, int) and 1 <= g < 2**31 for g in grid), f"{name}: grid {grid}"
                assert all(isinstance(b, int) for b in block) and 1 <= int(np.prod(block)) <= 1024, name
                self.launched.append(name)

            return launch

        return types.SimpleNamespace(get_function=function)


@pytest.fixture
def backend():
    return CupyBackend(_Launches())


def _random(*shape, dtype):
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def test_the_parser_reads_every_kernel_of_every_module():
    for name, source in _sources.SOURCES.items():
        kernels = _parameters(_sources.module_source(name, "float32"))
        assert sorted(kernels) == sorted(source.kernels)
        assert all(kernels.values())


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(
    "a_shape,b_shape,transpose_b",
    [((5, 7), (7, 3), False), ((2, 5, 7), (7, 3), False), ((2, 5, 7), (2, 7, 3), False), ((5, 7), (3, 7), True)],
    ids=["2-D", "batched A", "batched both", "transposed B view"],
)
def test_gemm_launches_match_the_kernel_signature(backend, dtype, a_shape, b_shape, transpose_b):
    a, b = _random(*a_shape, dtype=dtype), _random(*b_shape, dtype=dtype)
    if transpose_b:
        b = b.T  # a Gemm's transB weight, read in place
    backend.gemm(a, b, _random(3, dtype=dtype), alpha=0.5)
    assert backend.xp.launched == ["gemm"]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("group,bias", [(1, True), (2, False), (8, True)], ids=["dense", "grouped", "depthwise"])
def test_conv_launches_match_the_kernel_signatures(backend, dtype, group, bias):
    x, w = _random(2, 8, 9, 7, dtype=dtype), _random(8, 8 // group, 3, 3, dtype=dtype)
    b = _random(8, dtype=dtype) if bias else None
    backend.conv(x, w, b, True, {"group": group, "strides": [2, 1], "pads": [1, 1, 0, 1], "dilations": [1, 2]})
    assert backend.xp.launched == (["depthwise_conv2d"] if group == 8 else ["im2col2d", "gemm"])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("mode", ["max", "average"])
def test_pool_launches_match_the_kernel_signature(backend, dtype, mode):
    attributes = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 1, 1], "ceil_mode": 1}
    backend.pool(_random(2, 3, 10, 9, dtype=dtype), mode, attributes)
    assert backend.xp.launched == ["pool2d"]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_softmax_and_layernorm_launches_match_their_kernel_signatures(backend, dtype):
    backend.softmax(_random(6, 100, dtype=dtype), -1, False, True)
    x = _random(4, 7, 64, dtype=dtype)
    backend.layer_normalization(x, _random(64, dtype=dtype), _random(64, dtype=dtype), -1, 1e-5)
    backend.layer_normalization(x, _random(64, dtype=dtype), None, -1, 1e-5)
    assert backend.xp.launched == ["softmax_rows", "layernorm_rows", "layernorm_rows"]


def test_a_launch_with_a_python_int_for_an_int_parameter_is_caught():
    fake = _Launches()
    module = fake.RawModule(_sources.module_source("softmax", "float32"), ())
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(AssertionError, match="softmax_rows argument 2 \\(int\\): int"):
        module.get_function("softmax_rows")((2,), (256,), (x, x, 4, np.int32(0)))
