# dpd-router: the two commands of the quick start are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test lint unit integration install clean

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

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

unit: $(VENV)/.installed-test
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

integration: $(VENV)/.installed-test
	$(BIN)/python -m pytest tests/integration $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build src/*.egg-info
