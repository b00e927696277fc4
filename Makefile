# batchd — `make serve` and `make test` work on a fresh clone (they install first).
PYTHON     ?= python3
VENV       ?= .venv
BIN        := $(VENV)/bin
# Pinned first so pip takes the CPU build; override e.g. TORCH_SPEC="torch==2.14.1".
TORCH_SPEC ?= torch==2.13.0
STAMP      := $(VENV)/.installed
SERVE_ARGS ?=
PYTEST_ARGS ?=
# Test processes (pytest-xdist): most tests wait on real servers, so two keep 2 cores
# busy and halve the suite's time (6.5 to 4.5 min here). PYTEST_JOBS=0: one process.
# Tests marked `serial` (they time calls under load) run after them, alone.
PYTEST_JOBS ?= 2
BENCH_ARGS ?=

.PHONY: install protos check-protos serve test lint format bench bench-hostile fuzz clean FORCE

# The torch asked for, kept so that another TORCH_SPEC installs again (written only
# when it changes: make then sees it newer than the stamp).
TORCH_WANTED := $(VENV)/.torch-spec
$(TORCH_WANTED): FORCE
	@mkdir -p $(VENV) && echo '$(TORCH_SPEC)' | cmp -s - $@ || echo '$(TORCH_SPEC)' > $@

$(STAMP): pyproject.toml $(TORCH_WANTED)
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

# Hostile requests: the frontend's cost per byte as each dimension grows 100x,
# issue 15's attacks against a real server with a probe alongside, and what 7 MB
# JSON bodies and job lines cost everyone else, and what a client resending poison
# requests (the same one, a new one each time) costs a bystander model.
bench-hostile: install
	mkdir -p bench/results
	$(BIN)/python bench/linearity.py --json bench/results/linearity.json
	$(BIN)/python bench/attacks.py --json bench/results/attacks.json
	$(BIN)/python bench/big_json.py --json bench/results/big_json.json
	$(BIN)/python bench/poison_storm.py --inputs same --json bench/results/poison_same.json
	$(BIN)/python bench/poison_storm.py --inputs new --json bench/results/poison_new.json

# The request-path fuzzer and the server-level one, far longer than `make test` runs them.
fuzz: install
	FUZZ_EXAMPLES=20000 HOSTILE_EXAMPLES=5000 $(BIN)/pytest -p no:cacheprovider \
		tests/test_fuzz_codec.py tests/test_hostile.py -o timeout=3600

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: install check-protos lint
	$(BIN)/pytest -n $(PYTEST_JOBS) -m "not serial" $(PYTEST_ARGS)
	$(BIN)/pytest -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]  # 5: PYTEST_ARGS chose none

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
