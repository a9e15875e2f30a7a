"""Prepare the GPU check on a machine with the package index: write ``.gpucheck/``, which the
``device`` call carries to the lent GPU machine (no network there, 64 MiB per call).

What it writes (at most 8 MB in all):

- ``wheels/``: plugrt, plugrt-cuda and the template provider, built from this checkout, and
  the wheels the GPU machine's image lacks (for CPython 3.12 on manylinux x86-64);
- ``models/``: onnx's nine light models, each with its final Softmax's input (the logits)
  as an extra output;
- ``references.npz`` and ``manifest.json``: the CPU provider's outputs for those models and
  for their random-weight variants (computed here with ``PLUGRT_NUMBA=0``), the digests that
  let the GPU machine check it regenerated the same inputs and weights, and the commit;
- ``decoder/``: the tiny builder-made Llama decoders of tests/genai (float32 and int4,
  about 0.6 MB), and in the manifest the CPU provider's greedy tokens for the check's prompt;
- ``run.sh``, ``driver.py``: the device command and its stages;

then compiles every CUDA C source for sm_90 with NVRTC, and makes (or reuses)
``.venv-gpu-image``: a CPython 3.12 venv holding the GPU machine image's versions of the
packages the check uses and nothing of plugrt, which the dry run (``GPU_CHECK_DRY=1 bash
.gpucheck/run.sh``) uses to stand in for that image. Run through ``bash
scripts/gpu_check.sh prep`` (which sets ``PLUGRT_NUMBA=0`` before plugrt is imported).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

#: what the image lacks for plugrt (DESIGN.md §9; the device tool's KINDS.md lists the rest)
MISSING_WHEELS = ("importlib-metadata", "zipp", "lazy-importer", "google-re2")
#: what the engines stage adds: cuDNN 9 is on the image, its Python frontend is not. 1.12.0
#: needs nothing else (later releases pull nvidia-cutlass-dsl) and is 1.7 MB
ENGINE_WHEELS = ("nvidia-cudnn-frontend==1.12.0",)
#: CPython 3.12 on manylinux x86-64, as pip matches platform tags exactly
PLATFORMS = (
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
SIZE_LIMIT = 8 * 1024 * 1024
NVRTC_ARCH = "sm_90"
#: the lent GPU machine's image, as far as the check uses it (the device tool's KINDS.md)
IMAGE_PACKAGES = (
    "cupy-cuda13x==14.2.0", "numpy==2.5.2", "onnx==1.23.1", "onnx-ir==1.0.0", "onnxruntime==1.30.0",
    "nvidia-cuda-nvrtc==13.0.*", "pluggy", "ml-dtypes", "threadpoolctl", "pytest",
)
IMAGE_VENV = os.path.join(ROOT, ".venv-gpu-image")


def find_python312() -> str | None:
    """A CPython 3.12 (the image's Python): GPU_CHECK_IMAGE_BASE_PYTHON, pyenv's, or python3.12."""
    candidates = [os.environ.get("GPU_CHECK_IMAGE_BASE_PYTHON", "")]
    try:
        pyenv_root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip()
    except OSError:
        pyenv_root = os.path.expanduser("~/.pyenv")
    candidates += sorted(glob.glob(os.path.join(pyenv_root or os.path.expanduser("~/.pyenv"), "versions", "3.12*",
                                                "bin", "python3.12")))
    candidates.append(shutil.which("python3.12") or "")
    for candidate in filter(None, candidates):
        try:
            found = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                                   capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if found.stdout.strip() == "True":
            return candidate
    return None


def make_image_venv() -> str | None:
    """``.venv-gpu-image`` with IMAGE_PACKAGES (reused while its package list is the same);
    its python, or None without a Python 3.12 here."""
    python = os.path.join(IMAGE_VENV, "bin", "python")
    marker = os.path.join(IMAGE_VENV, "plugrt-gpu-image.txt")
    wanted = "\n".join(IMAGE_PACKAGES)
    if os.path.exists(marker) and os.path.exists(python):
        with open(marker, encoding="utf-8") as f:
            if f.read() == wanted:
                return python
    base = find_python312()
    if base is None:
        return None
    shutil.rmtree(IMAGE_VENV, ignore_errors=True)
    subprocess.run([base, "-m", "venv", IMAGE_VENV], check=True)
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *IMAGE_PACKAGES],
                   check=True)
    with open(marker, "w", encoding="utf-8") as f:
        f.write(wanted)
    return python


def _pins() -> dict[str, str]:
    """name -> version from constraints.txt, so the carried wheels are those CI tested."""
    pins: dict[str, str] = {}
    with open(os.path.join(ROOT, "constraints.txt"), encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if "==" in line:
                name, version = line.split("==", 1)
                pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, cwd=ROOT)


def _remove_setuptools_output(project: str) -> None:
    """setuptools' own folders under ``project``'s build/ (a stale build/lib would put deleted
    modules in the wheel); the rest of build/ is the user's (decoder and benchmark models)."""
    folder = os.path.join(ROOT, project, "build")
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if name == "lib" or name.startswith(("bdist.", "lib.", "temp.")):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def build_wheels(wheels: str) -> list[str]:
    projects = (".", "./providers/cuda", "./providers/template")
    for project in projects:
        _remove_setuptools_output(project)
    try:
        _pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", wheels, *projects)
    finally:
        for project in projects:
            _remove_setuptools_output(project)
    pins = _pins()
    wanted = [f"{name}=={pins[name]}" if name in pins else name for name in MISSING_WHEELS] + list(ENGINE_WHEELS)
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    _pip("download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation",
         "cp", *platforms, "-d", wheels, *wanted)
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(wheels, "*.whl")))


def write_models_and_references(out: str) -> dict:
    """Light models with logits outputs, and the CPU provider's references for them and for
    their random-weight variants. Returns the manifest's ``models`` entries."""
    import numpy as np
    import onnx

    import plugrt
    from plugrt.conformance.light_models import arrays_digest, light_models, with_logits, with_random_weights

    os.makedirs(os.path.join(out, "models"), exist_ok=True)
    references: dict[str, np.ndarray] = {}
    entries = []
    for light in light_models():
        started = time.perf_counter()
        model, logits = with_logits(onnx.load(light.path))
        file = f"models/light_{light.name}.onnx"
        onnx.save(model, os.path.join(out, file))
        entry = {
            "name": light.name, "file": file, "logits": logits, "outputs": [o.name for o in model.graph.output],
            "inputs_sha256": arrays_digest(light.inputs), "variants": {},
        }
        variants = {"constant": (model, "")}
        random_model, weights_digest = with_random_weights(model, seed=0)
        variants["random"] = (random_model, weights_digest)
        for variant, (proto, digest) in variants.items():
            session = plugrt.load(proto.SerializeToString(), device="cpu")
            outputs = session.run(light.inputs)
            for name, value in outputs.items():
                references[f"{light.name}/{variant}/{name}"] = value
            entry["variants"][variant] = {"weights_sha256": digest, "seed": 0 if variant == "random" else None}
        entries.append(entry)
        print(f"  references: {light.name} ({time.perf_counter() - started:.1f} s)", flush=True)
    np.savez_compressed(os.path.join(out, "references.npz"), **references)
    return {"models": entries}


#: the tiny decoders the decoder stage runs, and what it decodes
DECODER_ASSETS = os.path.join(ROOT, "tests", "genai", "assets", "tiny_llama")
DECODER_PROMPT = [1, 17, 42, 99, 7, 200, 3]
DECODER_STEPS = 16


def write_decoders(out: str) -> dict:
    """Copy the tiny decoders and record the CPU provider's greedy tokens for each
    (the manifest's ``decoder`` entry)."""
    from plugrt import genai

    tokens = {}
    for precision in ("fp32", "int4"):
        target = os.path.join(out, "decoder", precision)
        shutil.copytree(os.path.join(DECODER_ASSETS, precision), target)
        model = genai.Model(target, device="cpu")
        tokens[precision] = genai.generate(model, DECODER_PROMPT, max_length=len(DECODER_PROMPT) + DECODER_STEPS)
    return {"decoder": {"prompt": DECODER_PROMPT, "steps": DECODER_STEPS, "cpu_tokens": tokens}}


def check_nvrtc() -> dict:
    """Every CUDA C source compiles for sm_90 (float32 and float16) with this machine's NVRTC."""
    from plugrt_cuda import _sources

    major, minor = _sources.nvrtc_version()
    compiled = []
    for module in sorted(_sources.SOURCES):
        for dtype in sorted(_sources.DTYPES):
            cubin = _sources.compile_cubin(module, dtype, NVRTC_ARCH)
            if cubin[:4] != b"\x7fELF":
                raise RuntimeError(f"NVRTC gave {module} ({dtype}) something that is not a cubin")
            compiled.append(f"{module}/{dtype}")
    return {"nvrtc": f"{major}.{minor}", "arch": NVRTC_ARCH, "compiled": compiled}


def _commit() -> str:
    try:
        found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return found.stdout.strip() + ("+changes" if dirty else "") if found.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, ".gpucheck"))
    parser.add_argument("--no-image-venv", action="store_true", help="do not make .venv-gpu-image for the dry run")
    args = parser.parse_args(argv)
    if os.environ.get("PLUGRT_NUMBA") != "0":
        print("prep: set PLUGRT_NUMBA=0 (bash scripts/gpu_check.sh prep does)", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.join(out, "wheels"))
    print(f"prep: wheels -> {out}/wheels", flush=True)
    wheels = build_wheels(os.path.join(out, "wheels"))
    print("prep: models and the CPU provider's references (PLUGRT_NUMBA=0)", flush=True)
    manifest = {"commit": _commit(), "prepared": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "wheels": wheels}
    manifest.update(write_models_and_references(out))
    print("prep: the tiny decoders and the CPU provider's tokens", flush=True)
    manifest.update(write_decoders(out))
    print(f"prep: NVRTC compiles every kernel source for {NVRTC_ARCH}", flush=True)
    manifest["nvrtc_check"] = check_nvrtc()
    for name in ("run.sh", "driver.py"):
        shutil.copy(os.path.join(HERE, name), os.path.join(out, name))
    with open(os.path.join(out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    size = _size(out)
    print(f"prep: {out} holds {size / 2**20:.2f} MiB ({len(wheels)} wheels, {len(manifest['models'])} models); "
          f"NVRTC {manifest['nvrtc_check']['nvrtc']} compiled {len(manifest['nvrtc_check']['compiled'])} modules "
          f"for {NVRTC_ARCH}")
    if size > SIZE_LIMIT:
        print(f"prep: {out} is over its {SIZE_LIMIT >> 20} MiB limit", file=sys.stderr)
        return 1
    if not args.no_image_venv:
        print(f"prep: {IMAGE_VENV}: Python 3.12 with the GPU image's packages, for the dry run", flush=True)
        if make_image_venv() is None:
            print("prep: no Python 3.12 here: the dry run will use python3 and cannot stand in for the GPU "
                  "machine's image (set GPU_CHECK_IMAGE_BASE_PYTHON to a CPython 3.12)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
