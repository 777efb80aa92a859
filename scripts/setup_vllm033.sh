#!/usr/bin/env bash
# A second environment with CUDA vLLM 0.33 (it imports on a CPU-only machine) to run the
# scheduler-side tests against vLLM's newer offloading API. Idempotent (stamp file).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV033:-.venv033}
stamp="$VENV/.tiering-setup"
recipe_hash=$(cat scripts/setup_vllm033.sh pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$recipe_hash" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade "pip>=23.2" "setuptools>=68" wheel
pip install "vllm==0.33.0"
pip install -e ".[test]"
echo "$recipe_hash" > "$stamp"
