# Two entry points, each of which sets up everything on a fresh machine first:
#   make train   the example training run (4 CPU ranks by default), logging the param norm
#   make test    the test suite
# Both run on megatron-core 0.16.1 (Python 3.11, the newest release it supports). The same on the
# newest megatron-core (Python >= 3.12): make train-latest / make test-latest; Megatron-Bridge's
# pretrain() tests, in an environment of their own: make test-bridge.
# make lint checks the code with ruff (rules and layout: pyproject.toml [tool.ruff]).
PYTHON ?= python3
VENV   ?= .venv
MCORE  ?= megatron-core==0.16.1
EXTRAS ?= test
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
# Megatron-Bridge's pretrain() tests get an environment of their own: Bridge needs an
# nvidia-resiliency-ext the registry has only in a release (0.4.1) that breaks a plain
# `import megatron.core`, so it must not go into .venv-latest. `pip install megatron-bridge` fails
# on a CPU machine (a source-only dependency downloads a binary; megatron-core[dev] pins a release
# the registry lacks): Bridge goes in with --no-deps, then what its pretraining path needs (the
# bridge-test extra), on a copy of .venv-latest (torch and megatron-core already in it; the
# copy is run only through its bin/python, which is what makes it safe to move).
BRIDGE_VENV  ?= .venv-bridge
BRIDGE_STAMP := $(BRIDGE_VENV)/.norm_optim-installed

.PHONY: train test lint bench setup train-latest test-latest bench-latest test-bridge

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q "$(MCORE)" -e ".[$(EXTRAS)]"
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/python examples/train_gpt.py $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

# ruff check: the lint rules; ruff format --check: the layout ruff format would give.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m benchmarks.param_norm --quick $(ARGS)

train-latest test-latest bench-latest:
	$(MAKE) $(@:-latest=) $(LATEST) ARGS='$(ARGS)'

$(BRIDGE_STAMP): setup.cfg pyproject.toml
	$(MAKE) setup $(LATEST)
	rm -rf $(BRIDGE_VENV) && cp -a .venv-latest $(BRIDGE_VENV)
	$(BRIDGE_VENV)/bin/python -m pip install -q --no-deps megatron-bridge==0.6.2
	$(BRIDGE_VENV)/bin/python -m pip install -q -e ".[test,bridge-test]"
	touch $(BRIDGE_STAMP)

# Megatron-Bridge's real pretrain() on CPU ranks (tests/test_megatron_bridge.py skips elsewhere).
test-bridge: $(BRIDGE_STAMP)
	$(BRIDGE_VENV)/bin/python -m pytest -q tests/test_megatron_bridge.py $(ARGS)
