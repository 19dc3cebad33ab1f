# Two entry points, each of which sets up everything on a fresh machine first:
#   make train   the example training run (4 CPU ranks by default), logging the param norm
#   make test    the test suite
# Both run on megatron-core 0.16.1 (Python 3.11, the newest release it supports). The same on the
# newest megatron-core (Python >= 3.12): make train-latest / make test-latest.
PYTHON ?= python3
VENV   ?= .venv
MCORE  ?= megatron-core==0.16.1
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.norm_optim-installed
# The CPU wheel of torch on Python 3.11; on 3.12 (and on a CUDA machine) pip picks the CUDA build
# of the same release, which also runs on the CPU.
TORCH  ?= torch==2.13.0

# The newest megatron-core and a Python it supports: pyenv's newest 3.12, else python3.12.
MCORE_LATEST  ?= megatron-core==0.19.2
PYTHON_LATEST ?= $(shell p=$$(pyenv prefix "$$(pyenv latest 3.12 2>/dev/null)" 2>/dev/null) \
                   && echo "$$p/bin/python" || command -v python3.12)
LATEST := PYTHON="$(PYTHON_LATEST)" VENV=.venv-latest MCORE="$(MCORE_LATEST)"

.PHONY: train test bench setup train-latest test-latest bench-latest

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q "$(MCORE)" -e ".[test]"
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/python examples/train_gpt.py $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/param_norm.py --quick $(ARGS)

train-latest test-latest bench-latest:
	$(MAKE) $(@:-latest=) $(LATEST) ARGS='$(ARGS)'
