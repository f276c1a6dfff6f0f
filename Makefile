# Two entry points (see README): `make demo` runs the main job, `make test` the test suite.
# Each one creates or refreshes .venv and installs what it needs; the CPU torch wheel goes in first
# so that no multi-GB CUDA build is pulled on machines without a GPU.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.qaccel-installed

.PHONY: venv demo test lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q "torch>=2.9"; \
	else \
		$(PY) -m pip install -q "torch==$(TORCH_VERSION)"; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/qaccel env
	$(VENV)/bin/qaccel selfcheck

test: $(STAMP)
	$(PY) -m pytest -q --timeout=900

lint: $(STAMP)
	$(VENV)/bin/ruff check qaccel tests scripts

bench: $(STAMP)
	$(VENV)/bin/qaccel bench quant --json bench_results/quant.json
	$(VENV)/bin/qaccel bench comm --json bench_results/comm.json

clean:
	rm -rf $(VENV) build *.egg-info
