# Two commands on a fresh machine: `make run` (install + a short training run) and `make test`.
# The newest JAX (0.12) needs Python >= 3.12: make builds the venv with python3.12 where the machine has
# one (pyenv's too), else with python3 (Python 3.11 gets JAX 0.10.2). `make PYTHON=...` picks another.
PY312 := $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),\
	$(if $(shell $(p) -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1 && echo y),$(p))))
PYTHON ?= $(or $(PY312),python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
LINT_STAMP := $(VENV)/.installed-lint
# The linter, formatter and type checker, pinned so that a clone, CI and pre-commit agree on the findings.
LINT_TOOLS := ruff==0.17.6 mypy==2.4.1

.PHONY: install run test test-fast lint bench clean clean-outputs

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $(STAMP)

# Test-only: pytest, Hugging Face transformers on PyTorch as the numerical reference, and libtpu (the
# tpu extra) so that a TPU train step can be compiled ahead of time here. On Python 3.11 PyTorch is the
# CPU build 2.13.0 where one is at hand; otherwise (Python 3.12) the test extra takes PyPI's build,
# which carries CUDA libraries (several GB) and computes on the CPU all the same.
$(TEST_STAMP): $(STAMP)
	if $(BIN)/python -c 'import sys; sys.exit(sys.version_info >= (3, 12))'; then \
		$(BIN)/python -m pip install -q torch==2.13.0 || echo "PyTorch 2.13.0 CPU not at hand: the test extra brings PyTorch"; fi
	$(BIN)/python -m pip install -q -e ".[test,tpu]"
	touch $(TEST_STAMP)

install: $(STAMP)

# A tiny LLaMA on Python's own source code, 8 simulated CPU devices, mesh dp=2 fsdp=2 tp=2. Run again, it
# says the run is done; `make run STEPS=240` continues it to step 240.
STEPS ?= 120
run: install
	$(BIN)/meshlm train --devices=8 --mesh_dim=2,2,2,1 --model=tiny --steps=$(STEPS) --batch_size=8 --seq_len=256 \
		--lr=3e-3 --log_every=10 --output_dir=outputs/run

# ruff (lint, then the formatter's check) over the tree, mypy over the core packages ([tool.mypy] files).
# On top of the test set-up, so that mypy reads the same installed libraries here, in CI and in pre-commit.
$(LINT_STAMP): $(TEST_STAMP)
	$(BIN)/python -m pip install -q $(LINT_TOOLS)
	touch $(LINT_STAMP)

lint: $(LINT_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=30

test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench: install
	$(BIN)/python bench/train_throughput.py

# The virtualenv and caches only: runs in outputs/ (checkpoints) are kept, and named.
clean:
	rm -rf $(VENV) .pytest_cache meshlm.egg-info
	find meshlm tests bench -name __pycache__ -type d -prune -exec rm -rf {} +
	@if [ -d outputs ]; then echo "kept outputs/ ($$(ls outputs | tr '\n' ' ')): make clean-outputs deletes it"; fi

# Every run in outputs/: checkpoints, metrics and converted models. Says what it deletes.
clean-outputs:
	@if [ -d outputs ]; then echo "deleting outputs/: $$(ls outputs | tr '\n' ' ')"; rm -rf outputs; fi
