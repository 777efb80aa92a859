"""Our eviction policies inside vLLM's own CPU tier (``CPUOffloadingSpec`` and
``TieringOffloadingSpec``):

    "eviction_policy": "S3FIFOPolicy", "cache_policy_module_path": "tiering.vllm"

(also ``TieringARCPolicy``, ``TieringLRUPolicy``). vLLM keeps a ``ChunkStatus`` per chunk with a
reference count (-1 while being written, >0 while being read) and tells the policy when a chunk
becomes evictable or stops being so (``mark_evictable``/``mark_non_evictable``); those map to
our pins, so ``evict`` never returns a chunk in use and stays all-or-nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from tiering.policies import create


class _AdaptedPolicy(CachePolicy):
    policy_name = "lru"

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._policy = create(self.policy_name, max(1, cache_capacity))
        self._chunks: dict[bytes, ChunkStatus] = {}

    def get(self, key) -> ChunkStatus | None:
        return self._chunks.get(key)

    def insert(self, key, chunk: ChunkStatus, req_context=None) -> None:
        # vLLM 0.33 passes the storing request's context; 0.32 does not
        self._chunks[key] = chunk
        self._policy.insert(key)
        if chunk.ref_cnt != 0:  # written or read right now: not evictable until marked so
            self._policy.pin(key)

    def remove(self, key) -> None:
        self._chunks.pop(key, None)
        self._policy.remove(key)

    def touch(self, keys: Iterable, req_context) -> None:
        self._policy.access_many([k for k in keys if k in self._chunks])

    def on_store_miss(self, keys: Iterable, req_context) -> None:
        for k in keys:
            self._policy.on_miss(k)

    def on_request_finished(self, key_groups: Sequence[Sequence], insertion_only_keys: set,
                            reused_keys: set, req_context) -> None:
        # Only real reuse counts as a hit (a store is not a frequency signal for ARC/S3-FIFO).
        ordered = order_request_keys(key_groups, req_context)
        self._policy.access_many([k for k in ordered if k in reused_keys and k in self._chunks])

    def evict(self, n: int, protected: set) -> list[tuple[object, ChunkStatus]] | None:
        victims = self._policy.evict(n, protected)
        if victims is None:
            return None
        return [(k, self._chunks.pop(k)) for k in victims]

    def clear(self) -> None:
        self._chunks.clear()
        self._policy.clear()

    def mark_evictable(self, key) -> None:
        if self._policy.is_pinned(key):
            self._policy.unpin(key)

    def mark_non_evictable(self, key) -> None:
        if key in self._chunks and not self._policy.is_pinned(key):
            self._policy.pin(key)


class S3FIFOPolicy(_AdaptedPolicy):
    policy_name = "s3fifo"


class TieringARCPolicy(_AdaptedPolicy):
    policy_name = "arc"


class TieringLRUPolicy(_AdaptedPolicy):
    policy_name = "lru"
