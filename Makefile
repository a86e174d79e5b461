# `make demo` and `make test` work on a fresh machine: they create the venv and build first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
NATIVE_SOURCES := $(wildcard csrc/*.cpp csrc/*.h csrc/cpu/*.cpp csrc/cpu/*.h csrc/cuda/*.cu csrc/cuda/*.cpp csrc/cuda/*.h)

.PHONY: venv build test demo bench clean cuda-headers cuda-check

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

# The CUDA compile checks run inside `make test` (tests/test_cuda_build.py): about 20 s, plus about
# 10 s the first time to fetch torch's CUDA headers. Without nvcc, or where pip cannot get the
# wheels, they are skipped with a message; a source that does not compile fails the suite.
test: build cuda-headers
	$(PY) -m pytest -q

cuda-headers: venv
	$(PY) -m tools.cuda_build fetch

# The same checks alone, strict: no nvcc or no headers is a failure here, not a skip.
cuda-check: venv
	$(PY) -m tools.cuda_build fetch --strict
	ZEROFAST_REQUIRE_CUDA_CHECK=1 $(PY) -m pytest -q -rs -p no:cacheprovider tests/test_cuda_build.py

demo: build
	$(PY) -m zerofast.demo

bench: build
	$(PY) benchmarks/run.py

clean:
	rm -rf build zerofast/_C*.so *.egg-info $(VENV)
