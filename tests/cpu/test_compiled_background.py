"""The compiled loops are built in the background: a session serves numpy until they are
loaded, then switches; a capture keeps the path it was made with; ``plugrt compile-cache``
fills numba's on-disk cache so that the next process loads every loop from it."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import onnx
import pytest
from onnx import helper

import plugrt
from plugrt.capture import Captured
from plugrt_cpu.kernels import _compiled

from cpu.test_into import replay_bytes, REPLAY_BYTES


def _needs_numba() -> None:
    pytest.importorskip("numba")
    if os.environ.get("PLUGRT_NUMBA", "1") == "0":
        pytest.skip("PLUGRT_NUMBA=0 turns the compiled loops off")


class _Recording:
    """A compiled module that notes each use (an attribute read) in ``used``."""

    def __init__(self, module, name: str, used: list[str]):
        self._module, self._name, self._used = module, name, used

    def __getattr__(self, attribute):
        self._used.append(self._name)
        return getattr(self._module, attribute)


@pytest.fixture
def held_build(monkeypatch):
    """A loader whose build waits for ``release`` (the test's stand-in for the compiler),
    then loads recording modules; the environment's default mode, read afresh."""
    _needs_numba()
    from plugrt_cpu.kernels._compiled_parallel import compiled_pool

    compiled_pool()  # made from the real loops, before the loader is swapped (it is kept for the process)
    release = threading.Event()
    used: list[str] = []

    def importer(name):
        assert release.wait(120)
        return _Recording(importlib.import_module(f"plugrt_cpu.kernels.{name}"), name, used)

    loader = _compiled._Loader(importer=importer, compile_ahead=lambda: None)
    monkeypatch.setattr(_compiled, "_LOADER", loader)
    monkeypatch.setenv("PLUGRT_NUMBA", "1")
    _compiled._mode.cache_clear()
    yield loader, release, used
    release.set()
    loader.finished.wait(120)
    _compiled._mode.cache_clear()


def _pool_model() -> bytes:
    """MaxPool 3x3/2 over float32 NCHW (SqueezeNet's): the compiled loops take it, and
    its maxima are exact on both paths."""
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2])
    graph = helper.make_graph(
        [node],
        "pool",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 16, 27, 27])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


_X = {"x": np.random.default_rng(0).standard_normal((1, 16, 27, 27)).astype(np.float32)}


def test_compiled_module_answers_at_once_while_its_loops_build(held_build):
    loader, _, _ = held_build
    started = time.perf_counter()
    assert _compiled.compiled_module("_numba_pool") is None
    assert time.perf_counter() - started < 0.5  # the held importer would block for 120 s
    assert loader._thread is not None and loader._thread.is_alive()  # the ask started the build


def test_a_forked_child_starts_a_build_of_its_own(held_build):
    loader, _, _ = held_build
    loader.want(["_numba_pool"])
    parent_thread = loader._thread
    loader._pid = -1  # as a child forked while the parent built sees it: the thread stayed in the parent
    assert loader._lock.acquire(timeout=5)  # and held the lock at the fork: the child must not wait on it
    loader.want(["_numba_pool"])
    assert loader._thread is not parent_thread and loader._thread.is_alive()


def test_only_the_modules_asked_for_are_loaded_first_asked_first(held_build):
    loader, release, used = held_build
    assert _compiled.compiled_module("_numba_pool") is None
    assert _compiled.compiled_module("_numba_loops") is None
    release.set()
    assert loader.finished.wait(120)
    order = list(loader.ready)
    assert order.index("_numba_pool") < order.index("_numba_loops")
    assert "_numba_winograd" not in loader.ready and "_numba_conv" not in loader.ready  # never asked for
    assert _compiled.compiled_module("_numba_winograd") is None  # asked now: queued, loaded next
    assert loader.finished.wait(120)
    assert "_numba_winograd" in loader.ready


def test_binding_a_node_queues_the_compiled_loops_its_kernel_runs_with(held_build):
    loader, _, used = held_build
    plugrt.load(_pool_model(), device="cpu")  # built, never run
    assert "_numba_pool" in loader._wanted and used == []  # queued at bind (the load is held)


def test_each_compiled_module_s_imports_of_others_are_listed():
    import ast
    from pathlib import Path

    folder = Path(_compiled.__file__).parent
    for name in _compiled.MODULES:
        tree = ast.parse((folder / f"{name}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}
        assert {m for m in imported if m in _compiled.MODULES} == set(_compiled.IMPORTS.get(name, ())), name


def test_the_compiled_modules_a_loaded_module_imports_are_ready_with_it(held_build):
    loader, release, _ = held_build
    _compiled.compiled_module("_numba_int4")  # imports the thread pool's loops
    release.set()
    assert loader.finished.wait(120)
    assert "_numba_int4" in loader.ready and "_numba_parallel" in loader.ready


def test_a_session_serves_numpy_while_the_loops_build_then_switches(held_build):
    loader, release, used = held_build
    session = plugrt.load(_pool_model(), device="cpu")
    before = session.run(_X)["y"]
    assert used == []  # the numpy path ran
    release.set()
    assert loader.finished.wait(120)
    after = session.run(_X)["y"]  # the same session and plan
    assert "_numba_pool" in used
    np.testing.assert_array_equal(after, before)


def test_a_capture_made_while_the_loops_build_keeps_its_path(held_build):
    loader, release, used = held_build
    session = plugrt.load(_pool_model(), device="cpu")
    result = session.try_capture(_X)
    assert isinstance(result, Captured)
    captured = session.replay(_X)["y"].copy()
    release.set()
    assert loader.finished.wait(120)
    replayed = session.replay(_X)["y"]
    assert used == []  # the replay kept the numpy path it was captured with
    np.testing.assert_array_equal(replayed, captured)
    assert replay_bytes(lambda: session.replay(_X), small_buffers=True) < REPLAY_BYTES
    session.run(_X)
    assert "_numba_pool" in used  # while an eager run moves on


def test_a_plan_built_before_the_packed_gemm_packs_its_weight_once_it_is_there(held_build):
    loader, release, _ = held_build
    from plugrt_cpu.kernels import conv, conv_units

    weight = conv._ConvWeight(np.ones((32, 16, 1, 1), np.float32), 1, np.dtype(np.float32))
    weight.constant = True
    assert weight.packed() is None
    release.set()
    assert loader.finished.wait(120)
    if conv_units.packing() is None:
        pytest.skip("no packed-weight GEMM on this host (AVX-512)")
    assert weight.packed() is not None


def _run_python(code: str, **environment: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **environment}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)


_LOAD_EVERYTHING = r"""
import json, importlib
from numba.core.ccallback import CFunc
from numba.core.registry import CPUDispatcher
from plugrt_cpu.kernels import _compiled
assert _compiled.wait_ready(600)
misses, hits = 0, 0
for name in _compiled.MODULES:
    module = importlib.import_module("plugrt_cpu.kernels." + name)
    for value in vars(module).values():
        if isinstance(value, CPUDispatcher) and not value._can_compile:  # the entry points
            misses += sum(value.stats.cache_misses.values())
            hits += sum(value.stats.cache_hits.values())
        elif isinstance(value, CFunc):
            misses += value.cache_hits == 0
            hits += value.cache_hits
print(json.dumps({"misses": misses, "hits": hits, "loaded": len(_compiled._LOADER.ready)}))
"""


def _compile_cache_then_load(cache: str | None) -> tuple[subprocess.CompletedProcess, dict]:
    environment = {"PLUGRT_NUMBA": "1", **({"NUMBA_CACHE_DIR": cache} if cache else {})}
    command = _run_python("from plugrt.cli import main; raise SystemExit(main(['compile-cache', '--provider', 'cpu']))", **environment)
    assert command.returncode == 0, command.stderr[-2000:]
    second = _run_python(_LOAD_EVERYTHING, **environment)
    assert second.returncode == 0, second.stderr[-2000:]
    return command, json.loads(second.stdout.strip().splitlines()[-1])


def test_compile_cache_shows_progress_and_a_second_process_loads_every_loop_from_the_cache():
    _needs_numba()
    command, loaded = _compile_cache_then_load(None)  # the cache the suite uses: warm already
    total = len(_compiled.MODULES)
    assert f"compiling 1 of {total}: _numba_parallel" in command.stderr
    assert f"{total} of {total} compiled in" in command.stderr
    assert f"cpu: {total} of {total} compiled units in the cache" in command.stdout
    assert loaded == {"misses": 0, "hits": loaded["hits"], "loaded": total} and loaded["hits"] > 0


@pytest.mark.slow
def test_compile_cache_fills_an_empty_cache(tmp_path):
    _needs_numba()
    _, loaded = _compile_cache_then_load(str(tmp_path))
    assert len(list(tmp_path.glob("plugrt-numba-*.ready"))) == 1  # the stamp later processes look for
    assert loaded["misses"] == 0 and loaded["loaded"] == len(_compiled.MODULES)


def test_prepare_cache_without_numba_says_how_to_get_it(monkeypatch):
    import importlib.util

    from plugrt_cpu import CPUProvider

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "numba" else real(name, *a))
    calls = []
    report = CPUProvider().prepare_cache(lambda *args: calls.append(args))
    assert report.ready == 0 and report.total == len(_compiled.MODULES)
    assert "plugrt[accelerate]" in report.note
    assert calls == []  # nothing was compiled


def test_prepare_cache_under_plugrt_numba_0_compiles_nothing(monkeypatch):
    from plugrt_cpu import CPUProvider

    pytest.importorskip("numba")  # without it the report says that instead
    monkeypatch.setenv("PLUGRT_NUMBA", "0")
    calls = []
    report = CPUProvider().prepare_cache(lambda *args: calls.append(args))
    assert report.ready == 0 and "PLUGRT_NUMBA=0" in report.note and calls == []


def test_a_module_that_fails_to_load_is_said_and_its_steps_stay_on_numpy():
    def importer(name):
        raise ValueError("a broken compiled module")

    loader = _compiled._Loader(importer=importer, compile_ahead=lambda: None)
    assert "_numba_gemm" not in _compiled.IMPORTS  # a module importing no other
    with pytest.warns(RuntimeWarning, match="_numba_gemm failed to load"):
        loader.want(["_numba_gemm"])
        assert loader.finished.wait(120)
    assert loader.failed == {"_numba_gemm"} and loader.ready == {}


def _printed_after_loading(needs: str, lines: str, cwd=None) -> list[str]:
    """What a fresh interpreter prints after loading the compiled pool's module and running
    ``lines``; skipped without numba or without the module ``needs``."""
    pytest.importorskip("numba")
    import importlib.util

    if importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed: numba imports nothing of it")
    code = (
        "import sys\n"
        "from plugrt_cpu.kernels import _compiled\n"
        "assert _compiled._LOADER.load('_numba_parallel') is not None\n"
    ) + lines
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_loading_the_compiled_loops_leaves_scipy_linalg_unimported_until_used():
    """numba checks at import that a BLAS exists by importing scipy.linalg.cython_blas
    (all of scipy.linalg: 0.2 s, 28 MiB); the loops never call BLAS through numba, so the
    module is deferred: the check passes, and numba's np.dot imports it when compiled."""
    printed = _printed_after_loading(
        "scipy",
        "import numba.np.arraymath\n"
        "print('scipy.linalg' in sys.modules, numba.np.arraymath._HAVE_BLAS)\n"
        "import numba, numpy as np\n"
        "dot = numba.njit(lambda a, b: np.dot(a, b))\n"
        "a = np.arange(16.0).reshape(4, 4)\n"
        "print(bool(np.allclose(dot(a, a), a @ a)), 'scipy.linalg' in sys.modules)\n",
    )
    assert printed == ["False", "True", "True", "True"]


def test_numba_still_reads_its_config_file_and_pyyaml_is_otherwise_left_unimported(tmp_path):
    """PyYAML is deferred like scipy.linalg while numba is imported: numba reads it only
    when a ``.numba_config.yaml`` is in the working directory, and then it still does."""
    lines = "import numba\nprint(type(sys.modules.get('yaml')).__name__, numba.config.BOUNDSCHECK)\n"
    assert _printed_after_loading("yaml", lines, cwd=tmp_path) == ["NoneType", "None"]
    (tmp_path / ".numba_config.yaml").write_text("boundscheck: 1\n")
    assert _printed_after_loading("yaml", lines, cwd=tmp_path) == ["module", "1"]


def test_a_build_for_changed_sources_forgets_every_compiled_modules_cache_entries(tmp_path, monkeypatch):
    """numba checks a function's own file only: a build with no stamp for these sources
    first removes the ``_numba_*`` entries (a unit calling into another module edited since
    would load its old code), and nothing else in the cache; a build the stamp says is
    complete removes nothing, and so does a later build for the same sources that did not
    complete (it forgets once per set of sources)."""
    entries = [
        "_numba_gemm.packed_product-412.py311.nbi", "_numba_gemm.packed_product-412.py311.1.nbc",
        "_numba_conv.conv_units-140.py311.nbi",
    ]
    others = ["other_project.f-1.py311.nbi", "plugrt-numba-0123456789abcdef.ready", "_numba_gemm.py", "plugrt-nrt-0a.pkl"]
    for name in entries + others:
        (tmp_path / name).write_text("x")
    stamp = tmp_path / "plugrt-numba-fedcba9876543210.ready"
    monkeypatch.setattr(_compiled, "cache_stamp", lambda: str(stamp))
    monkeypatch.setattr(_compiled, "cache_directory", lambda: str(tmp_path))
    monkeypatch.setattr(_compiled, "_mode", lambda: "wait")

    class NoModules:
        names: tuple[str, ...] = ()

    monkeypatch.setattr(_compiled, "_LOADER", NoModules())
    _compiled.build_all()
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith((".lock", ".forgotten")))
    assert left == sorted(others + [stamp.name])
    (tmp_path / entries[0]).write_text("x")  # compiled since, for these sources
    _compiled.build_all()
    assert (tmp_path / entries[0]).exists()
    stamp.unlink()  # a build that did not complete (a module that fails here): forgotten once already
    _compiled.build_all()
    assert (tmp_path / entries[0]).exists()
