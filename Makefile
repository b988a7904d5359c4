# The two entry points of the README. Each creates its own virtualenv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: run test lint format bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.run-installed: setup.py | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test-installed: setup.py | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $@

## Set up and run the main job on its embedded default (CPU).
run: $(VENV)/.run-installed
	$(BIN)/python -m experiments.tiny_generate --out-dir runs/tiny_generate

## Set up and run lint + the default test suite.
test: $(VENV)/.test-installed
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

format: $(VENV)/.test-installed
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) runs .pytest_cache
