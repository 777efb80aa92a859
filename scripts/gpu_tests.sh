#!/usr/bin/env bash
# The GPU tests (marker `gpu`): the CUDA copier's paths and the kvikio slab I/O byte-exact in
# every layout, our spec inside real CUDA vLLM (outputs identical with and without offloading,
# restart keeps disk hits). Needs an NVIDIA GPU; the vLLM tests also need CUDA vLLM importable.
#   bash scripts/gpu_tests.sh [pytest args]      (JUnit XML into $OUT when OUT is set)
# Two pytest processes: the vLLM tests run in one that has not touched CUDA itself, so vLLM can
# fork its engine processes.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
nvidia-smi -L || true
rc=0
for part in "tests/test_gpu_copy.py tests/test_gpu_kvikio.py" "tests/test_gpu_vllm.py"; do
  name=$(basename "${part##* }" .py)
  xml=()
  [ -n "${OUT:-}" ] && xml=(--junitxml "$OUT/$name.xml")
  # -P: the source folder tiering/ in the current directory must not shadow build-gpu/tiering
  # shellcheck disable=SC2086
  python3 -P -m pytest -m gpu -q -ra -p no:cacheprovider "${xml[@]}" $part "$@" || rc=1
done
exit $rc
