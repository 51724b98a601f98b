# Two commands do all the set-up on a fresh machine:
#   make serve   -> environment + default model, then the CPU worker on 127.0.0.1:8080
#   make test    -> the same environment plus test dependencies, then lint and the whole suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Pinned: an unpinned torch on a machine without one pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PORT ?= 8080

.PHONY: setup test-setup bytecode kernels serve serve-ray test lint bench bench-concurrency clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e .
	touch $@

# The chat page is tested in a real browser: Debian's Chromium, installed when missing and we may.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install --quiet -e ".[test]"
	command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || \
		{ apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q chromium; }; }
	touch $@

$(VENV)/.installed-ray: $(VENV)/.installed
	$(PIP) install --quiet -e ".[ray]"
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed-test
	$(PIP) install --quiet -e ".[test,bench]"
	touch $@

setup: $(VENV)/.installed

test-setup: $(VENV)/.installed-test

# The package's compiled bytecode, brought up to date (quick when it is). An editable install leaves its
# compiling to the first import, and where the environment forbids writing bytecode
# (PYTHONDONTWRITEBYTECODE) every start compiled the whole package again: 0.13 s of a 1 s start.
bytecode: setup
	$(PY) -m compileall -q src

# The C kernels for this CPU, built at set-up so that a worker's first start only loads them (compiling is
# about 4 s of it on two cores otherwise). A worker started without this builds them itself.
kernels: setup
	$(PY) -m llorch.kernels

serve: setup bytecode kernels
	$(VENV)/bin/llorch-cpu-worker --port $(PORT) $(ARGS)

# Engines as Ray Serve replicas behind one endpoint: make serve-ray ARGS="--replicas 2 --replica-cpus 1"
serve-ray: $(VENV)/.installed-ray bytecode kernels
	$(VENV)/bin/llorch-ray-serve --port $(PORT) $(ARGS)

lint: test-setup
	$(PY) -m ruff check src tests bench

test: test-setup bytecode kernels
	$(PY) -m ruff check src tests bench
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(VENV)/.installed-bench bytecode kernels
	$(PY) bench/speed.py $(ARGS)

bench-concurrency: test-setup bytecode
	$(PY) bench/concurrency.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
