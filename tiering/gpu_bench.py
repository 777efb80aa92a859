"""TTFT per cache phase and throughput over shared prefixes, for several offloading setups side
by side, on one GPU with real vLLM (``make gpu-bench``; docs/benchmarks.md shows the tables).

Setups (``--configs``): ``none`` (no offloading), ``cpu`` (vLLM's CPUOffloadingSpec),
``vtier-fs`` (vLLM's TieringOffloadingSpec with its ``fs`` tier), ``vtier-ours`` (vLLM's
TieringOffloadingSpec with our FileTier as secondary tier), ``ours`` (our TieredOffloadingSpec:
CPU tier + file tier, the file tier write-through: ``demote: on_store``), ``ours-wb`` (the same, the
file tier write-back: ``demote: on_evict``).

Phases per prompt length (``--phases``): ``cold`` (first sight), ``gpu`` (same prompt again:
GPU prefix cache), ``cpu`` (after ``reset_prefix_cache``: served from the CPU tier), ``disk``
(after filler prompts pushed it out of the CPU tier), ``restart`` (a new engine, fresh engine
process, same disk folder), ``recompute`` (the same prompt with ``skip_reading_prefix_cache``:
the work the caches save). ``throughput``: many concurrent requests over shared prefixes 3-5x
larger than a small GPU KV cache, once per CPU tier size (``--tp-cpu-fraction``: smaller than
the working set, so the disk matters, and larger, so it all fits in CPU memory).

Before the disk, restart and throughput measurements the benchmark waits until the tiers'
writes are done: until its engine processes' written bytes (``/proc/<pid>/io``) stop growing
and an ``os.sync()`` returned (``tiering.write_quiesce``; at most ``--settle-max-s``). The
time waited is in the timings.

Every phase's greedy token ids and sampled-token logprobs are compared with the cold run of the
no-offloading setup (``none`` must be among the configs). Where the prefix came from (GPU / CPU
/ disk tokens) is read from vLLM's ``vllm:prompt_tokens_cached_by_source`` counters.

The model is a Llama-shaped config with no tokenizer (prompts are token ids) whose weights are
drawn random-normal on the GPU from fixed seeds in every engine (``apply_model``): identical
weights in every process without writing a checkpoint, and outputs that vary (vLLM's dummy
weights repeat one token). Each engine runs in its own engine-core process (vLLM's default);
the engine-core process holds our spec's state, so a new ``LLM`` is an engine restart.

    python -m tiering.gpu_bench [--lengths 2048,8192,32768] [--configs none,ours] ...
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model's function
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONFIGS = ("none", "cpu", "vtier-fs", "vtier-ours", "ours", "ours-wb")
PHASES = ("cold", "gpu", "cpu", "recompute", "disk", "restart", "throughput")
SHAPES = {  # Llama-style shapes: layers, hidden, heads, kv heads, intermediate, vocab
    "8b": (32, 4096, 32, 8, 14336, 128256),    # Llama-3.1-8B
    "32b": (64, 5120, 40, 8, 27648, 128256),   # a 32B dense shape (Qwen2.5-32B-like widths)
    "small": (4, 1024, 8, 8, 2048, 32000),     # 64 KiB per-layer pages like 8b (GPU tests)
    "tiny": (2, 256, 4, 4, 512, 4096),         # for a CPU smoke run of this script
}
HAS_DISK = {"vtier-fs", "vtier-ours", "ours", "ours-wb"}


def _numbers(ap: argparse.ArgumentParser, option: str, text: str, kind: type) -> list:
    """A comma-separated list of positive numbers, or one clear error naming the option."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{option}: expected comma-separated positive numbers, got {text!r}")
    if not values or any(not v > 0 for v in values):
        ap.error(f"{option}: expected comma-separated positive numbers, got {text!r}")
    return values


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, of {', '.join(CONFIGS)} (default: all)")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--lengths", default="2048,8192,32768", help="prompt tokens, comma-separated")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cpu-gib", type=float, default=0.0,
                    help="CPU tier of the phase engines (0: 1.125 x the longest prompt's KV, "
                         "so that one prompt fits and the disk phase's fillers stay few)")
    ap.add_argument("--disk-gib", type=float, default=0.0,
                    help="file tier capacity (0: 1.5 x what the run stores, at least 1 GiB: "
                         "prompts and filler prompts, or the throughput working set; each "
                         "config's folder is removed after it ran)")
    ap.add_argument("--gpu-blocks", type=int, default=0,
                    help="GPU KV blocks of the phase engines (0: enough for the longest prompt)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--settle-max-s", type=float, default=120.0,
                    help="longest wait for the tiers' writes to finish before the disk, restart "
                         "and throughput measurements (then it logs and goes on; the waits "
                         "between other phases get at most 30 s)")
    ap.add_argument("--disk-gbps", type=float, default=None,
                    help="ignored (older command lines): the writes are now waited for")
    ap.add_argument("--tp-prefixes", type=int, default=8, help="throughput: shared prefixes")
    ap.add_argument("--tp-prefix-tokens", type=int, default=4096)
    ap.add_argument("--tp-requests", type=int, default=32,
                    help="throughput: requests, all submitted at once")
    ap.add_argument("--tp-gpu-factor", type=float, default=4.0,
                    help="throughput: working set / GPU KV cache")
    ap.add_argument("--tp-cpu-fraction", default="0.5,2",
                    help="throughput: CPU tier / working set, comma-separated: one throughput "
                         "run per value and config (below 1 the disk matters)")
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--gpu-copy", default="auto", help="ours: gpu_copy (auto, dma, staged, direct)")
    ap.add_argument("--promote", default="auto",
                    help="ours: the CPU tier's promote setting (default auto: the promotion "
                         "advisor decides each disk run; always: every disk hit is loaded)")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="skip the steps (a config's phases or throughput run) that would end "
                         "after this many seconds, judged by the longest such step so far "
                         "(0: no limit)")
    ap.add_argument("--scratch", default=os.environ.get(
        "TIERING_BENCH_DIR", os.path.join(tempfile.gettempdir(), "tiering-gpu-bench")),
        help="model folder and file tiers (removed and made again)")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--cpu-platform", action="store_true",
                    help="vLLM's CPU platform (a smoke run of this script without a GPU)")
    a = ap.parse_args()
    a.configs = [c for c in a.configs.split(",") if c]
    a.phases = [p for p in a.phases.split(",") if p]
    a.lengths = _numbers(ap, "--lengths", a.lengths, int)
    a.tp_cpu_fraction = _numbers(ap, "--tp-cpu-fraction", a.tp_cpu_fraction, float)
    bad = sorted(set(a.configs) - set(CONFIGS)) + sorted(set(a.phases) - set(PHASES))
    if bad:
        ap.error(f"unknown config/phase {bad}; configs {CONFIGS}, phases {PHASES}")
    return a


def write_model(folder: Path, shape: str, max_pos: int) -> Path:
    layers, hidden, heads, kv_heads, inter, vocab = SHAPES[shape]
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "head_dim": hidden // heads, "max_position_embeddings": max_pos,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": vocab,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
           "eos_token_id": 2, "attention_bias": False, "mlp_bias": False}
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder


def kv_bytes_per_token(shape: str, dtype: str) -> int:
    layers, hidden, heads, kv_heads, _, _ = SHAPES[shape]
    return 2 * layers * kv_heads * (hidden // heads) * (4 if dtype == "float32" else 2)


def shape_sizes(shape: str, dtype: str) -> dict[str, int]:
    """Parameters and bytes of a shape as ``write_model`` describes it to vLLM's Llama:
    untied embedding and output projection, per layer q/k/v/o, gate/up/down, two norms."""
    layers, hidden, heads, kv_heads, inter, vocab = SHAPES[shape]
    head_dim = hidden // heads
    per_layer = (hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
                 + heads * head_dim * hidden + 3 * hidden * inter + 2 * hidden)
    params = layers * per_layer + 2 * vocab * hidden + hidden
    width = 4 if dtype == "float32" else 2
    return {"params": params, "weight_bytes": params * width,
            "kv_bytes_per_token": kv_bytes_per_token(shape, dtype)}


def fillers(cpu_bytes: int, length: int, kvb: int) -> int:
    """Filler prompts of ``length`` tokens that together store a quarter more than the CPU
    tier holds: after them, nothing stored before is left in it."""
    return int(cpu_bytes * 1.25 // (length * kvb)) + 1


def auto_cpu_bytes(lengths: list[int], kvb: int) -> int:
    """The phase engines' CPU tier when ``--cpu-gib`` is 0: the longest prompt's KV and an
    eighth more (a prompt's cpu phase comes right after its cold run, so one prompt must fit;
    a small tier keeps the disk phase's filler prompts few)."""
    return int(max(lengths) * kvb * 1.125)


def randomize_weights(model) -> int:
    """Random-normal weights from fixed seeds (norm weights 1): the same in every engine.

    The output projection gets std 4/sqrt(hidden), so logits spread over ~4 units and the
    greedy choice is not a near-tie: with std 0.02 there too, the next-token distribution is
    almost flat and bf16 rounding differences between a full prefill and a cache hit (other
    matrix shapes, same KV) flip tokens, which would hide whether the KV itself was right."""
    import torch

    n = 0
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(model.named_parameters(), key=lambda x: x[0])):
            g = torch.Generator(device=p.device)
            g.manual_seed(12345 + i)
            if p.dim() == 1:
                p.fill_(1.0)
            elif "lm_head" in name:
                p.normal_(0.0, 4.0 / p.shape[-1] ** 0.5, generator=g)
            else:
                p.normal_(0.0, 0.02, generator=g)
            n += p.numel()
    return n


def transfer_config(name: str, scratch: Path, cpu_bytes: int, disk_gib: float,
                    gpu_copy: str = "auto", promote: str | None = None) -> dict | None:
    if name == "none":
        return None
    disk = scratch / name
    extra: dict = {"cpu_bytes_to_use": cpu_bytes}
    if name == "cpu":
        extra["spec_name"] = "CPUOffloadingSpec"
    elif name == "vtier-fs":
        extra.update(spec_name="TieringOffloadingSpec",
                     secondary_tiers=[{"type": "fs", "root_dir": str(disk)}])
    elif name == "vtier-ours":
        extra.update(spec_name="TieringOffloadingSpec",
                     secondary_tiers=[{"type": "FileTier", "module_path": "tiering.vllm",
                                       "path": str(disk), "capacity": f"{disk_gib:.3f}GiB",
                                       "policy": "lru", "io": "posix"}])
    else:  # ours, ours-wb: the file tier write-through (vLLM's default) or write-back
        file_tier = {"medium": "file", "path": str(disk), "capacity": f"{disk_gib:.3f}GiB",
                     "policy": "lru", "io": "posix"}
        if name == "ours-wb":
            file_tier["demote"] = "on_evict"
        extra.update(spec_name="TieredOffloadingSpec", spec_module_path="tiering.vllm",
                     gpu_copy=gpu_copy,
                     tiers=[{"medium": "cpu", "policy": "lru",
                             **({"promote": promote} if promote else {})}, file_tier])
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


class Engine:
    """One ``LLM`` (its own engine-core process) and the phase measurements taken on it."""

    def __init__(self, a, model: Path, config: str, kvt: dict | None, gpu_blocks: int,
                 max_len: int, warm_tokens: int | list[int] = 64, max_num_seqs: int = 64) -> None:
        from vllm import LLM

        self.settle_max_s = getattr(a, "settle_max_s", 120.0)
        kw = dict(model=str(model), skip_tokenizer_init=True, load_format="dummy",
                  dtype=a.dtype, enforce_eager=True, seed=0, max_model_len=max_len,
                  enable_prefix_caching=True, prefix_caching_hash_algo="sha256",
                  disable_log_stats=False, num_gpu_blocks_override=gpu_blocks,
                  max_num_seqs=max_num_seqs)
        if not a.cpu_platform:
            kw.update(attention_backend="TRITON_ATTN", gpu_memory_utilization=a.gpu_mem,
                      compilation_config={"custom_ops": ["none"]})
        if kvt is not None:
            kw["kv_transfer_config"] = kvt
        t = time.perf_counter()
        self.llm = LLM(**kw)
        self.config = config
        self.init_s = time.perf_counter() - t
        # by reference to this module (run as __main__, the function would not pickle to the
        # engine's worker processes)
        from tiering.gpu_bench import randomize_weights as by_reference

        t = time.perf_counter()
        self.llm.apply_model(by_reference)
        self.weights_s = time.perf_counter() - t
        self.warm_up(warm_tokens)

    def warm_up(self, n_tokens: int | list[int]) -> None:
        """Build the kernels before anything is timed: a short prompt and one of each measured
        length (tokens no measured prompt uses)."""
        from vllm import SamplingParams

        # the same sampling settings as the measured requests (logprobs: its first use is slow)
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False,
                            logprobs=1)
        lengths = n_tokens if isinstance(n_tokens, list) else [n_tokens]
        for n in sorted({64, *(max(64, x) for x in lengths)}):
            self.llm.generate([{"prompt_token_ids": [50 + (i + n) % 45 for i in range(n)]}], sp,
                              use_tqdm=False)
        self.settle()

    def counters(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for m in self.llm.get_metrics():
            if not hasattr(m, "value") or not isinstance(m.value, (int, float)):
                continue
            name = m.name + (f"[{m.labels['source']}]" if "source" in m.labels else "")
            out[name] = out.get(name, 0.0) + float(m.value)
        return out

    def generate(self, prompts: list[list[int]], max_tokens: int, skip_cache: bool = False):
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=1, detokenize=False,
                            skip_reading_prefix_cache=True if skip_cache else None)
        before = self.counters()
        t = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        wall = time.perf_counter() - t
        time.sleep(0.2)  # let the last stats reach the frontend's counters
        after = self.counters()
        src = {s: after.get(f"vllm:prompt_tokens_cached_by_source[{s}]", 0.0)
               - before.get(f"vllm:prompt_tokens_cached_by_source[{s}]", 0.0)
               for s in ("device", "host", "disk")}
        res = []
        for o in outs:
            c = o.outputs[0]
            lat = getattr(o.metrics, "first_token_latency", 0.0) if o.metrics else 0.0
            # logprob of the token actually sampled, step by step
            lps = [float(d[t].logprob) if d and t in d else None
                   for d, t in zip(c.logprobs or [], c.token_ids, strict=False)]
            res.append({"ttft_s": lat if lat and lat > 0 else None,
                        "cached_tokens": o.num_cached_tokens, "token_ids": list(c.token_ids),
                        "logprobs": lps})
        return wall, src, res

    def settle(self, seconds: float = 0.5, sync: bool = False) -> dict:
        """Let async stores finish, then drop the GPU prefix cache (vLLM refuses while blocks
        are still pinned by transfers: retry).

        Waits at least ``seconds`` (GPU->CPU copies: no write shows them) and until this
        process and its children (vLLM's engine core, its workers) stopped writing; with
        ``sync``, also until an ``os.sync()`` returned and the writes stayed quiet after it
        (a file tier's group commit sits in ``fdatasync`` without writing). Returns what the
        wait saw (seconds, bytes written meanwhile, whether it settled before the bound)."""
        from tiering.write_quiesce import wait_for_quiet_writes

        # a wait between phases gets at most 30 s: a writer that never stops (none is known)
        # costs minutes only at the few synced waits
        bound = self.settle_max_s if sync else min(self.settle_max_s, 30.0)
        got = wait_for_quiet_writes(min_s=seconds, max_s=max(seconds, bound), sync=sync)
        if not got.quiet:
            print(f"[bench] {self.config}: writes still running after {got.waited_s:.0f}s "
                  f"(--settle-max-s): measuring anyway", flush=True)
        for _ in range(50):
            if self.llm.reset_prefix_cache():
                break
            time.sleep(0.1)
        else:
            print(f"[bench] {self.config}: reset_prefix_cache kept failing", flush=True)
        return {"waited_s": round(got.waited_s, 3), "written_bytes": got.written_bytes,
                "settled": got.quiet, "unreadable_processes": got.unreadable}

    def close(self) -> None:
        import threading

        core = self.llm.llm_engine.engine_core

        def stop():
            try:
                core.shutdown()
            except Exception:  # noqa: BLE001
                pass
        th = threading.Thread(target=stop, daemon=True)
        th.start()
        th.join(60)
        self.llm = None
        gc.collect()
        time.sleep(1.0)


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(100, vocab - 300) for _ in range(n)]


def record(rows, a, engine, config, length, phase, prompts, skip_cache=False, extra=None):
    wall, src, res = engine.generate(prompts, a.max_tokens, skip_cache)
    r = res[0]
    row = {"config": config, "length": length, "phase": phase, "wall_s": wall,
           "ttft_s": r["ttft_s"] if r["ttft_s"] is not None else wall,
           "cached_tokens": r["cached_tokens"], "from_gpu": src["device"],
           "from_cpu": src["host"], "from_disk": src["disk"], "token_ids": r["token_ids"],
           "logprobs": r["logprobs"], **(extra or {})}
    rows.append(row)
    print(f"[bench] {config:<10} {length:>6} {phase:<9} ttft {row['ttft_s'] * 1000:8.1f} ms  "
          f"cached {row['cached_tokens']:>6} (gpu {src['device']:.0f} cpu {src['host']:.0f} "
          f"disk {src['disk']:.0f})", flush=True)
    return row


def phases_for(a, model, config, scratch, rows, lengths_prompts, kvb, max_len, gpu_blocks,
               cpu_bytes):
    """Phase engine (+ restart engine) of one config."""
    n_fill = fillers(cpu_bytes, max(a.lengths), kvb)
    stored = (sum(a.lengths) + n_fill * max(a.lengths)) * kvb
    kvt = transfer_config(config, scratch, cpu_bytes, a.disk_gib or max(1.0, 1.5 * stored / 2**30),
                          a.gpu_copy, a.promote)
    timings: dict = {}
    warm = list(a.lengths)
    eng = Engine(a, model, config, kvt, gpu_blocks, max_len, warm)
    timings["init_s"], timings["weights_s"] = eng.init_s, eng.weights_s
    try:
        for length, p in lengths_prompts:
            if "cold" in a.phases:
                record(rows, a, eng, config, length, "cold", [p])
            if "gpu" in a.phases:
                record(rows, a, eng, config, length, "gpu", [p])
            if "cpu" in a.phases:
                eng.settle(0.5 + length * kvb / 20e9)
                record(rows, a, eng, config, length, "cpu", [p])
            if "recompute" in a.phases:
                record(rows, a, eng, config, length, "recompute", [p], skip_cache=True)
        if "disk" in a.phases and config != "none":
            # filler prompts, together larger than the CPU tier, push everything out of it
            per = max(a.lengths)
            eng.settle()
            t = time.perf_counter()
            for i in range(n_fill):
                eng.generate([prompt(900 + i, per, SHAPES[a.shape][5])], 1)
            timings["filler_s"] = time.perf_counter() - t
            timings["filler_tokens"] = n_fill * per
            # every config waits (vLLM's CPU tier writes nothing, and the wait says so)
            timings["settle_disk"] = eng.settle(1.0, sync=True)
            for length, p in lengths_prompts:
                eng.settle(0.2)
                record(rows, a, eng, config, length, "disk", [p])
        if "restart" in a.phases and config in HAS_DISK:
            timings["settle_restart"] = eng.settle(1.0, sync=True)
    finally:
        eng.close()
    if "restart" in a.phases and config in HAS_DISK:
        eng = Engine(a, model, config, kvt, gpu_blocks, max_len, warm)
        timings["restart_init_s"] = eng.init_s
        try:
            for length, p in lengths_prompts:
                eng.settle(0.2)
                record(rows, a, eng, config, length, "restart", [p])
        finally:
            eng.close()
    return timings


def throughput_for(a, model, config, scratch, kvb, block_size, cpu_fraction):
    """Concurrent requests over shared prefixes larger than a small GPU cache, with a CPU tier
    of ``cpu_fraction`` x the working set (None for ``none``: no CPU tier)."""
    import random

    ws_tokens = a.tp_prefixes * a.tp_prefix_tokens
    max_len = a.tp_prefix_tokens + 64 + a.max_tokens
    # a GPU cache of working set / factor, but never too small for one request
    gpu_blocks = max(16, int(ws_tokens / a.tp_gpu_factor) // block_size,
                     -(-max_len // block_size) + 1)
    gpu_tokens = gpu_blocks * block_size
    cpu_bytes = int(ws_tokens * kvb * (cpu_fraction or 0))
    kvt = transfer_config(config, scratch / "tp", cpu_bytes,
                          a.disk_gib or max(1.0, 1.5 * ws_tokens * kvb / 2**30), a.gpu_copy, a.promote)
    vocab = SHAPES[a.shape][5]
    prefixes = [prompt(5000 + i, a.tp_prefix_tokens, vocab) for i in range(a.tp_prefixes)]
    r = random.Random(7)
    order = [i % a.tp_prefixes for i in range(a.tp_requests)]
    r.shuffle(order)
    reqs = [prefixes[i] + prompt(7000 + k, 32, vocab) for k, i in enumerate(order)]
    print(f"[bench] throughput {config} CPU tier {cpu_fraction or 0:g} x working set: "
          f"{len(reqs)} concurrent requests over {a.tp_prefixes} prefixes of "
          f"{a.tp_prefix_tokens} tokens = {ws_tokens} tokens, {ws_tokens / gpu_tokens:.1f}x the "
          f"GPU KV cache ({gpu_tokens} tokens); CPU tier {cpu_bytes / 2**30:.2f} GiB of "
          f"{ws_tokens * kvb / 2**30:.2f} GiB", flush=True)
    eng = Engine(a, model, config, kvt, gpu_blocks, max_len, a.tp_prefix_tokens,
                 max_num_seqs=max(64, len(reqs)))
    try:
        # populate: each prefix once (stores to the tiers), then wait for the writes
        eng.generate([p + prompt(6000 + i, 32, vocab) for i, p in enumerate(prefixes)], 1)
        settle = eng.settle(1.0, sync=True)
        # all requests in one call: vLLM schedules them together, as many as the GPU cache
        # and max_num_seqs admit
        wall, src, res = eng.generate(reqs, a.max_tokens)
    finally:
        eng.close()
    ttfts = sorted(x["ttft_s"] for x in res if x["ttft_s"] is not None)
    p99 = ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))] if ttfts else None
    row = {"config": config, "cpu_fraction": cpu_fraction, "requests": len(reqs),
           "wall_s": wall, "requests_per_s": len(reqs) / wall,
           "ttft_mean_s": statistics.mean(ttfts) if ttfts else None, "ttft_p99_s": p99,
           "gpu_kv_tokens": gpu_tokens, "working_set_tokens": ws_tokens,
           "working_set_bytes": ws_tokens * kvb, "cpu_tier_bytes": cpu_bytes,
           "from_gpu": src["device"], "from_cpu": src["host"], "from_disk": src["disk"],
           "settle": settle, "init_s": eng.init_s,
           "token_ids": [x["token_ids"] for x in res]}
    print(f"[bench] throughput {config:<10} cpu {cpu_fraction or 0:g}x "
          f"{row['requests_per_s']:6.2f} req/s  mean TTFT "
          f"{(row['ttft_mean_s'] or 0) * 1000:8.1f} ms  p99 {(p99 or 0) * 1000:8.1f} ms  "
          f"(gpu {src['device']:.0f} cpu {src['host']:.0f} disk {src['disk']:.0f} tokens; "
          f"waited {settle['waited_s']:.1f}s for {settle['written_bytes'] / 2**20:.0f} MiB of "
          f"writes)", flush=True)
    return row


def compare(rows: list[dict], tp_rows: list[dict]) -> None:
    """Check each row's greedy outputs (token ids and the sampled tokens' logprobs).

    * ``same_tokens``/``max_logprob_diff``: against the no-offloading cold run of that length.
    * ``exact_vs_gpu_hit``: for a prefix served from CPU, disk or after a restart, bitwise
      equality (tokens and logprobs) with the same engine's GPU prefix-cache hit. That hit
      recomputes the same number of tokens, so any difference is in the KV bytes. (A hit and
      a full prefill multiply matrices of other shapes, so their bf16 roundings differ a
      little; vLLM without offloading shows that too: compare its ``gpu`` row with ``cold``.)
    """
    ref = {r["length"]: r for r in rows if r["config"] == "none" and r["phase"] == "cold"}
    gpu_hit = {(r["config"], r["length"]): r for r in rows if r["phase"] == "gpu"}
    for r in rows:
        base = ref.get(r["length"])
        if base is None:
            r["same_tokens"] = r["max_logprob_diff"] = None
        else:
            r["same_tokens"] = r["token_ids"] == base["token_ids"]
            diffs = [abs(x - y) for x, y in zip(r["logprobs"], base["logprobs"], strict=False)
                     if x is not None and y is not None]
            r["max_logprob_diff"] = max(diffs) if diffs else None
        hit = gpu_hit.get((r["config"], r["length"]))
        r["exact_vs_gpu_hit"] = (None if hit is None or r["phase"] not in ("cpu", "disk", "restart")
                                 or r["config"] == "none" else
                                 r["token_ids"] == hit["token_ids"]
                                 and r["logprobs"] == hit["logprobs"])
    tp_ref = next((t for t in tp_rows if t["config"] == "none"), None)
    for t in tp_rows:
        if tp_ref is None:
            t["same_tokens_fraction"] = None
            continue
        same = sum(x == y for x, y in zip(t["token_ids"], tp_ref["token_ids"], strict=True))
        t["same_tokens_fraction"] = same / len(t["token_ids"])


def table(rows: list[dict], tp_rows: list[dict], configs: list[str]) -> str:
    lines = []
    phases = [p for p in PHASES if p != "throughput" and any(r["phase"] == p for r in rows)]
    lengths = sorted({r["length"] for r in rows})
    for length in lengths:
        lines.append(f"\nTTFT ms, {length} prompt tokens (source of the prefix: g=GPU c=CPU "
                     f"d=disk r=recompute; * = greedy tokens differ from no offloading's cold "
                     f"run; = : tokens and logprobs bitwise equal to this engine's GPU hit; "
                     f"! : they are not)")
        lines.append("| phase | " + " | ".join(configs) + " |")
        lines.append("|---|" + "---|" * len(configs))
        for ph in phases:
            cells = []
            for c in configs:
                r = next((x for x in rows if x["config"] == c and x["length"] == length
                          and x["phase"] == ph), None)
                if r is None:
                    cells.append("")
                    continue
                src = "".join(k for k, v in (("g", r["from_gpu"]), ("c", r["from_cpu"]),
                                             ("d", r["from_disk"])) if v > 0) or "r"
                part = ""
                hit = r["from_gpu"] + r["from_cpu"] + r["from_disk"]
                if src != "r" and hit < 0.9 * length:
                    part = f" {100 * hit / length:.0f}%"
                mark = "" if r.get("same_tokens") in (True, None) else " *"
                exact = r.get("exact_vs_gpu_hit")
                mark += "" if exact is None else (" =" if exact else " !")
                cells.append(f"{r['ttft_s'] * 1000:.0f} ({src}{part}){mark}")
            lines.append(f"| {ph} | " + " | ".join(cells) + " |")
    if tp_rows:
        t0 = tp_rows[0]
        lines.append(f"\nThroughput: {t0['requests']} concurrent requests over a working set of "
                     f"{t0['working_set_tokens']} prefix tokens = "
                     f"{t0['working_set_tokens'] / t0['gpu_kv_tokens']:.1f}x the GPU KV cache "
                     f"({t0['gpu_kv_tokens']} tokens); CPU tier = the given multiple of the "
                     f"working set (below 1x the disk matters)")
        lines.append("| CPU tier / working set | config | req/s | mean TTFT ms | p99 TTFT ms | "
                     "from GPU / CPU / disk tokens | same tokens |")
        lines.append("|---|---|---|---|---|---|---|")
        for t in sorted(tp_rows, key=lambda t: (t.get("cpu_fraction") or 0,
                                                configs.index(t["config"])
                                                if t["config"] in configs else 99)):
            same = t.get("same_tokens_fraction")
            frac = t.get("cpu_fraction")
            lines.append(f"| {'-' if not frac else f'{frac:g}x'} | {t['config']} | "
                         f"{t['requests_per_s']:.2f} | "
                         f"{(t['ttft_mean_s'] or 0) * 1000:.0f} | "
                         f"{(t['ttft_p99_s'] or 0) * 1000:.0f} | "
                         f"{t['from_gpu']:.0f} / {t['from_cpu']:.0f} / {t['from_disk']:.0f} | "
                         f"{'' if same is None else f'{100 * same:.0f}%'} |")
    return "\n".join(lines)


def plot(rows: list[dict], tp_rows: list[dict], configs: list[str], path: Path) -> None:
    """TTFT per phase, one panel per prompt length; then, with throughput rows, req/s and mean
    TTFT per CPU tier size (``none``, which has no CPU tier, in every group)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib missing: no plot", flush=True)
        return
    lengths = sorted({r["length"] for r in rows})
    phases = [p for p in PHASES if p != "throughput" and any(r["phase"] == p for r in rows)]
    panels = len(lengths) + (2 if tp_rows else 0)
    if not panels:
        return
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    width = 0.8 / max(1, len(configs))
    for ax, length in zip(axes[0], lengths, strict=False):
        for k, c in enumerate(configs):
            ys = []
            for ph in phases:
                r = next((x for x in rows if x["config"] == c and x["length"] == length
                          and x["phase"] == ph), None)
                ys.append(r["ttft_s"] * 1000 if r else 0)
            ax.bar([i + k * width for i in range(len(phases))], ys, width, label=c)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(phases))], phases, rotation=30)
        ax.set_title(f"{length} prompt tokens")
        ax.set_ylabel("TTFT ms")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    if tp_rows:
        fracs = sorted({t["cpu_fraction"] for t in tp_rows if t.get("cpu_fraction")}) or [None]
        t0 = tp_rows[0]
        ratio = t0["working_set_tokens"] / t0["gpu_kv_tokens"]
        for ax, (key, label, scale) in zip(
                axes[0][len(lengths):], (("requests_per_s", "requests/s", 1),
                                         ("ttft_mean_s", "mean TTFT ms", 1000)), strict=True):
            for k, c in enumerate(configs):
                ys = []
                for f in fracs:
                    t = next((t for t in tp_rows if t["config"] == c
                              and t.get("cpu_fraction") in (f, None)), None)
                    ys.append((t[key] or 0) * scale if t else 0)
                ax.bar([i + k * width for i in range(len(fracs))], ys, width, label=c)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(fracs))],
                          [f"CPU tier {f:g}x working set" if f else "-" for f in fracs])
            ax.set_title(f"throughput, working set {ratio:.1f}x the GPU KV cache", fontsize=9)
            ax.set_ylabel(label)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[bench] plot: {path}", flush=True)


def render(path: Path) -> None:
    """Recompute the checks, the table and the plot of a saved run (``--from-json``)."""
    d = json.loads(path.read_text())
    compare(d["phases"], d["throughput"])
    path.write_text(json.dumps(d, indent=1))
    text = table(d["phases"], d["throughput"], d["info"]["configs"])
    path.with_suffix(".md").write_text(text + "\n")
    plot(d["phases"], d["throughput"], d["info"]["configs"], path.with_suffix(".png"))
    print(text)


class StepBudget:
    """Which steps (a config's phases, one throughput run) still fit in ``--budget-s``.

    A step is expected to take as long as the longest step of its kind so far: its kind is what
    it runs and whether the config has a disk (a disk config's phases add the disk phase and an
    engine restart). With no step of its kind yet, a disk config's phases are expected to take
    twice the longest phases of a config without disk (8B on the H200: 95-100 s against 57 s),
    any other step as long as the longest of the same kind, or no time at all."""

    def __init__(self, budget_s: float, start: float, clock=time.perf_counter) -> None:
        self.budget_s, self.start, self.clock = budget_s, start, clock
        self.longest: dict[tuple[str, bool], float] = {}

    def spent(self) -> float:
        return self.clock() - self.start

    def estimate(self, what: str, config: str) -> float:
        disk = config in HAS_DISK
        if (what, disk) in self.longest:
            return self.longest[(what, disk)]
        other = self.longest.get((what, not disk), 0.0)
        return 2 * other if disk and what == "phases" else other

    def fits(self, what: str, config: str) -> bool:
        return not self.budget_s or self.spent() + self.estimate(what, config) <= self.budget_s

    def took(self, what: str, config: str, seconds: float) -> None:
        key = (what, config in HAS_DISK)
        self.longest[key] = max(self.longest.get(key, 0.0), seconds)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--from-json":
        render(Path(sys.argv[2]))
        return
    a = parse()
    t0 = time.perf_counter()
    if a.cpu_platform:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import vllm

    scratch = Path(a.scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    max_len = max(a.lengths) + 64 + a.max_tokens
    model = write_model(scratch / f"model-{a.shape}", a.shape, max(max_len, 4096) * 2)
    sizes = shape_sizes(a.shape, a.dtype)
    kvb = sizes["kv_bytes_per_token"]
    block_size = 128 if a.cpu_platform else 16
    gpu_blocks = a.gpu_blocks or -(-int(max_len * 1.25) // block_size)
    cpu_bytes = int(a.cpu_gib * 2**30) if a.cpu_gib else auto_cpu_bytes(a.lengths, kvb)
    vocab = SHAPES[a.shape][5]
    lengths_prompts = [(n, prompt(n, n, vocab)) for n in a.lengths]
    info = {"vllm": vllm.__version__, "shape": a.shape, "lengths": a.lengths,
            "configs": a.configs, "phases": a.phases, "kv_bytes_per_token": kvb,
            "params": sizes["params"], "weight_bytes": sizes["weight_bytes"],
            "cpu_gib": cpu_bytes / 2**30, "gpu_kv_tokens": gpu_blocks * block_size,
            "gpu_kv_bytes": gpu_blocks * block_size * kvb, "tp_cpu_fraction": a.tp_cpu_fraction,
            "max_tokens": a.max_tokens, "argv": sys.argv[1:]}
    print(f"[bench] {a.shape}: {sizes['params'] / 1e9:.2f}e9 parameters = "
          f"{sizes['weight_bytes'] / 2**30:.1f} GiB of weights, {kvb // 1024} KiB of KV per "
          f"token; phase engines: GPU KV cache {gpu_blocks * block_size} tokens = "
          f"{gpu_blocks * block_size * kvb / 2**30:.1f} GiB, CPU tier "
          f"{cpu_bytes / 2**30:.2f} GiB", flush=True)
    # no CUDA call in this process: vLLM then forks its engine processes instead of spawning
    # them (an engine start without re-importing vLLM)
    try:
        import subprocess

        import torch

        info["torch"] = torch.__version__
        info["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                                      "--format=csv,noheader"], capture_output=True,
                                     text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    print(f"[bench] {json.dumps(info)}", flush=True)
    rows: list[dict] = []
    tp_rows: list[dict] = []
    timings: dict[str, dict] = {}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_bench_{a.tag}_{a.shape}"

    def save() -> None:  # after every step: a run cut short still leaves its results
        info["total_s"] = time.perf_counter() - t0
        (out / f"{stem}.json").write_text(json.dumps(
            {"info": info, "timings": timings, "phases": rows, "throughput": tp_rows}, indent=1))
        (out / f"{stem}.md").write_text(table(rows, tp_rows, a.configs) + "\n")

    budget = StepBudget(a.budget_s, t0)

    def over_budget(what: str, config: str, key: str) -> bool:
        if budget.fits(what, config):
            return False
        print(f"[bench] {key}: {what} skipped (--budget-s {a.budget_s:.0f}: "
              f"{budget.spent():.0f}s spent, such a step is expected to take "
              f"{budget.estimate(what, config):.0f}s)", flush=True)
        timings.setdefault(key, {})[f"{what}_skipped"] = "budget"
        return True

    # all configs' phases first, then all configs' throughput runs (for each CPU tier size,
    # smallest first; `none` has no CPU tier: once): a budget cut loses whole steps
    steps: list[tuple[str, str, float | None]] = []
    if any(p in a.phases for p in PHASES if p != "throughput"):
        steps += [("phases", c, None) for c in a.configs]
    if "throughput" in a.phases:
        steps += [("throughput", "none", None)] if "none" in a.configs else []
        steps += [("throughput", c, f) for f in a.tp_cpu_fraction for c in a.configs
                  if c != "none"]
    for what, config, fraction in steps:
        key = config if fraction is None else f"{config}@{fraction:g}"
        if over_budget(what, config, key):
            continue
        t = time.perf_counter()
        try:
            if what == "phases":
                timings.setdefault(key, {}).update(phases_for(
                    a, model, config, scratch, rows, lengths_prompts, kvb, max_len, gpu_blocks,
                    cpu_bytes))
            else:
                tp_rows.append(throughput_for(a, model, config, scratch, kvb, block_size,
                                              fraction))
        except Exception as exc:  # report and go on with the next config
            import traceback

            traceback.print_exc()
            timings.setdefault(key, {})[f"{what}_error"] = f"{type(exc).__name__}: {exc}"[:1000]
        took = time.perf_counter() - t
        timings.setdefault(key, {})[f"{what}_wall_s"] = took
        budget.took(what, config, took)
        for d in (scratch / config, scratch / "tp" / config):
            shutil.rmtree(d, ignore_errors=True)
        print(f"[bench] {key} {what} done in {took:.0f}s", flush=True)
        compare(rows, tp_rows)
        save()
    compare(rows, tp_rows)
    save()
    text = table(rows, tp_rows, a.configs)
    (out / f"{stem}.md").write_text(text + "\n")
    plot(rows, tp_rows, a.configs, out / f"{stem}.png")
    print(text, flush=True)
    bad = [r for r in rows if r.get("same_tokens") is False]
    inexact = [r for r in rows if r.get("exact_vs_gpu_hit") is False]
    print(f"[bench] {len(rows)} phase rows: {len(bad)} with tokens different from no "
          f"offloading's cold run, {len(inexact)} tier hits not bitwise equal to the GPU hit; "
          f"total {info['total_s']:.0f}s; results in {out}/{stem}.*", flush=True)
    sys.stdout.flush()
    os._exit(0)  # do not hang on engine-core teardown


if __name__ == "__main__":
    main()
