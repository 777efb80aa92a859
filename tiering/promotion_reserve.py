"""PromotionReserve: how many CPU rows stores leave unpinned for promotions, step by step.

Owned by the ``TierChain`` (scheduler thread only); it sets ``CpuTier.keep_for_promotions``,
which the CPU tier applies to every store. When a step stores about as much as the whole CPU
tier holds, vLLM's store jobs pin every row until the next step, and a promotion the advisor
decided finds none (the H200's disk-backed sweep: docs/benchmarks.md, "twelfth and thirteenth
runs"). With a share configured (the CPU tier's ``promotion_reserve``; off by default):

* a promotion that finds no row while stores left at most the reserve unpinned marks the step
  starved (rows that only the request's own protected prefix holds are not won back by keeping
  them from stores);
* at the step's end a starved step sets the reserve to the share of the rows (at least one),
  twice the current reserve after that, never half the rows or more;
* once no promotion has been asked for ``PROMOTION_RESERVE_IDLE_S`` the reserve is 0 again.
"""

from __future__ import annotations

import logging
import time

from tiering.cpu_tier import CpuTier
from tiering.settings import PROMOTION_RESERVE_IDLE_S

log = logging.getLogger(__name__)


class PromotionReserve:
    def __init__(self, cpu: CpuTier, share: float, enabled: bool = True) -> None:
        """``share``: of the CPU rows, the first reserve (0: never any); ``enabled``: False
        where nothing is ever promoted (no tier below the CPU tier)."""
        if not 0 <= share <= 1:
            raise ValueError(f"promotion_reserve: expected a share of the rows in [0, 1], got "
                             f"{share!r}")
        self.cpu = cpu
        self.most = (cpu.num_rows - 1) // 2
        self.first = (min(max(1, int(cpu.num_rows * share)), self.most)
                      if enabled and share > 0 else 0)
        self._asked_at = 0.0  # time.monotonic() of the last promotion asked for
        self._starved = False  # a promotion of this step found no row

    def asked(self, found_row: bool) -> None:
        """A promotion was asked for; ``found_row``: whether it got a CPU row."""
        self._asked_at = time.monotonic()
        cpu = self.cpu
        if not found_row and cpu.num_rows - cpu.pinned_rows() <= cpu.promotion_reserve:
            self._starved = True

    def step_end(self) -> None:
        """Size the reserve for the next step (see the module doc)."""
        now = self.cpu.promotion_reserve
        if self._starved and self.first:
            self._starved = False
            grown = min(self.most, max(self.first, 2 * now))
            if grown != now:
                log.debug("promotions found every CPU row pinned: stores leave %d of %d rows "
                          "unpinned for them", grown, self.cpu.num_rows)
                self.cpu.keep_for_promotions(grown)
        elif now and time.monotonic() - self._asked_at >= PROMOTION_RESERVE_IDLE_S:
            self.cpu.keep_for_promotions(0)  # no promotion wanted for a while: rows to stores
