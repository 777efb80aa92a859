"""Our spec inside real (CUDA) vLLM on a GPU, with transfers running next to forward passes.

A Llama-shaped model with random-normal weights (drawn on the GPU from fixed seeds in every
engine, ``benchmarks.gpu_bench``), greedy decoding with the sampled tokens' logprobs, prompts given
as token ids.

What is compared, bitwise (tokens and logprobs): single requests run one at a time, so that the
matrix shapes are the same in both runs (vLLM is not batch-invariant: a batch of other
requests, or a cache hit against a full prefill, changes bf16 rounding). The transfers under
test happen in between, in concurrent batches:

* cold runs with offloading equal cold runs without it (stores do not disturb the compute);
* a batch loads old prompts from our CPU tier while new prompts are computed and stored; a GPU
  hit on the loaded KV then equals the GPU hit on the KV as first computed (loads are complete
  and exact);
* the new prompts, served from the CPU tier alone, equal their GPU hit (stores that ran next
  to other forward passes copied the blocks after they were written);
* after an engine restart (new engine process, same disk folder) the prompts come from disk and
  equal the first engine's GPU hit.

GPU only (marker ``gpu``; ``scripts/gpu_tests.sh``); skipped, never passed, elsewhere.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.gpu


def _gpu_listed() -> bool:
    """Asked of nvidia-smi, not of CUDA: a CUDA call here would keep vLLM from forking its
    engine processes (a forked child cannot use CUDA the parent initialized)."""
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                              timeout=30).stdout.startswith("GPU")
    except (OSError, subprocess.SubprocessError):
        return False


if not _gpu_listed():
    pytest.skip("needs an NVIDIA GPU (run scripts/gpu_tests.sh on a GPU machine)",
                allow_module_level=True)
pytest.importorskip("torch")
pytest.importorskip("vllm")

from benchmarks.gpu_bench import Engine, transfer_config, write_model  # noqa: E402
from tiering.settings import CUDA_CHUNK_TOKENS  # noqa: E402

MAX_TOKENS = 12
OPTS = SimpleNamespace(dtype="bfloat16", cpu_platform=False, gpu_mem=0.3)


def tokens(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(100, 31000) for _ in range(n)]


SHARED = tokens(1, 1024)
# Lengths whose hit ends at the same token whether it comes from the GPU's 16-token blocks or
# from the tiers' 64-token chunks (our default on CUDA): a compared run computes the same
# tokens in both, so its matrix shapes match (a hit 48 tokens shorter changes bf16 rounding)
PROMPTS = [SHARED + tokens(2, 10), SHARED + tokens(3, 333), SHARED + tokens(4, 650),
           tokens(5, 588), tokens(6, 1480), tokens(7, 2060)]
NEW = [tokens(8, 900), SHARED + tokens(9, 5)]
assert all((len(p) - 1) % CUDA_CHUNK_TOKENS < 16 for p in PROMPTS + NEW)
MAX_LEN = 4096
GPU_BLOCKS = 2048  # 32k tokens: everything fits; the point is correctness, not eviction


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"), "small", 8192)


@pytest.fixture(scope="module")
def reference(model):
    """Cold outputs without offloading, one request at a time."""
    eng = Engine(OPTS, model, "none", None, GPU_BLOCKS, MAX_LEN)
    try:
        outs, _ = one_by_one(eng, PROMPTS + NEW)
    finally:
        eng.close()
    return outs


def model_layers(model) -> int:
    return json.loads((model / "config.json").read_text())["num_hidden_layers"]


def one_by_one(eng, prompts):
    """Run each prompt alone: (tokens, logprobs) per prompt, and the summed hit sources."""
    outs, total = [], {"device": 0.0, "host": 0.0, "disk": 0.0}
    for p in prompts:
        _, src, res = eng.generate([p], MAX_TOKENS)
        outs.append((res[0]["token_ids"], res[0]["logprobs"]))
        for k in total:
            total[k] += src[k]
    return outs, total


# (copy path, the operator's VLLM_KV_CACHE_LAYOUT): None leaves the layout to our connector,
# which asks for the block-outermost BLHNC (every layer of a block in one tensor: one copy per
# chunk); LBHNC is vLLM's per-layer layout (one tensor per layer), set by the variable
@pytest.mark.parametrize("gpu_copy,kv_layout", [("dma", None), ("staged", None), ("dma", "LBHNC")])
def test_tier_hits_are_bitwise_equal_to_gpu_hits_with_transfers_next_to_compute(
        model, reference, tmp_path, monkeypatch, capfd, gpu_copy, kv_layout):
    if kv_layout:  # read by the engine-core process the engine starts
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", kv_layout)
    else:
        monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    n_old = len(PROMPTS)
    assert len({tuple(t) for t, _ in reference}) == len(reference)  # outputs vary by prompt
    # promote "always": load every disk hit (this small model recomputes faster than the disk
    # reads, and "auto" would rightly recompute; here the disk path itself is under test)
    kvt = transfer_config("ours", tmp_path, 2 << 30, 4.0, gpu_copy, promote="always")
    capfd.readouterr()  # the engine core is a child process writing to the same descriptors
    eng = Engine(OPTS, model, "ours", kvt, GPU_BLOCKS, MAX_LEN)
    try:
        started = "".join(capfd.readouterr())
        # the layout vLLM resolved, and what our worker was handed: BLHNC is one packed tensor
        layout = kv_layout or "BLHNC"
        assert f"Using {layout} KV cache layout" in started, started[-3000:]
        tensors = "1 KV tensors" if layout == "BLHNC" else f"{model_layers(model)} KV tensors"
        assert tensors in started, started[-3000:]
        cold, _ = one_by_one(eng, PROMPTS)
        # the reference ran in vLLM's default layout: the same kernels over other strides
        assert cold == reference[:n_old], kv_layout
        gpu_hit, src = one_by_one(eng, PROMPTS)
        assert src["device"] > 0.9 * sum(len(p) for p in PROMPTS), src
        eng.settle(1.0)  # stores done; GPU prefix cache dropped
        # concurrent: old prompts load from the CPU tier while new ones compute and store
        _, src, _ = eng.generate(PROMPTS + NEW, MAX_TOKENS)
        assert src["host"] > 0.5 * sum(len(p) for p in PROMPTS), src
        again, _ = one_by_one(eng, PROMPTS)  # GPU hits on the KV those loads brought back
        assert again == gpu_hit
        new_gpu_hit, _ = one_by_one(eng, NEW)
        eng.settle(1.0)
        new_cpu_hit, src = one_by_one(eng, NEW)  # served from the CPU tier
        assert src["host"] > 0.9 * sum(len(p) for p in NEW), src
        assert new_cpu_hit == new_gpu_hit
        eng.settle(2.0)  # let the file tier's writes land
    finally:
        eng.close()
    if gpu_copy != "dma" or kv_layout:  # the restart once, on the default path and layout
        return
    eng = Engine(OPTS, model, "ours", kvt, GPU_BLOCKS, MAX_LEN)  # restart: new engine process
    try:
        from_disk, src = one_by_one(eng, PROMPTS)
        assert src["disk"] > 0.5 * sum(len(p) for p in PROMPTS), src
        assert from_disk == gpu_hit
    finally:
        eng.close()
    assert os.path.isdir(tmp_path / "ours")


def test_the_promotion_advisor_times_the_steps_by_the_workers_cuda_events(model, tmp_path,
                                                                           monkeypatch, capfd):
    """``step_timing`` "forward" (the default, tiering/vllm/forward_timer.py) on CUDA: our
    connector carries the worker's event-timed forward passes back, and every prompt step of
    the prompts run one at a time becomes a sample of its own, of a plausible length (more
    than zero, less than the whole request took)."""
    import re
    import time

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the samples' lines (engine core)
    kvt = transfer_config("ours", tmp_path, 1 << 30, 2.0)
    capfd.readouterr()
    eng = Engine(OPTS, model, "ours", kvt, GPU_BLOCKS, MAX_LEN)
    try:
        slowest = 0.0
        for p in PROMPTS[3:]:  # three prompts that share no prefix: each computes in full
            t = time.perf_counter()
            eng.generate([p], MAX_TOKENS)
            slowest = max(slowest, time.perf_counter() - t)
    finally:
        eng.close()
    out = "".join(capfd.readouterr())
    assert "timed by the worker's forward passes from now on" in out, out[-3000:]
    found = re.findall(r"forward-timed sample: (\d+) tokens, attention \S+, ([0-9.]+) s", out)
    by_tokens = {int(n): float(s) for n, s in found}
    for p in PROMPTS[3:]:  # their prompt steps, whole (vLLM's step budget is the model length)
        computed = max(n for n in by_tokens if n <= len(p)) if by_tokens else 0
        assert computed >= len(p) - 16, (len(p), found)
    assert all(0.0 < s < slowest for s in by_tokens.values()), (found, slowest)
