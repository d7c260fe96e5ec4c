# Two commands do all set-up on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-tpu install clean-runs

install: $(STAMP)

# torch first, with pip (and uv, which has no dependencies): 2.13.0 is a CPU wheel on disk (pip's
# find-links); letting an installer resolve torch freely pulls a multi-GB CUDA build. Then the pinned
# set with uv, which downloads and byte-compiles in parallel (50 s where pip took 77 s on 2 cores; the
# installed torch satisfies the lock's pin), then this package (editable, for the CLI).
UV_VERSION := 0.13.9
$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 uv==$(UV_VERSION)
	$(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode -r requirements.lock
	$(VENV)/bin/uv pip install -q --python $(PY) --no-deps -e .
	touch $(STAMP)

# --resume: a demo stopped by Ctrl-C (or a finished one) continues instead of starting over.
demo: $(STAMP)
	$(VENV)/bin/torchlyra prepare
	$(VENV)/bin/torchlyra train --out runs/tiny --resume
	$(VENV)/bin/torchlyra eval --checkpoint runs/tiny
	$(VENV)/bin/torchlyra generate --checkpoint runs/tiny --prompt "ROMEO:" --max-tokens 100
	@echo
	@echo "metrics:     runs/tiny/metrics.jsonl"
	@echo "plots:       runs/tiny/plots/*.png (again: torchlyra plot runs/tiny)"
	@echo "checkpoints: runs/tiny/checkpoints (continue: torchlyra train --out runs/tiny --resume --steps N)"

# Two workers, whole files each (module fixtures are built once); the wall time is printed last.
# --max-worker-restart=0: a worker that crashes fails the run at once, naming its test; pytest-xdist
# 3.8 with --dist loadfile can wait forever for a replaced worker (pytest-xdist#784, #1323).
test: $(STAMP)
	@start=$$(date +%s); $(VENV)/bin/pytest -q -rs -p no:cacheprovider -n 2 --dist loadfile --max-worker-restart=0 \
	  --durations=25 tests; \
	rc=$$?; echo "make test: the suite took $$(( $$(date +%s) - start )) s wall"; exit $$rc

# The hardware tier, on a TPU host: tests/test_chip_*.py (marked `tpu`, skipped by `make test`), in ONE process
# (one program holds a chip at a time: no workers), on the chip (TORCHLYRA_TEST_TPU=1 lifts the
# suite's JAX_PLATFORMS=cpu). A host whose Python already has the stack (no venv, no index) runs
# `make test-tpu TPU_SETUP= PYTEST="python3 -m pytest"`. TPU_TESTS picks files (e.g. one at a time,
# under a time limit per command). The tier's programs go to a fresh compilation cache of its own, so
# a program compiled once (the SIGKILL test's three runs of one config) is loaded, not recompiled.
TPU_SETUP ?= $(STAMP)
PYTEST ?= $(VENV)/bin/pytest
TPU_TESTS ?= tests/test_chip_*.py
test-tpu: $(TPU_SETUP)
	@start=$$(date +%s); cache=$$(mktemp -d); TORCHLYRA_TEST_TPU=1 JAX_COMPILATION_CACHE_DIR=$$cache \
	  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 $(PYTEST) -q -rs -p no:cacheprovider -p no:xdist -m tpu \
	  --durations=15 $(TPU_TESTS); \
	rc=$$?; rm -rf $$cache; echo "make test-tpu: the tier took $$(( $$(date +%s) - start )) s wall"; exit $$rc

clean-runs:
	rm -rf runs
