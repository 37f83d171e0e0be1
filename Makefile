# longctx: `make test` and `make serve` do all set-up themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?= smollm2-135m-instruct

.PHONY: test serve lint typecheck pytest bench bench-resume bench-peers pull clean redis compiler

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

# mypy's cache lives beside the other caches of $LONGCTX_HOME, not in the checkout: a new clone
# re-checks only the files that differ (mypy validates each cached file by its content hash), in
# seconds instead of a minute.
MYPY_CACHE ?= $(or $(LONGCTX_HOME),$(HOME)/.cache/longctx)/mypy
typecheck: $(STAMP)
	$(VENV)/bin/mypy --cache-dir $(MYPY_CACHE) engine kvstore sessions tools api tests bench

# Tests use LONGCTX_TEST_REDIS_URL (default redis://127.0.0.1:6379/15) or, when none answers, a
# private redis-server of their own; tests that stop, pause or fill Redis, and the managed mode of
# `longctx serve`, always start their own: install redis-server when it is missing.
redis: $(STAMP)
	@(command -v redis-server && command -v redis-cli) >/dev/null || \
		( (apt-get update -q && apt-get install -y -q redis-server) || \
		  (sudo apt-get update -q && sudo apt-get install -y -q redis-server) )

# The compiled decode step (`--compile`, on by default) builds C++ with g++ against the Python
# headers; without them the engine runs eager with a warning: install them when missing.
compiler: $(STAMP)
	@( command -v g++ >/dev/null && test -f "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ) || \
		( (apt-get update -q && apt-get install -y -q g++ python3-dev) || \
		  (sudo apt-get update -q && sudo apt-get install -y -q g++ python3-dev) )

# Two pytest workers (pytest-xdist), one test module at a time each (its module-scoped servers
# start once): model loads, server starts and subprocesses of one overlap the other's work. The
# modules go out longest first (tests/module_costs.py), not by their number of tests.
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE): the
# suite starts hundreds of Python processes (servers, engine processes, ranks, the CLI), each of
# which would compile the project's modules again. Only the plugins the tests use are loaded:
# the other installed ones (schemathesis', faker's, anyio's) cost each worker seconds of imports
# and assertion rewriting before it collects.
PYTEST_WORKERS ?= 2
PYTEST_ENV := PYTHONDONTWRITEBYTECODE= PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
PYTEST_PLUGINS := -p xdist.plugin -p _hypothesis_pytestplugin
pytest: $(STAMP) pull redis compiler
	$(PYTEST_ENV) $(PY) -m pytest $(PYTEST_PLUGINS) -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

test: lint typecheck pytest

# `make print-VAR`: a variable as make expands it (bench/suite_time.py runs pytest as above).
print-%:
	@echo '$($*)'

# `make serve`: the HTTP server on the demo model. Without REDIS_URL it runs its own redis-server
# (installed here if missing) under $LONGCTX_HOME/redis; `make serve REDIS_URL=redis://host:6379/0`
# keeps conversations in that Redis instead. More flags: SERVE_ARGS="--dtype float32 ...".
HOST ?= 127.0.0.1
PORT ?= 8000
REDIS_URL ?=
SERVE_ARGS ?=
serve: $(STAMP) pull
ifeq ($(REDIS_URL),)
	@(command -v redis-server && command -v redis-cli) >/dev/null || \
		( (apt-get update -q && apt-get install -y -q redis-server) || \
		  (sudo apt-get update -q && sudo apt-get install -y -q redis-server) )
	@echo "longctx: starting the server on $(MODEL): http://$(HOST):$(PORT)/v1 (managed redis-server)"
	$(VENV)/bin/longctx serve --model $(MODEL) --host $(HOST) --port $(PORT) --served-model-name demo $(SERVE_ARGS)
else
	@echo "longctx: starting the server on $(MODEL): http://$(HOST):$(PORT)/v1 (Redis at $(REDIS_URL))"
	$(VENV)/bin/longctx serve --model $(MODEL) --host $(HOST) --port $(PORT) --redis-url $(REDIS_URL) --served-model-name demo $(SERVE_ARGS)
endif

bench: $(STAMP) pull
	$(PY) bench/engine_throughput.py

bench-resume: $(STAMP) pull redis
	$(PY) bench/resume.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

# llama.cpp for the side-by-side benchmark. Its default build crashes on AMX CPUs (llama.cpp
# issue 20824), so AMX is off and AVX-512 on; about 5 minutes on 2 cores.
LLAMA_CPP_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

bench-peers: $(STAMP)
	$(PY) -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" \
		$(PY) -m pip install -q --no-cache-dir llama-cpp-python==0.3.36
