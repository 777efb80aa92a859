"""Slot checksums: xxh3-64 of the stored bytes, seeded by the key and its namespace.

xxh3 hashes at memory speed (tens of GB/s on one core, against ~7 GB/s for zlib's crc32 on the
build machine), so verifying every read costs little of the CPU the tier shares with vLLM's
scheduler. It is not cryptographic: it catches torn writes, bit rot and misdirected I/O, which is
what a local cache needs; the namespace folder is private (0700) against tampering.

The seed binds a slot's bytes to the key (and namespace) they were written for: the seed is the
xxh3-64 of the key, itself seeded by the namespace id. A damaged index that points a key at
another key's slot (swapped records, a flipped byte that makes a phantom key, a record copied
from another namespace) then fails the check and is a miss, never another key's KV.

Rows of ``GIL_FREE_BYTES`` or more are hashed through the streaming ``xxh3_64`` object, which
hashes with the GIL released in every xxhash release; the one-shot ``xxh3_64_intdigest`` does
so only from xxhash 4 on (3.x holds the GIL for the whole row: with 16 I/O threads every
checksum then runs one at a time, 30 us per 256 KiB row, and stalls the threads' syscalls and
the scheduler thread meanwhile). Both give the same value, so the stored format is one.
"""

from __future__ import annotations

from xxhash import xxh3_64, xxh3_64_intdigest

# Below this the one-shot call is cheaper than a hasher object, and short enough that holding
# the GIL does not matter.
GIL_FREE_BYTES = 64 << 10


def namespace_seed(namespace_id: str) -> int:
    """The 64-bit seed of a namespace (its id is 16 hex digits; anything else is hashed)."""
    try:
        return int(namespace_id, 16) & 0xFFFF_FFFF_FFFF_FFFF
    except ValueError:
        return xxh3_64_intdigest(namespace_id.encode())


def checksum_of(seed: int, key: bytes, data: bytes | memoryview) -> int:
    """Checksum of ``data`` stored for ``key`` in the namespace whose seed is ``seed``."""
    row_seed = xxh3_64_intdigest(key, seed=seed)
    if len(data) >= GIL_FREE_BYTES:
        return xxh3_64(data, seed=row_seed).intdigest()
    return xxh3_64_intdigest(data, seed=row_seed)
