# `make demo` and `make test` work on a fresh machine: they create the venv and build first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
NATIVE_SOURCES := $(wildcard csrc/*.cpp csrc/*.h csrc/cpu/*.cpp csrc/cpu/*.h csrc/cuda/*.cu csrc/cuda/*.cpp csrc/cuda/*.h)

.PHONY: venv build test demo bench clean

venv: $(VENV)/.deps-stamp
build: $(VENV)/.build-stamp

$(VENV)/.deps-stamp: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -r requirements-dev.txt
	touch $@

$(VENV)/.build-stamp: $(VENV)/.deps-stamp setup.py pyproject.toml $(NATIVE_SOURCES)
	$(PIP) install --quiet --no-build-isolation --no-deps -e .
	touch $@

test: build
	$(PY) -m pytest -q

demo: build
	$(PY) -m zerofast.demo

bench: build
	$(PY) benchmarks/run.py

clean:
	rm -rf build zerofast/_C*.so *.egg-info $(VENV)
