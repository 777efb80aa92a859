"""TTFT per cache phase and throughput over shared prefixes, for several offloading setups side
by side, on one GPU with real vLLM (``make gpu-bench``; docs/benchmarks.md shows the tables).

Setups (``--configs``): ``none`` (no offloading), ``cpu`` (vLLM's CPUOffloadingSpec),
``vtier-fs`` (vLLM's TieringOffloadingSpec with its ``fs`` tier), ``vtier-ours`` (vLLM's
TieringOffloadingSpec with our FileTier as secondary tier), ``ours`` (our TieredOffloadingSpec:
CPU tier + file tier, the file tier write-through: ``demote: on_store``), ``ours-wb`` (the same, the
file tier write-back: ``demote: on_evict``). Named only, never in the default list: ``ours-fed``
(``ours`` with ``load_direct`` false: every load through the feeder thread, the A/B of a single
CPU hit's load enqueued by vLLM's worker thread).

Phases per prompt length (``--phases``): ``cold`` (first sight), ``gpu`` (same prompt again:
GPU prefix cache), ``cpu`` (after ``reset_prefix_cache``: served from the CPU tier), ``disk``
(after filler prompts pushed it out of the CPU tier), ``restart`` (a new engine, fresh engine
process, same disk folder), ``recompute`` (the same prompt with ``skip_reading_prefix_cache``:
the work the caches save). ``throughput``: many concurrent requests over shared prefixes 3-5x
larger than a small GPU KV cache, once per CPU tier size (``--tp-cpu-fraction``: smaller than
the working set, so the disk matters, and larger, so it all fits in CPU memory).

Before the disk, restart and throughput measurements the benchmark waits until the tiers'
writes are done: until its engine processes' written bytes (``/proc/<pid>/io``) stop growing
and an ``os.sync()`` returned (``benchmarks.write_quiesce``; at most ``--settle-max-s``). The
time waited is in the timings.

Every phase's greedy token ids and sampled-token logprobs are compared with the cold run of the
no-offloading setup (``none`` must be among the configs). Where the prefix came from (GPU / CPU
/ disk tokens) is read from vLLM's ``vllm:prompt_tokens_cached_by_source`` counters.

The model is a Llama-shaped config with no tokenizer (prompts are token ids) whose weights are
drawn random-normal on the GPU from fixed seeds in every engine (``apply_model``): identical
weights in every process without writing a checkpoint, and outputs that vary (vLLM's dummy
weights repeat one token). Each engine runs in its own engine-core process (vLLM's default);
the engine-core process holds our spec's state, so a new ``LLM`` is an engine restart.

    python -m benchmarks.gpu_bench [--lengths 2048,8192,32768] [--configs none,ours] ...
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiering.config import CONNECTOR_FIELDS

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model's function
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONFIGS = ("none", "cpu", "vtier-fs", "vtier-ours", "ours", "ours-wb")
# setups run only where --configs names them (A/Bs of one setting of ours)
EXTRA_CONFIGS = ("ours-fed",)
PHASES = ("cold", "gpu", "cpu", "recompute", "disk", "restart", "throughput")
# the warm-up prompts' lowest token (Engine.warm_up): the first engine's, and a restarted
# engine's under --restart-warmup fresh; both below the measured prompts' tokens (``prompt``)
WARM_BASE = 50
RESTART_WARM_BASE = 5

SHAPES = {  # Llama-style shapes: layers, hidden, heads, kv heads, intermediate, vocab
    "1b": (16, 2048, 32, 8, 8192, 128256),     # Llama-3.2-1B: 0.5 MiB of KV per 16 tokens
    "8b": (32, 4096, 32, 8, 14336, 128256),    # Llama-3.1-8B
    "32b": (64, 5120, 40, 8, 27648, 128256),   # a 32B dense shape (Qwen2.5-32B-like widths)
    "small": (4, 1024, 8, 8, 2048, 32000),     # 64 KiB per-layer pages like 8b (GPU tests)
    "tiny": (2, 256, 4, 4, 512, 4096),         # for a CPU smoke run of this script
}
HAS_DISK = {"vtier-fs", "vtier-ours", "ours", "ours-wb", "ours-fed"}


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
                    help=f"comma-separated, of {', '.join(CONFIGS + EXTRA_CONFIGS)} "
                         f"(default: {', '.join(CONFIGS)})")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--lengths", default="2048,8192,32768", help="prompt tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=1,
                    help="prompts per length, each of other tokens: every phase runs once per "
                         "prompt and the table gives the median and the range (one request a "
                         "cell spreads by tens of ms at 2k)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefix-hash-algo", default="sha256",
                    choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"),
                    help="vLLM's prefix_caching_hash_algo for every engine: vLLM hashes each "
                         "request's blocks on arrival, in its engine core's input thread, when "
                         "prefix caching is on or any KV connector is loaded")
    ap.add_argument("--cuda-graphs", default="eager", choices=sorted(CUDA_GRAPH_MODES),
                    help="how every engine of the run launches its forward passes: eager (each "
                         "kernel launched from Python, the runs recorded before 2026-12-07d), "
                         "decode (CUDA graphs for steps where every request computes one "
                         "token, the rest eager, no torch.compile: a hit's last-token step and "
                         "a 100%% batch's steps are such steps), compiled (vLLM's serving "
                         "default: torch.compile, full and piecewise graphs)")
    ap.add_argument("--cuda-graph-max-batch", type=int, default=0,
                    help="with --cuda-graphs decode or compiled: the largest batch captured "
                         "(vLLM's max_cudagraph_capture_size; 0: vLLM's default, 512). A 1B "
                         "100%% batch has steps of up to ~1000 one-token requests")
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
    ap.add_argument("--tp-rounds", type=int, default=1,
                    help="throughput: timed rounds of the requests per engine, each after the "
                         "tiers' writes settled and the GPU prefix cache was dropped; the row "
                         "gives the median round and every round's req/s (one round swung "
                         "+-15%% between calls)")
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--gpu-copy", default="auto", help="ours: gpu_copy (auto, dma, staged, direct)")
    ap.add_argument("--promote", default="auto",
                    help="ours: the CPU tier's promote setting (default auto: the promotion "
                         "advisor decides each disk run; always: every disk hit is loaded)")
    ap.add_argument("--kv-layout", default="", choices=("",) + KV_LAYOUTS,
                    help="vLLM's physical KV cache layout for every engine of the run "
                         "(VLLM_KV_CACHE_LAYOUT; default: what vLLM resolves, LBHNC under "
                         "the offloading connector). BLHNC keeps all layers of a block in one "
                         "run of memory: a 64-token chunk is then one copy per direction")
    ap.add_argument("--switch-ms", type=float, default=None,
                    help="our tiers' switch_interval_ms (default: the spec's; 0: Python's 5 ms)")
    ap.add_argument("--io-threads", type=int, default=None,
                    help="our file tiers' io_threads (default: the tier's, 16); vLLM's fs tier "
                         "keeps its own 16 + 16: an A/B of the read threads on one disk")
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
    ap.add_argument("--cprofile-phases", default="",
                    help="comma-separated phases (disk, restart, ...) whose requests at the "
                         "longest length run under cProfile in the engine core's step thread: "
                         "where a slow hit's steps go (a diagnostic run: those TTFTs include "
                         "the profiler's cost, and their rows say profiled); the stats and a "
                         "summary go into --out as phases_TAG_CONFIG_PHASE_LENGTH_R.profile.txt")
    ap.add_argument("--thread-cpu-phases", default="",
                    help="comma-separated phases whose requests record the CPU seconds of "
                         "every thread on the machine while they ran (benchmarks/thread_cpu.py; "
                         "read before and after the request): the busiest threads go into the "
                         "row (cpu_threads) and the log")
    ap.add_argument("--step-timing", choices=("forward", "outputs", "schedule_ends"), default=None,
                    help="ours: the CPU tier's step_timing, how the promotion advisor times "
                         "the engine's steps (default: the spec's)")
    ap.add_argument("--restart-warmup", choices=("fresh", "same"), default="fresh",
                    help="the restarted engine's warm-up prompts: fresh (tokens the first "
                         "engine never saw, so the warm-up computes in both engines) or same "
                         "(the first engine's, so the restarted engine's warm-up loads them "
                         "from the disk tier just before the measured requests: 4.5 GiB at "
                         "32k, 8B)")
    add_sweep_args(ap)
    a = ap.parse_args()
    a.configs = [c for c in a.configs.split(",") if c]
    a.phases = [p for p in a.phases.split(",") if p]
    a.cprofile_phases = [p for p in a.cprofile_phases.split(",") if p]
    a.thread_cpu_phases = [p for p in a.thread_cpu_phases.split(",") if p]
    # only the phases recorded request by request (``record``): not the throughput runs, not
    # the prefill sweep (its own --profile)
    recorded = [p for p in a.phases if p in PHASES and p != "throughput"]
    for opt, asked in (("--cprofile-phases", a.cprofile_phases),
                       ("--thread-cpu-phases", a.thread_cpu_phases)):
        if set(asked) - set(recorded):
            ap.error(f"{opt}: {sorted(set(asked) - set(recorded))} are not among the phases "
                     f"of --phases {a.phases} run request by request ({recorded})")
    a.lengths = _numbers(ap, "--lengths", a.lengths, int)
    if a.repeats < 1:
        ap.error(f"--repeats: expected at least 1, got {a.repeats}")
    if a.tp_rounds < 1:
        ap.error(f"--tp-rounds: expected at least 1, got {a.tp_rounds}")
    if a.io_threads is not None and not 1 <= a.io_threads <= 1024:
        ap.error(f"--io-threads: expected 1 to 1024 threads a file tier, got {a.io_threads}")
    a.tp_cpu_fraction = _numbers(ap, "--tp-cpu-fraction", a.tp_cpu_fraction, float)
    bad = (sorted(set(a.configs) - set(CONFIGS + EXTRA_CONFIGS))
           + sorted(set(a.phases) - set(PHASES) - {SWEEP_PHASE}))
    if SWEEP_PHASE in a.phases:
        check_sweep_args(ap, a)
    if bad:
        ap.error(f"unknown config/phase {bad}; configs {CONFIGS + EXTRA_CONFIGS}, "
                 f"phases {PHASES}")
    return a


SCRATCH_MARKER = ".tiering-gpu-bench-scratch"


def reset_scratch(scratch: Path) -> None:
    """Empty the scratch folder, only if this script made it (its marker file is there) or it
    is empty: never remove a folder someone pointed --scratch at by mistake."""
    if os.path.lexists(scratch):
        if scratch.is_symlink() or not scratch.is_dir():
            raise SystemExit(f"--scratch {scratch}: not a folder; refusing to use it")
        marker = scratch / SCRATCH_MARKER
        made_here = os.path.isfile(marker) and not os.path.islink(marker)
        if any(scratch.iterdir()) and not made_here:
            raise SystemExit(f"--scratch {scratch}: holds files and no {SCRATCH_MARKER} (not "
                             "made by this script); refusing to remove it, give an empty or "
                             "new folder")
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True, mode=0o700)
    (scratch / SCRATCH_MARKER).write_text("made by tiering.gpu_bench; removed by its next run\n")


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


def file_tier_gib(asked_gib: float, stored_bytes: int, scratch: Path) -> float:
    """The file tiers' capacity: ``--disk-gib`` if given, else 1.5x what the step stores (at
    least 1 GiB), but no more than 95% of what ``scratch``'s file system has free: our tier
    refuses a capacity its disk cannot hold (on the H100 of 2026-12-06h, three prompts a
    cell asked 35.6 GiB of a 26 GiB RAM disk and the engine did not start). SystemExit
    naming the folder if even what the step stores does not fit."""
    if asked_gib:
        return asked_gib
    from tiering.backends.file_config import nearest_existing

    want = max(float(1 << 30), 1.5 * stored_bytes)
    room = 0.95 * shutil.disk_usage(nearest_existing(scratch.resolve())).free
    if want <= room:
        return want / 2**30
    if 1.05 * stored_bytes > room:
        raise SystemExit(f"--scratch {scratch}: the step stores {stored_bytes / 2**30:.1f} GiB, "
                         f"its file system has {room / 0.95 / 2**30:.1f} GiB free; expected "
                         "at least 1.05x that (fewer --repeats or --lengths, or a larger disk)")
    return room / 2**30


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
    else:  # ours, ours-wb, ours-fed: the file tier write-through (vLLM's default) or write-back
        file_tier = {"medium": "file", "path": str(disk), "capacity": f"{disk_gib:.3f}GiB",
                     "policy": "lru", "io": "posix"}
        if name == "ours-wb":
            file_tier["demote"] = "on_evict"
        if name == "ours-fed":
            extra["load_direct"] = False
        extra.update(spec_name="TieredOffloadingSpec", spec_module_path="tiering.vllm",
                     gpu_copy=gpu_copy,
                     tiers=[{"medium": "cpu", "policy": "lru",
                             **({"promote": promote} if promote else {})}, file_tier])
        return {**CONNECTOR_FIELDS, "kv_connector_extra_config": extra}
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


def with_step_timing(kvt: dict | None, timing: str | None) -> dict | None:
    """``kvt`` with our CPU tier's ``step_timing`` set (None: the spec's default); configs
    without our spec are left as they are."""
    if kvt is None or timing is None:
        return kvt
    extra = kvt["kv_connector_extra_config"]
    if extra.get("spec_module_path") == "tiering.vllm":
        extra["tiers"][0]["step_timing"] = timing
    return kvt


def with_switch_interval(kvt: dict | None, ms: float | None) -> dict | None:
    """``kvt`` with our tiers' ``switch_interval_ms`` set to ``ms`` (None: the spec's default),
    for an A/B of the engine process's switch interval (tiering.switch_interval); configs
    without our tiers are left as they are."""
    if kvt is None or ms is None:
        return kvt
    extra = kvt["kv_connector_extra_config"]
    if extra.get("spec_module_path") == "tiering.vllm":
        extra["switch_interval_ms"] = ms
    for tier in extra.get("secondary_tiers", []):
        if tier.get("module_path") == "tiering.vllm":
            tier["switch_interval_ms"] = ms
    return kvt


# --cuda-graphs: what each mode sets on vLLM's engine (enforce_eager, compilation_config). Our
# connector adds no per-layer hooks (vLLM's OffloadingConnector keeps full graphs), so full CUDA
# graphs apply with it as without it. custom_ops "none" because the carried vLLM runs its
# layers' PyTorch versions (docs/gpu.md); torch.compile fuses those anyway.
CUDA_GRAPH_MODES: dict[str, dict] = {
    "eager": {"enforce_eager": True, "compilation_config": {"custom_ops": ["none"]}},
    "decode": {"enforce_eager": False,
               "compilation_config": {"custom_ops": ["none"], "mode": 0,
                                      "cudagraph_mode": "FULL_DECODE_ONLY"}},
    "compiled": {"enforce_eager": False,
                 "compilation_config": {"custom_ops": ["none"],
                                        "cudagraph_mode": "FULL_AND_PIECEWISE"}},
}


def engine_launch_kw(mode: str, max_batch: int = 0) -> dict:
    """``LLM`` keyword arguments for ``--cuda-graphs`` ``mode`` (a fresh copy each call), with
    graphs captured up to ``max_batch`` requests (0: vLLM's default)."""
    if mode not in CUDA_GRAPH_MODES:
        raise ValueError(f"--cuda-graphs: expected one of {sorted(CUDA_GRAPH_MODES)}, got {mode!r}")
    if max_batch < 0:
        raise ValueError(f"--cuda-graph-max-batch: expected 0 or more, got {max_batch}")
    kw = copy.deepcopy(CUDA_GRAPH_MODES[mode])
    if max_batch and not kw["enforce_eager"]:
        kw["compilation_config"]["max_cudagraph_capture_size"] = max_batch
    return kw


def with_io_threads(kvt: dict | None, n: int | None) -> dict | None:
    """``kvt`` with ``io_threads`` = ``n`` on each of our file tiers (None: the tier's default),
    for an A/B of how many reads a disk gets in flight (vLLM's fs tier runs 16 read-first and 16
    write-first threads, ours 16 by default); vLLM's own tiers are left as they are."""
    if kvt is None or n is None:
        return kvt
    if n < 1:
        raise ValueError(f"--io-threads: expected at least 1 thread, got {n}")
    extra = kvt["kv_connector_extra_config"]
    if extra.get("spec_module_path") == "tiering.vllm":
        for tier in extra.get("tiers", []):
            if tier.get("medium") == "file":
                tier["io_threads"] = n
    for tier in extra.get("secondary_tiers", []):
        if tier.get("module_path") == "tiering.vllm":
            tier["io_threads"] = n
    return kvt


class Engine:
    """One ``LLM`` (its own engine-core process) and the phase measurements taken on it."""

    def __init__(self, a, model: Path, config: str, kvt: dict | None, gpu_blocks: int | None,
                 max_len: int, warm_tokens: int | list[int] = 64, max_num_seqs: int | None = 64,
                 prefix_caching: bool = True, engine_kw: dict | None = None,
                 warm_base: int = WARM_BASE) -> None:
        from vllm import LLM

        self.settle_max_s = getattr(a, "settle_max_s", 120.0)
        kw = dict(model=str(model), skip_tokenizer_init=True, load_format="dummy",
                  dtype=a.dtype, enforce_eager=True, seed=0, max_model_len=max_len,
                  enable_prefix_caching=prefix_caching,
                  prefix_caching_hash_algo=getattr(a, "prefix_hash_algo", "sha256"),
                  disable_log_stats=False, num_gpu_blocks_override=gpu_blocks,
                  max_num_seqs=max_num_seqs)
        if not a.cpu_platform:
            kw.update(attention_backend="TRITON_ATTN", gpu_memory_utilization=a.gpu_mem,
                      **engine_launch_kw(getattr(a, "cuda_graphs", "eager"),
                                         getattr(a, "cuda_graph_max_batch", 0)))
        if kvt is not None:
            kw["kv_transfer_config"] = kvt
        kw.update(engine_kw or {})
        t = time.perf_counter()
        self.llm = LLM(**kw)
        self.config = config
        self.init_s = time.perf_counter() - t
        # by reference to this module (run as __main__, the function would not pickle to the
        # engine's worker processes)
        from benchmarks.gpu_bench import randomize_weights as by_reference

        try:
            t = time.perf_counter()
            self.llm.apply_model(by_reference)
            self.weights_s = time.perf_counter() - t
            self.warm_up(warm_tokens, warm_base)
        except BaseException:
            # the caller never gets this engine to close: its process would keep the GPU's
            # memory and no later engine could start
            self.close()
            raise

    def warm_up(self, n_tokens: int | list[int], base: int = WARM_BASE) -> None:
        """Build the kernels before anything is timed: a short prompt and one of each measured
        length (tokens ``base`` .. ``base`` + 44, which no measured prompt uses: those draw from
        100 up)."""
        from vllm import SamplingParams

        # the same sampling settings as the measured requests (logprobs: its first use is slow)
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False,
                            logprobs=1)
        lengths = n_tokens if isinstance(n_tokens, list) else [n_tokens]
        for n in sorted({64, *(max(64, x) for x in lengths)}):
            self.llm.generate([{"prompt_token_ids": [base + (i + n) % 45 for i in range(n)]}], sp,
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

    def timed_generate(self, prompts: list[list[int]], sp: Any) -> tuple[list[Any], float,
                                                                          dict[str, float]]:
        """``generate`` the prompts with ``sp``: the outputs, the wall seconds, and the prompt
        tokens served from each source (``device``, ``host``, ``disk``) meanwhile."""
        before = self.counters()
        t = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        wall = time.perf_counter() - t
        time.sleep(0.2)  # let the last stats reach the frontend's counters
        after = self.counters()
        src = {s: after.get(f"vllm:prompt_tokens_cached_by_source[{s}]", 0.0)
               - before.get(f"vllm:prompt_tokens_cached_by_source[{s}]", 0.0)
               for s in ("device", "host", "disk")}
        return outs, wall, src

    def generate(self, prompts: list[list[int]], max_tokens: int, skip_cache: bool = False):
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=1, detokenize=False,
                            skip_reading_prefix_cache=True if skip_cache else None)
        outs, wall, src = self.timed_generate(prompts, sp)
        res = []
        for o in outs:
            c = o.outputs[0]
            lat = getattr(o.metrics, "first_token_latency", 0.0) if o.metrics else 0.0
            # logprob of the token actually sampled, step by step
            lps = [float(d[t].logprob) if d and t in d else None
                   for d, t in zip(c.logprobs or [], c.token_ids, strict=False)]
            res.append({"ttft_s": lat if lat and lat > 0 else None,
                        **engine_core_split(o.metrics),
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
        from benchmarks.write_quiesce import wait_for_quiet_writes

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


def phase_prompts(lengths: list[int], repeats: int, vocab: int) -> list[tuple[int, list[int], int]]:
    """(length, prompt, repeat) for the phases, each length's repeats together; the first
    prompt of a length is the one runs without ``--repeats`` used, the others other tokens."""
    return [(n, prompt(n + 1_000_003 * r, n, vocab), r) for n in lengths for r in range(repeats)]


def record(rows, a, engine, config, length, phase, prompts, skip_cache=False, extra=None):
    if phase in a.thread_cpu_phases:
        from benchmarks import thread_cpu

        before = thread_cpu.snapshot()
        row = _record(rows, a, engine, config, length, phase, prompts, skip_cache, extra)
        row["cpu_threads"] = thread_cpu.busiest(before, thread_cpu.snapshot(), top=12)
        print(f"[bench] {config} {length} {phase}: busiest threads " + ", ".join(
            f"{t['process']}/{t['thread']} {t['cpu_s']:.2f}s" for t in row["cpu_threads"]),
            flush=True)
        return row
    return _record(rows, a, engine, config, length, phase, prompts, skip_cache, extra)


def engine_core_split(stats: Any) -> dict[str, float | None]:
    """A request's time in the engine core from vLLM's own timestamps (``RequestStateStats``,
    one monotonic clock): ``wait_s`` from queued to first scheduled to compute (admission,
    and a connector's load: vLLM records SCHEDULED only once the load is done) and
    ``compute_s`` from then to the first token. Both None where vLLM gave no timestamps."""
    q, s, f = (float(getattr(stats, k, 0.0) or 0.0)
               for k in ("queued_ts", "scheduled_ts", "first_token_ts"))
    if not (0 < q <= s <= f):
        return {"wait_s": None, "compute_s": None}
    return {"wait_s": s - q, "compute_s": f - s}


def _record(rows, a, engine, config, length, phase, prompts, skip_cache, extra):
    if phase in a.cprofile_phases and length == max(a.lengths):
        stem = Path(a.out).resolve() / (f"phases_{a.tag}_{config}_{phase}_{length}_"
                              f"{(extra or {}).get('repeat', 0)}")
        with engine_profile(engine, stem) as files:
            wall, src, res = engine.generate(prompts, a.max_tokens, skip_cache)
        extra = {**(extra or {}), "profiled": files}
    else:
        wall, src, res = engine.generate(prompts, a.max_tokens, skip_cache)
    r = res[0]
    row = {"config": config, "length": length, "phase": phase, "wall_s": wall,
           "ttft_s": r["ttft_s"] if r["ttft_s"] is not None else wall,
           "wait_s": r.get("wait_s"), "compute_s": r.get("compute_s"),
           "cached_tokens": r["cached_tokens"], "from_gpu": src["device"],
           "from_cpu": src["host"], "from_disk": src["disk"], "token_ids": r["token_ids"],
           "logprobs": r["logprobs"], **(extra or {})}
    rows.append(row)
    split = ("" if row["wait_s"] is None else
             f"  (wait {row['wait_s'] * 1000:.1f} + compute {row['compute_s'] * 1000:.1f} ms)")
    print(f"[bench] {config:<10} {length:>6} {phase:<9} ttft {row['ttft_s'] * 1000:8.1f} ms  "
          f"cached {row['cached_tokens']:>6} (gpu {src['device']:.0f} cpu {src['host']:.0f} "
          f"disk {src['disk']:.0f}){split}", flush=True)
    return row


@contextlib.contextmanager
def engine_profile(engine, stem: Path):
    """cProfile in the engine core's step thread (through ``collective_rpc``, as the sweep's
    profiled batch) while the block runs; yields a dict that then names the stats and summary
    files (or the error). Never raises for the profiler's sake."""
    from tiering import profiling

    files: dict = {}
    pstats_path = stem.with_suffix(".pstats")
    try:
        started = all(engine.llm.collective_rpc(profiling.start_profile,
                                                args=(str(pstats_path),)))
    except Exception as e:  # noqa: BLE001
        started, files["error"] = False, f"start: {type(e).__name__}: {e}"
    try:
        yield files
    finally:
        if started:
            try:
                ok = engine.llm.collective_rpc(profiling.stop_profile, args=(str(pstats_path),))
                if all(ok) and pstats_path.exists():
                    summary = stem.with_suffix(".profile.txt")
                    summary.write_text(profiling.summarize(str(pstats_path)) + "\n")
                    files.update(stats=pstats_path.name, summary=summary.name)
                else:
                    files["error"] = "the engine core wrote no stats"
            except Exception as e:  # noqa: BLE001
                files["error"] = f"stop: {type(e).__name__}: {e}"


def phases_for(a, model, config, scratch, rows, lengths_prompts, kvb, max_len, gpu_blocks,
               cpu_bytes):
    """Phase engine (+ restart engine) of one config."""
    n_fill = fillers(cpu_bytes, max(a.lengths), kvb)
    stored = (a.repeats * sum(a.lengths) + n_fill * max(a.lengths)) * kvb
    kvt = transfer_config(config, scratch, cpu_bytes, file_tier_gib(a.disk_gib, stored, scratch),
                          a.gpu_copy, a.promote)
    kvt = with_step_timing(with_switch_interval(kvt, a.switch_ms), a.step_timing)
    kvt = with_io_threads(kvt, a.io_threads)
    timings: dict = {}
    warm = list(a.lengths)
    eng = Engine(a, model, config, kvt, gpu_blocks, max_len, warm)
    timings["init_s"], timings["weights_s"] = eng.init_s, eng.weights_s
    try:
        for length, p, rep in lengths_prompts:
            extra = {"repeat": rep}
            if "cold" in a.phases:
                record(rows, a, eng, config, length, "cold", [p], extra=extra)
            if "gpu" in a.phases:
                record(rows, a, eng, config, length, "gpu", [p], extra=extra)
            if "cpu" in a.phases:
                eng.settle(0.5 + length * kvb / 20e9)
                record(rows, a, eng, config, length, "cpu", [p], extra=extra)
            if "recompute" in a.phases:
                record(rows, a, eng, config, length, "recompute", [p], skip_cache=True,
                       extra=extra)
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
            for length, p, rep in lengths_prompts:
                eng.settle(0.2)
                record(rows, a, eng, config, length, "disk", [p], extra={"repeat": rep})
        if "restart" in a.phases and config in HAS_DISK:
            timings["settle_restart"] = eng.settle(1.0, sync=True)
    finally:
        eng.close()
    if "restart" in a.phases and config in HAS_DISK:
        # a fresh warm-up computes, as the first engine's did; the first engine's own prompts
        # would be disk hits here, loaded seconds before the measured requests
        base = RESTART_WARM_BASE if a.restart_warmup == "fresh" else WARM_BASE
        eng = Engine(a, model, config, kvt, gpu_blocks, max_len, warm, warm_base=base)
        timings["restart_warmup"] = a.restart_warmup
        timings["restart_init_s"] = eng.init_s
        try:
            for length, p, rep in lengths_prompts:
                eng.settle(0.2)
                record(rows, a, eng, config, length, "restart", [p], extra={"repeat": rep})
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
                          file_tier_gib(a.disk_gib, ws_tokens * kvb, scratch / "tp"), a.gpu_copy,
                          a.promote)
    kvt = with_io_threads(with_switch_interval(kvt, a.switch_ms), a.io_threads)
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
    rounds = []
    try:
        # populate: each prefix once (stores to the tiers), then wait for the writes
        eng.generate([p + prompt(6000 + i, 32, vocab) for i, p in enumerate(prefixes)], 1)
        for _ in range(a.tp_rounds):
            # every round starts alike: the writes before it done, the GPU prefix cache empty
            settle = eng.settle(1.0, sync=True)
            # all requests in one call: vLLM schedules them together, as many as the GPU
            # cache and max_num_seqs admit
            wall, src, res = eng.generate(reqs, a.max_tokens)
            rounds.append(throughput_round(wall, src, res, settle))
    finally:
        eng.close()
    row = {"config": config, "cpu_fraction": cpu_fraction, "requests": len(reqs),
           **median_round(rounds), "rounds": len(rounds),
           "requests_per_s_rounds": [r["requests_per_s"] for r in rounds],
           "token_ids_rounds": [r["token_ids"] for r in rounds],
           "gpu_kv_tokens": gpu_tokens, "working_set_tokens": ws_tokens,
           "working_set_bytes": ws_tokens * kvb, "cpu_tier_bytes": cpu_bytes,
           "init_s": eng.init_s}
    settle = row["settle"]
    print(f"[bench] throughput {config:<10} cpu {cpu_fraction or 0:g}x "
          f"{row['requests_per_s']:6.2f} req/s  mean TTFT "
          f"{(row['ttft_mean_s'] or 0) * 1000:8.1f} ms  "
          f"p99 {(row['ttft_p99_s'] or 0) * 1000:8.1f} ms  (gpu {row['from_gpu']:.0f} "
          f"cpu {row['from_cpu']:.0f} disk {row['from_disk']:.0f} tokens; "
          f"waited {settle['waited_s']:.1f}s for {settle['written_bytes'] / 2**20:.0f} MiB of "
          f"writes){rounds_note(row)}", flush=True)
    return row


def throughput_round(wall: float, src: dict[str, float], res: list[dict], settle: dict) -> dict:
    """One timed round of the throughput requests: req/s, TTFTs, the tokens from each source
    and the greedy outputs (``compare`` checks them)."""
    ttfts = sorted(x["ttft_s"] for x in res if x["ttft_s"] is not None)
    p99 = ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))] if ttfts else None
    return {"wall_s": wall, "requests_per_s": len(res) / wall,
            "ttft_mean_s": statistics.mean(ttfts) if ttfts else None, "ttft_p99_s": p99,
            "from_gpu": src["device"], "from_cpu": src["host"], "from_disk": src["disk"],
            "settle": settle, "token_ids": [x["token_ids"] for x in res]}


def rounds_note(row: dict) -> str:
    """`` [min-max over N rounds]`` for a row of several rounds, else nothing."""
    rps = row.get("requests_per_s_rounds") or []
    return f" [{min(rps):.2f}-{max(rps):.2f} over {len(rps)} rounds]" if len(rps) > 1 else ""


def median_round(rounds: list[dict]) -> dict:
    """The round whose req/s is the median (the lower one of an even count): a row reports a
    whole round, so its TTFTs and token sources belong to the req/s it shows."""
    ranked = sorted(rounds, key=lambda r: r["requests_per_s"])
    return ranked[(len(ranked) - 1) // 2]


def compare(rows: list[dict], tp_rows: list[dict]) -> None:
    """Check each row's greedy outputs (token ids and the sampled tokens' logprobs).

    * ``same_tokens``/``max_logprob_diff``: against the no-offloading cold run of that length.
    * ``exact_vs_gpu_hit``: for a prefix served from CPU, disk or after a restart, bitwise
      equality (tokens and logprobs) with the same engine's GPU prefix-cache hit. That hit
      recomputes the same number of tokens, so any difference is in the KV bytes. (A hit and
      a full prefill multiply matrices of other shapes, so their bf16 roundings differ a
      little; vLLM without offloading shows that too: compare its ``gpu`` row with ``cold``.)
    """
    ref = {(r["length"], r.get("repeat", 0)): r for r in rows
           if r["config"] == "none" and r["phase"] == "cold"}
    gpu_hit = {(r["config"], r["length"], r.get("repeat", 0)): r for r in rows
               if r["phase"] == "gpu"}
    for r in rows:
        base = ref.get((r["length"], r.get("repeat", 0)))
        if base is None:
            r["same_tokens"] = r["max_logprob_diff"] = None
        else:
            r["same_tokens"] = r["token_ids"] == base["token_ids"]
            diffs = [abs(x - y) for x, y in zip(r["logprobs"], base["logprobs"], strict=False)
                     if x is not None and y is not None]
            r["max_logprob_diff"] = max(diffs) if diffs else None
        hit = gpu_hit.get((r["config"], r["length"], r.get("repeat", 0)))
        r["exact_vs_gpu_hit"] = (None if hit is None or r["phase"] not in ("cpu", "disk", "restart")
                                 or r["config"] == "none" else
                                 r["token_ids"] == hit["token_ids"]
                                 and r["logprobs"] == hit["logprobs"])
    tp_ref = next((t for t in tp_rows if t["config"] == "none"), None)
    for t in tp_rows:
        if tp_ref is None:
            t["same_tokens_fraction"] = None
            continue
        # every round's outputs (``--tp-rounds``) against the reference's median round
        outputs = t.get("token_ids_rounds") or [t["token_ids"]]
        same = sum(x == y for ids in outputs
                   for x, y in zip(ids, tp_ref["token_ids"], strict=True))
        t["same_tokens_fraction"] = same / sum(len(ids) for ids in outputs)


def cell_rows(rows: list[dict], config: str, length: int, phase: str) -> list[dict]:
    """The rows of one table cell: one per repeat (``--repeats``)."""
    return [x for x in rows if x["config"] == config and x["length"] == length
            and x["phase"] == phase]


def median_ttft_ms(rs: list[dict]) -> float:
    return statistics.median(r["ttft_s"] for r in rs) * 1000


def cell(rs: list[dict], length: int) -> str:
    """``TTFT ms (source) marks``; of several repeats the median TTFT, every source seen (each
    repeat's, ``/``-separated where they differ) and ``[min-max, n]``; a mark if any repeat
    has it."""
    if not rs:
        return ""
    srcs = []
    for r in rs:
        src = "".join(k for k, v in (("g", r["from_gpu"]), ("c", r["from_cpu"]),
                                     ("d", r["from_disk"])) if v > 0) or "r"
        hit = r["from_gpu"] + r["from_cpu"] + r["from_disk"]
        if src != "r" and hit < 0.9 * length:
            src += f" {100 * hit / length:.0f}%"
        if src not in srcs:
            srcs.append(src)
    mark = "" if all(r.get("same_tokens") in (True, None) for r in rs) else " *"
    exact = [r.get("exact_vs_gpu_hit") for r in rs if r.get("exact_vs_gpu_hit") is not None]
    mark += "" if not exact else (" =" if all(exact) else " !")
    mark += " p" if any(r.get("profiled") is not None for r in rs) else ""
    text = f"{median_ttft_ms(rs):.0f} ({'/'.join(srcs)}){mark}"
    if len(rs) > 1:
        ms = [r["ttft_s"] * 1000 for r in rs]
        text += f" [{min(ms):.0f}-{max(ms):.0f}, {len(rs)}]"
    return text


def split_table(rows: list[dict], configs: list[str], lengths: list[int]) -> list[str]:
    """Where a hit's first token goes, per phase that loads (cpu, disk, restart) and length:
    the medians of ``wait_s`` (queued to scheduled: admission and the load) and ``compute_s``
    (scheduled to the first token), in ms; no lines where no row has vLLM's timestamps."""
    out: list[str] = []
    for ph in ("cpu", "disk", "restart"):
        for length in lengths:
            cells = []
            for c in configs:
                rs = [r for r in cell_rows(rows, c, length, ph) if r.get("wait_s") is not None]
                cells.append("" if not rs else
                             f"{statistics.median(r['wait_s'] for r in rs) * 1000:.1f} + "
                             f"{statistics.median(r['compute_s'] for r in rs) * 1000:.1f}")
            if any(cells):
                out.append(f"| {ph} {length} | " + " | ".join(cells) + " |")
    if not out:
        return []
    return ["\nWhere a hit's first token goes, ms (vLLM's timestamps in the engine core; "
            "medians): queued to scheduled (admission and the load) + scheduled to the first "
            "token (the compute step)",
            "| phase, tokens | " + " | ".join(configs) + " |", "|---|" + "---|" * len(configs),
            *out]


def table(rows: list[dict], tp_rows: list[dict], configs: list[str]) -> str:
    lines = []
    phases = [p for p in PHASES if p != "throughput" and any(r["phase"] == p for r in rows)]
    lengths = sorted({r["length"] for r in rows})
    for length in lengths:
        lines.append(f"\nTTFT ms, {length} prompt tokens (source of the prefix: g=GPU c=CPU "
                     f"d=disk r=recompute; * = greedy tokens differ from no offloading's cold "
                     f"run; = : tokens and logprobs bitwise equal to this engine's GPU hit; "
                     f"! : they are not; p : run under cProfile (--cprofile-phases); of several "
                     f"prompts: the median, [min-max, count])")
        lines.append("| phase | " + " | ".join(configs) + " |")
        lines.append("|---|" + "---|" * len(configs))
        for ph in phases:
            cells = [cell(cell_rows(rows, c, length, ph), length) for c in configs]
            lines.append(f"| {ph} | " + " | ".join(cells) + " |")
    lines += split_table(rows, configs, lengths)
    if tp_rows:
        t0 = tp_rows[0]
        lines.append(f"\nThroughput: {t0['requests']} concurrent requests over a working set of "
                     f"{t0['working_set_tokens']} prefix tokens = "
                     f"{t0['working_set_tokens'] / t0['gpu_kv_tokens']:.1f}x the GPU KV cache "
                     f"({t0['gpu_kv_tokens']} tokens); CPU tier = the given multiple of the "
                     f"working set (below 1x the disk matters)"
                     + (f"; req/s: the median of {t0['rounds']} rounds per engine [their range],"
                        " the other columns from that round" if t0.get("rounds", 1) > 1 else ""))
        lines.append("| CPU tier / working set | config | req/s | mean TTFT ms | p99 TTFT ms | "
                     "from GPU / CPU / disk tokens | same tokens |")
        lines.append("|---|---|---|---|---|---|---|")
        for t in sorted(tp_rows, key=lambda t: (t.get("cpu_fraction") or 0,
                                                configs.index(t["config"])
                                                if t["config"] in configs else 99)):
            same = t.get("same_tokens_fraction")
            frac = t.get("cpu_fraction")
            lines.append(f"| {'-' if not frac else f'{frac:g}x'} | {t['config']} | "
                         f"{t['requests_per_s']:.2f}{rounds_note(t)} | "
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
                rs = cell_rows(rows, c, length, ph)
                ys.append(median_ttft_ms(rs) if rs else 0)
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

    A step is expected to take its work plus its engine starts. Its work is the longest work
    of a step of its kind so far: its kind is what it runs and whether the config has a disk
    (a disk config's phases add the disk phase and an engine restart). With no step of its kind
    yet, a disk config's phases are expected to do twice the work of the longest phases of a
    config without disk (8B on the H200: 95-100 s against 57 s), any other step as much as the
    longest of the same kind, or none at all. An engine start is taken to cost the quickest
    start seen after the run's first: the first engine of a fresh machine compiles kernels and
    warms caches (53 s on an H100, where every later start took 9-10 s), and counting that
    twice for a disk config skipped both disk configs of a run that had time for them; until
    a later start is seen a start is guessed at ``START_GUESS_S``. Where the run's phases
    have neither a disk phase nor a restart (``disk_phases`` False), a disk config's phases
    are of the same kind as any other's; only a restart starts a second engine (``restarts``).
    ``for_phases`` sets both from the run's ``--phases``."""

    START_GUESS_S = 15.0

    def __init__(self, budget_s: float, start: float, clock=time.perf_counter,
                 disk_phases: bool = True, restarts: bool | None = None) -> None:
        self.budget_s, self.start, self.clock = budget_s, start, clock
        self.disk_phases = disk_phases
        self.restarts = disk_phases if restarts is None else restarts and disk_phases
        self.longest: dict[tuple[str, bool], float] = {}  # work, without engine starts
        self.starts_seen = 0
        self.quickest_start: float | None = None  # of the starts after the first

    @classmethod
    def for_phases(cls, budget_s: float, start: float, phases: Sequence[str],
                   clock=time.perf_counter) -> StepBudget:
        """The budget of a run of ``phases`` (``phases_for`` restarts a disk config's engine
        only for the restart phase)."""
        return cls(budget_s, start, clock, disk_phases=bool({"disk", "restart"} & set(phases)),
                   restarts="restart" in phases)

    def spent(self) -> float:
        return self.clock() - self.start

    def start_s(self) -> float:
        return self.START_GUESS_S if self.quickest_start is None else self.quickest_start

    def _disk(self, what: str, config: str) -> bool:
        """Whether the step is of a disk config's kind (its phases add a disk phase and a
        restart)."""
        return config in HAS_DISK and (what != "phases" or self.disk_phases)

    def estimate(self, what: str, config: str) -> float:
        disk = self._disk(what, config)
        starts = 2 if disk and what == "phases" and self.restarts else 1
        if (what, disk) in self.longest:
            return self.longest[(what, disk)] + starts * self.start_s()
        other = self.longest.get((what, not disk))
        if other is None:
            return 0.0  # nothing to go by: it starts
        return (2 * other if disk and what == "phases" else other) + starts * self.start_s()

    def fits(self, what: str, config: str) -> bool:
        return not self.budget_s or self.spent() + self.estimate(what, config) <= self.budget_s

    def took(self, what: str, config: str, seconds: float,
             engine_starts_s: tuple[float, ...] = ()) -> None:
        """A step ended after ``seconds``, of which ``engine_starts_s`` were its engines'
        starts (in order; none given: all of it counts as work)."""
        for s in engine_starts_s:
            if self.starts_seen:
                self.quickest_start = s if self.quickest_start is None else min(
                    self.quickest_start, s)
            self.starts_seen += 1
        key = (what, self._disk(what, config))
        work = max(0.0, seconds - sum(engine_starts_s))
        self.longest[key] = max(self.longest.get(key, 0.0), work)


# -- the prefill sweep (issue 15: the source article's throughput experiment) ---------------------
#
# N unique prompts of --sweep-prompt-tokens tokens, max_tokens=1, GPU prefix caching off. A first
# pass (fill) stores them in the CPU tier; then one batch of N prompts per hit rate, in which
# that share of the prompts are prompts of the previous batch (the most recently used ones, so
# that an LRU tier of 1.5 batches holds them while the batch's new prompts are stored) and the
# rest are new. Throughput = prompt tokens / wall time of ``generate``. One engine per (shape,
# setup, chunk size) serves every hit rate. ``none`` (no offloading) runs a fresh batch and the
# same batch again (no cache of any kind: both cost the same; the two rows show it).

# vLLM 0.33's physical KV cache layouts (vllm/v1/kv_cache_layout.py, stride orders of the
# logical [layer, block, head, token, channel]): --kv-layout
KV_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def kv_layout_label() -> str:
    """The layout this run's engines were asked for (--kv-layout), for the results' info."""
    return os.environ.get("VLLM_KV_CACHE_LAYOUT") or (
        "the connector's: ours BLHNC (TieredOffloadingConnector, where the attention backend "
        "reads it), vLLM's spec and none vLLM's default")

SWEEP_PHASE = "prefill-sweep"
SWEEP_CONFIGS = ("none", "cpu", "ours")
# ours-disk (issue 14, asked for by name): our spec with a CPU tier of --sweep-disk-cpu-factor
# batches over a file tier of 2.5 batches in --scratch, so that the disk holds most hits; the
# tiers' writes are waited for between batches
SWEEP_DISK_CONFIG = "ours-disk"
# ours-sched: ours with vLLM's scheduler replaced by tiering.vllm.scheduler.TieringScheduler
# (--scheduler-cls: without vLLM's quadratic in-flight reservation sum; vLLM's queue order);
# ours-hf: the same scheduler with hits_first on (tiering/vllm/hits_first.py), for the A/B;
# ours-vorder: the same scheduler handing out GPU blocks in vLLM's order
# ("sort_gpu_blocks": false, tiering/vllm/block_order.py), for that A/B
SWEEP_SCHED_CONFIG = "ours-sched"
SWEEP_HF_CONFIG = "ours-hf"
SWEEP_VORDER_CONFIG = "ours-vorder"
# none-sched: no offloading under the same scheduler class, so that --sweep-trace gives no
# offloading's step table beside ours-sched's (where a 0% batch's extra time goes: its steps or
# its tail); the speed-ups stay relative to plain none
SWEEP_NONE_SCHED_CONFIG = "none-sched"
SWEEP_SCHEDULER_CONFIGS = (SWEEP_SCHED_CONFIG, SWEEP_HF_CONFIG, SWEEP_VORDER_CONFIG,
                           SWEEP_NONE_SCHED_CONFIG)
# the setups that offload nothing
SWEEP_NO_OFFLOAD_CONFIGS = ("none", SWEEP_NONE_SCHED_CONFIG)
SCHEDULER_CLS = "tiering.vllm.scheduler.TieringScheduler"
# every setup that runs our spec
OURS_SWEEP_CONFIGS = ("ours", SWEEP_DISK_CONFIG, SWEEP_SCHED_CONFIG, SWEEP_HF_CONFIG,
                      SWEEP_VORDER_CONFIG)
# every setup --sweep-configs takes
ALL_SWEEP_CONFIGS = SWEEP_CONFIGS + OURS_SWEEP_CONFIGS[1:] + (SWEEP_NONE_SCHED_CONFIG,)
# N per shape: all three of 1b, 8b, 32b with none, cpu and ours in ~7 minutes of an H200
# (a cold batch: ~3.3 s at 1b, ~3.6 s at 8b, ~5.4 s at 32b at the issue's no-offloading rates)
SWEEP_PROMPTS = {"1b": 1024, "8b": 256, "32b": 96, "small": 64, "tiny": 8}
# The GPU KV cache of a sweep engine, in batches (--sweep-gpu-cache-batches): small enough that
# every batch after the second runs in GPU blocks freed by earlier ones, as every request of a
# server that has run a while does. vLLM hands freed blocks out in descending order, a fresh
# cache ascending, and the two copy differently (block_copy.CopyLayout). Sized by vLLM from
# --gpu-mem instead, the H200's 8B cache held 6 batches: the 100% batch ran in fresh blocks.
SWEEP_GPU_CACHE_BATCHES = 2.0
PROFILERS = ("cprofile", "py-spy")
# the warm-up's hit rounds (SweepEngine.warm_hits): batch sizes that give Triton's integer
# specialisations (1, a multiple of 16, neither) and both attention variants (few requests
# with short queries: 3-D split-KV; many: 2-D)
WARM_HIT_SIZES = (1, 3, 16, 29)


def _percentages(ap: argparse.ArgumentParser, option: str, text: str) -> list[float]:
    """Comma-separated percentages in [0, 100], sorted, or one clear error naming the option."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 <= v <= 100 for v in values):
        ap.error(f"{option}: expected comma-separated percentages from 0 to 100, got {text!r}")
    return sorted(set(values))


def add_sweep_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group(
        "prefill sweep (--phases prefill-sweep)",
        "throughput of unique prompts against the share served from the CPU tier")
    g.add_argument("--sweep-shapes", default="",
                   help="shapes run one after another in this process, comma-separated "
                        "(default: --shape)")
    g.add_argument("--sweep-configs", default=",".join(SWEEP_CONFIGS),
                   help=f"comma-separated, of {', '.join(SWEEP_CONFIGS)} (ours: our spec with "
                        f"its CPU tier only), {SWEEP_SCHED_CONFIG} (ours under --scheduler-cls "
                        f"{SCHEDULER_CLS}), {SWEEP_HF_CONFIG} (the same with hits_first "
                        f"on), {SWEEP_VORDER_CONFIG} (the same with GPU blocks in vLLM's "
                        f"order), {SWEEP_DISK_CONFIG} (our spec, a small CPU "
                        "tier over a file tier in --scratch) and "
                        f"{SWEEP_NONE_SCHED_CONFIG} (no offloading under {SCHEDULER_CLS}, "
                        "for --sweep-trace)")
    g.add_argument("--sweep-prompts", type=int, default=0,
                   help="N, prompts per batch (0: per shape, " +
                        ", ".join(f"{k} {v}" for k, v in SWEEP_PROMPTS.items()) + ")")
    g.add_argument("--sweep-prompt-tokens", type=int, default=512)
    g.add_argument("--sweep-rounds", type=int, default=1,
                   help="batches per hit rate: the rates run this many times in turn on one "
                        "engine, and the table gives each rate's median [min-max] (one batch "
                        "cannot resolve a 1%% difference: no offloading's two batches differ "
                        "by up to 10%%)")
    g.add_argument("--sweep-hit-rates", default="0,20,50,80,100",
                   help="percent of each batch's prompts seen before, comma-separated")
    g.add_argument("--sweep-chunk-tokens", default="",
                   help="offloaded chunk sizes in tokens (kv_connector_extra_config "
                        "'block_size'), comma-separated: cpu and ours run one engine each "
                        "(default: vLLM's GPU block size)")
    g.add_argument("--sweep-max-num-seqs", type=int, default=0, help="0: vLLM's default")
    g.add_argument("--sweep-max-batched-tokens", type=int, default=0, help="0: vLLM's default")
    g.add_argument("--sweep-sync-load-mib", type=float, default=0.0,
                   help="cpu and ours: vLLM's sync_load_budget_bytes in MiB (loads of up to "
                        "that many bytes a step run before the step's forward pass, not "
                        "asynchronously; vLLM takes none for a prompt whose every token hits)")
    g.add_argument("--sweep-max-loading", type=int, default=-1,
                   help="ours: max_loading_requests (requests loading to the GPU at once; "
                        "0: no cap; -1: the spec's default)")
    g.add_argument("--sweep-load-starts", type=int, default=-1,
                   help="ours: max_load_starts_per_step (loads started in one scheduler step "
                        "while nothing computes; 0: no limit; -1: the spec's default)")
    g.add_argument("--sweep-load-queue-mib", type=float, default=-1,
                   help="ours: load_queue_bytes in MiB (loads enqueued on the copy engine at "
                        "once, the rest fed as room frees; 0: all at once; -1: the spec's "
                        "default)")
    g.add_argument("--sweep-load-direct", choices=("on", "off"), default=None,
                   help="ours: load_direct (a load with room in the queue and none waiting "
                        "enqueued by vLLM's worker thread; off: every load through the feeder "
                        "thread; default: the spec's)")
    g.add_argument("--sweep-load-waves", choices=("on", "off"), default=None,
                   help="ours: load_waves (room in the loads' queue only once it is empty, so "
                        "that a step's own input copies get the copy engine between waves; off: "
                        "a job enqueued as soon as the bytes queued leave room; default: the "
                        "spec's)")
    g.add_argument("--sweep-load-wave-streams", type=int, choices=(1, 2), default=None,
                   help="ours: load_wave_streams (2: the loads' waves take two streams in turn, "
                        "the next wave queued on one while the other copies, so the copy engine "
                        "never waits for the feeder thread between waves; needs load_waves; "
                        "default: the spec's)")
    g.add_argument("--sweep-prefix-caching", action="store_true",
                   help="GPU prefix caching on (off by default, as in the source article): then "
                        "vLLM hashes every request's blocks for every setup, no offloading "
                        "included; only the 0%% rate stays free of GPU hits")
    g.add_argument("--sweep-trace", action="store_true",
                   help=f"{', '.join(SWEEP_SCHEDULER_CONFIGS)}: a step trace of the engine "
                        "(tiering/step_trace.py) and a table of each batch's steps in --out")
    g.add_argument("--sweep-gpu-cache-batches", type=float, default=SWEEP_GPU_CACHE_BATCHES,
                   help="GPU KV cache in batches' blocks (later batches reuse freed blocks, "
                        "as a running server does); 0: vLLM's sizing from --gpu-mem")
    g.add_argument("--sweep-cpu-factor", type=float, default=1.5,
                   help="CPU tier size / KV of one batch")
    g.add_argument("--sweep-disk-cpu-factor", type=float, default=0.25,
                   help=f"{SWEEP_DISK_CONFIG}: CPU tier size / KV of one batch (its file tier "
                        "holds 2.5 batches)")
    g.add_argument("--sweep-promotion-reserve", type=float, default=None,
                   help=f"{SWEEP_DISK_CONFIG}: the CPU tier's promotion_reserve (share of the "
                        "rows stores leave for promotions once one found none; 0: off; "
                        "default: the spec's)")
    g.add_argument("--sweep-warm-hits", type=int, default=1,
                   help="1: before the fill, unmeasured rounds of CPU hits (of "
                        f"{', '.join(map(str, WARM_HIT_SIZES))} prompts) compile the kernels "
                        "a batch of hits needs; 0: none (a batch then pays Triton's compiles)")
    g.add_argument("--sweep-timeline-s", type=float, default=0.0,
                   help="py-spy dump of the engine core every this many seconds during every "
                        "batch of the offloading setups, into --out (0: off)")
    g.add_argument("--profile", default="",
                   help="comma-separated, of cprofile (in the engine-core process), py-spy "
                        "(py-spy record from outside): one more 100%%-hit batch per setup, "
                        "profiled; the stats and a summary land in --out")


def check_sweep_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.phases != [SWEEP_PHASE]:
        ap.error(f"--phases {SWEEP_PHASE} runs alone (got {','.join(a.phases)})")
    a.sweep_shapes = [x for x in (a.sweep_shapes or a.shape).split(",") if x]
    a.sweep_configs = [x for x in a.sweep_configs.split(",") if x]
    a.sweep_hit_rates = _percentages(ap, "--sweep-hit-rates", a.sweep_hit_rates)
    a.sweep_chunk_tokens = (_numbers(ap, "--sweep-chunk-tokens", a.sweep_chunk_tokens, int)
                            if a.sweep_chunk_tokens else [])
    a.profile = [x for x in a.profile.split(",") if x]
    bad = (sorted(set(a.sweep_shapes) - set(SHAPES))
           + sorted(set(a.sweep_configs) - set(ALL_SWEEP_CONFIGS))
           + sorted(set(a.profile) - set(PROFILERS)))
    if bad:
        ap.error(f"prefill sweep: unknown shape/config/profiler {bad}; shapes {sorted(SHAPES)}, "
                 f"configs {ALL_SWEEP_CONFIGS}, "
                 f"profilers {PROFILERS}")
    if not 1 <= a.sweep_rounds <= 20:
        ap.error(f"--sweep-rounds: expected 1 to 20 batches per hit rate, got {a.sweep_rounds}")
    if (a.sweep_prompts < 0 or a.sweep_prompt_tokens < 16 or a.sweep_cpu_factor <= 0
            or a.sweep_disk_cpu_factor <= 0 or not 0 <= a.sweep_gpu_cache_batches < 1e6
            or 0 < a.sweep_gpu_cache_batches < 1):
        ap.error("--sweep-prompts must be >= 0, --sweep-prompt-tokens >= 16, "
                 "--sweep-cpu-factor and --sweep-disk-cpu-factor > 0, "
                 "--sweep-gpu-cache-batches 0 or at least 1")


def sweep_transfer_config(config: str, cpu_bytes: int, chunk_tokens: int | None,
                          gpu_block_tokens: int, gpu_copy: str = "auto",
                          sync_load_bytes: int = 0,
                          max_loading_requests: int | None = None,
                          disk: tuple[Path, int] | None = None,
                          promote: str = "auto",
                          promotion_reserve: float | None = None,
                          max_load_starts_per_step: int | None = None,
                          load_queue_bytes: int | None = None,
                          load_direct: bool | None = None,
                          load_waves: bool | None = None,
                          load_wave_streams: int | None = None) -> dict | None:
    """The sweep's offloading setups: vLLM's CPUOffloadingSpec (``cpu``) or our spec with its
    CPU tier only (``ours``), offloading chunks of ``chunk_tokens`` (None: each spec's default,
    ``default_chunk_tokens``); ``ours-disk``: ours over a file tier at ``disk`` (folder,
    capacity in bytes), promoting disk hits by ``promote`` and with the CPU tier's
    ``promotion_reserve`` if given (None: the spec's default)."""
    if config in SWEEP_NO_OFFLOAD_CONFIGS:
        return None
    extra: dict = {"cpu_bytes_to_use": cpu_bytes}
    if chunk_tokens:  # also one GPU block's worth: our spec's default on CUDA is longer
        extra["block_size"] = chunk_tokens
    if sync_load_bytes:
        extra["sync_load_budget_bytes"] = sync_load_bytes
    if config == "cpu":
        extra["spec_name"] = "CPUOffloadingSpec"
    elif config in OURS_SWEEP_CONFIGS:
        tiers: list[dict] = [{"medium": "cpu", "policy": "lru"}]
        if config == SWEEP_DISK_CONFIG:
            if disk is None:
                raise ValueError(f"prefill sweep: {config} needs a folder and a capacity")
            if promote != "auto":
                tiers[0]["promote"] = promote
            if promotion_reserve is not None:
                tiers[0]["promotion_reserve"] = promotion_reserve
            tiers.append({"medium": "file", "path": str(disk[0]), "policy": "lru",
                          "capacity": f"{disk[1] / 2**30:.3f}GiB", "io": "posix"})
        extra.update(spec_name="TieredOffloadingSpec", spec_module_path="tiering.vllm",
                     gpu_copy=gpu_copy, tiers=tiers)
        if max_loading_requests is not None:
            extra["max_loading_requests"] = max_loading_requests
        if config == SWEEP_HF_CONFIG:
            extra["hits_first"] = True
        if config == SWEEP_VORDER_CONFIG:
            extra["sort_gpu_blocks"] = False
        if max_load_starts_per_step is not None:
            extra["max_load_starts_per_step"] = max_load_starts_per_step
        if load_queue_bytes is not None:
            extra["load_queue_bytes"] = load_queue_bytes
        if load_direct is not None:
            extra["load_direct"] = load_direct
        if load_waves is not None:
            extra["load_waves"] = load_waves
        if load_wave_streams is not None:
            extra["load_wave_streams"] = load_wave_streams
        return {**CONNECTOR_FIELDS, "kv_connector_extra_config": extra}
    else:
        raise ValueError(f"prefill sweep: unknown config {config!r}")
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


def default_chunk_tokens(config: str, gpu_block_tokens: int, on_cuda: bool) -> int:
    """The chunk a setup offloads when the sweep names none: vLLM's spec one GPU block, ours
    ``CUDA_CHUNK_TOKENS`` on CUDA where that is a multiple of the block
    (``tiering.vllm.spec.default_blocks_per_chunk``, which decides it in the engine)."""
    from tiering.settings import CUDA_CHUNK_TOKENS

    if (config in OURS_SWEEP_CONFIGS and on_cuda
            and gpu_block_tokens < CUDA_CHUNK_TOKENS
            and CUDA_CHUNK_TOKENS % gpu_block_tokens == 0):
        return CUDA_CHUNK_TOKENS
    return gpu_block_tokens


def sweep_gpu_blocks(n: int, tokens: int, block_tokens: int, batches: float,
                     max_len: int = 0) -> int | None:
    """GPU blocks for ``batches`` batches of ``n`` prompts of ``tokens`` tokens (each with its
    one output token), or None (``batches`` 0: vLLM sizes the cache). At least one request of
    ``max_len`` tokens' worth: vLLM refuses to start an engine whose cache cannot hold one."""
    if batches <= 0:
        return None
    return max(math.ceil(batches * n * -(-(tokens + 1) // block_tokens)),
               -(-max_len // block_tokens))


def sweep_batches(n: int, rates: list[float], seed: int = 11) -> list[tuple[str, float,
                                                                            list[int]]]:
    """The sweep's batches as prompt numbers: ``fill`` (prompts 0..n-1), then per hit rate a
    batch of ``n`` prompts, ``round(rate% * n)`` of them the last-submitted prompts of the
    previous batch (the most recently used ones), the rest never seen, in a shuffled order."""
    import random

    r = random.Random(seed)
    batches: list[tuple[str, float, list[int]]] = [("fill", 0.0, list(range(n)))]
    nxt = n
    prev = batches[0][2]
    for rate in rates:
        k = round(rate * n / 100)
        seen = prev[len(prev) - k:] if k else []
        batch = seen + list(range(nxt, nxt + n - k))
        nxt += n - k
        r.shuffle(batch)
        batches.append(("hit", rate, batch))
        prev = batch
    return batches


def sweep_plan(config: str, n: int, rates: list[float], rounds: int = 1
               ) -> list[tuple[str, float, list[int]]]:
    """A setup's batches: ``sweep_batches`` over the hit rates ``rounds`` times in turn; for
    ``none`` (no cache of any kind) a fresh batch, then the same prompts again, per round."""
    if config in SWEEP_NO_OFFLOAD_CONFIGS:
        return [("hit", rate, list(range(k * n, (k + 1) * n)))
                for k in range(rounds) for rate in (0.0, 100.0)]
    return sweep_batches(n, rates * rounds)


def sweep_prompts(count: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` distinct prompts of random token ids (no two share their first block)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    arr = rng.integers(100, vocab - 300, size=(count, tokens), dtype=np.int64)
    return arr.tolist()


def _py_spy() -> str | None:
    """The py-spy executable: on PATH, or beside a sys.path entry (a ``pip --target`` folder,
    as scripts/gpu_env.sh installs the carried wheels)."""
    found = shutil.which("py-spy")
    if found:
        return found
    for entry in sys.path:
        cand = Path(entry) / "bin" / "py-spy"
        if entry and cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return None


def _engine_core_pid() -> int | None:
    """The engine-core child process of this one (vLLM names it ``EngineCore``)."""
    try:
        import psutil
    except ImportError:
        return None
    kids = psutil.Process().children(recursive=True)
    for p in kids:
        try:
            if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()):
                return p.pid
        except psutil.Error:
            continue
    return kids[0].pid if kids else None


class StackTimeline:
    """``py-spy dump`` of the engine core every ``interval_s`` while a batch runs, each dump
    with its time since the batch started: where the engine spends a batch that is slow only
    once (the disk-backed sweep's slow 100% batch, which a repeat under a profiler never shows).
    One JSON line per dump into ``path`` (gzip). Never raises into the sweep: what failed is
    recorded in ``error``."""

    def __init__(self, path: Path, interval_s: float) -> None:
        self.path, self.interval_s = path, interval_s
        self.exe, self.pid = _py_spy(), _engine_core_pid()
        self.error = None if self.exe and self.pid else (
            f"py-spy {self.exe or 'not found'}, engine core pid {self.pid}")
        self.samples = 0
        self._stop: Any = None
        self._thread: Any = None

    def start(self, label: str) -> None:
        import threading

        if self.error:
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(label,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=30)
            self._thread = None

    def _run(self, label: str) -> None:
        import gzip
        import subprocess

        exe = self.exe
        assert exe is not None
        t0 = time.perf_counter()
        try:
            with gzip.open(self.path, "at") as fh:
                while not self._stop.is_set():
                    t = time.perf_counter() - t0
                    r = subprocess.run([exe, "dump", "--pid", str(self.pid),
                                        "--nonblocking", "--subprocesses"], capture_output=True, text=True,
                                       timeout=10)
                    fh.write(json.dumps({"batch": label, "t_s": round(t, 3),
                                         "took_s": round(time.perf_counter() - t0 - t, 3),
                                         "dump": r.stdout + r.stderr[-500:]}) + "\n")
                    self.samples += 1
                    self._stop.wait(max(0.0, self.interval_s - (time.perf_counter() - t0 - t)))
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"


class SweepEngine(Engine):
    """An engine of the sweep: prefix caching off, one output token, throughput per batch."""

    gpu_block_tokens: int  # set by sweep_setup

    def run_batch(self, prompts: list[list[int]]) -> dict:
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
        outs, wall, src = self.timed_generate(prompts, sp)
        return {"wall_s": wall, "from_gpu": src["device"], "from_cpu": src["host"],
                "from_disk": src["disk"], "cached_tokens": sum(o.num_cached_tokens for o in outs),
                "first_tokens": [o.outputs[0].token_ids[0] for o in outs],
                "latency": latency_split(outs)}

    def warm_hits(self, tokens: int, vocab: int, sizes: tuple[int, ...] = WARM_HIT_SIZES) -> dict:
        """Unmeasured rounds that compile the attention kernels a batch of hits launches
        before any batch is timed: per size k, k new prompts (stored), then the same k again
        (CPU hits: each request computes only its tail over a loaded prefix). Triton compiles
        a kernel for each new combination of its arguments' properties (the 3-D split-KV
        variant for short queries over long contexts; integers equal to 1 or divisible by 16
        specialise), ~1 s each on the H200: once, inside a measured batch, it made the
        disk-backed 100% batch 0.55-0.69x (docs/benchmarks.md, "The H200, seventh run").
        Prompts of their own (another seed): the sweep's prompts stay unseen."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        prompts = sweep_prompts(sum(sizes), tokens, vocab, seed=7)
        hits = 0
        at = 0
        for k in sizes:
            batch = prompts[at:at + k]
            at += k
            self.llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
            self.settle(0.3)
            outs = self.llm.generate([{"prompt_token_ids": p} for p in batch], sp,
                                     use_tqdm=False)
            hits += sum(1 for o in outs if (o.num_cached_tokens or 0) > 0)
            self.settle(0.3)
        return {"warm_hit_s": time.perf_counter() - t, "warm_hit_requests": hits,
                "warm_hit_sizes": list(sizes)}

    def profiled_batch(self, prompts: list[list[int]], profilers: list[str], stem: Path,
                       expect_s: float) -> dict:
        """The batch again under the profilers: cProfile inside the engine core (started and
        stopped through ``collective_rpc``), py-spy recording from outside."""
        from tiering import profiling

        files: dict = {}
        spy = None
        if "py-spy" in profilers:
            exe, pid = _py_spy(), _engine_core_pid()
            if exe is None or pid is None:
                files["py_spy_error"] = f"py-spy {exe or 'not found'}, engine core pid {pid}"
            else:
                import subprocess

                dump = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True,
                                      text=True, timeout=30)
                files["py_spy_dump_before"] = (dump.stdout + dump.stderr)[-4000:]
                spy_out = stem.with_suffix(".py-spy.txt")
                spy = subprocess.Popen(
                    [exe, "record", "--pid", str(pid), "--rate", "200", "--nonblocking",
                     "--format", "raw", "--duration", str(max(2, int(expect_s * 2 + 2))),
                     "-o", str(spy_out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True)
                files["py_spy"] = spy_out.name
                time.sleep(1.0)  # py-spy attaches
        pstats_path = stem.with_suffix(".pstats")
        if "cprofile" in profilers:
            self.llm.collective_rpc(profiling.start_profile, args=(str(pstats_path),))
        try:
            res = self.run_batch(prompts)
        finally:
            if "cprofile" in profilers:
                ok = self.llm.collective_rpc(profiling.stop_profile, args=(str(pstats_path),))
                files["cprofile"] = pstats_path.name if all(ok) else None
            if spy is not None:
                try:
                    out, _ = spy.communicate(timeout=expect_s * 2 + 60)
                except Exception:  # noqa: BLE001
                    spy.kill()
                    out, _ = spy.communicate()
                files["py_spy_log"] = (out or "")[-2000:]
        if files.get("cprofile"):
            blocks = res["from_cpu"] / max(1, self.gpu_block_tokens)
            text = profiling.summarize(str(pstats_path), blocks=blocks)
            stem.with_suffix(".profile.txt").write_text(text + "\n")
            files["summary"] = stem.with_suffix(".profile.txt").name
            print(text.split("\ntop ")[0], flush=True)
        res["profile"] = files
        return res


def sweep_setup(a: argparse.Namespace, model: Path, shape: str, config: str,
                chunk: int | None, n: int, tokens: int, block_tokens: int, out: Path,
                tag: str) -> tuple[list[dict], dict]:
    """One engine of the sweep: the fill pass and one batch per hit rate (``none``: a fresh
    batch and the same again), then the profiled batch if asked for."""
    kvb = kv_bytes_per_token(shape, a.dtype)
    vocab = SHAPES[shape][5]
    key = config if chunk is None else f"{config}@{chunk}"
    batch_bytes = n * tokens * kvb
    on_disk = config == SWEEP_DISK_CONFIG
    cpu_bytes = int(batch_bytes * (a.sweep_disk_cpu_factor if on_disk else a.sweep_cpu_factor))
    disk = None
    if on_disk:
        folder = Path(a.scratch) / f"sweep-disk-{shape}"
        shutil.rmtree(folder, ignore_errors=True)
        disk = (folder, int(batch_bytes * 2.5))
    kvt = sweep_transfer_config(config, cpu_bytes, chunk, block_tokens, a.gpu_copy,
                                int(a.sweep_sync_load_mib * 2**20),
                                None if a.sweep_max_loading < 0 else a.sweep_max_loading, disk,
                                a.promote, a.sweep_promotion_reserve,
                                None if a.sweep_load_starts < 0 else a.sweep_load_starts,
                                None if a.sweep_load_queue_mib < 0
                                else int(a.sweep_load_queue_mib * 2**20),
                                None if a.sweep_load_direct is None
                                else a.sweep_load_direct == "on",
                                None if a.sweep_load_waves is None
                                else a.sweep_load_waves == "on",
                                a.sweep_load_wave_streams)
    kvt = with_io_threads(with_switch_interval(kvt, a.switch_ms), a.io_threads)
    plan = sweep_plan(config, n, a.sweep_hit_rates, a.sweep_rounds)
    prompts = sweep_prompts(max(max(b) for _, _, b in plan) + 1, tokens, vocab,
                            seed=1000 + list(SHAPES).index(shape))
    engine_kw: dict = {}
    if a.sweep_max_batched_tokens:
        engine_kw["max_num_batched_tokens"] = a.sweep_max_batched_tokens
    if config in SWEEP_SCHEDULER_CONFIGS:
        engine_kw["scheduler_cls"] = SCHEDULER_CLS
    timings: dict = {"cpu_tier_bytes": cpu_bytes if kvt else 0}
    print(f"[sweep] {shape} {key}: {n} prompts x {tokens} tokens = "
          f"{batch_bytes / 2**30:.2f} GiB of KV a batch; CPU tier {cpu_bytes / 2**30:.2f} GiB",
          flush=True)
    max_len = tokens + 16
    gpu_blocks = sweep_gpu_blocks(n, tokens, block_tokens, a.sweep_gpu_cache_batches, max_len)
    timings["gpu_blocks"] = gpu_blocks
    trace = None
    if a.sweep_trace and config in SWEEP_SCHEDULER_CONFIGS:
        # the engine-core process records its steps and copy jobs (tiering/step_trace.py)
        from tiering.step_trace import ENV as TRACE_ENV

        trace = out / f"prefill_sweep_{tag}_{shape}_{key.replace('@', '_')}.trace"
        for old_file in out.glob(trace.name + ".*.jsonl"):
            old_file.unlink()
        os.environ[TRACE_ENV] = str(trace)
    try:
        eng = SweepEngine(a, model, key, kvt, gpu_blocks, max_len, [tokens],
                          max_num_seqs=a.sweep_max_num_seqs or None,
                          prefix_caching=a.sweep_prefix_caching,
                          engine_kw=engine_kw)
    finally:
        if trace is not None:
            os.environ.pop(TRACE_ENV, None)
    eng.gpu_block_tokens = block_tokens
    rows: list[dict] = []
    timeline = None
    # the engine is closed whatever stops the setup (its warm-up included): an engine process
    # left holding the GPU's memory keeps every later setup from starting
    try:
        if kvt is not None and a.sweep_warm_hits:
            timings.update(eng.warm_hits(tokens, vocab))
            print(f"[sweep] {shape} {key}: kernels warmed by hit rounds of "
                  f"{timings['warm_hit_sizes']} prompts ({timings['warm_hit_requests']} hits, "
                  f"{timings['warm_hit_s']:.1f} s)", flush=True)
        timings["init_s"], timings["weights_s"] = eng.init_s, eng.weights_s
        if a.sweep_timeline_s > 0 and kvt is not None:
            tl_path = out / (f"prefill_sweep_{tag}_{shape}_{key.replace('@', '_')}"
                             ".timeline.jsonl.gz")
            timeline = StackTimeline(tl_path, a.sweep_timeline_s)
            timings["timeline"] = {"file": tl_path.name, "error": timeline.error}
        for bi, (kind, rate, batch) in enumerate(plan):
            if timeline is not None:
                timeline.start(f"{bi}:{kind}:{rate:g}")
            try:
                t_batch = time.perf_counter()
                res = eng.run_batch([prompts[i] for i in batch])
                res["t0"], res["t1"] = t_batch, time.perf_counter()
            finally:
                if timeline is not None:
                    timeline.stop()
            seen = round(rate * n / 100) if kind == "hit" else 0
            row = {"shape": shape, "config": config,
                   "chunk_tokens": chunk or default_chunk_tokens(config, block_tokens,
                                                                 not a.cpu_platform),
                   "batch": kind, "hit_rate": rate,
                   "round": sum(1 for x in rows if (x["batch"], x["hit_rate"]) == (kind, rate)),
                   "prompts": n, "prompt_tokens": tokens,
                   "prefix_caching": a.sweep_prefix_caching, "hash_algo": a.prefix_hash_algo,
                   "cuda_graphs": a.cuda_graphs, "seen_prompts": seen, "tokens_per_s": n * tokens / res["wall_s"],
                   "blocks_loaded": res["from_cpu"] / block_tokens,
                   "blocks_per_s": res["from_cpu"] / block_tokens / res["wall_s"],
                   "kv_bytes_per_block": kvb * block_tokens, **res}
            rows.append(row)
            lat = res["latency"]
            slowest = "  ".join(f"{k} {v['requests']} (max {v['max_s']:.2f} s)"
                                for k, v in lat.items() if v["max_s"] is not None)
            print(f"[sweep] {shape} {key:<9} {kind:<4} {rate:5.0f}% seen: "
                  f"{row['tokens_per_s']:9.0f} tok/s  {res['wall_s']:6.2f} s  from CPU "
                  f"{res['from_cpu']:.0f} tokens ({row['blocks_per_s']:.0f} blocks/s)"
                  + (f"  requests: {slowest}" if slowest else ""), flush=True)
            if on_disk:  # the file tier's writes of the batch's new prompts end first
                row["settle"] = eng.settle(0.5, sync=True)
            elif kvt is not None:  # the batch's new prompts' stores finish before the next one
                time.sleep(0.3 + (n - seen) * tokens * kvb / 20e9)
        if a.profile and kvt is not None:
            last = plan[-1][2]
            stem = out / f"prefill_sweep_{tag}_{shape}_{key.replace('@', '_')}"
            expect = rows[-1]["wall_s"]
            res = eng.profiled_batch([prompts[i] for i in last], a.profile, stem, expect)
            timings["profiled"] = {k: v for k, v in res.items() if k != "first_tokens"}
            print(f"[sweep] {shape} {key} profiled batch: {n * tokens / res['wall_s']:.0f} "
                  f"tok/s under the profilers; files {res['profile']}", flush=True)
    finally:
        try:
            if timeline is not None:
                timings["timeline"].update(samples=timeline.samples, error=timeline.error)
            eng.close()
        except Exception:  # said, not raised: it would hide why the setup stopped
            import traceback

            print(f"[sweep] {shape} {key}: closing the engine failed", flush=True)
            traceback.print_exc()
        finally:
            if disk is not None:
                shutil.rmtree(disk[0], ignore_errors=True)
    if trace is not None:
        timings["trace"] = write_trace_summaries(trace, rows)
    return rows, timings


def write_trace_summaries(trace: Path, rows: list[dict]) -> str | None:
    """The step table of each measured batch of an engine traced with --sweep-trace, into
    TRACE.txt (tiering.step_trace.summarize); its name, or None if the engine wrote no rows."""
    from tiering.step_trace import load, summarize

    files = sorted(str(f) for f in trace.parent.glob(trace.name + ".*.jsonl"))
    if not files:
        print(f"[sweep] no step trace rows under {trace}", flush=True)
        return None
    trace_rows = load(files)
    parts = []
    for r in rows:
        if "t0" in r:
            parts.append(f"== {r['shape']} {r['config']} {r['batch']} {r['hit_rate']:g}% seen: "
                         f"{r['tokens_per_s']:.0f} tok/s, {r['wall_s']:.3f} s\n"
                         + summarize(trace_rows, r["t0"], r["t1"]))
    path = trace.with_suffix(".txt")
    path.write_text("\n\n".join(parts) + "\n")
    print(f"[sweep] step tables: {path.name}", flush=True)
    return path.name


def latency_split(outs: list[Any]) -> dict[str, dict[str, float | int | None]]:
    """A batch's first-token latencies (vLLM's ``first_token_latency``: seconds from arrival),
    split into the requests served cached tokens (``loaded``: from the CPU tier, promoted from
    a disk tier included) and those computed whole (``computed``): count, median and max of
    each (None where vLLM gave no latency). A batch's wall time is its slowest request's: this
    says which kind that was (the disk-backed sweep's slow 100% batch, docs/benchmarks.md)."""
    parts: dict[str, list[float]] = {"loaded": [], "computed": []}
    counts = dict.fromkeys(parts, 0)
    for o in outs:
        kind = "loaded" if (o.num_cached_tokens or 0) > 0 else "computed"
        counts[kind] += 1
        lat = getattr(o.metrics, "first_token_latency", 0.0) if o.metrics else 0.0
        if lat and lat > 0:
            parts[kind].append(float(lat))
    return {k: {"requests": counts[k],
                "median_s": statistics.median(v) if v else None,
                "max_s": max(v) if v else None} for k, v in parts.items()}


def sweep_medians(rows: list[dict], setup: tuple[str, Any], rate: float) -> dict | None:
    """One setup's batches at one hit rate (one per ``--sweep-rounds``) as their median
    ``tokens_per_s`` and ``blocks_per_s``, the range of ``tokens_per_s``, and the share served
    from a disk tier; None if the setup ran no batch at that rate."""
    rs = [x for x in rows if (x["config"], x["chunk_tokens"]) == setup and x["hit_rate"] == rate]
    if not rs:
        return None
    tps = [x["tokens_per_s"] for x in rs]
    disk = [x["from_disk"] / (x["prompts"] * x["prompt_tokens"]) for x in rs if x.get("from_disk")]
    return {"tokens_per_s": statistics.median(tps), "min": min(tps), "max": max(tps),
            "batches": len(rs), "blocks_loaded": statistics.median(x["blocks_loaded"] for x in rs),
            "blocks_per_s": statistics.median(x["blocks_per_s"] for x in rs),
            "disk_share": statistics.median(disk) if disk else 0.0}


def sweep_table(rows: list[dict], rates: list[float]) -> str:
    """tokens/s per setup and hit rate (the median of its batches, with their range where a
    rate ran several), the speed-up over no offloading, and each of our setups over vLLM's
    spec (``cpu``) where both ran."""
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == shape and r["batch"] == "hit"]
        if not rs:
            continue
        none = [r["tokens_per_s"] for r in rs if r["config"] == "none"]
        base = statistics.mean(none) if none else None
        r0 = rs[0]
        lines.append(f"\nPrefill sweep, {shape}: {r0['prompts']} prompts of "
                     f"{r0['prompt_tokens']} tokens a batch, max_tokens 1, prefix caching "
                     f"{'on' if r0.get('prefix_caching') else 'off'}"
                     + (f" (hash {r0['hash_algo']})" if r0.get("hash_algo", "sha256") != "sha256"
                        else "")
                     + f", {r0.get('cuda_graphs', 'eager')} launches; "
                     "tokens/s (x no offloading"
                     + (f", {base:.0f} tok/s" if base else "") + "); blocks/s loaded from CPU")
        lines.append("| setup | " + " | ".join(f"{x:g}%" for x in rates) + " |")
        lines.append("|---|" + "---|" * len(rates))
        setups = list(dict.fromkeys((r["config"], r["chunk_tokens"]) for r in rs))
        medians = {(su, rate): sweep_medians(rs, su, rate) for su in setups for rate in rates}
        for setup in setups:
            cells = []
            for rate in rates:
                m = medians[setup, rate]
                if m is None:
                    cells.append("")
                    continue
                cell = f"{m['tokens_per_s']:.0f}"
                if m["batches"] > 1:
                    cell += f" [{m['min']:.0f}-{m['max']:.0f}]"
                if base:
                    cell += f" ({m['tokens_per_s'] / base:.2f}x)"
                if m["blocks_loaded"]:
                    cell += f" {m['blocks_per_s']:.0f} b/s"
                if m["disk_share"]:  # tokens served from a file tier, of the batch's
                    cell += f", {m['disk_share']:.0%} disk"
                cells.append(cell)
            name = (setup[0] if setup[0] in SWEEP_NO_OFFLOAD_CONFIGS
                    else f"{setup[0]} ({setup[1]}-token chunks)")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        vllm_spec = next((su for su in setups if su[0] == "cpu"), None)
        for setup in setups:
            if vllm_spec is None or setup[0] not in OURS_SWEEP_CONFIGS:
                continue
            cells = []
            for rate in rates:
                ours, theirs = medians[setup, rate], medians[vllm_spec, rate]
                cells.append(f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.3f}"
                             if ours and theirs else "")
            lines.append(f"| {setup[0]} ÷ cpu | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_plot(rows: list[dict], path: Path) -> None:
    """tokens/s against the hit rate, one line per setup, one panel per shape (the source
    article's figure)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[sweep] matplotlib missing: no plot", flush=True)
        return
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    if not shapes:
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        rs = [r for r in rows if r["shape"] == shape and r["batch"] == "hit"]
        for setup in dict.fromkeys((r["config"], r["chunk_tokens"]) for r in rs):
            pts = [(rate, m["tokens_per_s"]) for rate in sorted({r["hit_rate"] for r in rs})
                   if (m := sweep_medians(rs, setup, rate)) is not None]
            label = (setup[0] if setup[0] in SWEEP_NO_OFFLOAD_CONFIGS
                     else f"{setup[0]} ({setup[1]} tok)")
            ax.plot([p[0] for p in pts], [p[1] / 1000 for p in pts], marker="o", label=label)
        ax.set_title(f"{shape}: prefill of unique prompts", fontsize=10)
        ax.set_xlabel("CPU hit rate %")
        ax.set_ylabel("k prompt tokens/s")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[sweep] plot: {path}", flush=True)


def sweep_main(a: argparse.Namespace, t0: float) -> None:
    """``--phases prefill-sweep``: every shape of ``--sweep-shapes`` in turn, each setup one
    engine; JSON, table and plot written after every engine."""
    scratch = Path(a.scratch)
    reset_scratch(scratch)  # before anything else: a wrong --scratch is refused at once
    import vllm

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    block_tokens = 128 if a.cpu_platform else 16
    chunks: list[int | None] = list(a.sweep_chunk_tokens) or [None]
    tokens = a.sweep_prompt_tokens
    stem = out / f"prefill_sweep_{a.tag}"
    info = {"vllm": vllm.__version__, "argv": sys.argv[1:], "shapes": a.sweep_shapes,
            "configs": a.sweep_configs, "hit_rates": a.sweep_hit_rates,
            "rounds": a.sweep_rounds,
            "chunk_tokens": [c or "default" for c in chunks], "prompt_tokens": tokens,
            "gpu_block_tokens": block_tokens,
            "kv_layout": kv_layout_label(), "cuda_graphs": a.cuda_graphs}
    rows: list[dict] = []
    timings: dict = {}
    budget = StepBudget(a.budget_s, t0)

    def save() -> None:
        info["total_s"] = time.perf_counter() - t0
        stem.with_suffix(".json").write_text(json.dumps(
            {"info": info, "timings": timings, "rows": rows}, indent=1))
        stem.with_suffix(".md").write_text(sweep_table(rows, a.sweep_hit_rates) + "\n")

    for shape in a.sweep_shapes:
        n = a.sweep_prompts or SWEEP_PROMPTS.get(shape, 64)
        model = write_model(scratch / f"model-{shape}", shape, max(4096, 2 * tokens))
        # the setups without offloading once (no chunk size), first
        steps: list[tuple[str, int | None]] = [(c, None) for c in SWEEP_NO_OFFLOAD_CONFIGS
                                               if c in a.sweep_configs]
        steps += [(c, ch) for ch in chunks for c in a.sweep_configs
                  if c not in SWEEP_NO_OFFLOAD_CONFIGS]
        for config, chunk in steps:
            key = f"{shape}/{config}" + ("" if chunk is None else f"@{chunk}")
            if not budget.fits(f"sweep-{shape}", config):
                print(f"[sweep] {key} skipped (--budget-s {a.budget_s:.0f}: "
                      f"{budget.spent():.0f}s spent)", flush=True)
                timings[key] = {"skipped": "budget"}
                continue
            t = time.perf_counter()
            try:
                got, tim = sweep_setup(a, model, shape, config, chunk, n, tokens, block_tokens,
                                       out, a.tag)
                rows += got
                timings[key] = tim
            except Exception as exc:  # report and go on with the next setup
                import traceback

                traceback.print_exc()
                timings[key] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
            took = time.perf_counter() - t
            timings[key]["wall_s"] = took
            budget.took(f"sweep-{shape}", config, took)
            print(f"[sweep] {key} done in {took:.0f}s", flush=True)
            save()
            gc.collect()
    save()
    text = sweep_table(rows, a.sweep_hit_rates)
    print(text, flush=True)
    sweep_plot(rows, stem.with_suffix(".png"))
    print(f"[sweep] total {time.perf_counter() - t0:.0f}s; results in {stem}.*", flush=True)
    sys.stdout.flush()
    os._exit(0)  # do not hang on engine-core teardown


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--from-json":
        render(Path(sys.argv[2]))
        return
    a = parse()
    t0 = time.perf_counter()
    if a.cpu_platform:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if a.kv_layout:  # read by the engine-core processes this one starts
        os.environ["VLLM_KV_CACHE_LAYOUT"] = a.kv_layout
    if SWEEP_PHASE in a.phases:
        sweep_main(a, t0)
        return
    import vllm

    scratch = Path(a.scratch)
    reset_scratch(scratch)
    max_len = max(a.lengths) + 64 + a.max_tokens
    model = write_model(scratch / f"model-{a.shape}", a.shape, max(max_len, 4096) * 2)
    sizes = shape_sizes(a.shape, a.dtype)
    kvb = sizes["kv_bytes_per_token"]
    block_size = 128 if a.cpu_platform else 16
    gpu_blocks = a.gpu_blocks or -(-int(max_len * 1.25) // block_size)
    cpu_bytes = int(a.cpu_gib * 2**30) if a.cpu_gib else auto_cpu_bytes(a.lengths, kvb)
    vocab = SHAPES[a.shape][5]
    lengths_prompts = phase_prompts(a.lengths, a.repeats, vocab)
    info = {"vllm": vllm.__version__, "shape": a.shape, "lengths": a.lengths,
            "configs": a.configs, "phases": a.phases, "kv_bytes_per_token": kvb,
            "params": sizes["params"], "weight_bytes": sizes["weight_bytes"],
            "cpu_gib": cpu_bytes / 2**30, "gpu_kv_tokens": gpu_blocks * block_size,
            "gpu_kv_bytes": gpu_blocks * block_size * kvb, "tp_cpu_fraction": a.tp_cpu_fraction,
            "max_tokens": a.max_tokens, "argv": sys.argv[1:],
            "kv_layout": kv_layout_label(), "cuda_graphs": a.cuda_graphs}
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
        (out / f"{stem}.md").write_text(f"Engines: {a.cuda_graphs} launches (--cuda-graphs)\n"
                                        + table(rows, tp_rows, a.configs) + "\n")

    budget = StepBudget.for_phases(a.budget_s, t0, a.phases)

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
        # the step's engine starts: the phases' engine and its restart, a throughput run's one
        ran = (timings.get(key, {}) if what == "phases"
               else tp_rows[-1] if tp_rows and (tp_rows[-1].get("config"),
                                                tp_rows[-1].get("cpu_fraction")) == (config, fraction)
               else {})
        starts = (ran.get("init_s"), ran.get("restart_init_s"))
        budget.took(what, config, took, tuple(x for x in starts if isinstance(x, float)))
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
