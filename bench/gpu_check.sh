#!/usr/bin/env bash
# Runs bench/gpu_check.py on a CUDA machine; table to $OUT (else ./gpu_out).
# Usage: bench/gpu_check.sh [--sizes 4GB,16GB] [--budget 1GiB] [--dry-run]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
exec timeout 475 "$PY" bench/gpu_check.py "$@"
