# The two commands of the README: `make demo` and `make test`.
# `make setup` installs what both need, idempotently.
SHELL := /bin/bash
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
MODEL := models/SmolLM2-135M-Instruct
DEMO_DATA := data/demo
RUN := PATH=$(BIN):$$PATH

.PHONY: setup demo test lint format slurm bench clean

setup: $(VENV)/.installed $(MODEL)/config.json $(DEMO_DATA)/part-0.parquet

$(VENV)/.installed: pyproject.toml requirements/cpu-constraints.txt scripts/setup-venv.sh
	bash scripts/setup-venv.sh $(VENV)
	touch $@

$(MODEL)/config.json: | $(VENV)/.installed
	$(BIN)/python scripts/make_demo_model.py $(MODEL)

$(DEMO_DATA)/part-0.parquet: scripts/make_demo_data.py | $(VENV)/.installed
	$(BIN)/python scripts/make_demo_data.py $(DEMO_DATA)

demo: setup
	$(RUN) snakemake --profile profiles/local

# The one-node Slurm cluster the tests submit to (needs root).
slurm:
	bash scripts/slurm-up.sh

lint: setup
	$(RUN) ruff check .
	$(RUN) ruff format --check .
	$(RUN) snakefmt --check Snakefile workflow/rules
	$(RUN) snakemake --lint --configfile config/config.yaml

format: setup
	$(RUN) ruff format .
	$(RUN) ruff check --fix .
	$(RUN) snakefmt Snakefile workflow/rules

test: setup slurm lint
	$(RUN) pytest $(PYTEST_ARGS)

# The throughput benchmark: raw vLLM against shardgen's generate path, one
# engine, alternating runs; writes bench/results/throughput.{json,md}.
bench: setup
	$(RUN) python bench/throughput.py

clean:
	rm -rf results .snakemake
