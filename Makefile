# Everything runs inside .venv, created on first use. torch is pinned here (not in
# pyproject) so that `make` never pulls a multi-gigabyte CUDA build by accident.
# Each target installs only what it needs into the one .venv: `make demo` torch, stoker and
# matplotlib (the `demo` extra, well under a minute); `make test` adds the test extras on top.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
SOURCES := pyproject.toml setup.py csrc/jpeg_region.c
TEST_EXTRAS := test,test-jax,test-formats,test-remote,test-gpu-decode,test-torchvision,plot,dist,integrations,video

.PHONY: demo test bench dist setup clean

# the venv with torch: the part both targets share (a pip new enough for editable pyproject installs)
$(VENV)/.torch:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q "pip>=21.3"
	$(BIN)/pip install -q "$(TORCH)"
	@touch $@

$(VENV)/.demo: $(VENV)/.torch $(SOURCES)
	$(BIN)/pip install -q -e ".[demo]"
	@touch $@

$(VENV)/.test: $(VENV)/.torch $(SOURCES) .ci/constraints.txt
	$(BIN)/pip install -q -c .ci/constraints.txt -e ".[$(TEST_EXTRAS)]"
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
