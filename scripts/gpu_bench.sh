#!/usr/bin/env bash
# TTFT per cache phase and throughput for five offloading setups side by side (benchmarks/gpu_bench.py):
#   bash scripts/gpu_bench.sh [--configs none,ours] [--lengths 2048] [--phases cold,gpu,cpu] ...
# Needs an NVIDIA GPU and CUDA vLLM importable. Writes docs/results/gpu_bench_<tag>_<shape>.{json,md,png}
# unless --out says otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
nvidia-smi -L || true
exec python3 -P -m benchmarks.gpu_bench "$@"
