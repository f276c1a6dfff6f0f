#!/usr/bin/env bash
# GPU check of the CUDA codec kernels, in one call on a machine with an NVIDIA GPU (an H200 here):
# JIT-builds the kernels for the device (sm_90 on an H200), checks them bit for bit against the
# reference codec on the GPU, measures their bandwidth against a device copy, and compares with
# bitsandbytes' quantize_blockwise when bitsandbytes imports (or installs from wheels carried in
# .whl/; nothing is fetched from the network). Runs in well under 5 minutes.
#
# Usage: scripts/gpu_check.sh [OUTPUT.json] [gpu_check.py options]
#   Writes $OUT/gpu_check.json (+ gpu_check.log) when $OUT is set, else OUTPUT.json
#   (default ./gpu_check.json). Exit status 0 when every case is bit-identical.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [[ -n "${OUT:-}" ]]; then
  DEST="$OUT/gpu_check.json"
  LOG="$OUT/gpu_check.log"
  [[ $# -gt 0 && "$1" != -* ]] && shift
else
  DEST="${1:-gpu_check.json}"
  LOG="${DEST%.json}.log"
  [[ $# -gt 0 && "$1" != -* ]] && shift
fi
mkdir -p "$(dirname "$DEST")"

# Optional comparison: bitsandbytes from carried wheels, installed outside the system site.
if ! "$PYTHON" -c "import bitsandbytes" >/dev/null 2>&1; then
  if compgen -G ".whl/bitsandbytes-*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/qaccel_bnb .whl/*.whl \
      && export PYTHONPATH="/tmp/qaccel_bnb${PYTHONPATH:+:$PYTHONPATH}" \
      || echo "gpu_check: bitsandbytes wheel did not install; skipping the comparison" >&2
  fi
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"      # qaccel from this checkout, no install
export QACCEL_CACHE_DIR="${QACCEL_CACHE_DIR:-/tmp/qaccel_kernels}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"                  # ninja parallelism for the JIT build
export PYTHONUNBUFFERED=1

set +e
timeout 280 "$PYTHON" scripts/gpu_check.py --json "$DEST" "$@" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
set -e
if [[ $status -eq 124 ]]; then
  echo "gpu_check: stopped after 280 s; $DEST holds the sections that finished" >&2
fi
exit "$status"
