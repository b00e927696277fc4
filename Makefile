# batchd — `make serve` and `make test` work on a fresh clone (they install first).
PYTHON     ?= python3
VENV       ?= .venv
BIN        := $(VENV)/bin
# Pinned first so pip takes the CPU build; override e.g. TORCH_SPEC="torch==2.14.1".
TORCH_SPEC ?= torch==2.13.0
STAMP      := $(VENV)/.installed
SERVE_ARGS ?=
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: install protos check-protos serve test lint format bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

protos: install
	$(BIN)/python protos/generate.py

check-protos: install
	$(BIN)/python protos/generate.py --check

serve: install
	$(BIN)/batchd serve --model-repository examples/models $(SERVE_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	mkdir -p .typecheck/batchd
	for d in protos server worker client; do ln -sfn ../../$$d .typecheck/batchd/$$d; done
	$(BIN)/mypy

# The echo ceiling, the raw model and batchd side by side: bench/results/results.{json,md}, plots.
bench: install
	$(BIN)/python bench/run.py $(BENCH_ARGS)

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: install check-protos lint
	$(BIN)/pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
