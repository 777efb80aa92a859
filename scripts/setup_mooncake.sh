#!/usr/bin/env bash
# Mooncake Store's Python client and its mooncake_master binary (one wheel) for the mooncake tier
# and its tests: the CUDA 13 build where an NVIDIA GPU answers, the non-CUDA build elsewhere (the
# same API; TCP transport only). Idempotent: returns at once when the venv already imports it.
# Usage: scripts/setup_mooncake.sh [VENV]   (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${VENV:-.venv}}
if "$VENV/bin/python" -c "import mooncake.store" >/dev/null 2>&1; then
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  wheel="mooncake-transfer-engine-cuda13==0.3.14"
else
  wheel="mooncake-transfer-engine-non-cuda==0.3.13.post1"
fi
PIP_NO_CACHE_DIR=1 "$VENV/bin/python" -m pip --disable-pip-version-check -q install "$wheel"
"$VENV/bin/python" -c "import mooncake.store"
