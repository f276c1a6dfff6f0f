#!/usr/bin/env bash
# GPU check of qaccel on one NVIDIA GPU (an H200 here), in one call, JSON out (docs/gpu_runbook.md):
# JIT-builds the CUDA codec kernels for the device (sm_90 on an H200) and checks them bit for bit
# against the reference codec; measures their bandwidth as a fraction of the device's peak memory
# bandwidth and what their fp64 arithmetic costs; compares with bitsandbytes' quantize_blockwise /
# dequantize_blockwise when bitsandbytes imports (or installs from wheels carried in .whl/; nothing
# is fetched from the network); checks the fused payload kernels; trains a small GPT-2 with FSDP2 +
# QSDP W8G8 over a 1-rank NCCL group next to stock FSDP2 (fp32 and bf16); runs 0/1 Adam steps under
# DDP over NCCL against torch.optim.Adam and a plain loop; checks the C++ kernels against CUDA; and,
# last, checks the Hadamard-rotated payload kernels against the reference and times them against plain.
# Budget: under 8 minutes on an H200 (stopped at 470 s; the JSON keeps every finished section).
#
# Usage: scripts/gpu_check.sh [OUTPUT.json] [gpu_check.py options, e.g. --sections fp64,fsdp_smoke]
#   Writes $OUT/gpu_check.json (+ gpu_check.log) when $OUT is set, else OUTPUT.json
#   (default ./gpu_check.json). Exit status 0 when every section that ran passed; 1 when one failed
#   or no CUDA device is visible; 124 when the time limit stopped it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LIMIT_S=${GPU_CHECK_LIMIT_S:-470}

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
export HF_HUB_OFFLINE=1                                  # the models are built from configs: nothing to fetch
export PYTHONUNBUFFERED=1

set +e
timeout "$LIMIT_S" "$PYTHON" scripts/gpu_check.py --json "$DEST" "$@" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
set -e
if [[ $status -eq 124 ]]; then
  echo "gpu_check: stopped after $LIMIT_S s; $DEST holds the sections that finished" >&2
fi
exit "$status"
