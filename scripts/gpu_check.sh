#!/usr/bin/env bash
# The GPU check of the CUDA provider, in two halves (docs/gpu-check.md says more):
#
#   bash scripts/gpu_check.sh prep   # here, with the package index: writes .gpucheck/
#   bash scripts/gpu_check.sh dry    # here: GPU_CHECK_DRY=1 bash .gpucheck/run.sh
#
# then, on the lent GPU machine (the device tool), one call:
#   run(command="bash .gpucheck/run.sh", carry=[".gpucheck"], timeout_s=560)
# which returns $OUT/summary.md and $OUT/results.jsonl (docs/gpu-results.md keeps the summary).
#
# prep runs with the python on PATH (a venv holding the test extra and plugrt-cuda with an
# NVRTC, e.g. `pip install -c constraints.txt ".[test]" "./providers/cuda[cuda12]"`).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    prep)
        # a cold numba compile costs minutes: the references come from the numpy kernels
        PLUGRT_NUMBA=0 python scripts/gpucheck/prep.py "${@:2}"
        ;;
    dry)
        [ -f .gpucheck/run.sh ] || { echo "no .gpucheck/: run 'bash scripts/gpu_check.sh prep' first" >&2; exit 2; }
        GPU_CHECK_DRY=1 bash .gpucheck/run.sh
        ;;
    *)
        echo "usage: bash scripts/gpu_check.sh prep|dry" >&2
        exit 2
        ;;
esac
