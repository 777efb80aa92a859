# Sourced by the scripts/gpu_*.sh scripts, from the project root: make the package and the
# benchmark harnesses (benchmarks/) importable without installing (mirrors pyproject's
# package-dir mapping) and add wheels carried in .whl/
# (for a GPU machine without network: lmdb, zstandard, kvikio, ...).
if ls .whl/*.whl >/dev/null 2>&1; then
  whl_site=${TIERING_WHL_SITE:-$PWD/build-gpu-wheels}
  stamp=$(ls .whl/*.whl | sort | md5sum | cut -d' ' -f1)
  if [ "$(cat "$whl_site/.stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$whl_site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$whl_site" .whl/*.whl
    echo "$stamp" > "$whl_site/.stamp"
  fi
  export PYTHONPATH=$whl_site${PYTHONPATH:+:$PYTHONPATH}
fi
rm -rf build-gpu && mkdir -p build-gpu/tiering
cp -r tiering/* build-gpu/tiering/ && cp -r backends build-gpu/tiering/backends \
  && cp -r policies build-gpu/tiering/policies && cp -r benchmarks build-gpu/benchmarks
export PYTHONPATH=$PWD/build-gpu${PYTHONPATH:+:$PYTHONPATH}
export KVIKIO_COMPAT_MODE=${KVIKIO_COMPAT_MODE:-ON}
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1
