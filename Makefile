# longctx: `make test` and `make serve` do all set-up themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?= smollm2-135m-instruct

.PHONY: test serve lint typecheck pytest bench pull clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

pull: $(STAMP)
	$(VENV)/bin/longctx models pull

lint: $(STAMP)
	$(VENV)/bin/ruff check engine kvstore sessions tools api tests bench
	$(VENV)/bin/ruff format --check engine kvstore sessions tools api tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy engine kvstore sessions tools api

pytest: $(STAMP) pull
	$(PY) -m pytest -q tests

test: lint typecheck pytest

serve: $(STAMP) pull
	$(VENV)/bin/longctx generate --model $(MODEL) --chat --max-tokens 64 --prompt "Hello! Who are you?"

bench: $(STAMP) pull
	$(PY) bench/engine_throughput.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
