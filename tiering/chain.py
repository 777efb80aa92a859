"""TierChain: routes chunks between tier 0 (the CPU staging rows) and the file tiers below it.

vLLM-agnostic: keys are bytes, rows are integers, outcomes are the types of ``tiering.tier``;
``tiering.vllm`` translates. Every method runs on the owner thread (vLLM's scheduler) and never
blocks on I/O. The chain owns no chunk state and no counters: each tier owns its own. It owns
only what is between tiers — which rows are being written down (demotions) or filled from below
(promotions) — and applies every background completion in one place, ``poll``.

Store path: vLLM asks ``prepare_store`` (the CPU tier reserves rows; the GPU fills them), then
``complete_store``: the rows become READY and are offered to every file tier (demotion; each
tier's own ``store_threshold`` decides). A demoted row stays pinned until its write completes.

Disk-hit path: ``lookup`` misses the CPU tier and hits a file tier: a CPU row is reserved at once
(PROMOTING), the answer is PENDING, and at the step's end (``on_schedule_end``) the reads of all
promotions of the step are issued in one batch per tier. ``poll`` marks the rows READY; vLLM's next
lookup hits them and loads them to the GPU like any CPU hit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tiering.backends.file_tier import FileTier
from tiering.cpu_tier import CpuTier
from tiering.tier import Completion, Lookup, Tier

log = logging.getLogger(__name__)

__all__ = ["Event", "Lookup", "TierChain"]


@dataclass
class Event:
    keys: list[bytes]
    medium: str  # "cpu" or "disk"
    removed: bool


def tier_label(i: int) -> str:
    """The ``tier`` label of tier ``i`` in metrics and hit sources."""
    return "cpu" if i == 0 else ("disk" if i == 1 else f"disk{i}")


class TierChain:
    def __init__(self, cpu: CpuTier, file_tiers: Sequence[FileTier] = (),
                 events: bool = False) -> None:
        self.cpu = cpu
        self.file_tiers = list(file_tiers)
        self.tiers: list[Tier] = [cpu, *self.file_tiers]
        self.region = cpu.region
        self.num_rows, self.row_bytes = cpu.num_rows, cpu.row_bytes
        self.events_enabled = events
        self._events: list[Event] = []
        self._promote: list[list[tuple[bytes, int]]] = [[] for _ in self.file_tiers]
        self._in_flight: dict[tuple[int, str, bytes], tuple[int, float]] = {}  # -> row, start
        # (tier index, "store" | "promotion", seconds): read and cleared by the metrics layer
        self.transfer_samples: list[tuple[int, str, float]] = []

    def _event(self, keys: list[bytes], medium: str, removed: bool) -> None:
        if self.events_enabled and keys:
            self._events.append(Event(keys, medium, removed))

    # -- lookups and loads -------------------------------------------------------------------
    def lookup(self, key: bytes, count: bool = True) -> Lookup:
        """``count=False`` for a repeated lookup of the same chunk by the same request (vLLM
        asks again every step while any chunk is pending): hit ratios stay per chunk."""
        self.poll()
        found = self.cpu.lookup(key, count)
        if found is not Lookup.MISS:
            return found
        for i, tier in enumerate(self.file_tiers, start=1):
            if tier.lookup(key, count) is not Lookup.HIT:
                continue
            tier.touch([key])  # a promotion is a use: recency and the persisted hit count
            row = self.cpu.reserve_promotion(key, tier_label(i))
            if row is None:  # no CPU row free now: a miss (counted on the CPU tier)
                return Lookup.MISS
            self._promote[i - 1].append((key, row))
            self._in_flight[(i, "promotion", key)] = (row, time.perf_counter())
            return Lookup.PENDING
        return Lookup.MISS

    def hit_source(self, key: bytes) -> str:
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
        """(keys to store, their rows, evicted keys), or None if no room can be made now."""
        out = self.cpu.put(keys, None)
        if not out.admitted and any(r != "threshold" for r in out.rejected.values()):
            return None
        self._event(out.evicted, "cpu", True)
        return out.admitted, [self.cpu.row_of(k) for k in out.admitted], out.evicted

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None:
        ready = self.cpu.finish_store(keys, success)
        if not ready:
            return
        self._event(list(ready), "cpu", False)
        self._demote(ready)

    def _demote(self, keys: list[bytes]) -> None:
        views = [self.cpu.view(k) for k in keys]
        for i, tier in enumerate(self.file_tiers, start=1):
            out = tier.put(keys, views)
            self._event(out.evicted, "disk", True)
            now = time.perf_counter()
            for k in out.admitted:
                self.cpu.pin(k, io=True)
                self._in_flight[(i, "store", k)] = (self.cpu.row_of(k), now)

    # -- background completions: the one place they are applied ------------------------------
    def on_schedule_end(self) -> None:
        """Issue the step's promotions (one batch per tier), then apply what finished."""
        for i, tier in enumerate(self.file_tiers, start=1):
            batch, self._promote[i - 1] = self._promote[i - 1], []
            if not batch:
                continue
            started = tier.get([(k, self.region.row(r), (k, r)) for k, r in batch])
            for (k, r), ok in zip(batch, started, strict=True):
                if not ok:  # gone from the tier since the lookup: a miss after all
                    self._finish_promotion(i, Completion("read", k, False, "gone",
                                                         token=(k, r)))
        self.poll()

    def poll(self, wait: float = 0.0) -> None:
        """Apply finished file-tier I/O (``wait`` > 0 blocks up to that long per busy tier)."""
        for i, tier in enumerate(self.file_tiers, start=1):
            # always drained (cheap when empty): admin requests of tools arrive here too
            for done in tier.poll(wait=wait if tier.has_pending_work() else 0.0):
                if done.kind == "store":
                    self._finish_demotion(i, done)
                else:
                    self._finish_promotion(i, done)

    def _finish_demotion(self, i: int, done: Completion) -> None:
        row, started = self._in_flight.pop((i, "store", done.key), (None, 0.0))
        if done.ok:
            self.transfer_samples.append((i, "store", time.perf_counter() - started))
            self._event([done.key], "disk", False)
        if row is not None:
            self.cpu.unpin_row(row, io=True)

    def _finish_promotion(self, i: int, done: Completion) -> None:
        key, row = done.token
        _, started = self._in_flight.pop((i, "promotion", key), (None, 0.0))
        if self.cpu.finish_promotion(key, row, done.ok):
            self.transfer_samples.append((i, "promotion", time.perf_counter() - started))
            self._event([key], "cpu", False)
        elif not done.ok and done.reason != "gone":
            self._event([key], "disk", True)  # the file tier dropped the key (bad slot)

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Block until all file-tier I/O has been applied (tests, tools, shutdown)."""
        deadline = time.monotonic() + timeout
        self.on_schedule_end()
        while self.has_pending_work():
            if time.monotonic() > deadline:
                raise TimeoutError(f"tier chain: I/O still in flight after {timeout}s")
            self.poll(wait=0.01)

    def has_pending_work(self) -> bool:
        return any(self._promote) or any(t.has_pending_work() for t in self.file_tiers)

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """Drop every CPU-tier row; file tiers keep their data.

        vLLM discards its in-flight jobs on a reset (their completions never come), so its pins
        go too; rows still read or written by a file tier stay detached until that I/O ends.
        """
        for i, queued in enumerate(self._promote, start=1):  # not issued yet: nothing to wait for
            for key, row in queued:
                self._in_flight.pop((i, "promotion", key), None)
                self.cpu.unpin_row(row, io=True)
        self._promote = [[] for _ in self.file_tiers]
        self._event(self.cpu.reset(), "cpu", True)

    def usage(self) -> dict[str, int]:
        return {"rows": self.num_rows, "used": self.num_rows - len(self.cpu.free_rows),
                "pinned": self.cpu.pinned_rows(), "entries": len(self.cpu)}

    def check(self) -> None:
        """Consistency checks across the chain (tests call it after each step)."""
        self.cpu.check()
        for (i, kind, key), (row, _) in self._in_flight.items():
            assert self.cpu.rows[row].io_pins > 0, (i, kind, key, self.cpu.rows[row])

    def close(self) -> None:
        try:
            self.wait_idle()
        except Exception:  # never let a stuck tier stop the shutdown of the others
            log.exception("tier chain: waiting for in-flight I/O at shutdown failed")
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:  # never let shutdown of one tier stop the others
                log.exception("closing tier %s failed", tier.medium)
