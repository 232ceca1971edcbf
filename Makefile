# make test: set up .venv, build the extension and the gtest binary, run pytest and ctest.
# make demo: same set-up, then the main job (python -m cp_cache demo).
# make test TORCH_VERSION=2.13.0: the same on another supported torch, in its own virtualenv.
# make matrix: the fast subset of the suite on every supported torch (MATRIX_VERSIONS).
SHELL := /bin/bash
# The default pairs with torch-npu 2.14.0 (which requires torch 2.14), the stack a new Ascend user installs.
DEFAULT_TORCH_VERSION := 2.14.1
TORCH_VERSION ?= $(DEFAULT_TORCH_VERSION)
ACCELERATE_VERSION := 1.15.0
TRL_VERSION := 1.16.0
DATASETS_VERSION := 5.2.0
MATRIX_VERSIONS ?= 2.13.0 2.14.1 2.15.0
# Each torch has its own virtualenv and gtest build; the default keeps the plain .venv.
ifeq ($(TORCH_VERSION),$(DEFAULT_TORCH_VERSION))
VENV ?= .venv
else
VENV ?= .venv-torch-$(TORCH_VERSION)
endif
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.cp_cache-deps
# The extension is built in place under python/ (one file for every virtualenv): the stamp names
# the virtualenv it was built for, and building for another removes the others' stamps.
EXT_STAMP := build/.extension-built-$(subst /,_,$(VENV))
GTEST_DIR := build/cpp/torch-$(TORCH_VERSION)
GTEST_BIN := $(GTEST_DIR)/cp_cache_tests
NATIVE_SOURCES := $(wildcard csrc/*.cpp csrc/*.h)
WHEELS_STAMP := .cache/torch_npu/.fetched
GTEST_SOURCES := $(wildcard tests/cpp/*.cpp) CMakeLists.txt
# A release past this machine's pip cap (torch<=2.14.1 where /etc/xdg/pip says so) is asked for by
# an exact pin: the virtualenv's pip reads an empty constraints file instead of the cap.
NO_CONSTRAINTS := build/no-constraints.txt
VENV_PIP := PIP_CONSTRAINT=$(CURDIR)/$(NO_CONSTRAINTS) $(PY) -m pip
# The demo/bench flags: make demo DEMO_ARGS="--steps 10"
DEMO_ARGS ?=

.PHONY: all build test pytest ctest demo bench compare doctor clean torch-npu-wheels matrix fast-test pip-install-check

all: test

$(PY):
	python3 -m venv $(VENV)

# torch first and pinned, so that nothing later pulls another (CUDA) build.
$(NO_CONSTRAINTS):
	@mkdir -p $(dir $@) && touch $@

$(DEPS_STAMP): | $(PY) $(NO_CONSTRAINTS)
	$(VENV_PIP) install --quiet "torch==$(TORCH_VERSION)"
	$(VENV_PIP) install --quiet "torch==$(TORCH_VERSION)" pybind11 ninja pytest cmake numpy matplotlib "transformers==5.24.0" "accelerate==$(ACCELERATE_VERSION)" "trl==$(TRL_VERSION)" "datasets==$(DATASETS_VERSION)"
	@if ! dpkg -s libgtest-dev >/dev/null 2>&1; then \
		echo "installing libgtest-dev"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q libgtest-dev; \
	fi
	touch $@

# The package, installed editable into .venv (its extension built in place under python/).
$(EXT_STAMP): $(DEPS_STAMP) $(NATIVE_SOURCES) csrc/sources.txt setup.py pyproject.toml build_backend.py
	@rm -f build/.extension-built-*
	$(VENV_PIP) install --quiet --no-build-isolation --no-deps -e .
	@mkdir -p build && touch $@

# torch_npu's Python files (its CP handlers, op schemas, meta functions), fetched once from
# the package index into .cache/torch_npu: the ground truth of the coexistence and fidelity
# tests and of `compare`.
$(WHEELS_STAMP): $(EXT_STAMP)
	$(PY) -m cp_cache.testing.torch_npu_wheel fetch
	@touch $@

$(GTEST_BIN): $(DEPS_STAMP) $(NATIVE_SOURCES) $(GTEST_SOURCES)
	$(VENV)/bin/cmake -S . -B $(GTEST_DIR) -G Ninja \
		-DCMAKE_MAKE_PROGRAM=$(CURDIR)/$(VENV)/bin/ninja \
		-DPython_EXECUTABLE=$(CURDIR)/$(PY) >/dev/null
	$(VENV)/bin/cmake --build $(GTEST_DIR)

build: $(EXT_STAMP) $(GTEST_BIN)

torch-npu-wheels: $(WHEELS_STAMP)

pytest: $(EXT_STAMP) $(WHEELS_STAMP)
	$(PY) -m pytest tests/python

ctest: $(GTEST_BIN)
	$(VENV)/bin/ctest --test-dir $(GTEST_DIR) --output-on-failure --timeout 300

test: build
	$(MAKE) --no-print-directory pytest
	$(MAKE) --no-print-directory ctest

demo: $(EXT_STAMP)
	$(PY) -m cp_cache demo $(DEMO_ARGS)

bench: $(EXT_STAMP) $(WHEELS_STAMP)
	$(PY) -m cp_cache bench $(DEMO_ARGS)

compare: $(EXT_STAMP) $(WHEELS_STAMP)
	$(PY) -m cp_cache compare $(DEMO_ARGS)

doctor: $(EXT_STAMP)
	$(PY) -m cp_cache doctor

# The fast subset on every supported torch, one virtualenv each; a summary line per version.
matrix:
	@failed=""; for v in $(MATRIX_VERSIONS); do \
		echo "== torch $$v"; \
		if $(MAKE) --no-print-directory TORCH_VERSION=$$v fast-test; then echo "== torch $$v: passed"; \
		else echo "== torch $$v: FAILED"; failed="$$failed $$v"; fi; \
	done; \
	if [ -n "$$failed" ]; then echo "matrix failed on:$$failed"; exit 1; fi; echo "matrix passed on: $(MATRIX_VERSIONS)"

# The fast subset: every test not marked slow, and the gtest binary.
fast-test: build $(WHEELS_STAMP)
	$(PY) -m pytest tests/python -m "not slow" -q
	$(MAKE) --no-print-directory ctest

# `pip install .` as a user types it: a copy of the tracked sources installed into a fresh
# virtualenv that has torch (and nothing of cp_cache's set-up), then the selftest there.
PIP_CHECK := build/pip-install-check
pip-install-check: $(NO_CONSTRAINTS)
	rm -rf $(PIP_CHECK) && mkdir -p $(PIP_CHECK)/src
	git ls-files -z | xargs -0 cp --parents -t $(PIP_CHECK)/src
	python3 -m venv $(PIP_CHECK)/venv
	PIP_CONSTRAINT=$(CURDIR)/$(NO_CONSTRAINTS) $(PIP_CHECK)/venv/bin/pip install --quiet "torch==$(TORCH_VERSION)"
	cd $(PIP_CHECK) && PIP_CONSTRAINT=$(CURDIR)/$(NO_CONSTRAINTS) venv/bin/pip install --quiet ./src
	cd $(PIP_CHECK) && venv/bin/cp-cache doctor && venv/bin/cp-cache selftest

clean:
	rm -rf build python/cp_cache/_C*.so python/cp_cache/native-build.txt python/*.egg-info
