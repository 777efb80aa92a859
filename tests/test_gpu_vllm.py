"""Our spec inside real (CUDA) vLLM on a GPU, with concurrent forward passes.

A Llama-shaped model with random-normal weights (drawn on the GPU from fixed seeds in every
engine, ``tiering.gpu_bench``), greedy decoding, prompts given as token ids. Several requests run
in one batch, so stores of some requests overlap the forward passes of others and loads must be
complete before the request that needs them is computed. The greedy tokens must equal those of
an engine without offloading:

* after ``reset_prefix_cache`` the prompts are served from our CPU tier (counted by vLLM's
  ``prompt_tokens_cached_by_source``), with new prompts computed in the same batch;
* after an engine restart (a new engine process, same disk folder) they come from disk.

GPU only (marker ``gpu``; ``scripts/gpu_tests.sh``); skipped, never passed, elsewhere.
"""

from __future__ import annotations

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

from tiering.gpu_bench import Engine, transfer_config, write_model  # noqa: E402

MAX_TOKENS = 12
OPTS = SimpleNamespace(dtype="bfloat16", cpu_platform=False, gpu_mem=0.3)


def tokens(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(100, 31000) for _ in range(n)]


SHARED = tokens(1, 1024)
PROMPTS = [SHARED + tokens(2, 100), SHARED + tokens(3, 333), SHARED + tokens(4, 700),
           tokens(5, 600), tokens(6, 1500), tokens(7, 2100)]
NEW = [tokens(8, 900), SHARED + tokens(9, 50)]
MAX_LEN = 4096
GPU_BLOCKS = 2048  # 32k tokens: everything fits; the point is correctness, not eviction


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"), "small", 8192)


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens without offloading: cold, then (for the new prompts) in a mixed batch."""
    eng = Engine(OPTS, model, "none", None, GPU_BLOCKS, MAX_LEN)
    try:
        _, _, cold = eng.generate(PROMPTS, MAX_TOKENS)
        eng.settle()
        _, _, mixed = eng.generate(PROMPTS + NEW, MAX_TOKENS)
    finally:
        eng.close()
    return [r["token_ids"] for r in cold], [r["token_ids"] for r in mixed]


def ids(res):
    return [r["token_ids"] for r in res]


@pytest.mark.parametrize("gpu_copy", ["dma", "staged"])
def test_outputs_identical_when_served_from_the_cpu_tier_and_after_restart(
        model, reference, tmp_path, gpu_copy):
    ref_cold, ref_mixed = reference
    assert len({tuple(t) for t in ref_cold}) == len(ref_cold)  # the weights make varied output
    kvt = transfer_config("ours", tmp_path, 2 << 30, 4.0, gpu_copy)
    eng = Engine(OPTS, model, "ours", kvt, GPU_BLOCKS, MAX_LEN)
    try:
        _, _, cold = eng.generate(PROMPTS, MAX_TOKENS)
        assert ids(cold) == ref_cold
        eng.settle(1.0)  # stores done; GPU prefix cache dropped
        _, src, mixed = eng.generate(PROMPTS + NEW, MAX_TOKENS)
        prompt_tokens = sum(len(p) for p in PROMPTS)
        assert src["host"] >= 0.9 * prompt_tokens, src  # the old prompts came from our CPU tier
        assert ids(mixed) == ref_mixed
        for p, r in zip(PROMPTS, mixed, strict=False):
            assert r["cached_tokens"] >= 0.8 * len(p), (len(p), r["cached_tokens"])
        eng.settle(2.0)  # let the file tier's writes land
    finally:
        eng.close()
    if gpu_copy != "dma":  # the restart once, on the default path
        return
    eng = Engine(OPTS, model, "ours", kvt, GPU_BLOCKS, MAX_LEN)  # restart: new engine process
    try:
        _, src, again = eng.generate(PROMPTS, MAX_TOKENS)
        assert src["disk"] >= 0.9 * sum(len(p) for p in PROMPTS), src
        assert ids(again) == ref_cold
    finally:
        eng.close()
    assert os.path.isdir(tmp_path / "ours")
