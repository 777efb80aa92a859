"""TierChain: routes chunks between tier 0 (the CPU staging rows) and the file tiers below it.

vLLM-agnostic: keys are bytes, rows are integers, outcomes are the types of ``tiering.tier``;
``tiering.vllm`` translates. Every method runs on the owner thread (vLLM's scheduler) and never
blocks on I/O. The chain owns no chunk state and no counters: each tier owns its own. It owns
only what is between tiers — which rows are being written down (demotions) or filled from below
(promotions) — and applies every background completion in one place, ``poll``.

Store path: vLLM asks ``prepare_store`` (the CPU tier reserves rows; the GPU fills them), then
``complete_store``: the rows become READY and are offered to every file tier (demotion; each
tier's own ``store_threshold`` decides). A demoted row stays pinned until its write completes.
Writes down pin at most ``DEMOTION_PIN_FRACTION`` of the rows: past that budget a write-through
row is owed (``OwedRows.behind``) and written oldest first as writes complete. With a
``promotion_reserve`` (off by default), once a promotion finds every row pinned (stores took
them all), stores leave that share of the rows unpinned for promotions
(``CpuTier.keep_for_promotions``), twice as many after each further step in which promotions
found none (up to under half), until no promotion has been asked for a while
(``tiering.promotion_reserve``).

Write-back (a file tier with ``demote: on_evict``): a READY row is only *owed* to that tier
(``_owed``). Rows are written down when they come near the head of the CPU tier's eviction order:
at each step's end enough of the next victims are written that free rows plus clean victims make
a reserve (``tiering.settings.WRITEBACK_RESERVE_FRACTION`` of the rows, or the last step's stores
if more). A row being written is pinned, so the CPU tier evicts around it
and never waits for a write. A row evicted while still owed never reaches that tier (counted as
``writeback_misses``); a reset and the shutdown write every owed row first.

Disk-hit path: a request's scan (``tiering.request_scan``) misses the CPU tier and finds a file
tier holding the chunk (``find_cpu``, ``find_file``); if it loads the chunk, ``promote`` reserves a
CPU row at once (PROMOTING), the answer is PENDING, and at the step's end (``on_schedule_end``)
the reads of all promotions of the step are issued in one batch per tier. ``poll`` marks the rows
READY; vLLM's next lookup hits them and loads them to the GPU like any CPU hit. The chain keeps
what the scan's decision needs from it: each tier's read backlog (``read_backlog_bytes``), its
read rate (each batch's bytes over its longest read, as the tier timed it) and, while a tier's
rate is unknown, a calibration read into scratch memory (``calibrate``) that no request waits for.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from tiering.advisor import PromotionAdvisor, rate_min_rows
from tiering.backends.slab_io import resident_buffer
from tiering.cpu_tier import CpuTier
from tiering.owed_rows import OwedRows
from tiering.promotion_reserve import PromotionReserve
from tiering.settings import (
    ADVISOR_CALIBRATION_BYTES,
    ADVISOR_CALIBRATION_MAX_ROWS,
    ADVISOR_OFFER_EVERY_S,
    DEMOTION_PIN_FRACTION,
    DEMOTION_PIN_MIN,
    LOOKUP_POLL_INTERVAL_S,
    PROMOTION_RESERVE_DEFAULT,
    WRITEBACK_RESERVE_FRACTION,
    WRITEBACK_RESERVE_MIN,
)
from tiering.tier import Completion, Lookup, StoreTier, Tier

log = logging.getLogger(__name__)

__all__ = ["Event", "Lookup", "TierChain"]


@dataclass
class Event:
    keys: list[bytes]
    medium: str  # the tier's ``medium``: "cpu", "file" or "mooncake"
    removed: bool


def tier_label(i: int, medium: str = "file") -> str:
    """The ``tier`` label (metrics, ``Row.source``) of tier id ``i``: the tier's index in the
    chain, 0 for the CPU tier and 1, 2, … for the tiers below it (the advisor's tier ids too).
    A file tier's label is ``disk``, ``disk2``, …, the shared store's ``mooncake``; a label
    names the tier, its ``medium`` what the tier keeps rows in."""
    if medium == "mooncake":
        return "mooncake"
    return "cpu" if i == 0 else ("disk" if i == 1 else f"disk{i}")


class TierChain:
    def __init__(self, cpu: CpuTier, file_tiers: Sequence[StoreTier] = (),
                 events: bool = False, advisor: PromotionAdvisor | None = None,
                 promotion_reserve: float = PROMOTION_RESERVE_DEFAULT) -> None:
        self.cpu = cpu
        self.file_tiers = list(file_tiers)
        self.tiers: list[Tier] = [cpu, *self.file_tiers]
        self.region = cpu.region
        self.num_rows, self.row_bytes = cpu.num_rows, cpu.row_bytes
        self.events_enabled = events
        self._events: list[Event] = []
        for tier in self.file_tiers:  # every key leaving a file tier, whatever the cause
            tier.on_removed(partial(self._removed, tier.medium))
        self._promote: list[list[tuple[bytes, int]]] = [[] for _ in self.file_tiers]
        # (tier, "store" | "promotion", key) -> its CPU row
        self._in_flight: dict[tuple[int, str, bytes], int] = {}
        # rows admitted for writing per file tier and not yet written: what its reads share the
        # device with, and, summed, the rows the demotion budget counts
        self._writes_queued = [0] * len(self.file_tiers)
        # reads queued or in flight per file tier (promotions and calibrations): its backlog
        self._reads_queued = [0] * len(self.file_tiers)
        # calibration reads in flight: tier -> their scratch buffers by key
        self._calibrating: dict[int, dict[bytes, memoryview]] = {}
        # tier -> the memory its calibrations read into, resident and reused (``_scratch``)
        self._scratch_rows: dict[int, memoryview] = {}
        # keys last written to each file tier (what a calibration can read)
        self._written: list[deque[bytes]] = [deque(maxlen=ADVISOR_CALIBRATION_MAX_ROWS)
                                             for _ in self.file_tiers]
        # (tier index, "store" | "promotion", seconds as the tier timed it, submit to
        # completion): read and cleared by the metrics layer
        self.transfer_samples: list[tuple[int, str, float]] = []
        self._writeback = [i for i, t in enumerate(self.file_tiers, start=1)
                           if t.demote == "on_evict"]
        self._write_through = [i for i, t in enumerate(self.file_tiers, start=1)
                               if t.demote != "on_evict"]
        self._write_through_set = frozenset(self._write_through)
        self._owed = OwedRows()
        self.steps = 0  # scheduler steps seen (on_schedule_end calls)
        self._polled_at = 0.0  # when finished I/O was last applied (poll)
        # the most rows pinned by writes down (_writes_queued summed: a row written to two
        # tiers counts twice)
        self._demote_budget = max(DEMOTION_PIN_MIN, int(self.num_rows * DEMOTION_PIN_FRACTION))
        self.advisor = advisor  # None: every disk hit is loaded
        self._advisor_offered_at = time.perf_counter()  # when the file tiers last got its state
        self._advisor_unoffered = False  # measured since (a step's output) and not handed over
        # read batches in flight: id -> [tier, reads left, bytes, longest read's seconds,
        # submitted at]; and when each tier's last finished batch ended
        self._batches: dict[int, list[Any]] = {}
        self._reads_ended = [0.0] * len(self.file_tiers)
        self._next_batch = 0
        self._reserve = max(WRITEBACK_RESERVE_MIN,
                            int(self.num_rows * WRITEBACK_RESERVE_FRACTION))
        self._stored_in_step = self._stored_last_step = 0  # rows given to stores, per step
        # the rows stores leave unpinned for promotions, sized at each step's end
        self._for_promotions = PromotionReserve(cpu, promotion_reserve, bool(self.file_tiers))
        if advisor is not None:
            for i in range(1, len(self.file_tiers) + 1):
                self._scratch(i)  # allocated now, at engine start, not in a scheduler step
            self._restore_advisor()
            self._calibrate_at_start()

    def _restore_advisor(self) -> None:
        """Start the advisor from what each file tier kept at the last engine's shutdown (a
        restarted server decides its first disk hits as the last one would have, instead of
        loading them all while its prefill is unmeasured)."""
        assert self.advisor is not None
        for i, tier in enumerate(self.file_tiers, start=1):
            state = tier.load_advisor_state()
            if state is None:
                continue
            label = tier_label(i, tier.medium)
            try:
                self.advisor.restore_tier(i, state)
            except ValueError as exc:
                log.warning("tier %s: the promotion advisor's saved state is ignored: %s",
                            label, exc)
                continue
            log.info("tier %s: promotion advisor restored: %s", label, self.advisor.describe())

    def _calibrate_at_start(self) -> None:
        """A file tier that holds rows but has no read rate (the engine before stopped before
        its idle steps could measure one: a calibration waits for the tier's writes to end and
        is issued at a step's end) is read once now, at engine start: otherwise the first disk
        hits after a restart would be recomputed as unmeasured. The reads land before the first
        request's lookups poll them, which is when the rate is applied."""
        assert self.advisor is not None
        for i, tier in enumerate(self.file_tiers, start=1):
            if not self.advisor.needs_measuring(i):
                continue
            keys = tier.calibration_keys(len(self._scratch(i)) // self.row_bytes)
            if keys and self.calibrate(i, keys):
                log.info("tier %s: no read rate kept; %d of its rows read at start to measure "
                         "one", tier_label(i, tier.medium), len(keys))

    def _removed(self, medium: str, keys: Iterable[bytes]) -> None:
        self._event(list(keys), medium, True)

    def _event(self, keys: list[bytes], medium: str, removed: bool) -> None:
        if self.events_enabled and keys:
            self._events.append(Event(keys, medium, removed))

    # -- lookups and loads -------------------------------------------------------------------
    # A request's lookups go through its RequestScan (tiering.request_scan), which counts each
    # chunk once, protects its own prefix and decides its run of disk hits; it calls the chain's
    # find_cpu, find_file and promote. ``lookup`` is the same path without a request record.

    def find_cpu(self, key: bytes, count: bool = True, per_request: bool = False) -> Lookup:
        """Apply finished I/O, then ask the CPU tier (HIT, PENDING while a promotion of the key
        is in flight, or MISS)."""
        if self._batches:  # reads in flight: a finished one may turn this lookup into a hit
            # at most every LOOKUP_POLL_INTERVAL_S after the last poll (settings)
            if time.perf_counter() - self._polled_at >= LOOKUP_POLL_INTERVAL_S:
                self.poll()  # (otherwise the step's end polls: admin requests, store completions)
        return self.cpu.lookup(key, count, per_request=per_request)

    def find_file(self, key: bytes, count: bool = True, counted_above: int = 0
                  ) -> tuple[Lookup, int]:
        """Ask the store tiers in order: (HIT, i) for the first (1-based chain index) that holds
        ``key``, (RETRY, i) if tier ``i`` is still asking a remote index (a Mooncake master:
        ask again next step), else (MISS, 0). Every tier asked counts the lookup when
        ``count``, except the tiers above ``counted_above`` (the tier that answered RETRY
        before: those above it counted this lookup then)."""
        for i, tier in enumerate(self.file_tiers, start=1):
            found = tier.lookup(key, count and i >= counted_above)
            if found is Lookup.HIT or found is Lookup.RETRY:
                return found, i
        return Lookup.MISS, 0

    def promote(self, key: bytes, i: int, protect: Collection[bytes] = ()) -> Lookup:
        """Start reading ``key`` from file tier ``i`` into a CPU row (issued with the step's
        batch at ``on_schedule_end``): PENDING, or MISS if no CPU row can be had now (counted
        on the CPU tier). A promotion never evicts a key in ``protect``."""
        tier = self.tiers[i]
        tier.touch([key])  # a promotion is a use: recency and the persisted hit count
        got = self.cpu.reserve_promotion(key, tier_label(i, tier.medium), protect)
        self._for_promotions.asked(got is not None)
        if got is None:
            return Lookup.MISS
        row, evicted = got
        self._evicted_from_cpu(evicted)
        self._promote[i - 1].append((key, row))
        self._in_flight[(i, "promotion", key)] = row
        self._reads_queued[i - 1] += 1
        return Lookup.PENDING

    def lookup(self, key: bytes, count: bool = True, protect: Collection[bytes] = ()) -> Lookup:
        """One chunk's lookup without a request record (tools, tests): every disk hit is
        promoted. ``count=False`` for a repeated lookup of the same chunk by the same request.
        ``protect``: the chunks the same request looked up before this one; a promotion never
        evicts them (vLLM loads a request's hits in one job, so a prefix larger than the CPU
        tier would otherwise evict its own head to promote its tail, forever)."""
        found = self.find_cpu(key, count)
        if found is not Lookup.MISS:
            return found
        found, i = self.find_file(key, count)
        return found if found is not Lookup.HIT else self.promote(key, i, protect)

    def read_backlog_bytes(self) -> dict[int, int]:
        """Per file tier, by tier id (1 = the first), the bytes of reads queued or in flight:
        what a new promotion waits behind."""
        return {i: n * self.row_bytes for i, n in enumerate(self._reads_queued, start=1)}

    def write_backlog_bytes(self) -> dict[int, int]:
        """Per file tier, by tier id, the bytes of writes admitted and not yet written: the
        writer keeps the tier's device busy with them, so a read shares it (reads go first on
        the tier's I/O threads, but not on the device)."""
        return {i: n * self.row_bytes for i, n in enumerate(self._writes_queued, start=1)}

    def _full_batch_rows(self, i: int) -> int:
        """Rows a read batch of tier ``i`` needs to measure its rate (``rate_min_rows``, or all
        a smaller tier can hold)."""
        return max(1, min(rate_min_rows(self.row_bytes), self._capacity_rows(i)))

    def _capacity_rows(self, i: int) -> int:
        """Rows file tier ``i`` can hold."""
        return self.tiers[i].usage()[1] // self.row_bytes

    def _calibration_rows(self) -> int:
        """Rows one calibration reads at most (settings: ADVISOR_CALIBRATION_BYTES)."""
        return max(rate_min_rows(self.row_bytes),
                   min(ADVISOR_CALIBRATION_MAX_ROWS, ADVISOR_CALIBRATION_BYTES // self.row_bytes))

    def _scratch(self, i: int) -> memoryview:
        """File tier ``i``'s calibration memory: one calibration's rows, resident before the
        first read and reused by every calibration of the tier (one at a time), so that a
        calibration times the device, not page faults of fresh memory (on the H100's RAM
        disk, fresh buffers made a 64 MiB calibration read at 2.66 GB/s, fio 5.6, and the
        advisor recomputed an 8k disk hit that loads in 0.86x the time)."""
        buf = self._scratch_rows.get(i)
        if buf is None:  # no more rows than the tier holds (a calibration reads rows it holds)
            rows = min(self._calibration_rows(), max(1, self._capacity_rows(i)))
            buf = self._scratch_rows[i] = resident_buffer(rows * self.row_bytes)
        return buf

    def calibrate(self, i: int, keys: Sequence[bytes] = ()) -> bool:
        """Measure file tier ``i``'s read rate with one batch of reads into scratch memory (no
        CPU row, no request waits): ``keys`` it holds, else the keys last written to it. False
        if a calibration of the tier is in flight or it has nothing to read."""
        if i in self._calibrating:
            return False
        tier = self.file_tiers[i - 1]
        least = rate_min_rows(self.row_bytes)
        scratch = self._scratch(i)
        rb = self.row_bytes
        rows = len(scratch) // rb
        # each key once: the scratch has a row per key, and a key written down twice (taken
        # again after its eviction) is twice in _written
        pick = list(dict.fromkeys(k for k in keys if tier.contains(k)))[:rows]
        if len(pick) < least:  # too few for a rate: the rows last written, if they are more
            # (an engine restarted over a full tier has written none: the few it has still
            # give it a first rate, or its short runs would be recomputed unmeasured forever)
            written = list(dict.fromkeys(k for k in reversed(self._written[i - 1])
                                         if tier.contains(k)))[:rows][::-1]
            if len(written) > len(pick):
                pick = written
        # fewer rows time latency, not a rate (on the H200 a calibration of the first 4 rows
        # written read at 1.14 GB/s, 2048 rows at 2.9): they give a tier with no rate a
        # provisional one, which the first full batch replaces; a tier too small to hold a full
        # batch is measured with what it has
        first = self.advisor is None or self.advisor.read_rate(i) is None
        if len(pick) < (1 if first else self._full_batch_rows(i)):
            return False
        b = self._next_batch
        self._next_batch += 1
        bufs = {k: scratch[n * rb:(n + 1) * rb] for n, k in enumerate(pick)}
        submitted = time.perf_counter()
        started = tier.get([(k, bufs[k], ("calibration", k, b)) for k in pick])
        bufs = {k: bufs[k] for k, ok in zip(pick, started, strict=True) if ok}
        n = len(bufs)
        if not n:
            return False
        self._batches[b] = [i, n, 0, 0.0, submitted]
        self._calibrating[i] = bufs  # the I/O threads write into them until the batch ends
        tier.stats.add("calibration_reads", n)
        self._reads_queued[i - 1] += n
        if self.advisor is not None:
            self.advisor.measuring(i)
        log.debug("tier %s: calibration read of %d rows", tier_label(i, tier.medium), n)
        return True

    def hit_source(self, key: bytes) -> str:
        """vLLM's hit source of a CPU-resident chunk (its ``CacheHitSource`` words): "cpu" if
        the GPU stored it, "disk" if it was promoted from any tier below (vLLM has no other)."""
        if not self.file_tiers:  # nothing is promoted: every row came from the GPU
            return "cpu"
        return "disk" if self.cpu.source_of(key) != "cpu" else "cpu"

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        return self.cpu.prepare_load(keys)

    def complete_load(self, keys: Iterable[bytes]) -> None:
        self.cpu.complete_load(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        for tier in self.tiers:
            tier.touch(keys)

    # -- stores ------------------------------------------------------------------------------
    def prepare_store(self, keys: Sequence[bytes]
                      ) -> tuple[list[bytes], list[int], list[bytes]] | None:
        """(keys to store, their rows, evicted keys), or None if no room can be made now.

        Rows owed to a file tier are not written here: a write started now ends after this
        call's evictions, so it would only pin the victims-to-be and push the evictions onto
        newer rows that no tier has either, at a pass over the reserve per call (vLLM 0.33
        prepares one chunk per call: 80-330 us a chunk). The step's end keeps them clean."""
        out = self.cpu.reserve_store(keys)
        if not out.admitted and any(r != "threshold" for r in out.rejected.values()):
            return None
        self._stored_in_step += len(out.admitted)
        self._evicted_from_cpu(out.evicted)
        return out.admitted, [self.cpu.row_of(k) for k in out.admitted], out.evicted

    def _evicted_from_cpu(self, keys: list[bytes]) -> None:
        self._event(keys, "cpu", True)
        if self._owed:
            for k in keys:
                for i in self._owed.take(k):
                    self.tiers[i].stats.add("writeback_misses")

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None:
        ready = self.cpu.finish_store(keys, success)
        if not ready:
            return
        self._event(list(ready), "cpu", False)
        for i in self._write_through:
            later = self._demote(ready, i)
            if later:
                self.tiers[i].stats.add("demotions_deferred", len(later))
                for k in later:
                    self._owed.add(k, i, eager=True)
        if self._writeback:
            for k in ready:
                for i in self._writeback:
                    self._owed.add(k, i, eager=False)

    def _keep_clean(self) -> None:
        """Write back owed rows at the head of the eviction order until free rows plus clean
        victims reach the reserve: the configured share of the rows, or what the last step
        stored if that was more (the next step's stores evict about as many)."""
        short = max(self._reserve, self._stored_last_step) - self.cpu.free_count()
        if short > 0:
            self._write_back(self.cpu.next_victims(short))

    def _catch_up(self) -> None:
        """Write rows that wait for a write-through tier, oldest first, as far as the budget
        allows (writes that completed since the last step freed it)."""
        room = self._demote_budget - sum(self._writes_queued)
        if room > 0 and self._owed.behind:
            self._write_back(self._owed.oldest_behind(room), only=self._write_through_set)

    def _write_back(self, keys: Iterable[bytes], only: Collection[int] | None = None,
                    force: bool = False) -> None:
        """Write owed rows down now (pinned until written; each tier's admission decides), to
        the tiers in ``only`` if given, within the demotion budget unless ``force``."""
        per_tier: dict[int, list[bytes]] = {}
        for k in keys:
            if not self.cpu.contains(k):  # only READY rows are owed; a dropped one is gone
                self._owed.take(k)
                continue
            for i in self._owed.take(k, only):
                per_tier.setdefault(i, []).append(k)
        for i, ks in per_tier.items():
            for k in self._demote(ks, i, force):  # no budget left: still owed
                self._owed.add(k, i, eager=i in self._write_through_set)

    def _demote(self, keys: list[bytes], i: int, force: bool = False) -> list[bytes]:
        """Offer READY rows to file tier ``i``; those it admits are pinned until written.
        Returns the keys not offered because the demotion budget is spent (all, if it is)."""
        room = len(keys) if force else max(0, self._demote_budget - sum(self._writes_queued))
        keys, later = keys[:room], keys[room:]
        if keys:
            out = self.file_tiers[i - 1].put(keys, [self.cpu.view(k) for k in keys])
            for k in out.admitted:
                self.cpu.pin(k, io=True)
                self._in_flight[(i, "store", k)] = self.cpu.row_of(k)
                self._writes_queued[i - 1] += 1
        return later

    def on_step_output(self) -> None:
        """The engine took back a step's output (vLLM's ``update_from_output``, once a step, in
        the order they were scheduled): the advisor's step clock times steps by it."""
        if self.advisor is not None:
            now = time.perf_counter()
            self.advisor.step_output(now)
            if now - self._advisor_offered_at >= ADVISOR_OFFER_EVERY_S:
                self.offer_advisor_state()
            else:
                self._advisor_unoffered = True

    def engine_idle(self) -> None:
        """The engine has no request left: what the advisor measured since the last offer is
        handed over now (an idle engine produces no step output to do it at)."""
        if self._advisor_unoffered:
            self.offer_advisor_state()

    def offer_advisor_state(self) -> None:
        """Hand each file tier the advisor's state to keep for the next engine (the tier
        writes it on its own thread: ``Tier.offer_advisor_state``). Scheduler thread."""
        if self.advisor is None:
            return
        self._advisor_offered_at = time.perf_counter()
        self._advisor_unoffered = False
        for i, below in enumerate(self.file_tiers, start=1):
            below.offer_advisor_state(self.advisor.tier_state(i))

    # -- background completions: the one place they are applied ------------------------------
    def on_schedule_end(self) -> None:
        """The end of a scheduler step: issue the step's promotions (one batch per tier), apply
        what finished, write back rows near eviction, then rows that wait for a write-through
        tier; the advisor's step clock ticks, and a tier whose read rate is due to be measured
        gets a calibration read."""
        self.steps += 1
        self._stored_last_step, self._stored_in_step = self._stored_in_step, 0
        self._for_promotions.step_end()
        self._issue_and_apply()
        if self.advisor is not None:
            self.advisor.step_end(time.perf_counter())
            for i, tier in enumerate(self.file_tiers, start=1):
                # measured while the tier writes nothing: a read rate, not a share of the disk
                if (self.advisor.needs_measuring(i) and self._written[i - 1]
                        and not tier.has_pending_work()):
                    self.calibrate(i)
        if self._batches:
            # Promotions in flight: vLLM re-asks every pending chunk each step, back to back,
            # so this thread would hold the GIL for whole switch intervals (5 ms) while the I/O
            # threads that finish those reads wait for it. Yield it once per step (no I/O wait:
            # sleep(0) only lets waiting threads run). docs/bench_promotion.py: 384 x 2 MiB
            # promotions read at 0.70x the speed of an idle scheduler without it, 1.0x with it.
            time.sleep(0)

    def _issue_and_apply(self) -> None:
        for i, tier in enumerate(self.file_tiers, start=1):
            batch, self._promote[i - 1] = self._promote[i - 1], []
            if not batch:
                continue
            b = self._next_batch  # registered once we know how many reads started
            self._next_batch += 1
            submitted = time.perf_counter()
            started = tier.get([(k, self.region.row(r), (k, r, b)) for k, r in batch])
            if any(started):
                self._batches[b] = [i, sum(started), 0, 0.0, submitted]
            for (k, r), ok in zip(batch, started, strict=True):
                if not ok:  # gone from the tier since the lookup: a miss after all
                    self._finish_promotion(i, Completion("read", k, False, "gone",
                                                         token=(k, r, None)))
        self.poll()
        if self._owed:
            self._keep_clean()
            self._catch_up()

    def poll(self, wait: float = 0.0) -> None:
        """Apply finished file-tier I/O (``wait`` > 0 blocks up to that long per busy tier)."""
        self._polled_at = time.perf_counter()
        for i, tier in enumerate(self.file_tiers, start=1):
            # always drained (cheap when empty): admin requests of tools arrive here too
            for done in tier.poll(wait=wait if tier.has_pending_work() else 0.0):
                if done.kind == "store":
                    self._finish_demotion(i, done)
                else:
                    self._finish_promotion(i, done)

    def _read_done(self, batch: int | None, done: Completion) -> None:
        """One read of a batch ended: the batch's last one measures the tier's read rate for
        the advisor, from the tier's own completion times (each read run reports the seconds
        since its batch was submitted; the batch ended with its longest one, not when this
        thread got round to polling, which is a step's length). A batch submitted while an
        earlier one was still being read waited for it: its rate counts from that one's end,
        so a disk with a queue is not taken for a slower one."""
        if batch is None:
            return
        entry = self._batches[batch]
        entry[1] -= 1
        # whole rows, not the bytes stored: a compressed row is read in fewer, and the advisor
        # prices a run at row_bytes a row (a batch of 16 zstd rows was never full, its rate
        # of stored bytes as slow as the compression ratio, and the tier was calibrated again
        # every idle step)
        entry[2] += self.row_bytes if done.ok else 0
        entry[3] = max(entry[3], done.seconds)
        if entry[1] == 0:
            del self._batches[batch]
            tier, nbytes, longest, submitted = entry[0], entry[2], entry[3], entry[4]
            ended = submitted + longest
            busy = ended - max(submitted, self._reads_ended[tier - 1])
            self._reads_ended[tier - 1] = max(self._reads_ended[tier - 1], ended)
            if self.advisor is not None and busy > 0:
                full = nbytes >= self._full_batch_rows(tier) * self.row_bytes
                self.advisor.observe_read_batch(tier, nbytes, busy, full)
                if log.isEnabledFor(logging.DEBUG):
                    rate = self.advisor.read_rate(tier)
                    log.debug("tier %s: a read batch of %d bytes took %.4f s on the device "
                              "(%.4f s since its submission): %.3g GB/s; the read rate now %s",
                              tier_label(tier, self.tiers[tier].medium), nbytes, busy, longest,
                              nbytes / busy / 1e9, f"{rate / 1e9:.3g} GB/s" if rate else "unknown")

    def _finish_demotion(self, i: int, done: Completion) -> None:
        row = self._in_flight.pop((i, "store", done.key), None)
        if done.ok:
            self.transfer_samples.append((i, "store", done.seconds))
            self._event([done.key], self.tiers[i].medium, False)
            self._written[i - 1].append(done.key)
        if row is not None:
            self.cpu.unpin_row(row, io=True)
            self._writes_queued[i - 1] -= 1

    def _finish_calibration(self, i: int, done: Completion) -> None:
        _, key, batch = done.token
        self._reads_queued[i - 1] -= 1
        self._read_done(batch, done)
        bufs = self._calibrating.get(i, {})
        bufs.pop(key, None)
        if not bufs:
            self._calibrating.pop(i, None)

    def _finish_promotion(self, i: int, done: Completion) -> None:
        if done.token and done.token[0] == "calibration":
            self._finish_calibration(i, done)
            return
        key, row, batch = done.token
        self._read_done(batch, done)
        self._in_flight.pop((i, "promotion", key), None)
        self._reads_queued[i - 1] -= 1  # every promotion ends here once (read, gone or failed)
        if self.cpu.finish_promotion(key, row, done.ok):
            self.transfer_samples.append((i, "promotion", done.seconds))
            self._event([key], "cpu", False)
            for j in self._writeback:  # another write-back tier below does not have it yet
                if j != i and not self.tiers[j].contains(key):
                    self._owed.add(key, j, eager=False)

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Block until all file-tier I/O has been applied (tests, tools, shutdown). Queued
        promotions are issued; no scheduler step is counted."""
        deadline = time.monotonic() + timeout
        self._issue_and_apply()
        while self.has_pending_work():
            if time.monotonic() > deadline:
                raise TimeoutError(f"tier chain: I/O still in flight after {timeout}s")
            self.poll(wait=0.01)
            self._catch_up()

    def has_pending_work(self) -> bool:
        """I/O in flight, promotions to issue, or rows waiting for a write-through tier (vLLM
        keeps stepping while this is True, so they are written even when no request runs)."""
        return (any(self._promote) or bool(self._owed.behind)
                or any(t.has_pending_work() for t in self.file_tiers))

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """Drop every CPU-tier row; file tiers keep their data.

        vLLM discards its in-flight jobs on a reset (their completions never come), so its pins
        go too; rows still read or written by a file tier stay detached until that I/O ends.
        """
        # nothing owed is lost: written before the drop, whatever the budget
        self._write_back(list(self._owed.tiers), force=True)
        for i, queued in enumerate(self._promote, start=1):  # not issued yet: nothing to wait for
            for key, row in queued:
                self._in_flight.pop((i, "promotion", key), None)
                self._reads_queued[i - 1] -= 1
                self.cpu.unpin_row(row, io=True)
        self._promote = [[] for _ in self.file_tiers]
        self._event(self.cpu.reset(), "cpu", True)

    def usage(self) -> dict[str, int]:
        return {"rows": self.num_rows, "used": self.num_rows - len(self.cpu.free_rows),
                "pinned": self.cpu.pinned_rows(), "entries": len(self.cpu)}

    def check(self) -> None:
        """Consistency checks across the chain (tests call it after each step)."""
        self.cpu.check()
        for tier in self.file_tiers:
            tier.check()
        for (i, kind, key), row in self._in_flight.items():
            assert self.cpu.rows[row].io_pins > 0, (i, kind, key, self.cpu.rows[row])
        for i in range(1, len(self.tiers)):
            tier_writes = sum(kind == "store" and t == i for t, kind, _ in self._in_flight)
            assert self._writes_queued[i - 1] == tier_writes, (i, self._writes_queued, tier_writes)
            reads = sum(kind == "promotion" and t == i for t, kind, _ in self._in_flight)
            calibrating = len(self._calibrating.get(i, {}))
            # a key promoted again after a reset while its first read is in flight has one
            # in-flight entry and two reads
            assert self._reads_queued[i - 1] >= reads + calibrating >= 0, \
                (i, self._reads_queued[i - 1], reads, calibrating)
        assert set(self._owed.behind) <= set(self._owed.tiers), "owed behind, to no tier"

    def close(self) -> None:
        try:
            self._write_back(list(self._owed.tiers), force=True)  # a restart finds them all
            self.wait_idle()
        except Exception:  # never let a stuck tier stop the shutdown of the others
            log.exception("tier chain: waiting for in-flight I/O at shutdown failed")
        if self.advisor is not None:
            for i, below in enumerate(self.file_tiers, start=1):
                try:
                    below.save_advisor_state(self.advisor.tier_state(i))
                except Exception:  # a tier's own failure is logged there; never stop shutdown
                    log.exception("tier %s: saving the promotion advisor's state failed",
                                  tier_label(i, below.medium))
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:  # never let shutdown of one tier stop the others
                log.exception("closing tier %s failed", tier.medium)
