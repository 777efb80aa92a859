#!/usr/bin/env bash
# Type check (mypy, settings in pyproject.toml): the package strict, the GPU tests non-strict.
#   bash scripts/typecheck.sh [python]      (default .venv/bin/python)
# The package's folders are mapped to their import paths (backends/ is tiering.backends,
# policies/ is tiering.policies) by a tree of links under build/typecheck/, since mypy cannot
# follow the editable install's import hook.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${1:-.venv/bin/python}
case $py in /*) ;; *) py=$root/$py ;; esac
tree=build/typecheck
rm -rf "$tree" && mkdir -p "$tree/tiering"
for entry in tiering/*; do ln -s "$root/$entry" "$tree/tiering/"; done
ln -s "$root/backends" "$tree/tiering/backends"
ln -s "$root/policies" "$tree/tiering/policies"
ln -s "$root/benchmarks" "$tree/benchmarks"
cd "$tree"
"$py" -m mypy --config-file "$root/pyproject.toml" -p tiering
"$py" -m mypy --config-file "$root/pyproject.toml" "$root"/tests/test_gpu_copy.py "$root"/tests/test_gpu_kvikio.py \
  "$root"/tests/test_gpu_vllm.py
