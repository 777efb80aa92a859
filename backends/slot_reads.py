"""Reading slots: the file tier's read path, on the slab I/O's threads.

``FileTier.get`` builds one ``ReadItem`` per key and calls ``start_reads``: runs of adjacent slots
become one vectored read each (``slab.run_rows``/``adjacent_runs``), every row's checksum (seeded
by its key and namespace) is verified on the I/O thread, and each run's outcome goes back to the
owner's queue as one ``ReadsDone``, which ``FileTier.poll`` applies. A read that fails, comes back
short or fails its checksum is a miss reason, never an exception and never wrong bytes.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass

from tiering.backends.checksum import checksum_of
from tiering.backends.codec import ZstdCodec
from tiering.backends.slab import SlabSet, adjacent_runs, run_rows
from tiering.backends.slab_io import ALIGN, SlabIo, aligned_buffer
from tiering.settings import MAX_READ_RUN_BYTES

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ReadItem:
    key: bytes
    slot: int
    length: int
    codec: int
    checksum: int
    out: memoryview
    token: object


@dataclass
class ReadsDone:
    """The outcome of one run of reads: (item, miss reason or '') per row, in one message."""

    outcomes: list[tuple[ReadItem, str]]
    seconds: float


def start_reads(io: SlabIo, slabs: SlabSet, codec: ZstdCodec, items: list[ReadItem],
                verify: bool, out: queue.SimpleQueue[object]) -> None:
    """Read ``items`` on the slab I/O's threads; each run's outcome reaches ``out`` as one
    ``ReadsDone``. Runs of adjacent slots become one vectored read each (see ``run_rows``)."""
    t0 = time.perf_counter()
    per_run = run_rows(len(items), io.threads, slabs.slot_bytes, MAX_READ_RUN_BYTES)
    for run in adjacent_runs(items, slabs, per_run, _slot_of):
        io.post(_read_and_report, io, slabs, codec, run, verify, out, t0, urgent=True)


def _read_and_report(io: SlabIo, slabs: SlabSet, codec: ZstdCodec, run: list[ReadItem],
                     verify: bool, out: queue.SimpleQueue[object], t0: float) -> None:
    try:
        outcomes = read_run(io, slabs, codec, run, verify)
    except Exception:  # never lose a run: its keys are pinned until reported
        log.exception("file tier: read of slots %d..%d failed", run[0].slot, run[-1].slot)
        outcomes = [(it, "error") for it in run]
    out.put(ReadsDone(outcomes, time.perf_counter() - t0))


def _slot_of(item: ReadItem) -> int:
    return item.slot


def read_slot(io: SlabIo, slabs: SlabSet, codec: ZstdCodec | None, it: ReadItem,
              verify: bool) -> str:
    """Read one slot into ``it.out``; returns '' on success or the miss reason."""
    handle, offset, _ = slabs.locate(it.slot)
    length, out = it.length, it.out
    if not 0 < length <= slabs.slot_bytes:  # a damaged record: never read past the slot
        return "corrupt"
    try:
        if it.codec == 0:
            if length != len(out):
                return "corrupt"
            n = io.read_into(handle, out, offset)
            if n < length:
                return "short_read"
            if verify and checksum_of(slabs.seed, it.key, out) != it.checksum:
                return "checksum"
            return ""
        if it.codec != 1:
            return "corrupt"
        padded = -(-length // ALIGN) * ALIGN
        buf = aligned_buffer(padded)
        n = io.read_into(handle, buf, offset)
        if n < length:
            return "short_read"
        payload = buf[:length]
        if verify and checksum_of(slabs.seed, it.key, payload) != it.checksum:
            return "checksum"
        if codec is None:
            codec = ZstdCodec()
        codec.decode(payload, out)
        return ""
    except OSError as exc:
        log.warning("file tier: read of slot %d failed: %s", it.slot, exc)
        return "error"
    except Exception as exc:  # a corrupt compressed payload
        log.warning("file tier: decoding slot %d failed: %s", it.slot, exc)
        return "corrupt"


def read_run(io: SlabIo, slabs: SlabSet, codec: ZstdCodec, run: list[ReadItem],
             verify: bool) -> list[tuple[ReadItem, str]]:
    """Read a run of consecutive slots (one vectored call when all are raw rows)."""
    if len(run) == 1 or any(it.codec or it.length != len(it.out) for it in run):
        return [(it, read_slot(io, slabs, codec, it, verify)) for it in run]
    handle, offset, _ = slabs.locate(run[0].slot)
    try:
        n = io.readv(handle, [it.out for it in run], offset)
    except OSError as exc:
        log.warning("file tier: read of slots %d..%d failed: %s", run[0].slot, run[-1].slot, exc)
        return [(it, "error") for it in run]
    out = []
    for it in run:
        if n < it.length:
            out.append((it, "short_read"))
        elif verify and checksum_of(slabs.seed, it.key, it.out) != it.checksum:
            out.append((it, "checksum"))
        else:
            out.append((it, ""))
        n -= it.length
    return out
