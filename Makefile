# Two entry points (see README): `make demo` runs the main job, `make test` the test suite.
# Each one creates or refreshes .venv and installs what it needs, torch first (see INSTALL_TORCH).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# Where torch comes from on a machine without nvidia-smi. Empty: pip's own configuration (PIP_INDEX_URL,
# pip.conf, find-links); if that yields a CUDA build, it is replaced by the build from TORCH_CPU_INDEX.
TORCH_INDEX_URL ?=
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.qaccel-installed

.PHONY: venv bytecode demo test test-all durations lint bench clean

# torch without a GPU: (1) torch==$(TORCH_VERSION) as pip is configured (or from TORCH_INDEX_URL);
# (2) if that is a CUDA build (torch.version.cuda set; e.g. PyPI's Linux x86-64 wheel), say so and
# reinstall torch alone from TORCH_CPU_INDEX, then drop the nvidia-*/triton wheels it pulled in;
# (3) if TORCH_CPU_INDEX cannot be reached, keep the CUDA build (it runs on CPU) and say so.
# With nvidia-smi: the CUDA build of torch in the tested range (pyproject.toml), as pip resolves it on PyPI.
define INSTALL_TORCH
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q "torch>=2.9,<2.14"; \
	else \
		$(PY) -m pip install -q $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "torch==$(TORCH_VERSION)"; \
		if $(PY) -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then \
			echo "make: no nvidia-smi, but pip installed a CUDA build of torch; replacing it with the CPU build from $(TORCH_CPU_INDEX)"; \
			if $(PY) -m pip install -q --force-reinstall --no-deps --index-url $(TORCH_CPU_INDEX) "torch==$(TORCH_VERSION)"; then \
				$(PY) -m pip freeze | grep -E '^(nvidia-|triton)' | cut -d= -f1 | xargs -r $(PY) -m pip uninstall -q -y; \
			else \
				echo "make: $(TORCH_CPU_INDEX) is not reachable; keeping the CUDA build of torch (it runs on CPU, but is larger)"; \
			fi; \
		fi; \
	fi
	$(PY) -c "import torch; print('make: torch', torch.__version__, '(CUDA build)' if torch.version.cuda else '(CPU build)')"
endef

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(INSTALL_TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

# The README's first command: gpt2-tiny on 2 CPU processes, QSDP W8G8 next to stock FSDP2, over a
# loopback shaped to 100 Mbit/s in a network namespace where root allows it (else it says why not).
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/qaccel demo --output_dir runs/demo

# The suite without its slow tier (tests marked `slow`: end-to-end runs of a minute or more, kill and
# resume runs, the wheel install, nvcc builds); goal: under 6 minutes on an idle 2-core machine.
# `make test-all` runs everything, as CI does (.ci/run; goal: under 12 minutes), and prints the slowest.
# Three pytest workers (pytest-xdist), each taking whole test files (module fixtures run once): an end-to-end
# test keeps the 2 cores busy about three quarters of its time (process start-up, file writes, waits on
# peers, collective timeouts), and the unit tests use one core; more workers fill the gaps. Measured on the
# idle 2-core machine, whole suite: 2 workers 22 min 11 s (3070 tests), 3 workers 20 min 51 s (3081 tests).
# TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 3
PYTEST := $(PY) -m pytest -q --timeout=900 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: $(STAMP) bytecode
	$(PYTEST) -m "not slow" --durations=10

test-all: $(STAMP) bytecode
	$(PYTEST) --durations=30

# The tests start a few hundred Python processes (ranks, launchers, CLIs), each importing qaccel: compile it
# once here, since a machine with PYTHONDONTWRITEBYTECODE set (as ours) would otherwise compile every module
# from source in every process (about 0.3 s of CPU each). Python still reads the .pyc files under that setting.
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 qaccel tests scripts > /dev/null

# Rewrites tests/DURATIONS.md (kept in the repo, so a change that adds minutes shows in review) from a
# whole-suite run (nothing is written when a test fails), or from the log of one: DURATIONS_FROM=ci.log.
DURATIONS_FROM ?=
DURATIONS_LOG := $(or $(DURATIONS_FROM),runs/test-all-durations.log)
durations: $(STAMP)
	$(if $(DURATIONS_FROM),,mkdir -p runs && $(PYTEST) --durations=40 > $(DURATIONS_LOG) 2>&1 || { tail -40 $(DURATIONS_LOG); exit 1; })
	grep -qE '^[0-9]+ passed' $(DURATIONS_LOG) && ! grep -qE '^[0-9]+ passed.* failed|^[0-9]+ failed|[0-9]+ error' $(DURATIONS_LOG)
	{ echo "# The slowest tests of \`make test-all\`"; echo; \
	  echo "Written by \`make durations\` from one whole-suite run; rerun it when a change adds or removes a slow test."; \
	  echo "Tests marked \`slow\` run only in \`make test-all\` and CI (.ci/run); the rest also in \`make test\`."; echo; \
	  echo '```'; sed -n '/slowest .*durations/,/short test summary info\|^[0-9]* passed/p' $(DURATIONS_LOG) | grep -E '^[0-9.]+s '; echo '```'; echo; \
	  grep -E '^[0-9]+ passed' $(DURATIONS_LOG) | tail -1; } > tests/DURATIONS.md
	cat tests/DURATIONS.md

lint: $(STAMP)
	$(VENV)/bin/ruff check qaccel tests scripts

bench: $(STAMP)
	$(VENV)/bin/qaccel bench quant --json bench_results/quant.json
	$(VENV)/bin/qaccel bench comm --json bench_results/comm.json

clean:
	rm -rf $(VENV) build *.egg-info
