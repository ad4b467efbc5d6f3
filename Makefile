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
	$(BIN)/pip install -q -e ".[test,test-formats,test-remote,test-gpu-decode,plot,dist,integrations]"
	@touch $@

setup: $(BIN)/stoker

demo: setup
	$(BIN)/stoker demo

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/stoker bench

# the wheel and sdist into dist/, installed and run without torch in clean venvs (as CI does)
dist: setup
	.ci/dist-check

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
