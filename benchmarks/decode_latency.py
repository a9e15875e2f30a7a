"""Per-token decode latency: plugrt replaying captured steps, plugrt eager, onnxruntime-genai and onnxruntime.

usage: python benchmarks/decode_latency.py [--precisions fp32,int4] [--tokens 64] [--rounds 7]
       python benchmarks/decode_latency.py --shape smollm2-135m [--precisions int4,int4-acc1,fp32]

``--shape`` other than ``tiny`` measures a decoder of the size people run (SmolLM2-135M,
Qwen2.5-0.5B; random weights, built by ``scripts/make_decoder_models.py`` under
``--models`` when missing, which needs torch, transformers and onnxruntime-genai): each
runtime runs in a process of its own, so that its peak RSS is its own, and prints the time
to first token after a ``--prompt``-token prompt, the median ms per token over ``--tokens``
new tokens, tokens/s and peak RSS, side by side with onnxruntime-genai given ``--threads``
intra-op threads (its default on a 2-core machine decodes on one). The first token is
timed from a loaded model (the prompt's prefill and the token after it); the load (importing
the runtime, reading and building the model and making its generator) is printed beside it,
and their sum.

On the model builder's tiny Llama decoders (``tests/genai/assets/tiny_llama``), in one
process: each round generates ``--tokens`` greedy tokens after a 7-token prompt with every
runtime, in a rotating order, and times each decode step (``generate_next_token`` after
the first token; the first decode step, where plugrt makes its decode capture, is
reported on its own). ``--turns generation`` (the default) lets each runtime generate all
its tokens before the next starts, as one application would; ``--turns step`` has the
runtimes take turns step by step, so load from other processes hits them alike (but each
finds the caches and its threads as the others left them). Prints the median per-token
latency of each runtime and the ratios. Every runtime must produce the same tokens
(checked; exit status 1 otherwise).

- ``plugrt replay``: ``plugrt.genai.Generator`` (fixed-capacity cache, decode replayed).
- ``plugrt eager``: the same with ``capture=False`` (the same fixed-shape steps, run plainly).
- ``onnxruntime-genai``: its greedy ``Generator`` (past and present share one buffer).
- ``onnxruntime``: a plain ``InferenceSession`` loop feeding each present back as the
  next past (the cache grows; no IO binding).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from plugrt import genai

ASSETS = Path(__file__).resolve().parents[1] / "tests" / "genai" / "assets" / "tiny_llama"
PROMPT = [1, 17, 42, 99, 7, 200, 3]


def _quiet_genai_copy(folder: Path, target: Path, threads: int, link: bool = False) -> Path:
    """The model folder with onnxruntime-genai's session given the threads compare.py gives
    onnxruntime (its genai_config.json takes no session config entries such as spinning).
    ``link``: the other files linked, not copied (the shapes people run have large data files).
    Without it, onnxruntime-genai decodes on one thread where plugrt uses every usable core:
    its default measured 13 ms/token on SmolLM2's shape with 13 ms of CPU a token, two
    threads 7.8 ms (2-core Xeon)."""
    if link:
        target.mkdir(parents=True)
        for item in folder.iterdir():
            if item.name != "genai_config.json":
                (target / item.name).symlink_to(item.resolve())
        shutil.copy(folder / "genai_config.json", target / "genai_config.json")
    else:
        shutil.copytree(folder, target)
    config_path = target / "genai_config.json"
    config = json.loads(config_path.read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    options["intra_op_num_threads"] = threads
    options["inter_op_num_threads"] = 1
    config_path.write_text(json.dumps(config, indent=4))
    return target


class _Runner:
    """One runtime: ``start()`` prefills and returns the first token; ``step()`` one decode step."""

    name = ""

    def start(self, max_length: int) -> int:
        raise NotImplementedError

    def step(self) -> int:
        raise NotImplementedError


class _Plugrt(_Runner):
    def __init__(self, model: genai.Model, capture: bool):
        self.model, self.capture = model, capture
        self.name = "plugrt replay" if capture else "plugrt eager"

    def start(self, max_length: int) -> int:
        from plugrt import genai

        self.generator = genai.Generator(self.model, max_length=max_length, capture=self.capture)
        self.generator.append_tokens(PROMPT)
        return self.generator.generate_next_token()

    def step(self) -> int:
        return self.generator.generate_next_token()


class _OnnxruntimeGenai(_Runner):
    name = "onnxruntime-genai"

    def __init__(self, folder: Path):
        import onnxruntime_genai as og

        self.og = og
        self.model = og.Model(str(folder))

    def start(self, max_length: int) -> int:
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=max_length)
        self.generator = self.og.Generator(self.model, params)
        self.generator.append_tokens(np.array([PROMPT], np.int32))
        return self.step()

    def step(self) -> int:
        self.generator.generate_next_token()
        return int(self.generator.get_next_tokens()[0])


class _Onnxruntime(_Runner):
    name = "onnxruntime"

    def __init__(self, folder: Path, threads: int):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
        from plugrt import genai

        self.layout = genai.DecoderLayout.from_genai_config(folder / "genai_config.json")
        self.names = [o.name for o in self.session.get_outputs()]

    def start(self, max_length: int) -> int:
        layout = self.layout
        empty = np.zeros((1, layout.kv_heads, 0, layout.head_size), np.float32)
        self.past = {past: empty for past, _ in layout.cache_names()}
        self.length = 0
        self.ids = np.array([PROMPT], np.int64)
        return self.step()

    def step(self) -> int:
        layout = self.layout
        self.length += self.ids.shape[1]
        feeds = {layout.input_ids: self.ids, "attention_mask": np.ones((1, self.length), np.int64), **self.past}
        outputs = dict(zip(self.names, self.session.run(self.names, feeds)))
        self.past = {past: outputs[present] for past, present in layout.cache_names()}
        token = int(np.argmax(outputs[layout.logits][0, -1]))
        self.ids = np.array([[token]], np.int64)
        return token


def _generate_in_turns(
    runners: list[_Runner], tokens: int, rotation: int, by_step: bool
) -> dict[str, tuple[list[int], list[float]]]:
    """Every runner's tokens and decode step times; the runners take turns step by step
    (``by_step``) or generation by generation."""
    results: dict[str, tuple[list[int], list[float]]] = {}
    order = runners[rotation % len(runners):] + runners[: rotation % len(runners)]

    def step(runner: _Runner) -> None:
        generated, times = results[runner.name]
        begin = time.perf_counter()
        generated.append(runner.step())
        times.append(time.perf_counter() - begin)

    if by_step:
        for runner in order:
            results[runner.name] = ([runner.start(len(PROMPT) + tokens)], [])
        for index in range(tokens - 1):
            for runner in order[index % len(order):] + order[: index % len(order)]:
                step(runner)
        return results
    for runner in order:
        results[runner.name] = ([runner.start(len(PROMPT) + tokens)], [])
        for _ in range(tokens - 1):
            step(runner)
    return results


def measure(precision: str, tokens: int, rounds: int, threads: int, scratch: Path, by_step: bool) -> bool:
    folder = ASSETS / precision
    from plugrt import genai

    model = genai.Model(folder)
    runners: list[_Runner] = [_Plugrt(model, capture=True), _Plugrt(model, capture=False)]
    try:
        runners.append(_OnnxruntimeGenai(_quiet_genai_copy(folder, scratch / precision, threads)))
    except ImportError:
        print("onnxruntime-genai is not installed: left out")
    try:
        runners.append(_Onnxruntime(folder, threads))
    except ImportError:
        print("onnxruntime is not installed: left out")
    steps: dict[str, list[float]] = {r.name: [] for r in runners}
    first: dict[str, list[float]] = {r.name: [] for r in runners}
    outputs: dict[str, list[int]] = {}
    for round_index in range(rounds + 1):  # round 0 warms up
        for name, (generated, times) in _generate_in_turns(runners, tokens, round_index, by_step).items():
            outputs.setdefault(name, generated)
            if round_index:
                steps[name].extend(times[1:])
                first[name].append(times[0])
    medians = {name: statistics.median(times) * 1e6 for name, times in steps.items()}
    turns = "step by step" if by_step else "generation by generation"
    print(f"\n{precision}: {tokens} tokens after a {len(PROMPT)}-token prompt, {rounds} rounds, turns {turns}")
    print(f"{'runtime':<20} {'median us/token':>16} {'p90':>9} {'first decode step us':>22}")
    for name, times in steps.items():
        p90 = float(np.percentile(times, 90)) * 1e6
        print(f"{name:<20} {medians[name]:>16.1f} {p90:>9.1f} {statistics.median(first[name]) * 1e6:>22.1f}")
    generator = runners[0].generator  # type: ignore[attr-defined]
    use = generator.capture_use
    report = use.reports.get("decode")
    seams = "no capture" if report is None else f"{len(report.segments)} segment(s), {len(report.seams)} seam(s)"
    print(f"plugrt decode capture: {seams}; last generation: {use.replayed_steps} replayed, {use.eager_steps} eager")
    pairs = [
        ("plugrt replay", "plugrt eager"),
        ("plugrt replay", "onnxruntime-genai"),
        ("plugrt eager", "onnxruntime-genai"),
        ("plugrt replay", "onnxruntime"),
        ("onnxruntime", "onnxruntime-genai"),
    ]
    for a, b in pairs:
        if a in medians and b in medians:
            print(f"  {a} / {b}: {medians[a] / medians[b]:.2f}x")
    reference = outputs["plugrt replay"]
    same = True
    for name, generated in outputs.items():
        if generated != reference:
            print(f"  tokens differ: {name} {generated} vs plugrt replay {reference}")
            same = False
    return same


# -- decoders of the size people run: each runtime in a process of its own -----------------


def _child(runtime: str, folder: Path, prompt: int, tokens: int) -> dict:
    """One generation in this process: time to first token, decode step times, peak RSS."""
    import resource

    ids = [3 + i for i in range(prompt)]
    started = time.perf_counter()
    if runtime == "plugrt":  # the import is part of the load, as onnxruntime_genai's is below
        from plugrt import genai

        generator = genai.Generator(genai.Model(folder), max_length=prompt + tokens, capture=True)
        loaded = time.perf_counter()
        generator.append_tokens(ids)
        generated = [generator.generate_next_token()]
        step = generator.generate_next_token
    else:
        import onnxruntime_genai as og

        model = og.Model(str(folder))
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=prompt + tokens)
        og_generator = og.Generator(model, params)
        loaded = time.perf_counter()
        og_generator.append_tokens(np.array([ids], np.int32))

        def step() -> int:
            og_generator.generate_next_token()
            return int(og_generator.get_next_tokens()[0])

        generated = [step()]
    first = time.perf_counter() - loaded  # the prompt's prefill and the first token, the model loaded
    load = loaded - started  # the model read and built, and its generator made
    times = []
    for _ in range(tokens - 1):
        begin = time.perf_counter()
        generated.append(step())
        times.append(time.perf_counter() - begin)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    result = {"load_ms": load * 1e3, "first_ms": first * 1e3, "ms_per_token": statistics.median(times) * 1e3, "peak_rss_mib": rss,
              "tokens": generated}
    if runtime == "plugrt":  # whether the 4-bit kernels ran compiled (a stale numba cache still builds in the background)
        from plugrt_cpu.kernels import _compiled

        result["compiled_int4"] = _compiled.compiled_module("_numba_int4") is not None
    return result


def _build(models: Path, shape: str, precision: str) -> Path:
    folder = models / shape / precision
    if not (folder / "model.onnx").is_file():
        print(f"building {shape} {precision} under {models / shape} (scripts/make_decoder_models.py)", flush=True)
        script = Path(__file__).resolve().parents[1] / "scripts" / "make_decoder_models.py"
        subprocess.run([sys.executable, str(script), "--shape", shape, "--precision", precision,
                        "--output", str(models / shape)], check=True)
    return folder


def measure_shape(
    shape: str, precisions: list[str], models: Path, prompt: int, tokens: int, rounds: int, threads: int, scratch: Path
) -> bool:
    ok = True
    for precision in precisions:
        folder = _build(models, shape, precision)
        # onnxruntime-genai gets the threads plugrt uses (every usable core), as onnxruntime does in compare.py
        folders = {"onnxruntime-genai": _quiet_genai_copy(folder, scratch / shape / precision, threads, link=True),
                   "plugrt": folder}
        results: dict[str, list[dict]] = {"onnxruntime-genai": [], "plugrt": []}
        for round_index in range(rounds):
            order = list(results) if round_index % 2 == 0 else list(results)[::-1]
            for runtime in order:
                done = subprocess.run(
                    [sys.executable, __file__, "--child", runtime, str(folders[runtime]), "--prompt", str(prompt),
                     "--tokens", str(tokens)], capture_output=True, text=True,
                )
                if done.returncode != 0:
                    print(f"{runtime} failed:\n{done.stderr[-2000:]}")
                    return False
                results[runtime].append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"\n{shape} {precision}: {prompt}-token prompt, {tokens} new tokens, median of {rounds} processes each "
              f"(load average {os.getloadavg()[0]:.2f}, numba {'off' if os.environ.get('PLUGRT_NUMBA') == '0' else 'if installed'})")
        print(f"{'runtime':<18} {'load ms':>8} {'first token ms':>15} {'load + first':>13} {'ms/token':>9} "
              f"{'tokens/s':>9} {'peak RSS MiB':>13}")
        summary = {}
        for runtime, runs in results.items():
            row = {key: statistics.median(r[key] for r in runs) for key in ("load_ms", "first_ms", "ms_per_token", "peak_rss_mib")}
            row["cold_ms"] = statistics.median(r["load_ms"] + r["first_ms"] for r in runs)
            summary[runtime] = row
            print(f"{runtime:<18} {row['load_ms']:>8.0f} {row['first_ms']:>15.0f} {row['cold_ms']:>13.0f} "
                  f"{row['ms_per_token']:>9.2f} {1e3 / row['ms_per_token']:>9.1f} {row['peak_rss_mib']:>13.0f}")
        plugrt, peer = summary["plugrt"], summary["onnxruntime-genai"]
        print(f"  plugrt / onnxruntime-genai: ms/token {plugrt['ms_per_token'] / peer['ms_per_token']:.2f}x, "
              f"first token {plugrt['first_ms'] / peer['first_ms']:.2f}x (model loaded), "
              f"load + first token {plugrt['cold_ms'] / peer['cold_ms']:.2f}x, "
              f"peak RSS {plugrt['peak_rss_mib'] / peer['peak_rss_mib']:.2f}x")
        compiled = [r.get("compiled_int4", False) for r in results["plugrt"]]
        print(f"  plugrt's compiled 4-bit kernels loaded by the end in {sum(compiled)} of {len(compiled)} processes")
        same = results["plugrt"][0]["tokens"] == results["onnxruntime-genai"][0]["tokens"]
        agree = sum(a == b for a, b in zip(results["plugrt"][0]["tokens"], results["onnxruntime-genai"][0]["tokens"]))
        print(f"  greedy tokens: {'the same' if same else f'{agree} of {tokens} the same'}")
        ok &= same or precision == "int4"  # int8 activations (accuracy_level 4) may move a close call
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", default=None, help="default: fp32,int4 (tiny); int4,int4-acc1,fp32 (others)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=None, help="default: 7 (tiny), 3 processes each (others)")
    parser.add_argument("--turns", choices=("generation", "step"), default="generation")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="onnxruntime's and onnxruntime-genai's intra-op threads (default: every usable core, as plugrt)")
    parser.add_argument("--shape", default="tiny", help="tiny, smollm2-135m or qwen2.5-0.5b")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens for the shapes people run")
    parser.add_argument("--models", type=Path, default=Path("build/decoder_models"), help="where built shapes are kept")
    parser.add_argument("--load", type=int, default=0, metavar="N",
                        help="N busy background processes (one core each) while the shapes people run are measured (0)")
    parser.add_argument("--child", nargs=2, metavar=("RUNTIME", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child[0], Path(args.child[1]), args.prompt, args.tokens)))
        return 0
    if not 0 <= args.load <= 64:
        parser.error("--load must lie in [0, 64]")
    print(f"cores usable: {len(os.sched_getaffinity(0))}, load average: {os.getloadavg()}, "
          f"background load: {args.load} busy process(es)")
    if args.shape != "tiny":
        from compare import BackgroundLoad  # benchmarks/compare.py's busy processes

        precisions = (args.precisions or "int4,int4-acc1,fp32").split(",")
        with BackgroundLoad(args.load, 1800), tempfile.TemporaryDirectory() as scratch:
            done = measure_shape(args.shape, precisions, args.models, args.prompt, args.tokens, args.rounds or 3,
                                 args.threads, Path(scratch))
        return 0 if done else 1
    args.precisions = args.precisions or "fp32,int4"
    args.rounds = args.rounds or 7
    ok = True
    with tempfile.TemporaryDirectory() as scratch:
        for precision in args.precisions.split(","):
            ok &= measure(precision, args.tokens, args.rounds, args.threads, Path(scratch), args.turns == "step")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
