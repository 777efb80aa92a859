#!/usr/bin/env bash
# The GPU tests (marker `gpu`): the CUDA copy engine's paths and the kvikio engine byte-exact in
# every layout, our spec inside real CUDA vLLM (outputs identical with and without offloading,
# restart keeps disk hits). Needs an NVIDIA GPU; the vLLM tests also need CUDA vLLM importable.
#   bash scripts/gpu_tests.sh [pytest args]      (JUnit XML to $OUT/gpu_tests.xml when OUT is set)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
nvidia-smi -L || true
xml=()
[ -n "${OUT:-}" ] && xml=(--junitxml "$OUT/gpu_tests.xml")
# -P: the source folder tiering/ in the current directory must not shadow build-gpu/tiering
exec python3 -P -m pytest -m gpu -q -ra -p no:cacheprovider "${xml[@]}" tests/test_gpu_*.py "$@"
