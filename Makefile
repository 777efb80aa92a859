# Two commands a new user runs on a fresh machine: `make demo` and `make test`.
# Both build .venv through scripts/setup_env.sh (the one environment recipe).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test env lint gpu-check clean

env:
	@bash scripts/setup_env.sh

demo: env
	$(PY) -m tiering.demo

test: env
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

lint: env
	$(VENV)/bin/ruff check .

# GPU checks and benchmarks (run on a machine with an NVIDIA GPU; prints a short table).
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
