#!/usr/bin/env bash
# The whole device command of the GPU check (prepared by `bash scripts/gpu_check.sh prep`).
# On the lent GPU machine, from the repository root, carrying .gpucheck:
#
#   bash .gpucheck/run.sh
#
# It installs the carried wheels into a folder on PYTHONPATH of the image's python3 (no
# index, no dependencies: nothing is fetched), then runs the check's stages within
# GPU_CHECK_BUDGET seconds (default 480). Every stage appends to $OUT/results.jsonl and
# rewrites $OUT/summary.md as it finishes, so a run cut short still returns what it measured.
#
#   GPU_CHECK_DRY=1 bash .gpucheck/run.sh    # no GPU: install, imports, discovery, references
#   GPU_CHECK_PYTHON=/path/to/python3 ...     # another interpreter than the image's python3
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/.."
# the image's python3 on the GPU machine; for a dry run or a rehearsal elsewhere, the stand-in
# for that image which prep makes beside the checkout (CPython 3.12 with its versions, no plugrt)
PYTHON=${GPU_CHECK_PYTHON:-python3}
REHEARSAL=${GPU_CHECK_DRY:-}${GPU_CHECK_DEVICE:+rehearsal}
if [ -z "${GPU_CHECK_PYTHON:-}" ] && [ -n "$REHEARSAL" ] && [ -x "$HERE/../.venv-gpu-image/bin/python" ]; then
    PYTHON="$HERE/../.venv-gpu-image/bin/python"
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    echo "gpu check: $PYTHON is not CPython 3.12, the GPU machine's; the carried wheels are built for 3.12." >&2
    echo "  For a dry run here, 'bash scripts/gpu_check.sh prep' makes .venv-gpu-image (or set GPU_CHECK_PYTHON)." >&2
    exit 2
fi
export OUT=${OUT:-$HERE/out}
# a folder of this run's own: two checks on one machine (a dry run beside a rehearsal) must
# not install into each other's
export GPU_CHECK_SITE=${GPU_CHECK_SITE:-$(mktemp -d "${TMPDIR:-/tmp}/plugrt-gpucheck-site.XXXXXX")}
export GPU_CHECK_WORK=${GPU_CHECK_WORK:-/tmp/plugrt-gpucheck-work}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$GPU_CHECK_WORK"
rm -rf "$GPU_CHECK_SITE"
if ! "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$GPU_CHECK_SITE" "$HERE"/wheels/*.whl >"$OUT/install.log" 2>&1; then
    echo "gpu check: installing the carried wheels failed:" >&2
    cat "$OUT/install.log" >&2
    printf '{"stage": "install", "status": "fail", "detail": %s}\n' \
        "$("$PYTHON" -c 'import json,sys; print(json.dumps(open(sys.argv[1]).read()[-2000:]))' "$OUT/install.log")" \
        >>"$OUT/results.jsonl"
    exit 1
fi
export PYTHONPATH="$GPU_CHECK_SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$GPU_CHECK_SITE/bin:$PATH"
exec "$PYTHON" "$HERE/driver.py"
