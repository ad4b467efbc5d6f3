# Everything runs inside .venv, created on first use. torch is pinned here (not in
# pyproject) so that `make` never pulls a multi-gigabyte CUDA build by accident.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: demo test bench dist setup clean

$(BIN)/stoker: pyproject.toml setup.py csrc/jpeg_region.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test,test-jax,test-formats,test-remote,test-gpu-decode,plot,dist,integrations]"
	@touch $@

setup: $(BIN)/stoker

# STOKER_PYTHON=an interpreter that has torch and stoker's dependencies already (a GPU machine's own
# image, perhaps with no package index): the demo runs from this checkout with it, no .venv, nothing
# downloaded; the region decoder is built in place first (optional: without it, whole-image decode).
ifdef STOKER_PYTHON
demo:
	-$(STOKER_PYTHON) setup.py -q build_ext --inplace
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(STOKER_PYTHON) -m stoker.cli demo
else
demo: setup
	$(BIN)/stoker demo
endif

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/stoker bench

# the wheel and sdist into dist/, installed and run without torch in clean venvs (as CI does)
dist: setup
	.ci/dist-check

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
