"""Hostile tests of the Mooncake tier's one retry of items that failed with a transfer error
(``mooncake_io._once_more``: a batch put's or read's items whose code was -800, sent once more
when the first call took less than ``MOONCAKE_TRANSFER_AGAIN_WITHIN`` x ``timeout_s`` and the
link was not at fault).

A real ``mooncake_master`` runs on localhost (one per module); a ``Scripted`` wrapper around the
tier's real store makes chosen calls fail, lie, sleep or raise, and records every name each
batch call was sent. Each test checks what a user of the tier needs: bytes round-trip exactly,
a failed store is counted and is a MISS for another client, nothing reports success that is not
stored, at most one retry, and none when the first call was slow or the link was down. Counters
are compared whole (every non-zero counter of the tier), so a stray count fails too.
"""

# ruff: noqa: F811
from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("mooncake.store")

# the fixtures master, open_tier and staging are registered here by importing them; the tests
# name them as parameters, which ruff reads as redefinitions (F811)
from test_mooncake_tier import (  # noqa: E402, F401
    FACTS,
    RB,
    master,
    open_tier,
    resolve,
    staging,
    unique_keys,
    view,
)
from test_mooncake_tier import store as store_rows  # noqa: E402

from tiering.backends.mooncake_io import ALREADY_EXISTS  # noqa: E402
from tiering.backends.mooncake_tier import LinkState, MooncakeTier  # noqa: E402
from tiering.backends.mooncake_value import HEADER_BYTES, object_name  # noqa: E402
from tiering.settings import (  # noqa: E402
    MOONCAKE_OVERRUN_FACTOR,
    MOONCAKE_TRANSFER_AGAIN_WITHIN,
)
from tiering.tier import Lookup  # noqa: E402

# Mooncake's ErrorCode values (mooncake-store/include/types.h)
TRANSFER_FAIL = -800
RPC_FAIL = -900
NO_AVAILABLE_HANDLE = -200
OBJECT_NOT_FOUND = -704
INVALID_KEY = -400
INVALID_PARAMS = -600


# -- helpers (the fixtures, view, resolve and unique_keys are tests/test_mooncake_tier.py's) -------
def names_of(keys: list[bytes]) -> list[str]:
    return [object_name(FACTS.namespace_id, k) for k in keys]


def store(tier: MooncakeTier, keys: list[bytes], buf: mmap.mmap, first_row: int = 0) -> list:
    """Store rows first_row.. under keys; the completions in key order."""
    done = store_rows(tier, keys, buf, first_row)
    assert sorted(c.key for c in done) == sorted(keys)
    return sorted(done, key=lambda c: keys.index(c.key))


def read(tier: MooncakeTier, keys: list[bytes], buf: mmap.mmap, first_row: int) -> list:
    """Read keys into rows first_row..; the completions in key order."""
    assert tier.get([(k, view(buf, first_row + i), i) for i, k in enumerate(keys)]) == \
        [True] * len(keys)
    done = tier.wait_idle(timeout=30)
    assert sorted(c.token for c in done) == list(range(len(keys)))
    return sorted(done, key=lambda c: c.token)


def counters(tier: MooncakeTier) -> dict[str, int]:
    """Every non-zero counter of the tier."""
    return {k: v for k, v in tier.stats.values.items() if v}


def rejected(n: int, reason: str) -> dict[str, int]:
    """The counters of n failed stores whose reason is ``reason`` (as _finish_stores counts)."""
    return {f"rejections:{'full' if reason == 'full' else 'error'}": n,
            f"remote_errors:{'transfer' if reason == 'gone' else reason}": n, "io_errors": n}


# -- the scripted store -------------------------------------------------------------------------------
@dataclass
class Answer:
    """What one batch call answers. ``codes``: one fake code for every name, or per name (the
    other names go to the real store). ``land``: the faked names reach the real store too (the
    call did its work, its report lies). ``scribble``: garbage into the faked items' buffers (a
    read's partial transfer). ``sleep``: before anything (a slow call). ``exc``: raised instead.
    ``drop_last``: one code too few."""

    codes: int | dict[str, int] = TRANSFER_FAIL
    land: bool = False
    scribble: bool = False
    sleep: float = 0.0
    exc: Exception | None = None
    drop_last: bool = False

    def run(self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]],
            real: Callable) -> list[int]:
        if self.sleep:
            time.sleep(self.sleep)
        if self.exc is not None:
            raise self.exc
        if isinstance(self.codes, int):
            fake = dict.fromkeys(names, self.codes)
        else:
            fake = {n: c for n, c in self.codes.items() if n in names}
        through = [i for i, n in enumerate(names) if self.land or n not in fake]
        codes = [0] * len(names)
        if through:
            got = real([names[i] for i in through], [ptrs[i] for i in through],
                       [sizes[i] for i in through])
            for i, c in zip(through, got, strict=True):
                codes[i] = c
        for i, n in enumerate(names):
            if n in fake:
                codes[i] = fake[n]
                if self.scribble:
                    for addr, size in zip(ptrs[i], sizes[i], strict=True):
                        ctypes.memset(addr, 0xA5, size)
        return codes[:-1] if self.drop_last else codes


Plan = dict[int, Answer] | Callable[[int, list[str]], Answer | None]


class Scripted:
    """The real store, except for the batch puts and reads its plans name: ``puts[n]`` answers
    the n-th batch put (1-based), or ``puts(n, names)`` does (None: the real store's answer).
    Records the names of every batch put and read, in call order."""

    def __init__(self, store: object, puts: Plan | None = None, gets: Plan | None = None) -> None:
        self._store = store
        self.puts, self.gets = puts or {}, gets or {}
        self.put_calls: list[list[str]] = []
        self.get_calls: list[list[str]] = []
        self._lock = threading.Lock()

    @staticmethod
    def _answer(plan: Plan, n: int, names: list[str]) -> Answer | None:
        return plan(n, names) if callable(plan) else plan.get(n)

    def _batch(self, calls: list[list[str]], plan: Plan, real: Callable, names, ptrs, sizes):
        with self._lock:
            calls.append(list(names))
            n = len(calls)
        ans = self._answer(plan, n, list(names))
        return real(names, ptrs, sizes) if ans is None else ans.run(names, ptrs, sizes, real)

    def batch_put_from_multi_buffers(self, names, ptrs, sizes):
        return self._batch(self.put_calls, self.puts, self._store.batch_put_from_multi_buffers,
                           names, ptrs, sizes)

    def batch_get_into_multi_buffers(self, names, ptrs, sizes):
        return self._batch(self.get_calls, self.gets, self._store.batch_get_into_multi_buffers,
                           names, ptrs, sizes)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def script(tier: MooncakeTier, **plans: Plan) -> Scripted:
    s = Scripted(tier.client._store, **plans)
    tier.client._store = s
    return s


def stored_hits(writer_stats: dict[str, int], n: int) -> None:
    assert writer_stats == {"stores": n, "store_bytes": n * RB}


def readable_exactly(reader: MooncakeTier, keys: list[bytes], buf: mmap.mmap, rows: np.ndarray,
                     src: list[int], dst: int = 16) -> None:
    """Another client finds every key and reads back exactly rows ``src``."""
    assert resolve(reader, keys) == [Lookup.HIT] * len(keys)
    rows[dst:dst + len(keys)] = 0
    assert [c.ok for c in read(reader, keys, buf, dst)] == [True] * len(keys)
    for j, i in enumerate(src):
        assert np.array_equal(rows[dst + j], rows[i]), f"key {j} read back other bytes"


# -- puts ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fail_again", [(), (4,)], ids=["retry-ok", "retry-fails-one"])
def test_partial_put_failure_resends_only_the_failed_items(open_tier, staging, fail_again):
    """Items 1, 4, 6 of 8 fail with -800: only they are sent again (the others exactly once);
    the stored ones are readable with their bytes; one failing again is a counted rejection
    and a MISS elsewhere, the rest still stored."""
    buf, rows = staging
    writer, reader = open_tier(), open_tier()
    keys = unique_keys("partial-put", 8)
    names = names_of(keys)
    first = {names[i]: TRANSFER_FAIL for i in (1, 4, 6)}
    again = {names[i]: TRANSFER_FAIL for i in fail_again}
    s = script(writer, puts={1: Answer(first), 2: Answer(again)})
    done = store(writer, keys, buf)
    assert s.put_calls == [names, [names[1], names[4], names[6]]]
    sent = Counter(n for call in s.put_calls for n in call)
    assert all(sent[n] == (2 if i in (1, 4, 6) else 1) for i, n in enumerate(names))
    ok = [i for i in range(8) if i not in fail_again]
    assert [c.ok for c in done] == [i in ok for i in range(8)]
    assert all(c.reason == "transfer" for c in done if not c.ok)
    expected = {"stores": len(ok), "store_bytes": len(ok) * RB}
    if fail_again:
        expected |= rejected(len(fail_again), "transfer")
    assert counters(writer) == expected
    assert all(writer.contains(keys[i]) == (i in ok) for i in range(8))
    assert resolve(reader, keys) == [Lookup.HIT if i in ok else Lookup.MISS for i in range(8)]
    readable_exactly(reader, [keys[i] for i in ok], buf, rows, ok)


@pytest.mark.parametrize("retry", ["fake-already-exists", "real-store"])
def test_put_that_landed_but_reported_transfer_failure(open_tier, staging, retry):
    """The first put did store the values but answered -800 (a report that lies, or a revoke
    that did not happen). The retry's answer, ALREADY_EXISTS or the real store's, counts as
    stored; the other client reads the exact bytes; nothing is counted as failed."""
    assert ALREADY_EXISTS == -705
    buf, rows = staging
    writer, reader = open_tier(), open_tier()
    keys = unique_keys("landed", 4)
    plan = {1: Answer(TRANSFER_FAIL, land=True)}
    if retry == "fake-already-exists":
        plan[2] = Answer(ALREADY_EXISTS)
    s = script(writer, puts=plan)
    done = store(writer, keys, buf)
    assert [c.ok for c in done] == [True] * 4
    assert len(s.put_calls) == 2
    stored_hits(counters(writer), 4)
    readable_exactly(reader, keys, buf, rows, list(range(4)))


@pytest.mark.parametrize("code, reason", [(NO_AVAILABLE_HANDLE, "full"),
                                          (OBJECT_NOT_FOUND, "gone")])
def test_put_non_transfer_failures_are_not_sent_again(open_tier, staging, code, reason):
    """Items 0, 1 fail with a code that is not a transfer failure, items 2, 3 with -800: only
    2, 3 are sent again; 0, 1 are rejected (counted by their reason), a MISS elsewhere."""
    buf, rows = staging
    writer, reader = open_tier(), open_tier()
    keys = unique_keys(f"other-{reason}", 4)
    names = names_of(keys)
    s = script(writer, puts={1: Answer({names[0]: code, names[1]: code,
                                        names[2]: TRANSFER_FAIL, names[3]: TRANSFER_FAIL})})
    done = store(writer, keys, buf)
    assert s.put_calls == [names, names[2:]]
    assert [(c.ok, c.reason) for c in done] == [(False, reason)] * 2 + [(True, "")] * 2
    assert counters(writer) == {"stores": 2, "store_bytes": 2 * RB, **rejected(2, reason)}
    assert resolve(reader, keys) == [Lookup.MISS] * 2 + [Lookup.HIT] * 2
    readable_exactly(reader, keys[2:], buf, rows, [2, 3])


@pytest.mark.parametrize("code", [INVALID_KEY, INVALID_PARAMS])
def test_put_deterministic_rejection_is_not_sent_again(open_tier, staging, code):
    """Mooncake codes that are no transfer failure and cannot change on a second try (an
    invalid key, invalid parameters) are not sent again: the retry is for -800 (settings.py:
    'Mooncake's TCP transport under load returns -800 now and then')."""
    buf, _ = staging
    writer = open_tier()
    keys = unique_keys(f"invalid{code}", 3)
    s = script(writer, puts=lambda n, names: Answer(code))  # the same answer every time
    done = store(writer, keys, buf)
    assert [(c.ok, c.reason) for c in done] == [(False, "transfer")] * 3
    assert counters(writer) == rejected(3, "transfer")
    assert len(s.put_calls) == 1, f"a put answered {code} was sent {len(s.put_calls)} times"


def test_put_retry_answered_with_the_link_down(open_tier, staging):
    """The retry of a -800 put finds the master gone (-900): rejected, counted unavailable,
    the link marked down, a MISS elsewhere; no third put, even after the link is probed."""
    buf, _ = staging
    writer, reader = open_tier(), open_tier()
    keys = unique_keys("retry-down", 4)
    s = script(writer, puts={1: Answer(TRANSFER_FAIL), 2: Answer(RPC_FAIL)})
    done = store(writer, keys, buf)
    assert [(c.ok, c.reason) for c in done] == [(False, "unavailable")] * 4
    assert writer.link.state is LinkState.DOWN
    assert counters(writer) == rejected(4, "unavailable")
    for _ in range(10):
        writer.poll(wait=0.05)
    assert len(s.put_calls) == 2
    assert resolve(reader, keys) == [Lookup.MISS] * 4


@pytest.mark.parametrize("kind", ["put", "read"])
def test_no_retry_when_the_first_call_says_the_link_is_down(open_tier, staging, kind):
    """One item -900 (the master did not answer), the others -800: nothing is sent again,
    the link is marked down, every item is counted once by its own reason."""
    buf, rows = staging
    writer, reader = open_tier(), open_tier()
    keys = unique_keys(f"fault-{kind}", 4)
    names = names_of(keys)
    codes = {names[0]: RPC_FAIL, **{n: TRANSFER_FAIL for n in names[1:]}}
    if kind == "put":
        s = script(writer, puts={1: Answer(codes)})
        done = store(writer, keys, buf)
        assert len(s.put_calls) == 1
        assert writer.link.state is LinkState.DOWN
        assert [c.reason for c in done] == ["unavailable"] + ["transfer"] * 3
        assert counters(writer) == {"rejections:error": 4, "remote_errors:unavailable": 1,
                                    "remote_errors:transfer": 3, "io_errors": 4}
        assert resolve(reader, keys) == [Lookup.MISS] * 4
        return
    assert [c.ok for c in store(writer, keys, buf)] == [True] * 4
    assert resolve(reader, keys) == [Lookup.HIT] * 4
    s = script(reader, gets={1: Answer(codes, scribble=True)})
    done = read(reader, keys, buf, 16)
    assert len(s.get_calls) == 1
    assert reader.link.state is LinkState.DOWN
    assert [c.reason for c in done] == ["unavailable"] + ["transfer"] * 3
    assert counters(reader) == {"lookups": 4, "hits": 4, "hit_bytes": 4 * RB,
                                "promotion_failures": 4, "remote_errors:unavailable": 1,
                                "remote_errors:transfer": 3, "io_errors": 4}
    assert not any(reader.contains(k) for k in keys)


@pytest.mark.parametrize("outcome", ["raises", "too-few-codes"])
def test_put_retry_that_breaks_is_a_counted_rejection(open_tier, staging, outcome):
    """The retry of a -800 put raises (or answers one code too few): every retried item is a
    rejected store counted under transfer, no third put, the link stays up, a MISS elsewhere,
    and the tier stores new keys afterwards."""
    buf, rows = staging
    writer, reader = open_tier(), open_tier()
    keys = unique_keys(f"retry-{outcome}", 4)
    second = (Answer(exc=RuntimeError("binding blew up")) if outcome == "raises"
              else Answer(TRANSFER_FAIL, drop_last=True))
    s = script(writer, puts={1: Answer(TRANSFER_FAIL), 2: second})
    done = store(writer, keys, buf)
    assert [(c.ok, c.reason) for c in done] == [(False, "transfer")] * 4
    assert len(s.put_calls) == 2
    assert writer.link.up
    assert counters(writer) == rejected(4, "transfer")
    assert resolve(reader, keys) == [Lookup.MISS] * 4
    more = unique_keys(f"after-{outcome}", 4)
    assert [c.ok for c in store(writer, more, buf, first_row=4)] == [True] * 4
    assert counters(writer) == {"stores": 4, "store_bytes": 4 * RB, **rejected(4, "transfer")}
    readable_exactly(reader, more, buf, rows, [4, 5, 6, 7])


def test_put_first_call_raising_quickly_is_sent_once_more(open_tier, staging):
    """The binding raised on the first put (every item 'transfer', quick): sent once more, and
    stored then; counted as stores only."""
    buf, rows = staging
    writer, reader = open_tier(), open_tier()
    keys = unique_keys("first-raises", 4)
    s = script(writer, puts={1: Answer(exc=RuntimeError("binding blew up"))})
    assert [c.ok for c in store(writer, keys, buf)] == [True] * 4
    assert len(s.put_calls) == 2
    stored_hits(counters(writer), 4)
    readable_exactly(reader, keys, buf, rows, list(range(4)))


# -- reads ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fail_again", [(), (3,)], ids=["retry-ok", "retry-fails-one"])
def test_partial_read_failure_rereads_only_the_failed_items(open_tier, staging, fail_again):
    """Reads 0, 3, 7 of 8 fail with -800 after writing garbage into their rows (a partial
    transfer): only they are read again and end with the exact bytes; the others are read once.
    One failing again is a counted miss and forgotten."""
    buf, rows = staging
    writer, reader = open_tier(), open_tier()
    keys = unique_keys("partial-read", 8)
    names = names_of(keys)
    assert [c.ok for c in store(writer, keys, buf)] == [True] * 8
    assert resolve(reader, keys) == [Lookup.HIT] * 8
    first = {names[i]: TRANSFER_FAIL for i in (0, 3, 7)}
    again = {names[i]: TRANSFER_FAIL for i in fail_again}
    s = script(reader, gets={1: Answer(first, scribble=True), 2: Answer(again, scribble=True)})
    rows[16:24] = 0
    done = read(reader, keys, buf, 16)
    assert s.get_calls == [names, [names[0], names[3], names[7]]]
    ok = [i for i in range(8) if i not in fail_again]
    assert [c.ok for c in done] == [i in ok for i in range(8)]
    for i in ok:
        assert np.array_equal(rows[16 + i], rows[i]), f"row {i} read back other bytes"
    n_bad = len(fail_again)
    expected = {"lookups": 8, "hits": 8, "hit_bytes": 8 * RB, "promotions": len(ok),
                "promotion_bytes": len(ok) * RB}
    if n_bad:
        expected |= {"promotion_failures": n_bad, "remote_errors:transfer": n_bad,
                     "io_errors": n_bad}
    assert counters(reader) == expected
    assert all(reader.contains(keys[i]) == (i in ok) for i in range(8))


def test_read_non_transfer_failures_are_not_read_again(open_tier, staging):
    """A read that says gone (-704) and one that returns the wrong length are not read again;
    only the -800 one is. Counted by their reasons."""
    buf, rows = staging
    writer, reader = open_tier(), open_tier()
    keys = unique_keys("read-other", 4)
    names = names_of(keys)
    assert [c.ok for c in store(writer, keys, buf)] == [True] * 4
    assert resolve(reader, keys) == [Lookup.HIT] * 4
    s = script(reader, gets={1: Answer({names[0]: OBJECT_NOT_FOUND, names[1]: HEADER_BYTES + 1,
                                        names[2]: TRANSFER_FAIL}, scribble=True)})
    rows[16:20] = 0
    done = read(reader, keys, buf, 16)
    assert s.get_calls == [names, [names[2]]]
    assert [(c.ok, c.reason) for c in done] == [(False, "gone"), (False, "short"), (True, ""),
                                                (True, "")]
    for i in (2, 3):
        assert np.array_equal(rows[16 + i], rows[i])
    assert counters(reader) == {"lookups": 4, "hits": 4, "hit_bytes": 4 * RB,
                                "promotions": 2, "promotion_bytes": 2 * RB,
                                "promotion_failures": 2, "remote_errors:gone": 1,
                                "remote_errors:short": 1, "io_errors": 1}


# -- the time limit ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["put", "read"])
@pytest.mark.parametrize("timeout_s, sleep, again", [(1.0, 0.6, False), (1.0, 0.1, True),
                                                      (2.0, 0.6, True)])
def test_a_slow_first_call_is_not_sent_again(open_tier, staging, kind, timeout_s, sleep, again):
    """A first call that took at least MOONCAKE_TRANSFER_AGAIN_WITHIN x timeout_s is final (a
    counted failure); a quicker one is sent once more and succeeds."""
    assert MOONCAKE_TRANSFER_AGAIN_WITHIN == 0.5
    buf, rows = staging
    writer, reader = open_tier(timeout_s=timeout_s), open_tier(timeout_s=timeout_s)
    keys = unique_keys(f"slow-{kind}", 4)
    slow = Answer(TRANSFER_FAIL, sleep=sleep, scribble=kind == "read")
    if kind == "put":
        s = script(writer, puts={1: slow})
        done = store(writer, keys, buf)
        assert len(s.put_calls) == (2 if again else 1)
        assert [c.ok for c in done] == [again] * 4
        if again:
            stored_hits(counters(writer), 4)
            readable_exactly(reader, keys, buf, rows, list(range(4)))
        else:
            assert counters(writer) == rejected(4, "transfer")
            assert resolve(reader, keys) == [Lookup.MISS] * 4
        return
    assert [c.ok for c in store(writer, keys, buf)] == [True] * 4
    assert resolve(reader, keys) == [Lookup.HIT] * 4
    s = script(reader, gets={1: slow})
    rows[16:20] = 0
    done = read(reader, keys, buf, 16)
    assert len(s.get_calls) == (2 if again else 1)
    assert [c.ok for c in done] == [again] * 4
    base = {"lookups": 4, "hits": 4, "hit_bytes": 4 * RB}
    if again:
        assert np.array_equal(rows[16:20], rows[0:4])
        assert counters(reader) == {**base, "promotions": 4, "promotion_bytes": 4 * RB}
    else:
        assert counters(reader) == {**base, "promotion_failures": 4,
                                    "remote_errors:transfer": 4, "io_errors": 4}


def test_an_overrun_call_marks_the_link_down_in_a_line_of_its_own(open_tier, staging, caplog):
    """A call past timeout_s: its chunks are counted under remote_errors{reason="timeout"} and
    the link goes down with the same "did not answer" line as a failed call gives, whatever
    the rate-limited fault line says (the e2e test waits for the link's return by these
    lines; a second overrun within a minute logged nothing at all)."""
    buf, _ = staging
    writer = open_tier(timeout_s=0.5)  # overrun after 0.5 x MOONCAKE_OVERRUN_FACTOR + 1 s
    assert MOONCAKE_OVERRUN_FACTOR == 3.0
    keys = unique_keys("overrun", 4)
    script(writer, puts={1: Answer(TRANSFER_FAIL, sleep=3.5)})
    with caplog.at_level(logging.WARNING, logger="tiering.backends.mooncake_tier"):
        done = store_rows(writer, keys, buf)
    assert [c.ok for c in done] == [False] * 4
    assert writer.stats["remote_errors:timeout"] == 4
    down = [r.getMessage() for r in caplog.records if "did not answer" in r.getMessage()]
    assert len(down) == 1, down
    assert "2.5 s" in down[0] and writer.cfg.master in down[0]


# -- never more than once -----------------------------------------------------------------------------
def test_every_name_is_sent_at_most_twice_however_quick_the_failures(open_tier, staging):
    """Every put and every read answers -800 at once, over several batches on two I/O threads:
    each name is sent exactly twice (puts and reads), every item is a counted failure."""
    buf, _ = staging
    writer, reader = open_tier(batch_rows=4, io_threads=2), open_tier(batch_rows=4, io_threads=2)
    keys = unique_keys("always", 10)
    names = names_of(keys)
    s = script(writer, puts=lambda n, names: Answer(TRANSFER_FAIL))
    done = store(writer, keys, buf)
    assert [c.ok for c in done] == [False] * 10
    assert len(s.put_calls) == 6  # 3 batches, each sent twice
    assert Counter(n for call in s.put_calls for n in call) == dict.fromkeys(names, 2)
    assert counters(writer) == rejected(10, "transfer")
    # the same keys stored for real, then every read fails
    writer.client._store = s._store
    assert [c.ok for c in store(writer, keys, buf)] == [True] * 10
    assert resolve(reader, keys) == [Lookup.HIT] * 10
    g = script(reader, gets=lambda n, names: Answer(TRANSFER_FAIL, scribble=True))
    done = read(reader, keys, buf, 16)
    assert [c.ok for c in done] == [False] * 10
    assert len(g.get_calls) == 6
    assert Counter(n for call in g.get_calls for n in call) == dict.fromkeys(names, 2)
    assert counters(reader) == {"lookups": 10, "hits": 10, "hit_bytes": 10 * RB,
                                "promotion_failures": 10, "remote_errors:transfer": 10,
                                "io_errors": 10}


def test_reads_and_puts_failing_alternately_on_one_tier(open_tier, staging):
    """One tier both stores and reads, its batches in flight together on two I/O threads.
    Every name's first put and first read fail with -800 (a read's row gets garbage); the
    reads of a few names fail twice. Everything else round-trips exactly; every name is put
    exactly twice and read exactly twice; the counters count only the twice-failed reads."""
    buf, rows = staging
    tier, other = open_tier(batch_rows=3, io_threads=2), open_tier()
    a, b = unique_keys("mixed-a", 6), unique_keys("mixed-b", 6)
    twice = set(names_of([a[1], b[4]]))
    put_seen: Counter[str] = Counter()
    get_seen: Counter[str] = Counter()
    lock = threading.Lock()

    def puts(n: int, names: list[str]) -> Answer:
        with lock:
            first = {m: TRANSFER_FAIL for m in names if put_seen[m] == 0}
            put_seen.update(names)
        return Answer(first)

    def gets(n: int, names: list[str]) -> Answer:
        with lock:
            bad = {m: TRANSFER_FAIL for m in names if get_seen[m] == 0 or m in twice}
            get_seen.update(names)
        return Answer(bad, scribble=True)

    s = script(tier, puts=puts, gets=gets)
    assert [c.ok for c in store(tier, a, buf)] == [True] * 6
    # store b (rows 6..11) while reading a into rows 16..21: both kinds in flight at once
    rows[16:22] = 0
    assert tier.put(b, [view(buf, 6 + i) for i in range(6)]).admitted == b
    assert tier.get([(k, view(buf, 16 + i), ("a", i)) for i, k in enumerate(a)]) == [True] * 6
    done = tier.wait_idle(timeout=30)
    assert sorted(c.key for c in done if c.kind == "store") == sorted(b)
    assert all(c.ok for c in done if c.kind == "store")
    reads = {c.token[1]: c for c in done if c.kind == "read"}
    assert sorted(reads) == list(range(6))
    assert [reads[i].ok for i in range(6)] == [i != 1 for i in range(6)]
    for i in range(6):
        if i != 1:
            assert np.array_equal(rows[16 + i], rows[i]), f"a[{i}] read back other bytes"
    # read b on the same tier
    rows[22:28] = 0
    done = read(tier, b, buf, 22)
    assert [c.ok for c in done] == [i != 4 for i in range(6)]
    for i in range(6):
        if i != 4:
            assert np.array_equal(rows[22 + i], rows[6 + i]), f"b[{i}] read back other bytes"
    assert Counter(n for call in s.put_calls for n in call) == dict.fromkeys(names_of(a + b), 2)
    assert Counter(n for call in s.get_calls for n in call) == dict.fromkeys(names_of(a + b), 2)
    assert counters(tier) == {"stores": 12, "store_bytes": 12 * RB, "promotions": 10,
                              "promotion_bytes": 10 * RB, "promotion_failures": 2,
                              "remote_errors:transfer": 2, "io_errors": 2}
    # what was stored is whole for another client (the failed reads did not remove it)
    readable_exactly(other, a + b, buf, rows, list(range(12)), dst=16)


# -- what the operator reads -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["put", "read"])
def test_the_log_names_the_code_of_the_failure_that_remains(open_tier, staging, caplog, kind):
    """Item 0 fails with -800 and is fixed by the retry; item 1 fails for good with another
    code. The warning about item 1's failure must name item 1's code, not the -800 that the
    retry fixed."""
    buf, rows = staging
    writer, reader = open_tier(), open_tier()
    keys = unique_keys(f"detail-{kind}", 2)
    names = names_of(keys)
    caplog.set_level(logging.WARNING, logger="tiering.backends.mooncake_tier")
    if kind == "put":
        s = script(writer, puts={1: Answer({names[0]: TRANSFER_FAIL,
                                            names[1]: NO_AVAILABLE_HANDLE})})
        done = store(writer, keys, buf)
        calls, reason, code = s.put_calls, "full", NO_AVAILABLE_HANDLE
    else:
        assert [c.ok for c in store(writer, keys, buf)] == [True] * 2
        assert resolve(reader, keys) == [Lookup.HIT] * 2
        caplog.clear()
        s = script(reader, gets={1: Answer({names[0]: TRANSFER_FAIL, names[1]: HEADER_BYTES + 1},
                                           scribble=True)})
        done = read(reader, keys, buf, 16)
        calls, reason, code = s.get_calls, "short", HEADER_BYTES + 1
    assert calls == [names, [names[0]]]
    assert [(c.ok, c.reason) for c in done] == [(True, ""), (False, reason)]
    lines = [r.getMessage() for r in caplog.records if f"reason={reason!r}" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert f"code {code}" in lines[0] and f"code {TRANSFER_FAIL}" not in lines[0], lines[0]
