"""Scheduler-side cost of a CPU-tier load, per block, in a real vLLM Scheduler (issue 15).

    .venv033/bin/python docs/bench_load_path.py [--prompts 256] [--chunk-tokens 16]
        [--configs none,cpu,ours,ours@0] [--repeat 5] [--profile DIR]
        [--baseline OLD_CHECKOUT --rounds 3] [--miss]

The prefill sweep's workload without a model: N unique 512-token prompts, max_tokens 1, GPU
prefix caching off, 16-token GPU blocks (CUDA vLLM 0.33 on a machine without a GPU: the
scheduler needs none). A fill batch stores them (the simulated worker of
``tests/vllm_harness.py`` completes every job one step after it was issued), then the same
prompts again as new requests: every full chunk but the last is a CPU hit. Timed: the whole
hit batch through ``Scheduler.schedule`` and ``update_from_output`` (and the connector's
scheduler side and our manager inside them), against the same batch without offloading
(``none``: every token computed). Reported: µs per loaded GPU block (wall clock and CPU time of
the process), raw and above ``none`` (what the load path adds on the scheduler thread), and the
steps the batch took. ``--miss``: the sweep's 0% batch instead: every timed batch is N prompts
never seen (every chunk a miss and a store; the CPU tier evicts once full), per stored block.

Configs: ``none``, ``cpu`` (vLLM's ``CPUOffloadingSpec``), ``ours`` (``TieredOffloadingSpec``
with its defaults), ``ours-sched`` (ours under ``TieringScheduler``'s plain variant), ``ours@K`` (ours with ``max_loading_requests`` K; ``ours@0``: no cap). Every
config gets its own scheduler, filled once; the hit batches then alternate between the configs
(``--repeat`` rounds), so a busy machine slows them alike. ``--baseline DIR``: a checkout of an
older tree (``git worktree add DIR COMMIT``); the benchmark runs itself ``--rounds`` times in a
fresh process per tree, alternating the old tree's code (its ``tiering``, ``backends`` and
``policies``) and this one's, and reports each tree's configs (``--baseline-configs`` for the
old tree, which may not know ``ours@K``). ``--profile DIR``: one more hit batch per config under
cProfile, summarized by part of the code (``tiering.profiling``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.machinery
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # vllm_harness
sys.path.insert(0, str(HERE.parent))  # benchmarks (not a package of the install)

# where each package of a checkout lives (pyproject's package-dir)
_PACKAGES = {"tiering": "tiering", "tiering.backends": "backends", "tiering.policies": "policies"}


class _CheckoutFinder:
    """Imports ``tiering`` and its two mapped packages from another checkout (the baseline)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, name: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        for pkg in sorted(_PACKAGES, key=len, reverse=True):  # tiering.backends before tiering
            if name != pkg and not name.startswith(pkg + "."):
                continue
            rel = name[len(pkg):].lstrip(".").replace(".", "/")
            base = self.root / _PACKAGES[pkg] / rel if rel else self.root / _PACKAGES[pkg]
            if (base / "__init__.py").is_file():
                return importlib.util.spec_from_file_location(
                    name, base / "__init__.py", submodule_search_locations=[str(base)])
            if base.with_suffix(".py").is_file():
                return importlib.util.spec_from_file_location(name, base.with_suffix(".py"))
            return None
        return None


def extra_for(config: str, cpu_bytes: int, chunk_tokens: int, block_tokens: int,
              sync_load_bytes: int = 0) -> dict | None:
    if config == "none":
        return None
    extra: dict = {"cpu_bytes_to_use": cpu_bytes}
    if sync_load_bytes:
        extra["sync_load_budget_bytes"] = sync_load_bytes
    if chunk_tokens != block_tokens:
        extra["block_size"] = chunk_tokens
    if config == "cpu":
        extra["spec_name"] = "CPUOffloadingSpec"
    else:
        name, _, cap = config.partition("@")
        if name not in ("ours", "ours-sched"):
            raise SystemExit(f"unknown config {config!r}: none, cpu, ours, ours-sched or ours@K")
        extra.update(spec_name="TieredOffloadingSpec", spec_module_path="tiering.vllm",
                     tiers=[{"medium": "cpu", "policy": "lru"}])
        if cap:
            extra["max_loading_requests"] = int(cap)
    return extra


# the benches' model: KV bytes a token (layers x kv heads x head dim x (K, V) x float32)
BENCH_KV_BYTES_PER_TOKEN = 2 * 2 * 64 * 2 * 4


def bench_model(tmp: Path) -> str:
    """The small model these scheduler benches run (its KV: BENCH_KV_BYTES_PER_TOKEN)."""
    from benchmarks.tiny_model import build

    return str(build(tmp / "model", layers=2, hidden=128, heads=2, kv_heads=2,
                     intermediate=256, max_pos=4096))


def measure(a: argparse.Namespace) -> dict[str, dict]:
    """Every config's hit batches in this process: {config: {wall, cpu, blocks, steps}}."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-load-"))
    os.environ.setdefault("TIERING_SHM_DIR", str(tmp / "shm"))
    import random

    from vllm_harness import Harness

    from tiering import profiling

    model, kvb = bench_model(tmp), BENCH_KV_BYTES_PER_TOKEN
    n, tokens = a.prompts, a.tokens
    rng = random.Random(5)
    prompts = [[rng.randrange(4, 500) for _ in range(tokens)] for _ in range(n)]
    fresh = [[[rng.randrange(4, 500) for _ in range(tokens)] for _ in range(n)]
             for _ in range(a.repeat + 1)] if a.miss else []
    configs = [c for c in a.configs.split(",") if c]
    harnesses = {}
    for config in configs:  # rows are never written (no worker): the region stays sparse
        cpu_bytes = int(n * tokens * kvb * 1.5) + (64 << 20)
        sched = None
        if config.partition("@")[0] == "ours-sched":  # vLLM's scheduler with the linear sum
            from tiering.vllm.scheduler import TieringSyncScheduler as sched
        h = Harness(model, extra_for(config, cpu_bytes, a.chunk_tokens, 16,
                                     int(a.sync_load_mib * 2**20)),
                    gpu_tokens=n * (tokens + 32) + 4096, delay=1, max_len=tokens + 64,
                    batched_tokens=16384, max_num_seqs=1024, prefix_caching=False,
                    scheduler_cls=sched)
        assert h.block_size == 16, f"GPU block size {h.block_size}: run with CUDA vLLM 0.33"
        for i, p in enumerate(prompts):  # the fill batch stores every prompt
            h.add(f"fill-{i}", p, max_tokens=1)
        h.run(max_steps=100_000)
        harnesses[config] = h
    runs: dict[str, dict[str, list[float]]] = {
        c: {"wall": [], "cpu": [], "blocks": [], "steps": []} for c in configs}
    for rep in range(a.repeat + (1 if a.profile else 0)):
        prof = rep == a.repeat  # one more batch under the profiler
        for config in configs:
            h = harnesses[config]
            h.cached.clear()
            batch = prompts
            if a.miss:  # the same fresh prompts for every config in a round
                batch = fresh[rep]
            for i, p in enumerate(batch):
                h.add(f"hit{rep}-{i}", p, max_tokens=1)
            gc.collect()
            if prof:
                path = Path(a.profile) / f"bench_load_path_{config}_{a.chunk_tokens}.pstats"
                path.parent.mkdir(parents=True, exist_ok=True)
                profiling.start_profile(None, str(path))
            step0 = h.step_no
            t0, c0 = time.perf_counter(), time.process_time()
            h.run(max_steps=100_000)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            # --miss: the blocks of the batch's full chunks (what the connector stores)
            chunk = a.chunk_tokens
            blocks = (n * (tokens // chunk) * (chunk // 16) if a.miss
                      else sum(h.cached.values()) / 16)
            if prof:
                profiling.stop_profile(None, str(path))
                text = profiling.summarize(str(path), blocks=max(blocks, 1.0))
                path.with_suffix(".txt").write_text(text + "\n")
                print(f"== {config}\n" + text.split("\ntop ")[0])
                continue
            r = runs[config]
            r["wall"].append(wall)
            r["cpu"].append(cpu)
            r["blocks"].append(blocks)
            r["steps"].append(h.step_no - step0)
    for h in harnesses.values():
        if h.manager is not None:
            h.manager.shutdown()
    return runs


def report(label: str, runs: dict[str, dict[str, list[float]]]) -> None:
    """Median [min-max] of µs per loaded block, wall and CPU, raw and above ``none``."""
    base = runs.get("none")
    print(f"{'tree':<9} {'config':<8} {'runs':>4} {'steps':>5} {'blocks':>6} "
          f"{'wall us/block':>20} {'cpu us/block':>20} {'wall above none':>20}")

    def per(xs: list[float], blocks: float) -> list[float]:
        return [1e6 * x / blocks for x in xs]

    def fmt(xs: list[float]) -> str:
        return f"{statistics.median(xs):6.1f} [{min(xs):5.1f}-{max(xs):5.1f}]"

    for config, r in runs.items():
        blocks = statistics.median(r["blocks"])
        steps = statistics.median(r["steps"])
        if not blocks:
            print(f"{label:<9} {config:<8} {len(r['wall']):>4} {steps:5.0f} {0:6.0f} "
                  f"{'(no loads) batch ' + format(statistics.median(r['wall']), '.3f') + ' s':>20}")
            continue
        above = ""
        if base is not None and base["wall"]:
            b = statistics.median(base["wall"])
            above = fmt(per([w - b for w in r["wall"]], blocks))
        print(f"{label:<9} {config:<8} {len(r['wall']):>4} {steps:5.0f} {blocks:6.0f} "
              f"{fmt(per(r['wall'], blocks)):>20} {fmt(per(r['cpu'], blocks)):>20} {above:>20}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--chunk-tokens", type=int, default=16)
    ap.add_argument("--configs", default="none,cpu,ours")
    ap.add_argument("--repeat", type=int, default=3, help="hit batches timed per config")
    ap.add_argument("--sync-load-mib", type=float, default=0.0,
                    help="vLLM's sync_load_budget_bytes (MiB of loads a step that run before "
                         "the step's forward pass instead of asynchronously; 0: off)")
    ap.add_argument("--profile", default="", help="folder for the profiles of the hit batch")
    ap.add_argument("--baseline", default="", help="a checkout of the old code to compare")
    ap.add_argument("--baseline-configs", default="none,cpu,ours")
    ap.add_argument("--rounds", type=int, default=3, help="processes per tree (--baseline)")
    ap.add_argument("--miss", action="store_true",
                    help="time batches of new prompts (the sweep's 0%%: stores) instead of hits")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # child process
    a = ap.parse_args()
    root = os.environ.get("BENCH_TIERING_ROOT")
    if root:  # a child measuring the baseline's code
        sys.meta_path.insert(0, _CheckoutFinder(Path(root)))
    if a.baseline:
        compare(a)
        return
    print(f"{a.prompts} prompts x {a.tokens} tokens, {a.chunk_tokens}-token chunks; "
          f"{a.repeat} hit batches per config, alternating")
    runs = measure(a)
    if a.json:
        print("JSON " + json.dumps(runs))
    else:
        report("this", runs)


def compare(a: argparse.Namespace) -> None:
    """Old and new trees alternated, a fresh process each; every process's batches pooled."""
    trees = {"baseline": (Path(a.baseline).resolve(), a.baseline_configs),
             "this": (None, a.configs)}
    pooled: dict[str, dict[str, dict[str, list[float]]]] = {t: {} for t in trees}
    print(f"{a.prompts} prompts x {a.tokens} tokens, {a.chunk_tokens}-token chunks; "
          f"{a.rounds} rounds x {a.repeat} hit batches per config and tree")
    for rnd in range(a.rounds):
        for tree, (path, configs) in trees.items():
            env = dict(os.environ)
            env.pop("BENCH_TIERING_ROOT", None)
            if path is not None:
                env["BENCH_TIERING_ROOT"] = str(path)
            cmd = [sys.executable, __file__, "--json", "--prompts", str(a.prompts),
                   "--tokens", str(a.tokens), "--chunk-tokens", str(a.chunk_tokens),
                   "--configs", configs, "--repeat", str(a.repeat),
                   "--sync-load-mib", str(a.sync_load_mib)] + (["--miss"] if a.miss else [])
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("JSON ")]
            if out.returncode or not lines:
                sys.stderr.write(out.stderr[-4000:])
                raise SystemExit(f"{tree} round {rnd}: the measuring process failed")
            for config, r in json.loads(lines[-1][5:]).items():
                dst = pooled[tree].setdefault(config, {k: [] for k in r})
                for k, v in r.items():
                    dst[k].extend(v)
            print(f"round {rnd + 1}/{a.rounds}: {tree} done", flush=True)
    for tree, runs in pooled.items():
        report(tree, runs)


if __name__ == "__main__":
    main()
