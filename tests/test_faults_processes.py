"""Fault suite, processes: writers killed (-9) during writes, evictions and admin requests;
readers (CLI commands) killed mid-read against a busy writer; tools run concurrently against
a busy writer. Asserts: no wrong bytes, no acknowledged write lost unless evicted, the writer
keeps accepting writes, every tool exits 0/1/2 with at most one line."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

from faultutil import TESTS, assert_tool_ok
from tierutil import key, open_tier, read, row_for

# The writer reports every acknowledged write ("ack KEY") and, *before* the tier acts on it,
# every key it evicts or drops ("gone KEY ..."), so the test knows which keys must survive.
WRITER = textwrap.dedent("""
    import itertools, sys
    sys.path.insert(0, {tests!r})
    from tierutil import open_tier, key, row_for
    t = open_tier({path!r}, slots={slots}, io_threads=2, policy={policy!r})

    def say(*words):
        sys.stdout.write(" ".join(words) + "\\n")
        sys.stdout.flush()

    evict, drop = t.policy.evict, t.drop

    def evict_and_say(n, protected=()):
        victims = evict(n, protected)
        if victims:
            say("gone", *(k.hex() for k in victims))
        return victims

    def drop_and_say(keys):
        say("gone", *(k.hex() for k in keys))
        return drop(keys)

    t.policy.evict, t.drop = evict_and_say, drop_and_say
    say("ready")
    for i in itertools.count():
        ks = [key(f"{seed}-{{i}}-{{j}}") for j in range(3)]
        t.put(ks, [row_for(k) for k in ks])
        for d in (t.wait_idle() if i % 2 else t.poll()):
            if d.kind == "store" and d.ok:
                say("ack", d.key.hex())
        if i % 5 == 0:
            t.touch(t.keys()[:2])
""")

MODES = {"write": 600, "evict": 24, "admin": 48}  # mode -> slots


def _one_writer_kill(tmp_path, trial: int, mode: str, rng: random.Random) -> tuple[int, int]:
    path = tmp_path / f"w{trial}"
    slots = MODES[mode]
    script = WRITER.format(tests=str(TESTS), path=str(path), slots=slots, seed=trial,
                           policy=("lru", "arc", "s3fifo")[trial % 3])
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    tool = None
    if mode == "admin":  # a tool's request is in flight when the writer dies
        time.sleep(rng.uniform(0.0, 0.2))
        op = rng.choice([["evict", "--bytes", "16KiB"], ["clear"], ["evict", "--older-than",
                                                                     "0s"]])
        tool = subprocess.Popen([sys.executable, "-m", "tiering.cli", op[0], str(path), *op[1:],
                                 "--timeout", "2"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 10  # kill once the request is in the writer's hands
        while not list(path.glob("*/requests/*")) and time.monotonic() < deadline:
            time.sleep(0.01)
    time.sleep(rng.uniform(0.05, 0.5) if tool is None else rng.uniform(0.0, 0.3))
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate()
    if tool is not None:
        tout, terr = tool.communicate(timeout=60)
        assert_tool_ok(subprocess.CompletedProcess(tool.args, tool.returncode, tout, terr),
                       allowed=(0, 1))
    acked, gone = set(), set()
    for line in out.splitlines():
        word, *keys = line.split()
        if word == "ack":
            acked.update(keys)
        elif word == "gone":
            gone.update(keys)
    with open_tier(path, slots=slots) as t:
        t.check(index=True)  # no slot indexed twice, the index agrees with the slot table
        for k in t.keys():
            data, done = read(t, k)
            assert data == bytes(row_for(k)), f"wrong or lost bytes for {k.hex()}: {done}"
        present = {k.hex() for k in t.keys()}
        lost = acked - gone - present
        assert not lost, f"{mode} trial {trial}: {len(lost)} acknowledged writes lost"
        fresh = [key(f"after-{trial}")]  # the next writer accepts writes
        assert t.put(fresh, [row_for(fresh[0])]).admitted == fresh
        assert all(d.ok for d in t.wait_idle())
    return len(acked), len(acked & gone)


def test_writer_killed_during_writes_evictions_and_admin_requests(tmp_path, trials):
    n = trials(6)
    rng = random.Random(2024)
    totals = {m: [0, 0, 0] for m in MODES}
    for trial in range(n * len(MODES)):
        mode = list(MODES)[trial % len(MODES)]
        acked, evicted = _one_writer_kill(tmp_path, trial, mode, rng)
        totals[mode][0] += 1
        totals[mode][1] += acked
        totals[mode][2] += evicted
    assert sum(t[1] for t in totals.values()) > 0, "no write was ever acknowledged"
    assert totals["evict"][2] > 0, "no eviction happened: the eviction kind proves nothing"
    for mode, (k, a, e) in totals.items():
        print(f"writer kill during {mode}: {k} trials, {a} acknowledged writes checked "
              f"({e} evicted), 0 lost, 0 wrong bytes")


READ_COMMANDS = (["inspect"], ["verify"], ["stats"], ["export"])


def _busy_writes(t, keys_iter, seconds: float) -> int:
    """Write for ``seconds`` like a server (put, poll); every write must succeed."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        ks = [next(keys_iter) for _ in range(4)]
        t.put(ks, [row_for(k, t.row_bytes) for k in ks])
        for d in t.poll():
            assert d.ok, f"a write failed: {d}"
            n += 1
        time.sleep(0.002)
    for d in t.wait_idle():
        assert d.ok, f"a write failed: {d}"
        n += 1
    return n


def _key_stream(prefix: str):
    i = 0
    while True:
        yield key(f"{prefix}{i}")
        i += 1


def test_killed_readers_never_stop_writes(tmp_path, trials):
    n = trials(8)
    rng = random.Random(7)
    row = 4096
    with open_tier(tmp_path, slots=2000, row_bytes=row, slab_file_bytes=1 << 20) as t:
        keys = _key_stream("r")
        _busy_writes(t, keys, 0.5)
        killed, written = [], 0
        for trial in range(n):
            cmd = READ_COMMANDS[trial % len(READ_COMMANDS)]
            p = subprocess.Popen([sys.executable, "-m", "tiering.cli", *cmd, str(tmp_path)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            written += _busy_writes(t, keys, rng.uniform(0.25, 0.9))
            if p.poll() is None:
                p.kill()
                killed.append(p.pid)
            out, err = p.communicate()
            if p.returncode != -signal.SIGKILL:
                assert_tool_ok(subprocess.CompletedProcess(p.args, p.returncode, out, err),
                               allowed=(0,))
        written += _busy_writes(t, keys, 1.0)  # housekeeping runs meanwhile
        readers = t.index.env.readers()
        stale = [pid for pid in killed if f"\n{pid} " in "\n" + readers]
        assert not stale, f"reader slots of killed tools still pinned: {stale}"
        data = t.folder / "index.lmdb" / "data.mdb"
        assert data.stat().st_size < 64 << 20
        for k in rng.sample(t.keys(), 50):
            assert read(t, k)[0] == bytes(row_for(k, row))
    print(f"reader kills: {n} tools started, {len(killed)} killed mid-run, {written} writes "
          "after them, 0 failed, 0 stale reader slots")


TOOLS = (["inspect"], ["verify"], ["stats"], ["export"], ["evict", "--bytes", "8KiB"],
         ["evict", "--older-than", "1h"], ["clear"])


def test_tools_against_a_busy_writer(tmp_path, trials):
    n = trials(2)
    row = 4096
    answered = 0
    with open_tier(tmp_path, slots=1000, row_bytes=row, slab_file_bytes=1 << 20) as t:
        keys = _key_stream("c")
        for _ in range(n):
            procs = []
            for cmd in TOOLS:
                extra = ["--timeout", "20"] if cmd[0] in ("evict", "clear") else []
                procs.append(subprocess.Popen([sys.executable, "-m", "tiering.cli", *cmd,
                                               str(tmp_path), *extra],
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True))
            while any(p.poll() is None for p in procs):
                _busy_writes(t, keys, 0.1)
            for p in procs:
                out, err = p.communicate()
                assert_tool_ok(subprocess.CompletedProcess(p.args, p.returncode, out, err),
                               allowed=(0,))
                if p.args[3] in ("evict", "clear"):
                    assert "(live writer)" in out, out
                    answered += 1
            for k in t.keys()[:20]:
                if t.contains(k):
                    assert read(t, k)[0] == bytes(row_for(k, row))
    assert os.path.isdir(t.folder)
    print(f"concurrent tools: {n} rounds of {len(TOOLS)} tools, {answered} admin requests "
          "answered by the busy writer, all exit 0")
