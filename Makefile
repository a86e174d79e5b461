# `make demo` and `make test` work on a fresh machine: they create the venv and build first.
# `make demo` installs the runtime dependencies only (torch, numpy, ninja); `make test` adds the
# development set (requirements-dev.txt: DeepSpeed, transformers, ...).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The torch the tests pin (the CPU wheel), so that the demo does not pull a CUDA build either.
TORCH := $(shell grep -m1 '^torch==' requirements-dev.txt)

.PHONY: runtime venv build test demo bench clean cuda-headers cuda-check wheel

runtime: $(VENV)/.runtime-stamp
venv: $(VENV)/.deps-stamp

# A plain `pip install -e .` (build isolation on): it compiles nothing, so it takes seconds.
$(VENV)/.runtime-stamp: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	@echo "== installing $(TORCH) and numpy into $(VENV)"
	$(PIP) install --quiet $(TORCH) numpy
	@echo "== installing zerofast (editable)"
	$(PIP) install --quiet -e .
	touch $@

$(VENV)/.deps-stamp: $(VENV)/.runtime-stamp requirements-dev.txt
	@echo "== installing the development dependencies (requirements-dev.txt)"
	$(PIP) install --quiet -r requirements-dev.txt
	touch $@

# Compiles the native core against the venv's torch into the user cache, showing each step, or
# finds it there already built (see `zerofast doctor`).
build: runtime
	$(PY) -m zerofast build
	touch $(VENV)/.build-stamp

# The CUDA compile checks run inside `make test` (tests/test_cuda_build.py): about 20 s, plus about
# 10 s the first time to fetch torch's CUDA headers. Without nvcc, or where pip cannot get the
# wheels, they are skipped with a message; a source that does not compile fails the suite.
# ZEROFAST_NATIVE=1: a native core that does not load fails the suite instead of falling back.
# Two workers, each taking whole files (module fixtures are made once): the suite is mostly
# single-threaded Python, so on CI's 2 cores this takes about a third off. TEST_WORKERS=0 runs it
# in this process (no xdist).
TEST_WORKERS ?= 2
test: venv build cuda-headers
	ZEROFAST_NATIVE=1 $(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

cuda-headers: venv
	$(PY) -m tools.cuda_build fetch

# The same checks alone, strict: no nvcc or no headers is a failure here, not a skip.
cuda-check: venv
	$(PY) -m tools.cuda_build fetch --strict
	ZEROFAST_REQUIRE_CUDA_CHECK=1 $(PY) -m pytest -q -rs -p no:cacheprovider tests/test_cuda_build.py

demo: build
	$(PY) -m zerofast.testing.demo

bench: venv build
	$(PY) benchmarks/run.py

# A platform wheel that carries the CPU core compiled against the venv's torch (zerofast/_prebuilt):
# installed beside the same torch build and Python it loads with no compiler. The build itself
# stays torch-free (`--no-isolation` is not needed: the core is compiled before it starts). The
# core is taken out of the checkout again, so the editable install goes on building its own.
wheel: runtime
	$(PIP) install --quiet build
	$(PY) -m zerofast.native.prebuild
	$(PY) -m build --wheel --outdir dist . ; status=$$?; rm -rf zerofast/_prebuilt; exit $$status

clean:
	rm -rf build dist zerofast/_prebuilt zerofast/_C*.so *.egg-info $(VENV)
