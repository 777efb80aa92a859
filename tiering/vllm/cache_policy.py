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
chunk; we collect the chunks of one ``prepare_store`` and hand them to our policy as one batch
before the next call that looks at the order: by token position, tail first (``insert_many``),
when vLLM 0.33 passes the request's context with positions; in arrival order when it passes a
context without them (as vLLM's LRU does); tail first in listed order under vLLM 0.32, which
passes no context and lists a request's chunks in prefix order. When a request stores over
several steps (chunked prefill), all of its resident chunks are re-stamped in prefix order after
each batch (``refresh_many``: recency only, no hit counted; one policy move per resident chunk
of the request, each position looked up once), so the later batch is still evicted first. At
``on_request_finished`` the request's chunks are ordered once more, reused ones counting as a
hit; vLLM 0.32 gets the cross-batch order there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from tiering.policies import EvictionPolicy, create
from tiering.vllm.compat import ReqContext


@dataclass
class _RequestChunks:
    """The chunks one request stored or used in one policy instance (kept in its ReqContext),
    with their end-token positions (each looked up once)."""

    owner: object
    generation: int
    keys: dict[bytes, int | None] = field(default_factory=dict)  # in arrival order
    batches: int = 0

    def learn(self, keys: list[bytes], ctx: ReqContext) -> list[int | None]:
        known = self.keys
        for k in keys:
            if k not in known:
                known[k] = ctx.get_offload_key_position(k)
        self.batches += 1
        return [known[k] for k in keys]


def _by_position(keys: list[bytes], positions: list[int] | Mapping[bytes, int | None]
                 ) -> list[bytes]:
    """Head to tail; ``positions`` maps each key (or parallels ``keys`` if a list)."""
    if isinstance(positions, list):
        return [k for _, k in sorted(zip(positions, keys, strict=True), key=lambda p: p[0])]
    return sorted(keys, key=lambda k: positions[k] or 0)  # the caller checked: all known


class _AdaptedPolicy(CachePolicy):
    policy_name = "lru"

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._policy: EvictionPolicy[bytes] = create(self.policy_name, max(1, cache_capacity))
        self._chunks: dict[bytes, ChunkStatus] = {}
        self._pending: list[tuple[bytes, ReqContext | None]] = []  # inserted, not yet given to the policy
        self._generation = 0  # bumped by clear(): request state from before is stale

    @property
    def policy(self) -> EvictionPolicy[bytes]:
        """The tiering policy that orders the chunks (for inspection: ``policy.stats()``)."""
        return self._policy

    # -- the batch of inserts of one prepare_store -------------------------------------------
    def _flush(self) -> None:
        """Give pending inserts to the policy, one request's run at a time."""
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
            if ctx is None:
                # vLLM 0.32 gives no context; its manager passes a request's keys in prefix
                # order, which insert_many applies tail first
                self._policy.insert_many(keys)
            else:
                positions = self._request_chunks(ctx).learn(keys, ctx)
                known = [p for p in positions if p is not None]
                if len(known) < len(positions):  # as vLLM 0.33's LRU: unpositioned by arrival
                    for k in keys:
                        self._policy.insert(k)
                else:
                    self._policy.insert_many(_by_position(keys, known))
            for k in keys:
                if self._chunks[k].ref_cnt != 0:  # being written: evictable once marked so
                    self._policy.pin(k)
            if ctx is not None:
                self._restamp(ctx)
            start = end

    def _request_chunks(self, ctx: ReqContext) -> _RequestChunks:
        state: _RequestChunks | None = ctx.get_state(_RequestChunks)
        if state is None or state.owner is not self or state.generation != self._generation:
            state = _RequestChunks(self, self._generation)
            ctx.set_state(state)
        return state

    def _restamp(self, ctx: ReqContext) -> None:
        """Re-stamp the request's resident chunks in prefix order, so its newest batch (its
        tail) stays first to go. Costs one policy move per resident chunk of the request."""
        state = self._request_chunks(ctx)
        if state.batches < 2 or None in state.keys.values():
            return
        resident = [k for k in state.keys if k in self._chunks]
        self._policy.refresh_many(_by_position(resident, state.keys))

    # -- CachePolicy ---------------------------------------------------------------------------
    def get(self, key: bytes) -> ChunkStatus | None:
        return self._chunks.get(key)

    def insert(self, key: bytes, chunk: ChunkStatus, req_context: ReqContext | None = None
               ) -> None:
        # vLLM 0.33 passes the storing request's context; 0.32 does not
        self._chunks[key] = chunk
        self._pending.append((key, req_context))

    def remove(self, key: bytes) -> None:
        self._flush()
        self._chunks.pop(key, None)
        self._policy.remove(key)

    def touch(self, keys: Iterable[bytes], req_context: ReqContext) -> None:
        self._flush()
        self._policy.access_many([k for k in keys if k in self._chunks])

    def on_store_miss(self, keys: Iterable[bytes], req_context: ReqContext) -> None:
        self._flush()
        for k in keys:
            self._policy.on_miss(k)

    def on_request_access(self, keys: Iterable[bytes], req_context: ReqContext) -> None:
        # vLLM 0.33: chunks a running request loads or finds resident belong to its prefix
        self._flush()
        resident = [k for k in keys if k in self._chunks]
        if resident:
            self._request_chunks(req_context).learn(resident, req_context)
            self._restamp(req_context)

    def on_request_finished(self, key_groups: Sequence[Sequence[bytes]],
                            insertion_only_keys: set[bytes], reused_keys: set[bytes],
                            req_context: ReqContext) -> None:
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
        state = self._request_chunks(req_context)
        state.keys.clear()
        state.batches = 0

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
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

    def mark_evictable(self, key: bytes) -> None:
        self._flush()
        if self._policy.is_pinned(key):
            self._policy.unpin(key)

    def mark_non_evictable(self, key: bytes) -> None:
        self._flush()
        if key in self._chunks and not self._policy.is_pinned(key):
            self._policy.pin(key)


class S3FIFOPolicy(_AdaptedPolicy):
    policy_name = "s3fifo"


class TieringARCPolicy(_AdaptedPolicy):
    policy_name = "arc"


class TieringLRUPolicy(_AdaptedPolicy):
    policy_name = "lru"
