"""The one way the CPU kernels load their optional numba-compiled loops: built in the
background, so that no step ever waits for the compiler.

``compiled_module(name)`` answers at once: the module when its loops are ready in this
process, else None, and the caller runs its numpy path. An ask for a module not loaded
yet queues it for a thread of this process, which imports the modules asked for, in the
order asked, each ready as soon as it is loaded (with the compiled modules it imports);
modules no kernel asks for are never loaded, so a decoder does not pay the convolution
loops' load time and memory. The first ask in a process whose cache is not complete
first has a child process (at the lowest priority) import every compiled module, which
compiles into numba's on-disk cache whatever it lacks. A compile on a thread of
this process would hold the GIL for most of its time (SqueezeNet's numpy runs beside it
measured 2.6x slower, against 1.35x beside the child); loading from the cache is short.
Once the child has built everything a stamp beside the cache says so, and later processes
load at once. ``generation()`` counts the modules loaded, for callers that remember
something derived from them (a packed weight).

``PLUGRT_NUMBA``: ``0`` turns the loops off (numpy runs those steps); ``wait`` makes the
first step that asks for a module import it on the spot, compiling what the cache lacks,
and wait (the behaviour before the background build: for benchmarks and tests of the
compiled loops); anything else, or unset, builds in the background.

A capture pins what was ready when it was made (``pinned``), so that a replay never
switches paths (a first compiled call allocates its contexts and packed weights).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from types import ModuleType
from typing import Callable, Iterable, Iterator, Mapping

__all__ = [
    "IMPORTS",
    "MODULES",
    "Snapshot",
    "build_all",
    "call_pinned",
    "build_finished",
    "cache_directory",
    "cache_stamp",
    "compiled_enabled",
    "compiled_module",
    "forget_compiled_entries",
    "generation",
    "pinned",
    "snapshot",
    "wait_ready",
]

#: Every compiled-loops module of ``plugrt_cpu.kernels``, in build order (a module after
#: those it imports), with what it compiles.
MODULES: dict[str, str] = {
    "_numba_parallel": "compiled jobs over the threads",
    "_numba_epilogue": "Conv and BatchNormalization epilogues",
    "_numba_gemm": "packed-weight GEMM",
    "_numba_conv": "Conv units (gather, GEMM, epilogue)",
    "_numba_loops": "GELU, LayerNorm of a sum, attention softmax",
    "_numba_dense": "dense layers' packing and bias/GELU epilogue",
    "_numba_decode": "RMS norms, decode attention, rotary KV caches",
    "_numba_int4": "4-bit MatMulNBits (int8 and float tiles)",
    "_numba_depthwise": "depthwise Conv",
    "_numba_pool": "MaxPool and AveragePool",
    "_numba_winograd": "Winograd transforms",
    "_numba_transpose": "transposed copies",
}
#: The compiled modules each one imports (loaded before it: a module asked for later is
#: then ready at once, as the thread pool's loops under the 4-bit kernels must be).
IMPORTS: dict[str, tuple[str, ...]] = {
    "_numba_epilogue": ("_numba_parallel",),
    "_numba_conv": ("_numba_parallel", "_numba_epilogue", "_numba_gemm"),
    "_numba_decode": ("_numba_parallel",),
    "_numba_dense": ("_numba_parallel", "_numba_gemm", "_numba_loops"),
    "_numba_loops": ("_numba_parallel", "_numba_epilogue"),
    "_numba_depthwise": ("_numba_parallel", "_numba_epilogue"),
    "_numba_int4": ("_numba_parallel",),
    "_numba_pool": ("_numba_parallel",),
    "_numba_winograd": ("_numba_parallel", "_numba_gemm"),
    "_numba_transpose": ("_numba_parallel",),
}
_PACKAGE = "plugrt_cpu.kernels"

#: What kernels of a kind ask for when a node is bound (``kernel(..., compiled=...)``).
CONV_LOOPS = ("_numba_conv", "_numba_depthwise", "_numba_winograd")
DENSE_LOOPS = ("_numba_dense",)
ROW_LOOPS = ("_numba_loops",)
POOL_LOOPS = ("_numba_pool",)
TRANSPOSE_LOOPS = ("_numba_transpose",)

Progress = Callable[[int, int, str], None]  # (modules done, modules in all, the one starting)


class Snapshot:
    """The modules ready at one moment, and the generation they make."""

    __slots__ = ("modules", "generation")

    def __init__(self, modules: Mapping[str, ModuleType], generation: int) -> None:
        self.modules = dict(modules)
        self.generation = generation


class _Loader:
    """This process's compiled modules: those ready, those that failed, those asked for
    and not loaded yet, and the thread that loads them.

    ``importer`` imports one module by name; ``compile_ahead`` fills the on-disk cache
    before this process imports from it (a child process). Both are parameters so that
    tests can hold a build back or count what it does."""

    def __init__(
        self,
        importer: Callable[[str], ModuleType] | None = None,
        compile_ahead: Callable[[], None] | None = None,
        modules: Mapping[str, str] = MODULES,
    ) -> None:
        self.importer = importer or (lambda name: importlib.import_module(f"{_PACKAGE}.{name}"))
        self.compile_ahead = compile_ahead or _compile_in_child
        self.names = tuple(modules)
        self.ready: dict[str, ModuleType] = {}
        self.failed: set[str] = set()
        self.generation = 0
        self.finished = threading.Event()  # set while nothing asked for is left to load
        self.finished.set()
        self._wanted: list[str] = []  # asked for and not loaded yet, in the order asked
        self._cache_checked = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()  # the process the load thread runs in

    def load(self, name: str) -> ModuleType | None:
        """Import ``name`` on this thread (compiling what the cache lacks); None, and
        remembered, where numba is missing or unusable."""
        module = self.ready.get(name)
        if module is not None or name in self.failed:
            return module
        _defer_numba_blas_check()
        _cache_numba_runtime()
        try:
            module = self.importer(name)
        except ImportError:
            self.failed.add(name)
            return None
        except (RuntimeError, OSError) as e:  # numba there but unusable (e.g. no writable cache)
            self.failed.add(name)
            warnings.warn(f"plugrt: numba's compiled loops are off ({e}); numpy runs those steps", RuntimeWarning, 2)
            return None
        with self._lock:
            if name not in self.ready:
                self.ready[name] = module
                self.generation += 1
        return module

    def want(self, names: Iterable[str]) -> None:
        """Queue ``names`` (after what was asked before) and make sure a thread loads them."""
        if self._pid != os.getpid():  # a forked child: the load thread, and any lock it held, stayed behind
            self._thread, self._lock, self._pid = None, threading.Lock(), os.getpid()
        with self._lock:
            for asked in names:
                for name in IMPORTS.get(asked, ()) + (asked,):
                    if name not in self.ready and name not in self.failed and name not in self._wanted:
                        self._wanted.append(name)
            if not self._wanted:
                return
            self.finished.clear()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="plugrt-numba-build", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        """The load thread: the modules asked for, one by one, until none is left."""
        if not self._cache_checked:
            self._cache_checked = True
            if not os.path.exists(cache_stamp()):
                with contextlib.suppress(Exception):
                    self.compile_ahead()  # waits on the child without the GIL
        while True:
            with self._lock:
                if not self._wanted:
                    self._thread = None
                    self.finished.set()
                    return
                name = self._wanted[0]
            try:
                self.load(name)
            except Exception as e:  # noqa: BLE001  (a module that cannot load leaves its steps on numpy)
                self.failed.add(name)
                warnings.warn(f"plugrt: the compiled loops {name} failed to load ({e!r}); numpy runs those steps",
                              RuntimeWarning, 2)
            finally:
                with self._lock:
                    self._wanted = [w for w in self._wanted if w not in self.ready and w not in self.failed]
            if self.ready and "numpy.ma" not in sys.modules:
                # numba's typeof of an array reads numpy.ma, whose import (~9 ms) numpy defers:
                # here, beside the session's build, rather than in the first run's first call
                with contextlib.suppress(ImportError):
                    importlib.import_module("numpy.ma")

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(self.ready, self.generation)

    def settled(self) -> bool:
        """Whether nothing will change any more: every module loaded or failed."""
        return all(name in self.ready or name in self.failed for name in self.names)


def _defer_numba_blas_check() -> None:
    """Import numba's numpy support, whose module-level check that a BLAS exists imports
    ``scipy.linalg.cython_blas`` where scipy is installed, and with it all of scipy.linalg:
    0.19 s and 28 MiB (2-core EPYC), a tenth of a 135M-parameter decoder's peak memory.
    The compiled loops never call BLAS through numba (they call the GEMM by its address),
    so that import is answered by a stand-in (``plugrt._deferred_sympy.defer``) for the
    length of this one import, then taken away: numba's check passes, and numba's own
    linear algebra, or anything else, imports the real module when it asks for it. PyYAML,
    which numba imports in case a ``.numba_config.yaml`` is in the working directory (19 ms,
    1 MiB), is deferred the same way: numba reads it only when that file exists."""
    if "numba.np.arraymath" in sys.modules:
        return
    from plugrt._deferred_sympy import defer, undefer  # the core's deferred modules (private to the project)

    stand_ins = [defer(name) for name in ("scipy.linalg.cython_blas", "yaml")]
    try:
        import numba.np.arraymath  # noqa: F401
    except Exception:  # noqa: BLE001  (numba missing or unusable: the load below says so)
        pass
    finally:
        for stand_in in stand_ins:
            undefer(stand_in)


def _cache_numba_runtime() -> None:
    """Have numba read its runtime library from the compiled loops' cache directory
    rather than compile it with LLVM in every process (``_nrt_cache``: 27 MiB of LLVM's
    code not paged in, ~20 ms); before the first compiled module is imported."""
    from ._nrt_cache import install

    with contextlib.suppress(Exception):  # an unexpected numba: it compiles its runtime as usual
        install(cache_directory)


@functools.cache
def _mode() -> str:
    """"off", "wait" or "background" (see the module); read once (tests clear it)."""
    value = os.environ.get("PLUGRT_NUMBA", "1")
    if value == "0" or not _numba_installed():
        return "off"
    return "wait" if value == "wait" else "background"


def _numba_installed() -> bool:
    """Whether numba can be found, without importing it (a missing one starts no build)."""
    try:
        return importlib.util.find_spec("numba") is not None
    except (ImportError, ValueError, AttributeError, RuntimeError):  # a module object that is not one: let its import tell
        return True


def compiled_enabled() -> bool:
    """Whether compiled modules can come in this process (numba installed, not turned
    off by ``PLUGRT_NUMBA=0``), ready yet or not: for kernels that prepare a weight in
    the compiled loops' layout at compile time."""
    return _mode() != "off"


def compiled_module(name: str) -> ModuleType | None:
    """The compiled-loops module ``plugrt_cpu.kernels.<name>`` when it is ready in this
    process; None when numba is not installed, cannot be used here, the environment sets
    ``PLUGRT_NUMBA=0``, or its loops are still being built (the first ask starts the
    build; see the module). Every caller then runs its numpy path. Never blocks, except
    under ``PLUGRT_NUMBA=wait``. Cheap: callers ask on every call."""
    view = getattr(_PINNED, "view", None)
    if view is not None:
        module = view.modules.get(name)
        if module is None and _mode() == "background":
            _LOADER.want((name,))  # for the eager runs after this replay or capture
        return module
    mode = _mode()
    if mode == "off":
        return None
    loader = _LOADER
    module = loader.ready.get(name)
    if module is None and name not in loader.failed:
        if mode == "wait":
            return loader.load(name)
        loader.want((name,))
    return module


def generation() -> int:
    """How many compiled modules this process has loaded (in a pinned replay: had, when
    it was captured). A value derived from ``compiled_module``'s answers stays right while
    this does not change."""
    view = getattr(_PINNED, "view", None)
    return view.generation if view is not None else _LOADER.generation


def snapshot() -> Snapshot | None:
    """What is ready now, for a capture to pin; None when nothing can change any more
    (the build is done or failed, or numba is off): then there is nothing to pin."""
    view = getattr(_PINNED, "view", None)
    if view is not None:
        return view
    if _mode() == "off" or _LOADER.settled():
        return None
    return _LOADER.snapshot()


@contextlib.contextmanager
def pinned(view: Snapshot | None) -> Iterator[None]:
    """Within this block, this thread's ``compiled_module`` answers from ``view`` (None:
    as usual)."""
    if view is None:
        yield
        return
    before = getattr(_PINNED, "view", None)
    _PINNED.view = view
    try:
        yield
    finally:
        _PINNED.view = before


def call_pinned(view: Snapshot, run: Callable[[], None]) -> None:
    """``run()`` with this thread's ``compiled_module`` answering from ``view``: what
    ``pinned`` does, without a generator's enter and exit (a replay makes this call for
    each of its steps, hundreds a decode step)."""
    before = getattr(_PINNED, "view", None)
    _PINNED.view = view
    try:
        run()
    finally:
        _PINNED.view = before


def build_finished() -> bool:
    """Whether every module asked for so far is loaded or failed (or numba is off)."""
    return _mode() == "off" or _LOADER.finished.is_set()


def wait_ready(timeout: float | None = None) -> bool:
    """Ask for every compiled module and wait until they are loaded (or failed), up to
    ``timeout`` seconds; whether they were. For tests and benchmarks that want the
    compiled paths from their first run; a session never needs it."""
    if _mode() == "off":
        return True
    _LOADER.want(_LOADER.names)
    return _LOADER.finished.wait(timeout)


def build_all(progress: Progress | None = None) -> int:
    """Import every compiled module in this process, compiling into numba's on-disk cache
    whatever it lacks, calling ``progress(done, total, name)`` before each (``done``
    finished so far) and ``progress(total, total, "")`` at the end; then write the stamp
    that tells later processes the cache is complete. Returns the modules loaded (0 where
    numba is missing, unusable, or ``PLUGRT_NUMBA=0``). Blocks: for
    ``plugrt compile-cache`` and the background build's child."""
    if _mode() == "off":
        return 0
    names = _LOADER.names
    loaded = 0
    with _cache_lock():  # one build per cache at a time: processes started together wait, then load
        forgotten = cache_stamp()[: -len(".ready")] + ".forgotten"  # once per set of sources, even if a build fails
        if not os.path.exists(cache_stamp()) and not os.path.exists(forgotten):
            forget_compiled_entries()
            with contextlib.suppress(OSError), open(forgotten, "w"):
                pass
        for done, name in enumerate(names):
            if progress is not None:
                progress(done, len(names), name)
            if _LOADER.load(name) is not None:
                loaded += 1
        if progress is not None:
            progress(len(names), len(names), "")
        if loaded == len(names):
            _write_stamp()
    return loaded


def forget_compiled_entries(directory: str | None = None) -> int:
    """Remove numba's cache entries of the compiled modules (``_numba_*.nbi`` and ``.nbc``
    in ``directory``, the cache by default) before a build for sources no complete build
    has seen: numba checks a function's own file only, so a function calling into another
    ``_numba_*`` module edited since (``_numba_conv``'s units into ``_numba_gemm``'s
    tiles) would load its old code. Other files there are left alone. Returns how many it
    removed."""
    directory = directory or cache_directory()
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    removed = 0
    for name in names:
        if name.startswith("_numba_") and name.endswith((".nbi", ".nbc")):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, name))
                removed += 1
    return removed


@contextlib.contextmanager
def _cache_lock() -> Iterator[None]:
    """An exclusive lock on a file beside the stamp, held while the block runs (where
    there is ``fcntl`` and the directory is writable; elsewhere no lock)."""
    try:
        import fcntl

        os.makedirs(cache_directory(), exist_ok=True)
        handle = open(cache_stamp()[: -len(".ready")] + ".lock", "a")
    except (ImportError, OSError):
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def cache_stamp() -> str:
    """The file that says numba's cache holds every compiled module, for this numba,
    Python, CPU target and these sources: beside numba's cache (``NUMBA_CACHE_DIR``, else
    the kernels' ``__pycache__`` where it is writable, else the user's cache directory)."""
    return os.path.join(cache_directory(), f"plugrt-numba-{_cache_key()}.ready")


@functools.cache
def _cache_key() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    parts = [here, sys.version, platform.machine(), _numba_stamp()]
    parts += [f"{k}={os.environ.get(k, '')}" for k in ("NUMBA_CACHE_DIR", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", "NUMBA_OPT")]
    for name in sorted(os.listdir(here)):
        if name.startswith("_numba_") and name.endswith(".py"):
            stat = os.stat(os.path.join(here, name))
            parts.append(f"{name}:{stat.st_mtime_ns}:{stat.st_size}")  # what numba's own index checks
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _numba_stamp() -> str:
    """Which numba is installed, from its files (cheaper than its metadata, and no import)."""
    try:
        spec = importlib.util.find_spec("numba")
        origin = spec.origin if spec is not None else None
        stat = os.stat(origin) if origin else None
    except (ImportError, ValueError, OSError):
        return ""
    return f"{origin}:{stat.st_mtime_ns}:{stat.st_size}" if stat is not None else ""


def cache_directory() -> str:
    """Where numba caches the compiled modules (as numba chooses it: ``NUMBA_CACHE_DIR``,
    else the kernels' ``__pycache__`` where it is writable, else a user cache directory)."""
    configured = os.environ.get("NUMBA_CACHE_DIR")
    if configured:
        return configured
    beside = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__")
    if os.access(beside, os.W_OK) or (not os.path.exists(beside) and os.access(os.path.dirname(beside), os.W_OK)):
        return beside
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(home, "plugrt")


def _write_stamp() -> None:
    path = cache_stamp()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False) as stamp:
            stamp.write(f"built {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        os.replace(stamp.name, path)
    except OSError:  # a read-only cache: later processes just start a child that finds it all there
        pass


_CHILD = (
    "import os\n"
    "if hasattr(os, 'nice') and os.nice(0) < 19: os.nice(19 - os.nice(0))\n"
    "from plugrt_cpu.kernels._compiled import build_all\n"
    "build_all()\n"
)


def _compile_in_child() -> None:
    """Fill numba's on-disk cache in a child process at the lowest priority, and wait for
    it. Its failures are not reported here: this process's own imports then meet the
    same problem and say so."""
    nice = shutil.which("nice")  # niced from its first instruction (the child's own os.nice comes after its start-up)
    command = ([nice, "-n", "19"] if nice else []) + [sys.executable, "-c", _CHILD]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


_LOADER = _Loader()
_PINNED = threading.local()  # .view: the Snapshot a replay on this thread runs with
