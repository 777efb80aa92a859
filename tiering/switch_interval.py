"""The engine process's interpreter switch interval while our tiers run I/O threads.

A thread whose ``pread`` returned waits for the GIL up to the switch interval while another
thread runs Python, and vLLM's scheduler thread runs Python all the time a request waits for
its disk hit. Both of our vLLM entry points (our spec, and our file or mooncake tier under
vLLM's ``TieringOffloadingSpec``) lower it the same way: ``switch_interval_ms`` in their config,
``tiering.settings.IO_SWITCH_INTERVAL_S`` by default, 0 to leave Python's own. It is never
raised: another library in the process may have lowered it further.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from tiering.settings import IO_SWITCH_INTERVAL_S

log = logging.getLogger(__name__)
MAX_MS = 100


def parse_switch_interval_ms(value: Any = None) -> float:
    """``switch_interval_ms`` from a config (None: the default), in milliseconds; a ValueError
    naming the key for anything but a number from 0 to ``MAX_MS``."""
    if value is None:
        return IO_SWITCH_INTERVAL_S * 1000
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_MS:
        raise ValueError(f"switch_interval_ms: expected a number of milliseconds from 0 (leave "
                         f"Python's own) to {MAX_MS}, got {value!r}")
    return float(value)


def shorten_switch_interval(ms: float, why: str = "the tiers' I/O threads get the GIL back "
                            "soon after each read while the scheduler runs") -> None:
    """Lower this process's switch interval to ``ms`` milliseconds (0: leave it); never raise
    it. Called once a tier with I/O threads is opened, and where a GPU worker feeds its loads
    from a thread (``load_queue_bytes``; backends/copy_feeder.py): ``why`` says which."""
    now = sys.getswitchinterval()
    seconds = ms / 1000
    if 0 < seconds < now:
        sys.setswitchinterval(seconds)
        log.info("vllm-tiering: interpreter switch interval %.2g ms (was %.2g ms), so that %s "
                 "(switch_interval_ms: 0 leaves it)", ms, now * 1000, why)
