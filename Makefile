# Two commands on a fresh machine: `make run` (install + a short training run) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install run test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $(STAMP)

# Test-only: pytest, Hugging Face transformers on PyTorch CPU as the numerical reference, and libtpu
# (the tpu extra) so that a TPU train step can be compiled ahead of time here.
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q torch==2.13.0 || echo "PyTorch CPU not installable: the Hugging Face comparison tests will skip"
	$(BIN)/python -m pip install -q -e ".[test,tpu]"
	touch $(TEST_STAMP)

install: $(STAMP)

# A tiny LLaMA on Python's own source code, 8 simulated CPU devices, mesh dp=2 fsdp=2 tp=2.
run: install
	$(BIN)/meshlm train --devices=8 --mesh_dim=2,2,2,1 --model=tiny --steps=120 --batch_size=8 --seq_len=256 \
		--lr=3e-3 --log_every=10 --output_dir=outputs/run

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench: install
	$(BIN)/python bench/train_throughput.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
