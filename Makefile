# Everything runs inside .venv, created on first use with the torch that fits the machine
# (scripts/venv-torch): the torch PY already has (nothing downloaded); else on Linux without an NVIDIA
# GPU the CPU build from PyTorch's CPU index (the configured index's +cpu build where that one cannot be
# reached); else torch==$(TORCH_VERSION) from the default index. torch is pinned here, not in pyproject,
# and every later install is held to the torch the venv got (.venv/torch-constraints.txt), so `make`
# never pulls a multi-gigabyte CUDA build by accident. `make demo TORCH=<requirement>` installs exactly that.
# Each target installs only what it needs into the one .venv: `make demo` torch, stoker and
# matplotlib (the `demo` extra, well under a minute); `make test` adds the test extras on top.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH ?=
SOURCES := pyproject.toml setup.py $(wildcard csrc/*.c csrc/*.h)
TEST_EXTRAS := test,test-jax,test-formats,test-remote,test-gpu-decode,test-torchvision,plot,dist,integrations,video

.PHONY: demo test bench dist setup clean

# the venv with torch: the part both targets share (a pip new enough for editable pyproject installs)
$(VENV)/.torch: scripts/venv-torch
	scripts/venv-torch "$(PY)" $(VENV) $(TORCH_VERSION) $(TORCH_CPU_INDEX) "$(TORCH)"
	@touch $@

$(VENV)/.demo: $(VENV)/.torch $(SOURCES)
	$(BIN)/pip install -q -c $(VENV)/torch-constraints.txt -e ".[demo]"
	@touch $@

$(VENV)/.test: $(VENV)/.torch $(SOURCES) .ci/constraints.txt
	$(BIN)/pip install -q -c .ci/constraints.txt -c $(VENV)/torch-constraints.txt -e ".[$(TEST_EXTRAS)]"
	@touch $@

setup: $(VENV)/.test

# STOKER_PYTHON=an interpreter that has torch and stoker's dependencies already (a GPU machine's own
# image, perhaps with no package index): the demo runs from this checkout with it, no .venv, nothing
# downloaded; the region decoder is built in place first (optional: without it, whole-image decode).
ifdef STOKER_PYTHON
demo:
	-$(STOKER_PYTHON) setup.py -q build_ext --inplace
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(STOKER_PYTHON) -m stoker.cli demo
else
demo: $(VENV)/.demo
	$(BIN)/stoker demo
endif

test: $(VENV)/.test
	$(BIN)/python -m pytest -q

bench: $(VENV)/.demo
	$(BIN)/stoker bench

# the wheel and sdist into dist/, installed and run without torch in clean venvs (as CI does)
dist: $(VENV)/.test
	.ci/dist-check

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
