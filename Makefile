# Two entry points, each of which sets up everything on a fresh machine first:
#   make train   the example training run (4 CPU ranks by default), logging the param norm
#   make test    the test suite
# and the Megatron-Bridge pretrain() tests, in their own environment: make test-bridge
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.norm_optim-installed
# The CPU wheel of torch; on a CUDA machine pip picks the matching build of the same release.
TORCH  ?= torch==2.13.0

.PHONY: train test bench setup test-bridge

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

# Megatron-Bridge's real pretrain() on CPU ranks (tests/test_megatron_bridge.py, which skips in
# the environment above). `pip install megatron-bridge` fails on a CPU machine, so Bridge and the
# megatron-core it is built on go in with --no-deps, then what its pretraining path needs (the
# bridge-test extra). Bridge 0.6.2 needs Python >= 3.12 (pyenv's newest 3.12, else python3.12).
BRIDGE        ?= megatron-bridge==0.6.2 megatron-core==0.19.2
PYTHON_BRIDGE ?= $(shell p=$$(pyenv prefix "$$(pyenv latest 3.12 2>/dev/null)" 2>/dev/null) \
                   && echo "$$p/bin/python" || command -v python3.12)
BRIDGE_VENV   ?= .venv-bridge
BRIDGE_STAMP  := $(BRIDGE_VENV)/.norm_optim-installed

$(BRIDGE_STAMP): setup.cfg pyproject.toml
	$(PYTHON_BRIDGE) -m venv $(BRIDGE_VENV)
	$(BRIDGE_VENV)/bin/python -m pip install -q --upgrade pip
	$(BRIDGE_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(BRIDGE_VENV)/bin/python -m pip install -q --no-deps $(BRIDGE)
	$(BRIDGE_VENV)/bin/python -m pip install -q -e ".[test,bridge-test]"
	touch $(BRIDGE_STAMP)

test-bridge: $(BRIDGE_STAMP)
	$(BRIDGE_VENV)/bin/python -m pytest -q tests/test_megatron_bridge.py $(ARGS)
