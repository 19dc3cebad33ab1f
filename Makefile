# Two entry points, each of which sets up everything on a fresh machine first:
#   make train   the example training run (4 CPU ranks by default), logging the param norm
#   make test    the test suite
# Both run on megatron-core 0.16.1 (Python 3.11, the newest release it supports). The same on the
# newest megatron-core (Python >= 3.12): make train-latest / make test-latest; Megatron-Bridge's
# pretrain() tests, in an environment of their own: make test-bridge. The other release lines:
# make test-0.14, test-0.15, test-0.17, test-0.18; megatron-core main: make test-main. The torch
# range: make test-torch-floor (setup.cfg's torch floor), make test-torch-newest.
# make lint checks the code with ruff (rules and layout: pyproject.toml [tool.ruff]) and for
# merge-conflict markers.
# make gpu-check measures the CUDA path on one GPU, one table (docs/gpu-check.md); no CUDA: skips.
PYTHON ?= python3
VENV   ?= .venv
MCORE  ?= megatron-core==0.16.1
EXTRAS ?= test
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.norm_optim-installed
# The CPU wheel of torch on Python 3.11; on 3.12 (and on a CUDA machine) pip picks the CUDA build
# of the same release, which also runs on the CPU.
TORCH  ?= torch==2.13.0

# The newest megatron-core and a Python it supports: pyenv's newest 3.12, else python3.12; on the
# newest torch pip installs (the CUDA build, which runs on the CPU), so that this environment is
# also the torch range's newest leg (below): one torch download fewer in CI.
MCORE_LATEST  ?= megatron-core==0.19.2
TORCH_LATEST  ?= torch==2.14.1
PYTHON_LATEST ?= $(shell p=$$(pyenv prefix "$$(pyenv latest 3.12 2>/dev/null)" 2>/dev/null) \
                   && echo "$$p/bin/python" || command -v python3.12)
LATEST := PYTHON="$(PYTHON_LATEST)" VENV=.venv-latest MCORE="$(MCORE_LATEST)" \
          TORCH="$(TORCH_LATEST)"
# Megatron-Bridge's pretrain() tests get an environment of their own: Bridge needs an
# nvidia-resiliency-ext the registry has only in a release (0.4.1) that breaks a plain
# `import megatron.core`, so it must not go into .venv-latest. `pip install megatron-bridge` fails
# on a CPU machine (a source-only dependency downloads a binary; megatron-core[dev] pins a release
# the registry lacks): Bridge goes in with --no-deps, then what its pretraining path needs (the
# bridge-test extra), on a copy of .venv-latest (torch and megatron-core already in it).
BRIDGE_VENV  ?= .venv-bridge
BRIDGE_STAMP := $(BRIDGE_VENV)/.norm_optim-installed

# Every other minor release line, each a CI leg (make test-0.14 ...): the newest patch of the
# line, in a copy of the environment of its Python (.venv: 3.11, up to 0.16; .venv-latest: 3.12,
# which 0.17 and later need) with megatron-core swapped, so torch is installed once per Python.
# LEG_TESTS is what these legs run: the tests that read megatron-core (README, "Supported
# megatron-core versions"); LEG_TESTS=tests runs the whole suite. Not in it: test_harness.py
# (under every other test already, 30-40 s a leg alone), test_counting_rule.py and
# test_install_options.py (no megatron-core), test_megatron_fsdp_v2.py (main only), Bridge.
# The in-between lines (0.15, 0.17, 0.18) each run one of two disjoint halves of the subset
# (SHARE_<line>, pytest --share: by a hash of each test's id; 0.17 and 0.18 together run all of
# it); 0.14, 0.16, 0.19 and main run it whole, so either side of any one version gate has a line
# that runs all of it. SHARE_0.17= runs the whole subset there.
LINES      := 0.14 0.15 0.17 0.18
MCORE_0.14 := 0.14.0
MCORE_0.15 := 0.15.3
MCORE_0.17 := 0.17.1
MCORE_0.18 := 0.18.2
BASE_0.14  := .venv
BASE_0.15  := .venv
BASE_0.17  := .venv-latest
BASE_0.18  := .venv-latest
SHARE_0.15 := 0/2
SHARE_0.17 := 1/2
SHARE_0.18 := 0/2
LEG_TESTS  ?= tests/test_layouts.py tests/test_ownership.py tests/test_breakdowns.py \
              tests/test_transparency.py tests/test_staleness.py tests/test_checkpoint.py \
              tests/test_optimizer_kinds.py tests/test_hangs.py tests/test_errors.py \
              tests/test_megatron_fsdp.py tests/test_megatron_lm.py tests/test_versions.py \
              tests/test_torch_fsdp2.py tests/test_sinks.py tests/test_mimo.py \
              tests/test_audit.py \
              tests/test_step_norms.py tests/test_step_norms_muon.py \
              tests/test_step_norms_precision_aware.py tests/test_watch.py \
              tests/test_declarations.py tests/test_name_exchange.py tests/test_scale.py \
              tests/test_remainders.py tests/test_example.py tests/test_gpu_check.py \
              tests/test_watch_megatron_lm.py tests/test_resume.py tests/test_resume_megatron_lm.py \
              tests/test_resume_example.py

# The torch range: setup.cfg's floor and the newest torch pip installs, each with the tests that
# read the optimizer's rule and state (TORCH_TESTS). The floor: a copy of .venv (Python 3.11) with
# megatron-core 0.14.0 (the oldest line) and torch swapped (the registry's build of that release
# is a CUDA one, ~2.5 GB: one download, once). The newest: .venv-latest itself (TORCH_LATEST), so
# CI's make test-latest runs these tests there with the rest of the suite.
TORCH_FLOOR  ?= 2.5.1
TORCH_TESTS  ?= tests/test_step_norms.py tests/test_audit.py
TORCH_LEGS   := floor
TORCH_floor  := $(TORCH_FLOOR)
BASE_floor   := .venv
MCORE_floor  := megatron-core==0.14.0

# Tests that read no megatron-core release (pure kernels and names, the code's own rules and
# types, the benchmark script) and the launcher's own (test_harness.py: every other test runs
# under the launcher, on every line): CI runs them once, in make test, and the other whole-suite
# legs leave them out (make test-latest SKIP_ONCE=1).
ONCE_TESTS   := tests/test_typing.py tests/test_benchmark.py tests/test_kernels.py \
                tests/test_package_structure.py tests/test_rollups.py \
                tests/test_patching.py tests/test_harness.py tests/test_shares.py
SKIP_ONCE    ?=
ONCE_IGNORED  = $(if $(SKIP_ONCE),$(ONCE_TESTS:%=--ignore=%))

# megatron-core main (the 0.20 line, what users of a Megatron-LM checkout run), in a copy of
# .venv-latest: by default the wheel of main next to the project (../shared/megatron-main/), or
# any megatron-core source: MCORE_MAIN=path/to/Megatron-LM (a checkout) or a wheel. It is
# reinstalled when MCORE_MAIN changes or holds a file newer than the last install.
MCORE_MAIN ?= $(lastword $(sort $(wildcard ../shared/megatron-main/megatron_core-*.whl)))
MAIN_VENV  ?= .venv-main
MAIN_STAMP := $(MAIN_VENV)/.norm_optim-installed
MAIN_FROM  := $(MAIN_VENV)/.megatron-core-source
# What it runs: the subset and what only main has (Megatron-FSDP v2); MAIN_TESTS=tests runs the
# whole suite.
MAIN_TESTS ?= $(LEG_TESTS) tests/test_megatron_fsdp_v2.py

# $(call copy-env,BASE,NEW): NEW becomes a copy of the environment BASE (.venv or .venv-latest,
# made first), without BASE's stamp. Hard links where the file system has them (seconds, no
# second 5 GB): pip unlinks a file before it writes one, so installing into the copy never
# changes BASE. The copy is run only through its bin/python, which is what makes it safe to move.
define copy-env
	$(MAKE) setup $(if $(filter .venv-latest,$(1)),$(LATEST))
	rm -rf $(2)
	cp -al $(1) $(2) 2>/dev/null || { rm -rf $(2) && cp -a $(1) $(2); }
	rm -f $(2)/.norm_optim-installed
endef

.PHONY: train test lint bench gpu-check setup train-latest test-latest bench-latest test-bridge
.PHONY: setup-latest
.PHONY: $(LINES:%=test-%) test-main mcore-main $(TORCH_LEGS:%=test-torch-%) test-torch-newest

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
	$(BIN)/python -m pytest -q $(ONCE_IGNORED) $(ARGS)

# ruff check: the lint rules; ruff format --check: the layout ruff format would give; no
# tracked file may keep a merge-conflict marker line.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	bash .ci/no-conflict-markers

bench: $(STAMP)
	$(BIN)/python -m benchmarks.param_norm --quick $(ARGS)

gpu-check: $(STAMP)
	$(BIN)/python -m benchmarks.gpu_check $(ARGS)

train-latest test-latest bench-latest setup-latest:
	$(MAKE) $(@:-latest=) $(LATEST) ARGS='$(ARGS)' SKIP_ONCE='$(SKIP_ONCE)'

$(BRIDGE_STAMP): setup.cfg pyproject.toml
	$(call copy-env,.venv-latest,$(BRIDGE_VENV))
	$(BRIDGE_VENV)/bin/python -m pip install -q --no-deps megatron-bridge==0.6.2
	$(BRIDGE_VENV)/bin/python -m pip install -q -e ".[test,bridge-test]"
	touch $(BRIDGE_STAMP)

# Megatron-Bridge's real pretrain() on CPU ranks (tests/test_megatron_bridge.py skips elsewhere).
test-bridge: $(BRIDGE_STAMP)
	$(BRIDGE_VENV)/bin/python -m pytest -q tests/test_megatron_bridge.py tests/test_audit_bridge.py \
	  tests/test_watch_bridge.py $(ARGS)

$(LINES:%=.venv-%/.norm_optim-installed): .venv-%/.norm_optim-installed: setup.cfg pyproject.toml
	$(call copy-env,$(BASE_$*),.venv-$*)
	.venv-$*/bin/python -m pip install -q --no-deps megatron-core==$(MCORE_$*)
	touch $@

$(LINES:%=test-%): test-%: .venv-%/.norm_optim-installed
	.venv-$*/bin/python -m pytest -q $(LEG_TESTS) $(if $(SHARE_$*),--share=$(SHARE_$*)) $(ARGS)

$(TORCH_LEGS:%=.venv-torch-%/.norm_optim-installed): .venv-torch-%/.norm_optim-installed: \
    setup.cfg pyproject.toml
	$(call copy-env,$(BASE_$*),.venv-torch-$*)
	$(if $(MCORE_$*),.venv-torch-$*/bin/python -m pip install -q --no-deps "$(MCORE_$*)")
	.venv-torch-$*/bin/python -m pip install -q "torch==$(TORCH_$*)"
	touch $@

$(TORCH_LEGS:%=test-torch-%): test-torch-%: .venv-torch-%/.norm_optim-installed
	.venv-torch-$*/bin/python -m pytest -q $(TORCH_TESTS) $(ARGS)

test-torch-newest:
	$(MAKE) setup $(LATEST)
	.venv-latest/bin/python -m pytest -q $(TORCH_TESTS) $(ARGS)

$(MAIN_STAMP): setup.cfg pyproject.toml
	$(call copy-env,.venv-latest,$(MAIN_VENV))
	touch $@

test-main:
	@test -n "$(MCORE_MAIN)" || { echo "make test-main: no wheel in ../shared/megatron-main/;" \
	  "point MCORE_MAIN at a megatron-core source (a Megatron-LM checkout or a wheel)" >&2; exit 2; }
	$(MAKE) $(MAIN_STAMP)
	@if [ "$$(cat $(MAIN_FROM) 2>/dev/null)" != "$(MCORE_MAIN)" ] \
	    || [ -n "$$(find "$(MCORE_MAIN)" -newer $(MAIN_FROM) -print -quit)" ]; then \
	  echo "installing megatron-core from $(MCORE_MAIN) into $(MAIN_VENV)"; \
	  $(MAIN_VENV)/bin/python -m pip install -q --no-deps --force-reinstall "$(MCORE_MAIN)" \
	    && echo "$(MCORE_MAIN)" > $(MAIN_FROM); \
	fi
	$(MAIN_VENV)/bin/python -m pytest -q $(MAIN_TESTS) $(ARGS)

# What make test-main installs (empty: nothing found; .ci/run then skips it).
mcore-main:
	@echo "$(MCORE_MAIN)"
