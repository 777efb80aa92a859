#!/usr/bin/env bash
# GPU checks and benchmarks in one call (see scripts/gpu_check.py). Works on a machine with an
# NVIDIA GPU and PyTorch; installs missing wheels from .whl/ if present (no network needed).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu-results}}
if ls .whl/*.whl >/dev/null 2>&1; then
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
  export PYTHONPATH=$site:${PYTHONPATH:-}
fi
# the package itself, importable without installing (mirrors pyproject's package-dir mapping)
rm -rf build-gpu && mkdir -p build-gpu/tiering
cp -r tiering/* build-gpu/tiering/ && cp -r backends build-gpu/tiering/backends \
  && cp -r policies build-gpu/tiering/policies
export PYTHONPATH=$PWD/build-gpu:${PYTHONPATH:-}
export KVIKIO_COMPAT_MODE=${KVIKIO_COMPAT_MODE:-ON}
nvidia-smi -L || true
python3 scripts/gpu_check.py "$OUT"
