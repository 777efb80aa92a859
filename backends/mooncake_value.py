"""How one chunk is named and laid out in Mooncake Store.

Name: ``vt<FORMAT_VERSION>/<namespace id>/<chunk key hex>``. The namespace id is the digest of
the facts that make KV bytes compatible (``backends/namespace.py``: model, dtype, layout, row
size, tokens per chunk, parallel layout, format version), so engines of different models or
layouts never ask for each other's names; ``vt<N>/<ns>/`` is also the prefix that tools use to
find one namespace's objects on the master.

Value: a 64-byte header, then the row's bytes. The header records the namespace seed, a digest
of the chunk key, the row length and the row's xxh3 checksum seeded by key and namespace
(``backends/checksum.py``, the same function the file tier uses). A read checks the header
always and the checksum when ``verify`` is on: a value written for another key or namespace
(a name collision, a buggy writer elsewhere in the cluster), a short or torn value, or flipped
bits are a miss, never KV served to the wrong engine.

The header and the row are separate buffers of one Mooncake object (multi-buffer put/get), so
the row moves straight between the registered staging region and the store.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from xxhash import xxh3_64_intdigest

from tiering.backends.checksum import checksum_of, namespace_seed
from tiering.backends.namespace import FORMAT_VERSION

MAGIC = b"VTMC"
HEADER_VERSION = 1
HEADER_BYTES = 64
# magic, header version, flags, namespace seed, key digest, row length, checksum
_HEADER = struct.Struct("<4sHHQQQQ")
assert _HEADER.size <= HEADER_BYTES

KEY_PREFIX = f"vt{FORMAT_VERSION}"
META_NAME = "meta"  # vt<N>/<ns>/meta: the namespace's facts as JSON (tools show them)


def namespace_prefix(namespace_id: str) -> str:
    return f"{KEY_PREFIX}/{namespace_id}/"


def object_name(namespace_id: str, key: bytes) -> str:
    return f"{KEY_PREFIX}/{namespace_id}/{key.hex()}"


@dataclass(frozen=True)
class ValueCodec:
    """Packs and checks headers for one namespace (one per tier; thread-safe: no state)."""

    namespace_id: str
    row_bytes: int

    @property
    def seed(self) -> int:
        return namespace_seed(self.namespace_id)

    def key_digest(self, key: bytes) -> int:
        return xxh3_64_intdigest(key, seed=self.seed)

    def pack(self, key: bytes, row: memoryview | bytes, out: memoryview) -> None:
        """Write the header of ``row`` stored under ``key`` into ``out`` (HEADER_BYTES)."""
        seed = self.seed
        _HEADER.pack_into(out, 0, MAGIC, HEADER_VERSION, 0, seed, self.key_digest(key),
                          len(row), checksum_of(seed, key, row))
        out[_HEADER.size:HEADER_BYTES] = bytes(HEADER_BYTES - _HEADER.size)

    def check(self, key: bytes, header: memoryview | bytes, row: memoryview | bytes,
              verify: bool) -> str:
        """Why the value read for ``key`` is not usable ("" when it is): "header" (not ours,
        another key's or namespace's, another length), "checksum" (the bytes changed)."""
        try:
            magic, version, _, seed, digest, length, checksum = _HEADER.unpack_from(header, 0)
        except struct.error:
            return "header"
        if (magic != MAGIC or version != HEADER_VERSION or seed != self.seed
                or digest != self.key_digest(key) or length != len(row)
                or length != self.row_bytes):
            return "header"
        if verify and checksum_of(seed, key, row) != checksum:
            return "checksum"
        return ""
