# The two front-door commands (see README):  make demo   |   make test
# Both create or reuse .venv and install what they need; torch is pinned to the CPU wheel 2.13.0.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hybridflow-installed

# Two shared cores: never let OpenMP spin-wait, never let one process grab both cores by default.
export OMP_WAIT_POLICY := PASSIVE
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export RAY_DEDUP_LOGS := 0

.PHONY: install demo test lint clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,tracking,math,models,recipes]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hybridflow.quickstart

test: $(STAMP)
	bash scripts/run_tests.sh $(PY)

lint: $(STAMP)
	$(VENV)/bin/ruff check hybridflow tests scripts

clean-venv:
	rm -rf $(VENV)
