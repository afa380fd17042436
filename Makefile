PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv test demo bench clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test,experiments]"
	touch $@

venv: $(BIN)/.installed

test: venv
	$(BIN)/python -m pytest -q tests

demo: venv
	$(BIN)/python -m experiments.demo

bench: venv
	$(BIN)/python -m experiments.bench

clean:
	rm -rf $(VENV) output
