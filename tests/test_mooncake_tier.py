"""MooncakeTier against a real ``mooncake_master`` on localhost (started per module on free
ports, killed at teardown): bytes round-trip exactly between two clients, the wrong namespace
never hits, a corrupt or foreign value is a miss, a master killed with -9 (or frozen) turns
into misses and rejections without blocking the caller, and a restarted master serves new
stores again. Also the tier inside a ``TierChain`` (RETRY, then a promotion into a CPU row)."""

from __future__ import annotations

import mmap
import struct
import time

import numpy as np
import pytest

pytest.importorskip("mooncake.store")

from mooncake_util import MooncakeMaster  # noqa: E402

from tiering.backends.mooncake_config import MooncakeTierConfig  # noqa: E402
from tiering.backends.mooncake_tier import LinkState, MooncakeTier  # noqa: E402
from tiering.backends.mooncake_value import HEADER_BYTES, object_name  # noqa: E402
from tiering.backends.namespace import NamespaceFacts  # noqa: E402
from tiering.tier import Lookup  # noqa: E402

RB = 64 << 10  # row bytes
ROWS = 32
FACTS = NamespaceFacts("model-a", "bfloat16", "NHD", RB, 16)
OTHER = NamespaceFacts("model-b", "bfloat16", "NHD", RB, 16)


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    m = MooncakeMaster(tmp_path_factory.mktemp("mooncake")).start()
    yield m
    m.close()


@pytest.fixture
def staging():
    """A page-aligned region of ROWS random rows, as the CPU tier's staging region is."""
    buf = mmap.mmap(-1, ROWS * RB)
    rows = np.frombuffer(buf, dtype=np.uint8).reshape(ROWS, RB)
    rows[:] = np.random.default_rng(3).integers(0, 256, rows.shape, dtype=np.uint8)
    yield buf, rows
    del rows


def view(buf: mmap.mmap, i: int) -> memoryview:
    return memoryview(buf)[i * RB:(i + 1) * RB]


@pytest.fixture
def open_tier(master):
    tiers: list[MooncakeTier] = []

    def make(facts: NamespaceFacts = FACTS, **cfg: object) -> MooncakeTier:
        conf = master.tier_config(**{"local_hostname": "127.0.0.1", "timeout_s": 1.0, **cfg})
        t = MooncakeTier(conf, facts)
        tiers.append(t)
        assert t.wait_connected(30), "the tier did not connect to the master"
        return t

    yield make
    for t in tiers:
        t.close()


def resolve(tier: MooncakeTier, keys: list[bytes], timeout: float = 10.0) -> list[Lookup]:
    """Ask like vLLM does (every step until nothing answers RETRY)."""
    deadline = time.monotonic() + timeout
    while True:
        answers = [tier.lookup(k) for k in keys]
        if Lookup.RETRY not in answers or time.monotonic() > deadline:
            return answers
        tier.poll(wait=0.05)


def unique_keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{time.monotonic_ns()}-{i}".encode() for i in range(n)]


def store(tier: MooncakeTier, keys: list[bytes], buf: mmap.mmap, first_row: int = 0) -> list:
    out = tier.put(keys, [view(buf, first_row + i) for i in range(len(keys))])
    assert out.admitted == keys, out
    return tier.wait_idle(timeout=30)


def test_bytes_round_trip_between_two_clients(open_tier, staging):
    buf, rows = staging
    writer, reader = open_tier(), open_tier()
    keys = unique_keys("rt", 8)
    done = store(writer, keys, buf)
    assert [c.ok for c in done] == [True] * 8
    assert writer.stats["stores"] == 8 and writer.stats["store_bytes"] == 8 * RB
    assert resolve(reader, keys) == [Lookup.HIT] * 8
    started = reader.get([(k, view(buf, 16 + i), i) for i, k in enumerate(keys)])
    assert started == [True] * 8
    reads = reader.wait_idle(timeout=30)
    assert sorted((c.token, c.ok, c.nbytes) for c in reads) == [(i, True, RB) for i in range(8)]
    for i in range(8):
        assert np.array_equal(rows[16 + i], rows[i]), f"row {i} differs after the round trip"
    assert reader.stats["hits"] == 8 and reader.stats["promotion_bytes"] == 8 * RB


def test_unknown_key_is_retry_then_miss_counted_once(open_tier):
    tier = open_tier()
    key = unique_keys("miss", 1)
    assert tier.lookup(key[0]) is Lookup.RETRY
    assert tier.stats["lookups"] == 0  # not counted until answered
    assert resolve(tier, key) == [Lookup.MISS]
    assert tier.stats["lookups"] == 1 and tier.stats["hits"] == 0


def test_wrong_namespace_never_hits(open_tier, staging):
    buf, _ = staging
    a, b = open_tier(FACTS), open_tier(OTHER)
    keys = unique_keys("ns", 4)
    store(a, keys, buf)
    assert resolve(b, keys) == [Lookup.MISS] * 4
    assert b.get([(k, view(buf, 20), None) for k in keys]) == [False] * 4
    assert object_name(FACTS.namespace_id, keys[0]) != object_name(OTHER.namespace_id, keys[0])


def raw_client(master):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", master.metadata, 16 << 20, 16 << 20, "tcp", "",
                   master.master) == 0
    return s


def test_corrupt_value_is_a_miss_never_served(master, open_tier, staging):
    buf, rows = staging
    writer, reader = open_tier(), open_tier()
    keys = unique_keys("corrupt", 2)
    store(writer, keys, buf)
    raw = raw_client(master)
    try:
        name = object_name(FACTS.namespace_id, keys[0])
        value = bytearray(raw.get(name))
        assert len(value) == HEADER_BYTES + RB and value[HEADER_BYTES:] == rows[0].tobytes()
        value[HEADER_BYTES + 1000] ^= 0xFF  # one flipped byte, header intact
        assert raw.remove(name, True) == 0
        assert raw.put(name, bytes(value)) == 0
        # a value under our name whose header names another namespace (a foreign writer)
        foreign = bytearray(raw.get(object_name(FACTS.namespace_id, keys[1])))
        struct.pack_into("<Q", foreign, 8, 12345)
        name1 = object_name(FACTS.namespace_id, keys[1])
        assert raw.remove(name1, True) == 0
        assert raw.put(name1, bytes(foreign)) == 0
        # (the raw client stays open: its segment may hold the values it put)
        assert resolve(reader, keys) == [Lookup.HIT, Lookup.HIT]
        rows[10:12] = 0
        assert reader.get([(k, view(buf, 10 + i), i) for i, k in enumerate(keys)]) == [True] * 2
        reads = {c.token: c for c in reader.wait_idle(timeout=30)}
    finally:
        raw.close()
    assert (reads[0].ok, reads[0].reason) == (False, "checksum")
    assert (reads[1].ok, reads[1].reason) == (False, "header")
    assert reader.stats["checksum_failures"] == 1
    assert reader.stats["remote_errors:checksum"] == 1
    assert reader.stats["remote_errors:header"] == 1
    assert not reader.contains(keys[0]) and not reader.contains(keys[1])  # forgotten: misses


def test_verify_off_still_checks_the_header(master, open_tier, staging):
    buf, _ = staging
    writer, reader = open_tier(), open_tier(verify=False)
    keys = unique_keys("nover", 1)
    store(writer, keys, buf)
    raw = raw_client(master)
    try:
        name = object_name(FACTS.namespace_id, keys[0])
        value = bytearray(raw.get(name))
        value[0:4] = b"XXXX"
        assert raw.remove(name, True) == 0 and raw.put(name, bytes(value)) == 0
        assert resolve(reader, keys) == [Lookup.HIT]
        reader.get([(keys[0], view(buf, 9), 0)])
        (done,) = reader.wait_idle(timeout=30)
    finally:
        raw.close()
    assert (done.ok, done.reason) == (False, "header")


def test_store_threshold_and_bad_rows(open_tier, staging):
    buf, _ = staging
    tier = open_tier(store_threshold=2)
    keys = unique_keys("thr", 2)
    out = tier.put(keys, [view(buf, 0), view(buf, 1)])
    assert out.admitted == [] and out.rejected == {k: "threshold" for k in keys}
    assert tier.stats["rejections:threshold"] == 2
    assert tier.put(keys, [view(buf, 0), view(buf, 1)]).admitted == keys
    tier.wait_idle(timeout=30)
    with pytest.raises(ValueError, match="row_bytes"):
        tier.put([b"short"], [memoryview(bytearray(100))])
    with pytest.raises(ValueError, match="2 keys but 1 rows"):
        tier.put(keys, [view(buf, 0)])


@pytest.mark.parametrize("bad, match", [
    ({"master": "nohost"}, r"tiers\[1\]\.master: expected HOST:PORT"),
    ({"metadata": "127.0.0.1:8080"}, r"metadata: expected the metadata server's URL"),
    ({"protocol": "udp"}, r"protocol: expected one of tcp, rdma"),
    ({"segment": "lots"}, r"segment: expected a byte size"),
    ({"segment": "8MiB"}, r"segment: expected 0 \(lend nothing\) or at least 16MiB"),
    ({"timeout_s": 0}, r"timeout_s: expected seconds"),
    ({"verify": "yes"}, r"verify: expected true or false"),
    ({"demote": "later"}, r"demote: expected one of"),
    ({"colour": "blue"}, r"unknown key\(s\) 'colour'"),
])
def test_bad_config_is_one_clear_error(bad, match):
    cfg = {"master": "127.0.0.1:50051", "metadata": "http://127.0.0.1:8080/metadata", **bad}
    with pytest.raises(ValueError, match=match):
        MooncakeTierConfig.from_dict(cfg, "tiers[1]")


def test_master_killed_then_restarted(master, open_tier, staging):
    """kill -9 mid-run: lookups miss, stores are rejected, reads fail, each call returns at
    once; after a restart (every value lost with the old master) new stores hit again."""
    buf, rows = staging
    writer, reader = open_tier(), open_tier()
    before = unique_keys("before", 4)
    store(writer, before, buf)
    assert resolve(reader, before) == [Lookup.HIT] * 4
    master.kill()
    try:
        # a read of a chunk the master said exists: fails (never hangs), a miss
        assert reader.get([(before[0], view(buf, 12), "r")]) == [True]
        (done,) = reader.wait_idle(timeout=30)
        assert not done.ok and done.reason in ("unavailable", "transfer", "gone")
        during = unique_keys("during", 2)
        t0 = time.monotonic()
        answers = resolve(reader, during)
        out = writer.put(during, [view(buf, 4), view(buf, 5)])
        writer.wait_idle(timeout=30)
        assert answers == [Lookup.MISS, Lookup.MISS]
        assert time.monotonic() - t0 < 10
        assert reader.link.state is LinkState.DOWN
        assert writer.link.state is LinkState.DOWN or not out.admitted
        later = writer.put(unique_keys("later", 1), [view(buf, 6)])
        assert later.admitted == [] and set(later.rejected.values()) == {"error"}
        assert writer.stats["rejections:error"] >= 1
        assert reader.stats["remote_errors:unavailable"] >= 1
    finally:
        master.start()
    for t in (writer, reader):
        deadline = time.monotonic() + 30
        while t.link.state is not LinkState.UP and time.monotonic() < deadline:
            t.poll(wait=0.1)
        assert t.link.state is LinkState.UP, "the tier did not reconnect to the restarted master"
    after = unique_keys("after", 3)
    deadline = time.monotonic() + 30
    while True:  # the client re-mounts its segment on the new master within a few seconds
        out = writer.put(after, [view(buf, 7 + i) for i in range(3)])
        done = writer.wait_idle(timeout=30)
        if all(c.ok for c in done) and len(done) == 3:
            break
        assert time.monotonic() < deadline, f"stores never succeeded after the restart: {done}"
        time.sleep(0.5)
    assert resolve(reader, after) == [Lookup.HIT] * 3
    assert reader.get([(k, view(buf, 20 + i), i) for i, k in enumerate(after)]) == [True] * 3
    assert all(c.ok for c in reader.wait_idle(timeout=30))
    for i in range(3):
        assert np.array_equal(rows[20 + i], rows[7 + i])


def test_frozen_master_times_out_never_blocks(master, open_tier, staging):
    """SIGSTOP: the master keeps its sockets but answers nothing. Every call of the tier
    returns at once; the queries fail within the timeout and are misses."""
    buf, _ = staging
    tier = open_tier(timeout_s=0.5)
    keys = unique_keys("frozen", 3)
    master.stop()
    try:
        t0 = time.monotonic()
        first = [tier.lookup(k) for k in keys]
        put = tier.put(unique_keys("frozen-put", 1), [view(buf, 3)])
        returned = time.monotonic() - t0
        assert first == [Lookup.RETRY] * 3 and len(put.admitted) == 1
        assert returned < 0.25, f"lookup/put waited {returned:.2f}s on a frozen master"
        done = tier.wait_idle(timeout=30)
        assert [c.ok for c in done] == [False]
        assert resolve(tier, keys) == [Lookup.MISS] * 3
        assert tier.link.state is LinkState.DOWN
    finally:
        master.cont()
    deadline = time.monotonic() + 30
    while tier.link.state is not LinkState.UP and time.monotonic() < deadline:
        tier.poll(wait=0.1)
    assert tier.link.state is LinkState.UP


def test_in_a_chain_a_remote_hit_is_promoted_into_a_cpu_row(open_tier, staging, tmp_path,
                                                           monkeypatch):
    from tiering.backends.staging import StagingRegion
    from tiering.chain import TierChain
    from tiering.cpu_tier import CpuTier
    from tiering.request_scan import RequestScan

    monkeypatch.setenv("VLLM_TIERING_SHM_DIR", str(tmp_path))
    buf, rows = staging
    writer = open_tier()
    keys = unique_keys("chain", 3)
    store(writer, keys, buf)
    region = StagingRegion(f"mc-{time.monotonic_ns()}", 8, RB)
    try:
        chain = TierChain(CpuTier(region, "lru"), [open_tier()])
        req = RequestScan(chain, "r1")
        answers = [req.lookup(k) for k in keys]
        assert answers == [Lookup.RETRY] * 3
        deadline = time.monotonic() + 10
        while Lookup.RETRY in answers and time.monotonic() < deadline:
            chain.on_schedule_end()
            chain.poll(wait=0.05)
            answers = [req.lookup(k) for k in keys]
        assert answers == [Lookup.PENDING] * 3  # promotions reserved
        chain.wait_idle(timeout=30)
        assert [req.lookup(k) for k in keys] == [Lookup.HIT] * 3
        for i, k in enumerate(keys):
            assert np.array_equal(region.rows[chain.cpu.row_of(k)], rows[i])
        # the CPU tier counted one miss per chunk, not one per re-ask
        assert chain.cpu.stats["lookups"] == 3 and chain.cpu.stats["hits"] == 0
        assert chain.tiers[1].stats["lookups"] == 3 and chain.tiers[1].stats["hits"] == 3
        chain.close()
    finally:
        region.close(unlink=True)


def test_calibrations_read_into_one_registered_region(open_tier, staging, tmp_path,
                                                      monkeypatch):
    """Every calibration of a Mooncake tier in a chain reads into the same resident memory,
    registered with the client once. Fresh buffers were registered one by one at each
    calibration, kept registered until the tier closed, and outlived by their registration
    (a later mapping at that address passed for registered memory)."""
    from tiering.advisor import PromotionAdvisor
    from tiering.backends.staging import StagingRegion
    from tiering.chain import TierChain
    from tiering.cpu_tier import CpuTier

    monkeypatch.setenv("VLLM_TIERING_SHM_DIR", str(tmp_path))
    buf, rows = staging
    keys = unique_keys("cal", 16)
    store(open_tier(), keys, buf)
    reader = open_tier()
    assert resolve(reader, keys) == [Lookup.HIT] * 16
    region = StagingRegion(f"mc-{time.monotonic_ns()}", 8, RB)
    try:
        chain = TierChain(CpuTier(region, "lru"), [reader],
                          advisor=PromotionAdvisor(1, RB, chunk_tokens=16))
        before = reader.client.registered_regions()
        for _ in range(3):
            assert chain.calibrate(1, keys)
            chain.wait_idle(timeout=30)
        assert reader.stats["calibration_reads"] == 48
        assert chain.advisor is not None and chain.advisor.read_rate(1)
        after = reader.client.registered_regions()
        assert after[:len(before)] == before and len(after) == len(before) + 1
        chain.close()
    finally:
        region.close(unlink=True)


def test_tiering_inspect_and_stats_show_the_masters_view(master, open_tier, staging, capsys):
    import json

    from tiering.cli import main

    buf, _ = staging
    tier = open_tier(OTHER)  # its own namespace: only this test's chunks in it
    keys = unique_keys("inspect", 5)
    store(tier, keys, buf)
    assert main(["inspect", f"mooncake://{master.admin}", "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    (ns,) = [n for n in view["namespaces"] if n["namespace"] == OTHER.namespace_id]
    assert ns["chunks"] >= 5 and ns["kv_bytes"] == ns["chunks"] * RB
    assert ns["value_bytes"] == ns["chunks"] * (RB + HEADER_BYTES)
    assert ns["facts_published"] is True
    assert view["master"]["master_total_capacity_bytes"] > 0
    assert main(["stats", f"mooncake://{master.admin}", "--namespace", OTHER.namespace_id]) == 0
    text = capsys.readouterr().out
    assert f"namespace {OTHER.namespace_id}: {ns['chunks']} chunks" in text
    assert main(["inspect", "mooncake://nohost"]) == 2
    assert "expected mooncake://HOST:PORT" in capsys.readouterr().err


def _writer_process(cfg: dict, keys: list[bytes], ready) -> None:
    """A peer engine: lends its segment, stores the rows, then lives until killed."""
    buf = mmap.mmap(-1, len(keys) * RB)
    np.frombuffer(buf, dtype=np.uint8)[:] = 7
    tier = MooncakeTier(cfg, FACTS)
    assert tier.wait_connected(30)
    tier.put(keys, [view(buf, i) for i in range(len(keys))])
    ready.put(sum(c.ok for c in tier.wait_idle(timeout=30)))
    time.sleep(600)


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_peer_gone_with_its_segment_is_a_miss(master, open_tier, staging, how):
    """The values live in a peer's segment (this reader lends none); the peer is killed -9 (or
    frozen with SIGSTOP: its sockets open, nothing answers): reads of them fail within the
    timeout as misses, and the master forgets them once the peer's lease ends."""
    import multiprocessing as mp
    import os
    import signal

    buf, _ = staging
    reader = open_tier(segment=0)
    keys = unique_keys("peer", 4)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    cfg = master.tier_config(local_hostname="127.0.0.1", timeout_s=1.0, segment="32MiB")
    peer = ctx.Process(target=_writer_process, args=(cfg, keys, ready), daemon=True)
    peer.start()
    try:
        assert ready.get(timeout=60) == 4
        assert resolve(reader, keys) == [Lookup.HIT] * 4
        if how == "freeze":
            os.kill(peer.pid, signal.SIGSTOP)
        else:
            peer.kill()  # SIGKILL: its segment goes with it
            peer.join(30)
        t0 = time.monotonic()
        assert reader.get([(k, view(buf, 24 + i), i) for i, k in enumerate(keys)]) == [True] * 4
        reads = reader.wait_idle(timeout=60)
        assert time.monotonic() - t0 < 20  # Mooncake's own TCP default would wait 30 s a batch
    finally:
        peer.kill()
        peer.join(30)
    assert [c.ok for c in reads] == [False] * 4
    assert {c.reason for c in reads} <= {"transfer", "gone", "unavailable", "timeout"}
    assert reader.stats["promotion_failures"] == 4
    assert not any(reader.contains(k) for k in keys)
    deadline = time.monotonic() + 30  # the master drops the dead client's objects (client_ttl)
    while resolve(reader, keys) != [Lookup.MISS] * 4:
        assert time.monotonic() < deadline, "the dead peer's chunks are still listed"
        time.sleep(0.5)


def test_full_store_is_a_counted_rejection(tmp_path):
    """One client lending Mooncake's smallest segment (16 MiB), offered 32 MiB at once: what
    does not fit is rejected as full (counted, logged), the rest is stored and reads back."""
    own = MooncakeMaster(tmp_path).start()
    row = 1 << 20
    buf = mmap.mmap(-1, 32 * row)
    rows = np.frombuffer(buf, dtype=np.uint8).reshape(32, row)
    rows[:] = np.random.default_rng(5).integers(0, 256, rows.shape, dtype=np.uint8)
    facts = NamespaceFacts("model-a", "bfloat16", "NHD", row, 16)
    tier = MooncakeTier(own.tier_config(local_hostname="127.0.0.1", segment="16MiB"), facts)
    try:
        assert tier.wait_connected(30)
        keys = unique_keys("full", 32)
        out = tier.put(keys, [memoryview(buf)[i * row:(i + 1) * row] for i in range(32)])
        assert out.admitted == keys
        done = tier.wait_idle(timeout=60)
        failed = [c for c in done if not c.ok]
        stored = [c.key for c in done if c.ok]
        assert failed and stored and len(done) == 32
        assert {c.reason for c in failed} == {"full"}
        assert tier.stats["rejections:full"] == len(failed) == tier.stats["remote_errors:full"]
        assert tier.stats["stores"] == len(stored)
        assert not any(tier.contains(c.key) for c in failed)
        # the master evicts past its high watermark (90%): a stored chunk may be gone already
        back = mmap.mmap(-1, len(stored) * row)
        assert tier.get([(k, memoryview(back)[i * row:(i + 1) * row], i)
                         for i, k in enumerate(stored)]) == [True] * len(stored)
        reads = tier.wait_idle(timeout=30)
        assert any(c.ok for c in reads) and {c.reason for c in reads if not c.ok} <= {"gone"}
        for c in reads:
            if c.ok:
                i = c.token
                assert back[i * row:(i + 1) * row] == rows[keys.index(stored[i])].tobytes()
    finally:
        tier.close()
        own.close()


MC = {"medium": "mooncake", "master": "127.0.0.1:50051",
      "metadata": "http://127.0.0.1:8080/metadata"}


def test_tiers_config_places_the_mooncake_tier_last(tmp_path):
    from tiering.config import check_sizes, parse

    def extra(*tiers: dict) -> dict:
        return {"cpu_bytes_to_use": "64MiB", "tiers": [{"medium": "cpu"}, *tiers]}

    cfg = parse(extra(MC))
    assert len(cfg.mooncake) == 1 and cfg.files == []
    assert cfg.mooncake[0].segment_bytes == 1 << 30
    disk = {"medium": "file", "path": str(tmp_path / "kv"), "capacity": "1MiB"}
    cfg = parse(extra(disk, {**MC, "segment": "32MiB", "store_threshold": 2}))
    assert len(cfg.files) == 1 and cfg.mooncake[0].store_threshold == 2
    assert check_sizes(cfg, 1 << 20) == 64
    with pytest.raises(ValueError, match=r"tiers\[2\]: a file tier after the mooncake tier"):
        parse(extra(MC, disk))
    with pytest.raises(ValueError, match=r"tiers\[2\]: a second mooncake tier"):
        parse(extra(MC, MC))
    with pytest.raises(ValueError, match=r"tiers\[1\]: 'metadata' is required"):
        parse(extra({"medium": "mooncake", "master": "127.0.0.1:50051"}))
    with pytest.raises(ValueError, match=r"tiers\[1\]\.medium: expected 'file' or 'mooncake'"):
        parse(extra({"medium": "redis"}))
    with pytest.raises(ValueError, match=r"tiers\[1\]\.segment: 16777216 bytes holds no value"):
        check_sizes(parse(extra({**MC, "segment": "16MiB"})), 16 << 20)


class FlakyTransfers:
    """The real store, except that its first ``fail`` batch reads (or puts) report Mooncake's
    transfer failure (-800) for every item: what a TCP transfer under load returned in CI. A put
    that fails so has been revoked by Mooncake's client (nothing of it stays on the master), which
    is what not calling the real store models."""

    def __init__(self, store: object, fail: int) -> None:
        self._store, self.fail, self.calls, self.puts = store, fail, 0, 0

    def batch_get_into_multi_buffers(self, names, ptrs, sizes):
        self.calls += 1
        if self.calls <= self.fail:
            return [-800] * len(names)
        return self._store.batch_get_into_multi_buffers(names, ptrs, sizes)

    def batch_put_from_multi_buffers(self, names, ptrs, sizes):
        self.puts += 1
        if self.puts <= self.fail:
            return [-800] * len(names)
        return self._store.batch_put_from_multi_buffers(names, ptrs, sizes)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


@pytest.mark.parametrize("fail, served", [(1, True), (2, False)])
def test_a_transient_transfer_failure_is_read_again_once(open_tier, staging, fail, served):
    buf, rows = staging
    writer, reader = open_tier(), open_tier()
    keys = unique_keys("flaky", 4)
    assert all(c.ok for c in store(writer, keys, buf))
    assert resolve(reader, keys) == [Lookup.HIT] * 4
    flaky = FlakyTransfers(reader.client._store, fail)
    reader.client._store = flaky
    rows[8:12] = 0
    assert reader.get([(k, view(buf, 8 + i), i) for i, k in enumerate(keys)]) == [True] * 4
    reads = reader.wait_idle(timeout=30)
    assert [c.ok for c in sorted(reads, key=lambda c: c.token)] == [served] * 4
    assert flaky.calls == 2, "one read again, never more"
    if served:
        assert np.array_equal(rows[8:12], rows[0:4])
        assert reader.stats["remote_errors:transfer"] == 0
    else:
        assert reader.stats["remote_errors:transfer"] == 4


@pytest.mark.parametrize("fail, stored", [(1, True), (2, False)])
def test_a_transient_transfer_failure_is_stored_again_once(open_tier, staging, fail, stored):
    """A put whose transfer failed once (seen in CI: -800 under load, so B recomputed what A had
    computed) is sent once more; a second failure is a rejected store, counted."""
    buf, rows = staging
    writer, reader = open_tier(), open_tier()
    flaky = FlakyTransfers(writer.client._store, fail)
    writer.client._store = flaky
    keys = unique_keys("flaky-put", 4)
    done = store(writer, keys, buf)
    assert [c.ok for c in done] == [stored] * 4
    assert flaky.puts == 2, "one put again, never more"
    if stored:
        assert writer.stats["remote_errors:transfer"] == 0 and writer.stats["stores"] == 4
        assert resolve(reader, keys) == [Lookup.HIT] * 4
        rows[8:12] = 0
        assert reader.get([(k, view(buf, 8 + i), i) for i, k in enumerate(keys)]) == [True] * 4
        assert [c.ok for c in reader.wait_idle(timeout=30)] == [True] * 4
        assert np.array_equal(rows[8:12], rows[0:4])
    else:
        assert writer.stats["remote_errors:transfer"] == 4 and writer.stats["stores"] == 0
        assert resolve(reader, keys) == [Lookup.MISS] * 4
