"""A seeded model fuzzer: mutated real models through load() and run() in watched child processes.

Each case is one mutation of a seed model (onnx's light models and node-test models):
a truncation, byte flips, or a structured change (shapes, types, attributes, hostile
external-data paths, function bombs, huge generated tensors, catastrophic regexes). A
worker process runs many cases in a row under ``RLIMIT_AS``, with an audit hook that
records every file opened during ``load()``/``run()``; the parent gives each case a
timeout and restarts a worker that crashed or hung. A case's outcome is one of:

- ``ok``: loaded and ran (or loaded and refused its inputs with a typed error);
- ``typed``: a ``PlugrtError`` subclass (or ``MemoryError``, which the contract allows);
- ``untyped``: any other exception out of ``load()``/``run()`` (a defect);
- ``crash``: the worker died; ``hang``: the case ran past its timeout (defects);
- any case may also list ``outside``: files opened outside the model's folder (a defect).

Run ``python tests/security/fuzz.py --cases 10000`` for a report, or through pytest
(``PLUGRT_FUZZ_CASES``, ``PLUGRT_FUZZ_SEED``, ``PLUGRT_FUZZ_WORKERS``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import resource
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Iterator

_PROTOCOL = "@@fuzz "
#: Address space per worker: enough for a real model, far below the machine.
ADDRESS_SPACE = 6 * 2**30
CASE_TIMEOUT = 30.0
_STARTUP_TIMEOUT = 300.0

# -- the corpus -----------------------------------------------------------------------------------


def corpus_dir() -> str:
    import onnx

    base = os.environ.get("PLUGRT_FUZZ_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "plugrt")
    return os.path.join(base, f"fuzz-corpus-onnx-{onnx.__version__}")


def build_corpus() -> str:
    """Seed models with inputs, written once as protobuf (never pickle) and reused."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    folder = corpus_dir()
    if os.path.exists(os.path.join(folder, "DONE")):
        return folder
    os.makedirs(folder, exist_ok=True)
    light = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
    index = 0
    for name in sorted(os.listdir(light)):
        if name.endswith(".onnx"):
            shutil.copyfile(os.path.join(light, name), os.path.join(folder, f"{index:05d}.onnx"))
            index += 1
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases()
    for case in cases:
        if case.model is None or not case.data_sets:
            continue
        inputs = onnx.SequenceProto(elem_type=onnx.SequenceProto.TENSOR)
        try:
            for value in case.data_sets[0][0]:
                inputs.tensor_values.append(numpy_helper.from_array(np.asarray(value)))
        except Exception:
            continue  # sequence or optional inputs: the model still seeds, with no inputs
        with open(os.path.join(folder, f"{index:05d}.onnx"), "wb") as f:
            f.write(case.model.SerializeToString())
        with open(os.path.join(folder, f"{index:05d}.inputs.pb"), "wb") as f:
            f.write(inputs.SerializeToString())
        index += 1
    with open(os.path.join(folder, "DONE"), "w") as f:
        f.write(str(index))
    return folder


def seed_names(folder: str) -> list[str]:
    return sorted(n[:-5] for n in os.listdir(folder) if n.endswith(".onnx"))


# -- mutations ------------------------------------------------------------------------------------

_HOSTILE_LOCATIONS = (
    "ABSOLUTE_SECRET",  # replaced by the absolute path of the secret file
    "../outside/secret.bin",
    "secret.bin",  # only in the working directory (the outside folder), not beside the model
    "link.bin",  # a symlink in the model folder to the secret
    "fifo.bin",
    "/dev/zero",
    "sub/../../outside/secret.bin",
    "weights.bin",  # legitimate: beside the model
)

_OPS = ("Add", "Relu", "Reshape", "Expand", "Gather", "Concat", "Slice", "MatMul", "Conv", "Loop", "If",
        "ConstantOfShape", "Tile", "Range", "Resize", "TopK", "Split", "Einsum", "ReduceSum", "Cast", "Pad")

_INTS = (-(2**63), -(2**31), -1, 0, 1, 2, 3, 7, 2**31 - 1, 2**31, 2**40, 2**62)


def _pick(rng: random.Random, items: Any) -> Any:
    items = list(items)
    return rng.choice(items) if items else None


def _all_nodes(graph: Any) -> Iterator[Any]:
    import onnx

    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _all_nodes(g)


def _external(tensor: Any, location: str, secret: str) -> None:
    import onnx

    tensor.ClearField("raw_data")
    for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        tensor.ClearField(field)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    del tensor.external_data[:]
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", secret if location == "ABSOLUTE_SECRET" else location


def _structured(model: Any, rng: random.Random, secret: str) -> str:
    """Apply one structured mutation to ``model`` in place; return its name."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    graph = model.graph
    nodes = list(_all_nodes(graph))
    # mild changes that keep the model runnable, more often than bombs
    kind = rng.choice(
        ["dims", "elem_type", "attribute", "op_type", "inputs", "opset", "initializer", "duplicate_output"] * 3
        + ["external", "external", "function_external", "function_external", "function_bomb",
           "recursive_function", "depth", "huge_constant", "expand_bomb", "regex"]
    )
    if kind == "dims":
        value = _pick(rng, list(graph.input) + list(graph.output) + list(graph.value_info))
        if value is not None and value.type.HasField("tensor_type"):
            dims = value.type.tensor_type.shape.dim
            if len(dims):
                _pick(rng, dims).dim_value = _pick(rng, (0, 1, 2**31, 2**40, 10**6))
            else:
                value.type.tensor_type.shape.dim.add().dim_value = rng.choice((0, 5, 2**40))
    elif kind == "elem_type":
        value = _pick(rng, list(graph.input) + list(graph.output))
        if value is not None and value.type.HasField("tensor_type"):
            value.type.tensor_type.elem_type = rng.randrange(0, 27)
        elif graph.initializer:
            _pick(rng, graph.initializer).data_type = rng.randrange(0, 27)
    elif kind == "attribute":
        node = _pick(rng, nodes)
        if node is not None and node.attribute:
            attr = _pick(rng, node.attribute)
            if attr.type == onnx.AttributeProto.INT:
                attr.i = rng.choice(_INTS)
            elif attr.type == onnx.AttributeProto.INTS:
                attr.ClearField("ints")
                attr.ints.extend(rng.choice(_INTS) for _ in range(rng.randrange(0, 6)))
            elif attr.type == onnx.AttributeProto.FLOAT:
                attr.f = rng.choice((float("nan"), float("inf"), -1e38, 0.0))
            elif attr.type == onnx.AttributeProto.STRING:
                attr.s = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 12)))
            elif attr.type == onnx.AttributeProto.TENSOR:
                attr.t.dims.append(rng.choice((0, 3, 2**33)))
            else:
                attr.type = rng.randrange(0, 14)
        elif node is not None:
            node.attribute.append(helper.make_attribute("axis", rng.choice(_INTS)))
    elif kind == "op_type":
        node = _pick(rng, nodes)
        if node is not None:
            node.op_type = rng.choice(_OPS)
    elif kind == "inputs":
        node = _pick(rng, nodes)
        if node is not None:
            choice = rng.randrange(3)
            if choice == 0 and node.input:
                del node.input[rng.randrange(len(node.input))]
            elif choice == 1 and node.input and node.output:
                node.input[rng.randrange(len(node.input))] = node.output[0]  # a cycle
            else:
                node.input.append(_pick(rng, [n for m in nodes for n in m.output]) or "missing")
    elif kind == "opset":
        for entry in model.opset_import:
            if entry.domain in ("", "ai.onnx"):
                entry.version = rng.choice((1, 6, 7, 13, 18, 22, 23, 99))
    elif kind == "initializer" and graph.initializer:
        tensor = _pick(rng, graph.initializer)
        if tensor.dims:
            tensor.dims[rng.randrange(len(tensor.dims))] = rng.choice((0, 1, -1, 2**31, 2**40))
        else:
            tensor.dims.append(2**20)
    elif kind == "external":
        tensors = list(graph.initializer) + [
            a.t for n in nodes for a in n.attribute if a.type == onnx.AttributeProto.TENSOR
        ]
        if tensors:
            _external(_pick(rng, tensors), rng.choice(_HOSTILE_LOCATIONS), secret)
    elif kind == "function_external":
        # a Constant inside a model-local function, its value stored "outside"
        constant = numpy_helper.from_array(np.arange(4, dtype=np.float32), "leak")
        _external(constant, rng.choice(_HOSTILE_LOCATIONS), secret)
        body = [helper.make_node("Constant", [], ["y"], value=constant)]
        inner = helper.make_function("fuzz", "Leak", [], ["y"], body, [helper.make_opsetid("", 18)])
        if rng.random() < 0.5:  # nested one level
            outer = helper.make_function("fuzz", "Outer", [], ["y"], [helper.make_node("Leak", [], ["y"], domain="fuzz")],
                                         [helper.make_opsetid("", 18), helper.make_opsetid("fuzz", 1)])
            model.functions.extend([inner, outer])
            call = "Outer"
        else:
            model.functions.append(inner)
            call = "Leak"
        model.opset_import.append(helper.make_opsetid("fuzz", 1))
        graph.node.append(helper.make_node(call, [], ["fuzz_leak"], domain="fuzz"))
        graph.output.append(helper.make_tensor_value_info("fuzz_leak", onnx.TensorProto.FLOAT, [4]))
        model.ir_version = max(model.ir_version, 8)
    elif kind in ("function_bomb", "recursive_function"):
        opsets = [helper.make_opsetid("", 18), helper.make_opsetid("fuzz", 1)]
        if kind == "recursive_function":
            functions = [helper.make_function("fuzz", "f0", ["x"], ["y"], [helper.make_node("f0", ["x"], ["y"], domain="fuzz")], opsets)]
        else:
            functions = []
            for level in range(8):
                callee, domain = (f"f{level - 1}", "fuzz") if level else ("Identity", "")
                chain, previous = [], "x"
                for i in range(10):
                    out = "y" if i == 9 else f"t{i}"
                    chain.append(helper.make_node(callee, [previous], [out], domain=domain))
                    previous = out
                functions.append(helper.make_function("fuzz", f"f{level}", ["x"], ["y"], chain, opsets))
        model.functions.extend(functions)
        model.opset_import.append(helper.make_opsetid("fuzz", 1))
        graph.input.append(helper.make_tensor_value_info("fuzz_x", onnx.TensorProto.FLOAT, [1]))
        graph.node.append(helper.make_node(functions[-1].name, ["fuzz_x"], ["fuzz_y"], domain="fuzz"))
        graph.output.append(helper.make_tensor_value_info("fuzz_y", onnx.TensorProto.FLOAT, [1]))
        model.ir_version = max(model.ir_version, 8)
    elif kind == "depth":
        inner = helper.make_graph([helper.make_node("Identity", ["fuzz_c"], ["d0"])], "b0", [],
                                  [helper.make_tensor_value_info("d0", onnx.TensorProto.BOOL, [])])
        # protobuf parses about 100 message levels, three per If level: deeper cannot be read
        for level in range(1, rng.choice((5, 20, 31))):
            leaf = helper.make_graph([helper.make_node("Identity", ["fuzz_c"], [f"e{level}"])], f"e{level}", [],
                                     [helper.make_tensor_value_info(f"e{level}", onnx.TensorProto.BOOL, [])])
            # one branch nests, the other is a leaf: depth grows, size stays linear
            node = helper.make_node("If", ["fuzz_c"], [f"d{level}"], then_branch=inner, else_branch=leaf)
            inner = helper.make_graph([node], f"b{level}", [], [helper.make_tensor_value_info(f"d{level}", onnx.TensorProto.BOOL, [])])
        graph.input.append(helper.make_tensor_value_info("fuzz_c", onnx.TensorProto.BOOL, []))
        graph.node.extend(inner.node)
        graph.output.extend(inner.output)
    elif kind == "huge_constant":
        shape = numpy_helper.from_array(np.array([rng.choice((2**31, 2**40, 3 * 2**28))], np.int64), "fuzz_shape")
        graph.initializer.append(shape)
        graph.node.append(helper.make_node("ConstantOfShape", ["fuzz_shape"], ["fuzz_big"]))
        graph.output.append(helper.make_tensor_value_info("fuzz_big", onnx.TensorProto.FLOAT, None))
    elif kind == "expand_bomb":
        graph.input.append(helper.make_tensor_value_info("fuzz_one", onnx.TensorProto.FLOAT, [1]))
        graph.initializer.append(numpy_helper.from_array(np.array([2**20, 2**20, 4], np.int64), "fuzz_wide"))
        graph.node.append(helper.make_node("Expand", ["fuzz_one", "fuzz_wide"], ["fuzz_view"]))
        graph.node.append(helper.make_node("ReduceSum", ["fuzz_view"], ["fuzz_sum"], keepdims=0))
        graph.output.append(helper.make_tensor_value_info("fuzz_sum", onnx.TensorProto.FLOAT, None))
    elif kind == "regex":
        text = numpy_helper.from_array(np.array(["a" * 64 + "!"], dtype=object), "fuzz_text")
        graph.initializer.append(text)
        pattern = rng.choice(("(a+)+$", "(a|aa)*c", "(a*)*b", "(a)\\1", "(?=a)a", "[", "(x+x+)+y"))
        graph.node.append(helper.make_node("RegexFullMatch", ["fuzz_text"], ["fuzz_match"], pattern=pattern))
        graph.output.append(helper.make_tensor_value_info("fuzz_match", onnx.TensorProto.BOOL, [1]))
        for entry in model.opset_import:
            if entry.domain in ("", "ai.onnx"):
                entry.version = max(entry.version, 20)
    elif kind == "duplicate_output" and len(nodes) > 1:
        a, b = rng.sample(nodes, 2)
        if a.output and b.output:
            b.output[0] = a.output[0]
    return kind


def make_case(seed: int, index: int, seeds: list[str], folder: str, secret: str) -> tuple[str, bytes, str]:
    """(seed name, mutated bytes, mutation name) for case ``index``, deterministically."""
    import onnx

    rng = random.Random(f"{seed}:{index}")
    name = rng.choice(seeds)
    with open(os.path.join(folder, name + ".onnx"), "rb") as f:
        data = f.read()
    roll = rng.random()
    if roll < 0.15:
        cut = rng.randrange(0, len(data))
        return name, data[:cut], f"truncate@{cut}"
    if roll < 0.35:
        mutated = bytearray(data)
        for _ in range(rng.randrange(1, 9)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        return name, bytes(mutated), "byte_flips"
    model = onnx.ModelProto()
    model.ParseFromString(data)
    try:
        kinds = [_structured(model, rng, secret) for _ in range(rng.choice((1, 1, 1, 2, 3)))]
        mutated = model.SerializeToString()
    except Exception as exc:  # a mutation protobuf itself cannot encode: a byte flip instead
        mutated, kinds = bytearray(data), [f"unencodable({type(exc).__name__})"]
        mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        mutated = bytes(mutated)
    if rng.random() < 0.1:
        mutated = bytearray(mutated)
        mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        kinds.append("byte_flip")
    return name, bytes(mutated), "+".join(kinds)


# -- the worker -----------------------------------------------------------------------------------


class _Audit:
    """Records files opened while armed; only paths outside the allowed roots are kept."""

    def __init__(self, allowed: list[str]) -> None:
        self.allowed = [os.path.realpath(a) for a in allowed]
        self.armed = False
        self.opened: list[str] = []

    def hook(self, event: str, args: tuple) -> None:
        if not self.armed or event != "open" or not args:
            return
        target = args[0]
        if isinstance(target, int):
            return  # an already-open descriptor
        try:
            path = os.path.realpath(os.fsdecode(target))
        except Exception:
            self.opened.append(repr(target))
            return
        if "__path_hook__" in path:
            return  # an editable install's import hook marker on sys.path, not a file
        if not any(path == root or path.startswith(root + os.sep) for root in self.allowed):
            self.opened.append(path)


def _inputs_for(session: Any, folder: str, name: str) -> dict:
    import numpy as np
    import onnx
    from onnx import numpy_helper

    given: list = []
    path = os.path.join(folder, name + ".inputs.pb")
    if os.path.exists(path):
        sequence = onnx.SequenceProto()
        with open(path, "rb") as f:
            sequence.ParseFromString(f.read())
        given = [numpy_helper.to_array(t) for t in sequence.tensor_values]
    feeds = {}
    rng = np.random.default_rng(0)
    for index, info in enumerate(session.inputs):
        if index < len(given):
            feeds[info.name] = given[index]
            continue
        shape = [d if isinstance(d, int) and 0 <= d <= 64 else 2 for d in (info.shape or [])]
        dtype = info.dtype if getattr(info, "dtype", None) is not None else np.float32
        try:
            feeds[info.name] = rng.standard_normal(shape).astype(dtype)
        except Exception:
            feeds[info.name] = np.zeros(shape, np.float32)
    return feeds


def _warm_up(folder: str, seeds: list[str]) -> None:
    import plugrt

    for name in seeds[9:15]:  # a few node models: the light models are slow to warm up with
        try:
            session = plugrt.load(os.path.join(folder, name + ".onnx"))
            session.run(_inputs_for(session, folder, name))
        except Exception:
            pass


def worker(root: str, seed: int) -> None:
    """Read case indices on stdin, answer one protocol line each on stdout."""
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout = sys.stderr  # library prints never corrupt the protocol
    import numpy as np  # noqa: F401  (imported before arming the hook)
    import onnx  # noqa: F401

    import plugrt
    from plugrt.errors import PlugrtError

    folder = os.path.join(root, "corpus")
    seeds = seed_names(folder)
    outside = os.path.join(root, "outside")
    secret = os.path.join(outside, "secret.bin")
    model_dir = os.path.join(root, f"models-{os.getpid()}")
    os.chdir(outside)  # a CWD-relative location finds the secret here
    roots = [model_dir, "/proc", "/sys", "/dev/null", "/dev/urandom", sys.prefix, sys.base_prefix, sys.exec_prefix]
    roots += [p for p in sys.path if p and os.path.isdir(p)]
    # a root above the fuzz folder (say /tmp on sys.path) would hide the secret's opens
    real_root = os.path.realpath(root)
    roots = [r for r in roots if not (real_root + os.sep).startswith(os.path.realpath(r) + os.sep) or r == model_dir]
    _warm_up(folder, seeds)  # plugin discovery and lazy imports happen before the hook is armed
    roots += sorted({os.path.dirname(m.__file__) for m in list(sys.modules.values()) if getattr(m, "__file__", None)})
    audit = _Audit(roots)
    sys.addaudithook(audit.hook)
    protocol.write(_PROTOCOL + json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        index = int(line)
        if index == -1:  # the canary: proves the hook sees an open outside the folder
            audit.opened.clear()
            audit.armed = True
            open(secret, "rb").close()
            audit.armed = False
            protocol.write(_PROTOCOL + json.dumps({"index": -1, "outcome": "ok", "outside": audit.opened}) + "\n")
            continue
        name, data, mutation = make_case(seed, index, seeds, folder, secret)
        shutil.rmtree(model_dir, ignore_errors=True)
        os.makedirs(model_dir)
        os.symlink(secret, os.path.join(model_dir, "link.bin"))
        os.mkfifo(os.path.join(model_dir, "fifo.bin"))
        with open(os.path.join(model_dir, "weights.bin"), "wb") as f:
            f.write(bytes(4096))
        by_path = index % 2 == 0
        if by_path:
            with open(os.path.join(model_dir, "model.onnx"), "wb") as f:
                f.write(data)
        options = {} if index % 10 == 0 else {"limits.tensor_bytes": 2**28}
        outcome, detail = "ok", ""
        started = time.perf_counter()
        audit.opened.clear()
        audit.armed = True
        try:
            session = plugrt.load(os.path.join(model_dir, "model.onnx") if by_path else data, **options)
            audit.armed = False
            feeds = _inputs_for(session, folder, name)
            audit.armed = True
            session.run(feeds)
        except (PlugrtError, MemoryError) as exc:
            outcome, detail = "typed", type(exc).__name__
        except Exception as exc:
            outcome, detail = "untyped", f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            audit.armed = False
        result = {"index": index, "seed": name, "mutation": mutation, "outcome": outcome, "detail": detail,
                  "outside": audit.opened[:5], "seconds": round(time.perf_counter() - started, 3)}
        protocol.write(_PROTOCOL + json.dumps(result) + "\n")


# -- the parent -----------------------------------------------------------------------------------


class _Worker:
    def __init__(self, root: str, seed: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", root, "--seed", str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1,
        )
        self.ready = self._read(_STARTUP_TIMEOUT) is not None  # imports and warm-up are not a case's time

    def _read(self, timeout: float) -> dict | None:
        """The next protocol message, or None when the worker died or ``timeout`` passed."""
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.process.stdout], [], [], left)
            if not ready:
                continue
            line = self.process.stdout.readline()
            if not line:
                return None
            if line.startswith(_PROTOCOL):
                return json.loads(line[len(_PROTOCOL):])

    def run(self, index: int, timeout: float) -> dict | None:
        """The case's result, or None when the worker died or hung (it is then gone)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(f"{index}\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            return None
        found = self._read(timeout)
        if found is not None:
            return found
        if self.process.poll() is None:
            self.kill()
            return {"index": index, "outcome": "hang", "outside": []}
        return {"index": index, "outcome": "crash", "detail": f"worker exited with {self.process.returncode}", "outside": []}

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def run_fuzz(cases: int, seed: int = 0, workers: int = 1, timeout: float = CASE_TIMEOUT, canary: bool = True) -> dict:
    """Run ``cases`` mutated models; return counts and every defect found."""
    root = tempfile.mkdtemp(prefix="plugrt-fuzz-")
    try:
        os.symlink(build_corpus(), os.path.join(root, "corpus"))
        os.makedirs(os.path.join(root, "outside"))
        with open(os.path.join(root, "outside", "secret.bin"), "wb") as f:
            f.write(bytes(range(256)) * 64)
        corpus = os.path.join(root, "corpus")
        seeds = seed_names(corpus)
        secret = os.path.join(root, "outside", "secret.bin")
        indices = list(range(cases))
        results: list[dict] = []
        lock = threading.Lock()
        # every result as it comes, for a long run watched (or cut short) from outside
        log = open(os.environ["PLUGRT_FUZZ_LOG"], "a") if os.environ.get("PLUGRT_FUZZ_LOG") else None

        def drive() -> None:
            current = _Worker(root, seed)
            if not current.ready:
                raise RuntimeError("a fuzz worker did not start (run it alone: python tests/security/fuzz.py --cases 1)")
            try:
                if canary:
                    found = current.run(-1, timeout)
                    with lock:
                        results.append(found or {"index": -1, "outcome": "crash", "outside": []})
                while True:
                    with lock:
                        if not indices:
                            return
                        index = indices.pop(0)
                    found = current.run(index, timeout)
                    if found is None or found["outcome"] in ("hang", "crash"):
                        current.kill() if current.process.poll() is None else None
                        current = _Worker(root, seed)
                        if found is None:
                            found = {"index": index, "outcome": "crash", "detail": "worker gone", "outside": []}
                    if found["outcome"] in ("hang", "crash"):
                        found["seed"], _, found["mutation"] = make_case(seed, index, seeds, corpus, secret)
                    with lock:
                        results.append(found)
                        if log is not None:
                            log.write(json.dumps(found) + "\n")
                            log.flush()
            finally:
                current.close()

        started = time.monotonic()
        threads = [threading.Thread(target=drive) for _ in range(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return summarize(results, time.monotonic() - started)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def summarize(results: list[dict], seconds: float) -> dict:
    canary = [r for r in results if r["index"] == -1]
    cases = [r for r in results if r["index"] != -1]
    outcomes = collections.Counter(r["outcome"] for r in cases)
    mutations = collections.Counter(str(r.get("mutation", "?")).split("@")[0] for r in cases)
    return {
        "cases": len(cases),
        "seconds": round(seconds, 1),
        "outcomes": dict(outcomes),
        "typed_errors": dict(collections.Counter(r.get("detail") for r in cases if r["outcome"] == "typed")),
        "mutations": dict(mutations.most_common(40)),
        "crashes": [r for r in cases if r["outcome"] == "crash"],
        "hangs": [r for r in cases if r["outcome"] == "hang"],
        "untyped": [r for r in cases if r["outcome"] == "untyped"],
        "outside": [r for r in cases if r.get("outside")],
        "canary_outside": [p for r in canary for p in r.get("outside", [])],
        "slowest": sorted(
            ({"seconds": r.get("seconds"), "seed": r.get("seed"), "mutation": r.get("mutation")} for r in cases if r.get("seconds")),
            key=lambda r: -r["seconds"],
        )[:5],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=int(os.environ.get("PLUGRT_FUZZ_CASES", "300")))
    parser.add_argument("--seed", type=int, default=int(os.environ.get("PLUGRT_FUZZ_SEED", "0")))
    parser.add_argument("--workers", type=int, default=int(os.environ.get("PLUGRT_FUZZ_WORKERS", "1")))
    parser.add_argument("--worker", metavar="ROOT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.seed)
        return 0
    summary = run_fuzz(args.cases, args.seed, args.workers)
    print(json.dumps(summary, indent=1, default=str))
    defects = summary["crashes"] or summary["hangs"] or summary["untyped"] or summary["outside"]
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
