"""numba's runtime library (NRT) comes from a file beside the compiled loops' cache after
the first process compiles it (``plugrt_cpu.kernels._nrt_cache``): the functions numba then
compiles or loads allocate, free and count references through it as through numba's own.

Each case runs in a process of its own: the runtime is made once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

# A function numba compiles here (not cached), whose temporaries are allocated and released
# through the runtime: numba's allocation statistics must balance, and its result must be
# numpy's.
_SCRIPT = """
import json, os, sys
import numpy as np
from plugrt_cpu.kernels import _nrt_cache
installed = _nrt_cache.install(lambda: sys.argv[1])
import numba
from numba.core.runtime import rtsys

@numba.njit
def work(n):
    total = 0.0
    for i in range(n):
        a = np.arange(i + 3) * 2.0
        b = a[::-1].copy()
        total += (a * b).sum()
    return total, np.arange(n) * 0.5

work(1)  # compiled, and the runtime made (its statistics start with it)
before = rtsys.get_allocation_stats()
total, array = work(50)
del array
after = rtsys.get_allocation_stats()
print(json.dumps({
    "installed": installed,
    "source": _nrt_cache.state()["source"],
    "total": total,
    "allocated": after.alloc - before.alloc,
    "freed": after.free - before.free,
    "files": sorted(name for name in os.listdir(sys.argv[1]) if name.startswith("plugrt-nrt-")),
}))
"""


def _run(directory: Path, **env: str) -> dict:
    environment = {**os.environ, "NUMBA_NRT_STATS": "1", **env}
    environment.pop("NUMBA_DISABLE_JIT", None)
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(directory)], capture_output=True, text=True,
                          env=environment, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _expected_total(n: int = 50) -> float:
    import numpy as np

    total = 0.0
    for i in range(n):
        a = np.arange(i + 3) * 2.0
        total += float((a * a[::-1]).sum())
    return total


def test_first_process_compiles_and_writes_later_ones_read(tmp_path):
    first = _run(tmp_path)
    assert first["installed"] and first["source"] == "compiled"
    assert len(first["files"]) == 1
    second = _run(tmp_path)
    assert second["source"] == "cache"
    assert second["files"] == first["files"]
    for result in (first, second):
        assert result["total"] == pytest.approx(_expected_total(), rel=1e-12)
        assert result["allocated"] > 100  # the loop's temporaries went through the runtime
        assert result["freed"] == result["allocated"]  # and every one was released


def test_a_file_that_does_not_read_back_is_compiled_again_and_replaced(tmp_path):
    name = _run(tmp_path)["files"][0]
    (tmp_path / name).write_bytes(b"not a pickle")
    again = _run(tmp_path)
    assert again["source"] == "compiled"
    assert again["total"] == pytest.approx(_expected_total(), rel=1e-12)
    assert again["freed"] == again["allocated"]
    assert _run(tmp_path)["source"] == "cache"


def test_another_cpu_target_gets_a_file_of_its_own(tmp_path):
    native = _run(tmp_path)["files"]
    generic = _run(tmp_path, NUMBA_CPU_NAME="generic")
    assert generic["source"] == "compiled"  # the native target's object code is not taken for it
    assert len(generic["files"]) == 2 and set(native) < set(generic["files"])
    assert generic["total"] == pytest.approx(_expected_total(), rel=1e-12)


def test_the_compiled_loops_loader_installs_it(tmp_path):
    """Loading a compiled module puts the cache in place before numba makes its runtime."""
    script = (
        "import json\n"
        "from plugrt_cpu.kernels import _compiled, _nrt_cache\n"
        "assert _compiled._LOADER.load('_numba_parallel') is not None\n"
        "print(json.dumps(_nrt_cache.state()))\n"
    )
    environment = {**os.environ, "PLUGRT_NUMBA": "wait"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment, timeout=600)
    assert done.returncode == 0, done.stderr
    state = json.loads(done.stdout.strip().splitlines()[-1])
    assert state["installed"] and state["source"] in ("cache", "compiled")
