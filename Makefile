# Two entry points, each of which sets up everything on a fresh machine first:
#   make train   the example training run (4 CPU ranks by default), logging the param norm
#   make test    the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.norm_optim-installed
# The CPU wheel of torch; on a CUDA machine pip picks the matching build of the same release.
TORCH  ?= torch==2.13.0

.PHONY: train test bench setup

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/python examples/train_gpt.py $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/param_norm.py --quick $(ARGS)
