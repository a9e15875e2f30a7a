"""The CUDA EPContext blob: round trip, malformed blobs, and the compatibility verdict."""

from __future__ import annotations

import pytest

from plugrt.errors import EpContextError
from plugrt.provider import Partition

from cuda_helpers import missing_cupy
from plugrt_cuda import _context
from plugrt_cuda._provider import CUDAProvider


def _saved(**changes) -> _context.SavedContext:
    fields = dict(arch="sm_90", driver_version=12040, runtime_version=12040, cupy_version="14.2.0",
                  cubins={("gemm", "float32"): b"\x7fELF-gemm", ("pool", "float16"): b"\x7fELF-pool"},
                  nvrtc_version=12090)
    fields.update(changes)
    return _context.SavedContext(**fields)


def test_a_blob_round_trips_its_cubins_and_where_they_were_built():
    saved = _saved()
    assert _context.loads(_context.dumps(saved)) == saved


@pytest.mark.parametrize(
    "blob,message",
    [
        (b"not a context", "bad magic"),
        (_context.dumps(_saved())[:14], "cut short"),
        (_context.dumps(_saved())[:-3], "outside the blob"),
    ],
    ids=["foreign", "no header", "truncated cubin"],
)
def test_a_malformed_blob_is_refused_with_what_is_wrong(blob, message):
    with pytest.raises(ValueError, match=message):
        _context.loads(blob)


def test_a_header_length_past_the_blob_is_refused():
    blob = bytearray(_context.dumps(_saved()))
    blob[len(b"PLUGRTCUDA\x00\x01") : len(b"PLUGRTCUDA\x00\x01") + 4] = (10**6).to_bytes(4, "little")
    with pytest.raises(ValueError, match="header claims"):
        _context.loads(bytes(blob))


def test_the_same_architecture_and_cuda_major_restore():
    assert _context.verdict(_saved(), arch="sm_90", driver_version=12080) is None


def test_a_newer_cupy_runtime_than_the_driver_does_not_force_a_recompile():
    # the lent H200: cupy's CUDA runtime is 13.2 (13020), the driver runs CUDA 13.0 (13000);
    # cubins from NVRTC 13.2 load there (minor-version compatibility)
    saved = _saved(runtime_version=13020, driver_version=13000, nvrtc_version=13020, cupy_version="14.2.0")
    assert _context.verdict(saved, arch="sm_90", driver_version=13000) is None


@pytest.mark.parametrize(
    "saved,here,expected",
    [
        ({}, dict(arch="sm_80", driver_version=12080), "compiled for sm_90, this GPU is sm_80"),
        (dict(nvrtc_version=13000), dict(arch="sm_90", driver_version=12080),
         "compiled by NVRTC 13.0, and this driver runs CUDA 12.8 at most"),
        (dict(nvrtc_version=0), dict(arch="sm_90", driver_version=12080), "does not say which NVRTC"),
    ],
    ids=["architecture", "driver's CUDA major", "unknown NVRTC"],
)
def test_a_difference_that_stops_a_restore_is_named(saved, here, expected):
    assert expected in _context.verdict(_saved(**saved), **here)


def test_a_blob_without_an_nvrtc_version_reads_as_unknown():
    blob = _context.dumps(_saved())
    header_start = len(b"PLUGRTCUDA\x00\x01") + 4
    length = int.from_bytes(blob[header_start - 4 : header_start], "little")
    header = blob[header_start : header_start + length].replace(b'"nvrtc_version": 12090, ', b"")
    old = blob[:header_start - 4] + len(header).to_bytes(4, "little") + header + blob[header_start + length :]
    assert _context.loads(old).nvrtc_version == 0


def _provider() -> CUDAProvider:
    return CUDAProvider(importer=missing_cupy)


def test_load_context_turns_a_malformed_blob_into_an_ep_context_error():
    partition = Partition("p", [], [], [], {"": 17})
    with pytest.raises(EpContextError, match="cannot be restored: not a plugrt CUDA context"):
        _provider().load_context(b"garbage", {"partition": partition, "partition_name": "p"})


def test_load_context_needs_the_partition_it_stands_for():
    with pytest.raises(EpContextError, match="meta\\['partition'\\]"):
        _provider().load_context(_context.dumps(_saved()), {"partition_name": "p"})


def test_check_context_refuses_another_format_with_the_fix():
    decision = _provider().check_context({"ep_sdk_version": "plugrt-cuda-context-0"})
    assert not decision.supported and "re-export" in decision.reason
    assert _provider().check_context({"ep_sdk_version": _context.FORMAT}).supported


def test_save_context_of_a_partition_not_compiled_on_a_gpu_is_refused():
    from plugrt.provider import CompiledPartition

    compiled = CompiledPartition(Partition("p", [], [], [], {"": 17}), [], "cuda", state=None)
    with pytest.raises(EpContextError, match="not compiled by the CUDA provider on a GPU"):
        _provider().save_context(compiled)
