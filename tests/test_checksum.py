"""Slot checksums: one value per (namespace, key, bytes), whichever xxhash call computes it.

Rows of ``GIL_FREE_BYTES`` or more are hashed through the streaming hasher (it releases the GIL
in every xxhash release), smaller ones with the one-shot call. Both must give exactly the value
that slots already on disk were written with, or an upgrade would turn every stored row into a
checksum miss.
"""

from __future__ import annotations

import numpy as np
import pytest
from xxhash import xxh3_64_intdigest

from tiering.backends.checksum import GIL_FREE_BYTES, checksum_of, namespace_seed


def _stored_value(seed: int, key: bytes, data: bytes) -> int:
    # the definition the on-disk format was written with: one-shot xxh3-64, seeded by the
    # xxh3-64 of the key seeded by the namespace
    return xxh3_64_intdigest(data, seed=xxh3_64_intdigest(key, seed=seed))


@pytest.mark.parametrize("size", [1, 4096, GIL_FREE_BYTES - 1, GIL_FREE_BYTES,
                                  GIL_FREE_BYTES + 1, 256 << 10, (2 << 20) + 4096])
def test_value_is_the_stored_format_on_both_sides_of_the_threshold(size):
    data = np.random.default_rng(size).integers(0, 256, size, np.uint8).tobytes()
    seed = namespace_seed("0123456789abcdef")
    key = b"k" * 36
    assert checksum_of(seed, key, data) == _stored_value(seed, key, data)
    assert checksum_of(seed, key, memoryview(data)) == _stored_value(seed, key, data)


def test_binds_key_namespace_and_every_byte():
    data = bytearray(np.random.default_rng(1).integers(0, 256, 256 << 10, np.uint8).tobytes())
    seed = namespace_seed("0123456789abcdef")
    base = checksum_of(seed, b"key-a", data)
    assert checksum_of(seed, b"key-b", data) != base
    assert checksum_of(namespace_seed("fedcba9876543210"), b"key-a", data) != base
    for pos in (0, GIL_FREE_BYTES, len(data) - 1):
        data[pos] ^= 1
        assert checksum_of(seed, b"key-a", data) != base
        data[pos] ^= 1
    assert checksum_of(seed, b"key-a", data) == base
