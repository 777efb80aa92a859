"""Workloads for ``tiering simulate``: streams of requests, each a list of chunk keys.

A request is what vLLM sees when a prompt arrives: its chunks in prefix order. The simulator
looks them up in the tier, stores the ones that missed, and counts. Built-in generators are
seeded and deterministic so tables in the docs can be reproduced exactly.

* ``zipf``  — single-chunk requests over a key universe with Zipf(alpha) popularity.
* ``scan``  — a hot working set read in a loop, interleaved with long one-off scans (batch
  jobs, crawlers): LRU lets each scan flush the hot set, scan-resistant policies should not.
* ``chat``  — multi-turn conversations: turn t of a conversation re-sends the whole history
  (a growing prefix), conversations picked with Zipf popularity, a shared system prompt.
* ``rag``   — many long documents queried alternately (the seed article's case): each query is
  system prompt + one document + a fresh question; more documents than the tier holds.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

Request = tuple[str, list[str]]  # (request id, chunk keys in prefix order)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    default_capacity: int
    make: Callable[[int], Iterator[Request]]


def _zipf_sampler(n: int, alpha: float, rng: random.Random) -> Callable[[], int]:
    weights = [1.0 / (i + 1) ** alpha for i in range(n)]
    cum, total = [], 0.0
    for w in weights:
        total += w
        cum.append(total)

    def sample() -> int:
        return rng.choices(range(n), cum_weights=cum, k=1)[0]

    return sample


def zipf(seed: int, n_keys: int = 20_000, n_requests: int = 200_000, alpha: float = 0.9
         ) -> Iterator[Request]:
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** alpha for i in range(n_keys)]
    keys = rng.choices(range(n_keys), weights=weights, k=n_requests)
    for i, k in enumerate(keys):
        yield f"r{i}", [f"z{k}"]


def scan(seed: int, hot: int = 600, n_rounds: int = 400, scan_every: int = 4, scan_len: int = 3000
         ) -> Iterator[Request]:
    rng = random.Random(seed)
    fresh = 0
    for rnd in range(n_rounds):
        for _ in range(hot // 4):  # a quarter of the hot set per round, random order
            k = rng.randrange(hot)
            yield f"h{rnd}-{k}", [f"hot{k}"]
        if rnd % scan_every == scan_every - 1:
            for _ in range(scan_len):
                yield f"s{fresh}", [f"once{fresh}"]
                fresh += 1


def chat(seed: int, n_convs: int = 2_000, n_turns: int = 40_000, system_chunks: int = 4,
         chunks_per_turn: int = 3) -> Iterator[Request]:
    rng = random.Random(seed)
    pick = _zipf_sampler(n_convs, 0.8, rng)
    turns = [0] * n_convs
    for i in range(n_turns):
        c = pick()
        turns[c] += 1
        depth = min(turns[c], 12)  # clients truncate very long histories
        keys = [f"sys{j}" for j in range(system_chunks)]
        keys += [f"c{c}.{j}" for j in range(depth * chunks_per_turn)]
        yield f"t{i}", keys


def rag(seed: int, n_docs: int = 400, doc_chunks: int = 16, n_queries: int = 12_000,
        system_chunks: int = 2) -> Iterator[Request]:
    rng = random.Random(seed)
    pick = _zipf_sampler(n_docs, 0.7, rng)
    for i in range(n_queries):
        d = pick()
        keys = [f"sys{j}" for j in range(system_chunks)]
        keys += [f"d{d}.{j}" for j in range(doc_chunks)]
        keys.append(f"q{i}")  # the question itself is never reused
        yield f"q{i}", keys


BUILTIN: dict[str, Workload] = {
    "zipf": Workload("zipf", "20k keys, Zipf(0.9), 200k single-chunk requests", 2_000,
                     lambda s: zipf(s)),
    "scan": Workload("scan", "600-key hot loop + 3000-key one-off scans", 1_000,
                     lambda s: scan(s)),
    "chat": Workload("chat", "2k conversations, growing prefixes, shared system prompt", 6_000,
                     lambda s: chat(s)),
    "rag": Workload("rag", "400 documents x 16 chunks, Zipf(0.7) queries", 2_000,
                    lambda s: rag(s)),
}


def from_trace(path: str | Path) -> Iterator[Request]:
    """Read a trace: one ``key [request_id]`` per line; consecutive lines of one request id
    form one request (a line without an id is a request of its own). ``#`` starts a comment."""
    current_id: str | None = None
    current: list[str] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, raw in enumerate(fh, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) > 2:
                raise ValueError(f"{path}:{lineno}: expected 'key [request_id]', got {raw.strip()!r}")
            key = parts[0]
            rid = parts[1] if len(parts) == 2 else None
            if current and (rid is None or rid != current_id):
                yield current_id or f"line{lineno}", current
                current = []
            current_id = rid
            current.append(key)
            if rid is None:
                yield f"line{lineno}", current
                current = []
    if current:
        yield current_id or "last", current
