"""The host's data cache sizes as sysfs reports them, and the blocking the packed GEMM
derives from its L2 (not a constant fitted on one CPU)."""

from __future__ import annotations

import io

import pytest

from plugrt_cpu.kernels import _host_cpu

# a 2-core AMD host's CPU 0: L1 data and instruction caches, L2, L3
_SYSFS = {
    "index0": {"level": "1", "type": "Data", "size": "32K"},
    "index1": {"level": "1", "type": "Instruction", "size": "32K"},
    "index2": {"level": "2", "type": "Unified", "size": "1024K"},
    "index3": {"level": "3", "type": "Unified", "size": "32M"},
}


def _fake_sysfs(monkeypatch: pytest.MonkeyPatch, entries: dict[str, dict[str, str]]) -> None:
    def fake_open(path: str, *args: object, **kwargs: object) -> io.StringIO:
        folder, _, name = path.rpartition("/")
        index = folder.rpartition("/")[2]
        if not folder.startswith("/sys/devices/system/cpu/cpu0/cache/") or index not in entries:
            raise FileNotFoundError(path)
        return io.StringIO(entries[index][name] + "\n")

    monkeypatch.setattr(_host_cpu, "open", fake_open, raising=False)
    _host_cpu.data_cache_bytes.cache_clear()  # read once per process: these tests read the fake


@pytest.fixture(autouse=True)
def _forget_the_fake_sizes():
    yield
    _host_cpu.data_cache_bytes.cache_clear()


def test_cache_sizes_are_read_per_level_skipping_the_instruction_cache(monkeypatch):
    _fake_sysfs(monkeypatch, _SYSFS)
    assert _host_cpu.data_cache_bytes(1, 0) == 32 * 1024
    assert _host_cpu.data_cache_bytes(2, 0) == 1 << 20
    assert _host_cpu.data_cache_bytes(3, 0) == 32 << 20


def test_a_size_in_bytes_is_read_as_it_is(monkeypatch):
    _fake_sysfs(monkeypatch, {"index0": {"level": "2", "type": "Unified", "size": "1310720"}})
    assert _host_cpu.data_cache_bytes(2, 0) == 1310720


@pytest.mark.parametrize(
    "entries",
    [{}, {"index0": {"level": "2", "type": "Unified", "size": "lots"}}],
    ids=["no-sysfs", "unreadable-size"],
)
def test_the_default_where_sysfs_says_nothing_usable(monkeypatch, entries):
    _fake_sysfs(monkeypatch, entries)
    assert _host_cpu.data_cache_bytes(2, 512 * 1024) == 512 * 1024


def test_the_packed_gemm_chunk_follows_the_l2(monkeypatch):
    pytest.importorskip("numba")
    from plugrt_cpu.kernels import _numba_gemm

    sizes = {2: 1 << 20}
    monkeypatch.setattr(_numba_gemm, "data_cache_bytes", lambda level, default: sizes.get(level, default))
    monkeypatch.setattr(_numba_gemm, "host_features", lambda: {"avx512f": True})
    assert _numba_gemm._chunk_floats() == 160 * 1024  # five eighths of 1 MiB, in floats
    sizes[2] = 256 * 1024
    assert _numba_gemm._chunk_floats() == 40 * 1024
    sizes[2] = 64 * 1024
    assert _numba_gemm._chunk_floats() == 16 * 1024  # never below a few tiles of a deep product
    sizes[2] = 1 << 20
    monkeypatch.setattr(_numba_gemm, "host_features", lambda: {})  # compiled for a portable target
    assert _numba_gemm._chunk_floats() == 80 * 1024  # 512 KiB's, whatever this host has
