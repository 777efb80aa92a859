"""Our eviction policies inside vLLM's own CPU tier (``CPUOffloadingSpec`` and
``TieringOffloadingSpec``):

    "eviction_policy": "S3FIFOPolicy", "cache_policy_module_path": "tiering.vllm"

(also ``TieringARCPolicy``, ``TieringLRUPolicy``). vLLM keeps a ``ChunkStatus`` per chunk with a
reference count (-1 while being written, >0 while being read) and tells the policy when a chunk
becomes evictable or stops being so (``mark_evictable``/``mark_non_evictable``); those map to
our pins, so ``evict`` never returns a chunk in use and stays all-or-nothing.

Order within a request (vLLM's contract, which its 0.33 LRU keeps while a request runs and its
ARC once the request finishes): a request's tail is evicted before its head, because a missing
head chunk makes every later chunk of the prefix unreachable. vLLM calls ``insert`` once per
chunk, head first; we collect the chunks of one ``prepare_store`` and hand them to our policy as
one batch (``insert_many`` applies it tail first) before the next call that looks at the order.
When a request stores over several steps (chunked prefill), vLLM 0.33 passes its context to
``insert``, and all of the request's resident chunks are re-stamped in prefix order after each
batch (``refresh_many``: recency only, no hit counted), so the later batch is still evicted
first. At ``on_request_finished`` the request's chunks are ordered once more, reused ones
counting as a hit; vLLM 0.32 (no context on ``insert``) gets the cross-batch order there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from tiering.policies import create


@dataclass
class _RequestChunks:
    """The chunks one request stored or used in one policy instance (kept in its ReqContext)."""

    owner: object
    generation: int
    keys: dict[bytes, None] = field(default_factory=dict)  # insertion-ordered set


class _AdaptedPolicy(CachePolicy):
    policy_name = "lru"

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._policy = create(self.policy_name, max(1, cache_capacity))
        self._chunks: dict[bytes, ChunkStatus] = {}
        self._pending: list[tuple[bytes, object]] = []  # inserted, not yet given to the policy
        self._generation = 0  # bumped by clear(): request state from before is stale

    # -- the batch of inserts of one prepare_store -------------------------------------------
    def _flush(self) -> None:
        """Give pending inserts to the policy, one request's run at a time, tail first."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        start = 0
        while start < len(pending):
            ctx = pending[start][1]
            end = start
            while end < len(pending) and pending[end][1] is ctx:
                end += 1
            keys = [k for k, _ in pending[start:end]]
            self._policy.insert_many(self._prefix_order(keys, ctx))
            for k in keys:
                if self._chunks[k].ref_cnt != 0:  # being written: evictable once marked so
                    self._policy.pin(k)
            if ctx is not None:
                self._remember(ctx, keys)
            start = end

    @staticmethod
    def _prefix_order(keys: list, ctx) -> list:
        return keys if ctx is None else order_request_keys([keys], ctx)

    def _request_chunks(self, ctx) -> _RequestChunks:
        state = ctx.get_state(_RequestChunks)
        if state is None or state.owner is not self or state.generation != self._generation:
            state = _RequestChunks(self, self._generation)
            ctx.set_state(state)
        return state

    def _remember(self, ctx, keys: Iterable) -> None:
        """Add keys to the request's chunks; if it already had some, re-stamp all of them in
        prefix order so the newest batch (its tail) stays first to go."""
        state = self._request_chunks(ctx)
        had_earlier = bool(state.keys)
        state.keys.update(dict.fromkeys(keys))
        if had_earlier:
            resident = [k for k in state.keys if k in self._chunks]
            self._policy.refresh_many(self._prefix_order(resident, ctx))

    # -- CachePolicy ---------------------------------------------------------------------------
    def get(self, key) -> ChunkStatus | None:
        return self._chunks.get(key)

    def insert(self, key, chunk: ChunkStatus, req_context=None) -> None:
        # vLLM 0.33 passes the storing request's context; 0.32 does not
        self._chunks[key] = chunk
        self._pending.append((key, req_context))

    def remove(self, key) -> None:
        self._flush()
        self._chunks.pop(key, None)
        self._policy.remove(key)

    def touch(self, keys: Iterable, req_context) -> None:
        self._flush()
        self._policy.access_many([k for k in keys if k in self._chunks])

    def on_store_miss(self, keys: Iterable, req_context) -> None:
        self._flush()
        for k in keys:
            self._policy.on_miss(k)

    def on_request_access(self, keys: Iterable, req_context) -> None:
        # vLLM 0.33: chunks a running request loads or finds resident belong to its prefix
        self._flush()
        self._remember(req_context, [k for k in keys if k in self._chunks])

    def on_request_finished(self, key_groups: Sequence[Sequence], insertion_only_keys: set,
                            reused_keys: set, req_context) -> None:
        # Tail to head, so the head ends most recent. Only real reuse counts as a hit (a store
        # is not a frequency signal for ARC/S3-FIFO); the other chunks are re-stamped.
        self._flush()
        for k in reversed(order_request_keys(key_groups, req_context)):
            if k not in self._chunks:
                continue
            if k in reused_keys:
                self._policy.access(k)
            else:
                self._policy.refresh(k)
        self._request_chunks(req_context).keys.clear()

    def evict(self, n: int, protected: set) -> list[tuple[object, ChunkStatus]] | None:
        self._flush()
        victims = self._policy.evict(n, protected)
        if victims is None:
            return None
        return [(k, self._chunks.pop(k)) for k in victims]

    def clear(self) -> None:
        self._pending.clear()
        self._chunks.clear()
        self._policy.clear()
        self._generation += 1

    def mark_evictable(self, key) -> None:
        self._flush()
        if self._policy.is_pinned(key):
            self._policy.unpin(key)

    def mark_non_evictable(self, key) -> None:
        self._flush()
        if key in self._chunks and not self._policy.is_pinned(key):
            self._policy.pin(key)


class S3FIFOPolicy(_AdaptedPolicy):
    policy_name = "s3fifo"


class TieringARCPolicy(_AdaptedPolicy):
    policy_name = "arc"


class TieringLRUPolicy(_AdaptedPolicy):
    policy_name = "lru"
