"""Cost of our CachePolicy classes inside vLLM's CPUOffloadingManager, against vLLM's own.

    python docs/bench_cache_policy.py [CHUNKS]

One request of CHUNKS chunks (token positions set, as vLLM's scheduler does) is stored into a
CPU tier of CHUNKS rows in batches of CHUNKS/16 (chunked prefill), 64 and 1 chunk (a chunk a
step, as when decode output is offloaded), then finished. Prints the total time per policy.
Our adapter re-stamps the request's resident chunks after each batch so that its newest batch
stays first to go; that costs one policy move per resident chunk of the request per batch.
"""

from __future__ import annotations

import sys
import time

POLICIES = ("lru", "TieringLRUPolicy", "arc", "TieringARCPolicy", "S3FIFOPolicy")


def run(policy: str, n: int, batch: int) -> float:
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    ours = {} if policy in ("lru", "arc") else {"cache_policy_module_path": "tiering.vllm"}
    m = CPUOffloadingManager(num_chunks=n, cache_policy=policy, **ours)
    keys = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(n)]
    ctx = ReqContext(req_id="r")
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (i + 1) * 16)
    m.on_new_request(ctx)
    t0 = time.perf_counter()
    for lo in range(0, n, batch):
        part = keys[lo:lo + batch]
        m.prepare_store(part, ctx)
        m.complete_store(part, ctx)
    m.on_request_finished(ctx)
    return time.perf_counter() - t0


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    print("| chunks per batch | " + " | ".join(POLICIES) + " |")
    print("|---" * (len(POLICIES) + 1) + "|")
    for batch in (max(1, n // 16), 64, 1):
        cells = [f"{run(p, n, batch) * 1e3:.0f} ms" for p in POLICIES]
        print(f"| {batch} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
