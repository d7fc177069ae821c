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
# First, under a minute: host RAM per program the budget charges (measured on
# CPU devices only so far; bench/device_programs.py).
out_dir=${OUT:-gpu_out}
mkdir -p "$out_dir"
if [[ " $* " != *" --dry-run "* ]]; then
  timeout 90 "$PY" bench/device_programs.py --out "$out_dir/device_programs.md" \
    || echo "bench/device_programs.py failed or timed out (exit $?)"
fi
exec timeout 475 "$PY" bench/gpu_check.py "$@"
