#!/usr/bin/env bash
# GPU checks and benchmarks in one call (see scripts/gpu_check.py). Works on a machine with an
# NVIDIA GPU and PyTorch; installs missing wheels from .whl/ if present (no network needed).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu-results}}
source scripts/gpu_env.sh
nvidia-smi -L || true
python3 scripts/gpu_check.py "$OUT"
