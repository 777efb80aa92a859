"""The first-token tail through a real vLLM ``Scheduler`` with our connector and spec
(``tests/vllm_harness.py``): a request whose hits were loaded is timed from its load's landing
to its first token, as vLLM hands the token out (``TieredOffloadingConnector``), and the
promotion advisor learns it only from a request that had the engine to itself."""

from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("vllm")

CHUNK = 128
PROMPT = 512
GAP_S = 0.02  # wall time between the harness's steps: what a step takes on a GPU


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from benchmarks.tiny_model import build

    return str(build(tmp_path_factory.mktemp("m") / "model", layers=2, hidden=128, heads=2,
                     kv_heads=2, intermediate=256, max_pos=4096))


def prompt(seed: int, n: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(n)]


def harness(model, tmp_path, batched: int = PROMPT):
    from vllm_harness import Harness

    extra = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
             "block_size": CHUNK, "cpu_bytes_to_use": 32 * (256 << 10),
             "tiers": [{"medium": "cpu", "policy": "lru", "store_threshold": 0,
                        "promote": "auto"},
                       {"medium": "file", "path": str(tmp_path / "kv"), "capacity": "64MiB",
                        "io": "posix", "store_threshold": 0}]}
    h = Harness(model, extra, batched_tokens=batched, max_num_seqs=8, delay=1,
                gpu_tokens=8192)
    assert h.manager.chain.advisor is not None
    return h, h.manager.chain.advisor


def run_slowly(h, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not h.scheduler.requests and not h._pending:
            break
        h.step()
        time.sleep(GAP_S)
    h.step()


@pytest.mark.parametrize("max_tokens", [1, 4])
def test_a_cpu_hit_alone_teaches_the_tail_from_its_landing_to_its_first_token(
        model, tmp_path, max_tokens):
    """A request loading its prefix from the CPU tier, alone: its load lands at the end of one
    step, vLLM computes its last token in the next and hands the token out then, one step's
    wall time later. With ``max_tokens`` 1 the token comes with the request's end (vLLM frees
    it before it hands the connector the step's output), with 4 while it decodes on."""
    h, adv = harness(model, tmp_path)
    try:
        h.add("a", prompt(1), max_tokens=max_tokens)
        run_slowly(h)
        assert adv.first_token_tail_s == 0.0  # computed cold: nothing was loaded
        h.reset_gpu_prefix_cache()
        h.add("a2", prompt(1), max_tokens=max_tokens)
        run_slowly(h)
        assert h.cached["a2"] >= PROMPT - CHUNK  # its hits were loaded
        tail = adv.first_token_tail_s
        assert GAP_S * 0.9 <= tail <= 10 * GAP_S + 0.5, tail
        assert not h.scheduler.connector._awaiting_first_token  # nothing left watched
    finally:
        h.manager.shutdown()


def test_requests_loading_side_by_side_teach_nothing(model, tmp_path):
    """Two requests whose loads land together: each one's first token waits for the other's
    compute too (a batch's wait, which a recomputed run pays as well): no tail is learned."""
    h, adv = harness(model, tmp_path)
    try:
        for i in (1, 2):
            h.add(f"c{i}", prompt(i))
        run_slowly(h)
        h.reset_gpu_prefix_cache()
        for i in (1, 2):
            h.add(f"h{i}", prompt(i))
        run_slowly(h)
        assert h.cached["h1"] >= PROMPT - CHUNK and h.cached["h2"] >= PROMPT - CHUNK
        assert adv.first_token_tail_s == 0.0
        assert not h.scheduler.connector._awaiting_first_token
    finally:
        h.manager.shutdown()


def test_a_partial_hit_teaches_nothing_its_cold_rest_was_computed_after_the_landing(
        model, tmp_path):
    """A loaded prefix followed by 1,024 cold tokens computed 256 a step: its first token
    comes after those steps, which a recompute pays as well. Timed as the tail, it was 4.3
    steps (found by a hostile review); a request that computed a chunk or more after its
    landing is no sample."""
    h, adv = harness(model, tmp_path, batched=256)
    try:
        head = prompt(1)
        h.add("cold", head, max_tokens=1)
        run_slowly(h)
        h.reset_gpu_prefix_cache()
        h.add("partial", head + prompt(2, 1024), max_tokens=1)
        run_slowly(h)
        assert h.cached["partial"] >= PROMPT - CHUNK  # the head was loaded
        assert adv.first_token_tail_s == 0.0
    finally:
        h.manager.shutdown()


def test_the_advisors_state_reaches_the_disk_when_the_engine_runs_out_of_requests(
        model, tmp_path):
    """A step's end hands the advisor's state over at most once a second; what was measured
    after the last hand-over (here: the request's own prefill, in the steps right after the
    start) goes over when the last request finishes, since an idle engine has no step to do it
    at. No shutdown: vLLM's server force-kills its engine core on SIGTERM."""
    import json

    h, adv = harness(model, tmp_path)
    try:
        h.add("a", prompt(1), max_tokens=1)
        run_slowly(h)
        assert adv.prefill.samples
        (ns,) = [p for p in (tmp_path / "kv").iterdir() if p.is_dir()]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            saved = ns / "advisor.json"
            if saved.exists() and json.loads(saved.read_text()).get("prefill"):
                break
            time.sleep(0.05)
        kept = json.loads((ns / "advisor.json").read_text())
        assert kept["prefill"]["samples"] == adv.prefill.samples
    finally:
        h.manager.shutdown()
