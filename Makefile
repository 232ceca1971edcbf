# make test: set up .venv, build the extension and the gtest binary, run pytest and ctest.
# make demo: same set-up, then the main job (python -m cp_cache demo).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.cp_cache-deps
EXT_STAMP := build/.extension-built
GTEST_BIN := build/cpp/cp_cache_tests
NATIVE_SOURCES := $(wildcard csrc/*.cpp csrc/*.h)
WHEELS_STAMP := .cache/torch_npu/.fetched
GTEST_SOURCES := $(wildcard tests/cpp/*.cpp) CMakeLists.txt
TORCH_VERSION ?= 2.13.0
# The demo/bench flags: make demo DEMO_ARGS="--steps 10"
DEMO_ARGS ?=

.PHONY: all build test pytest ctest demo bench compare doctor clean torch-npu-wheels

all: test

$(PY):
	python3 -m venv $(VENV)

# torch first and pinned, so that nothing later pulls another (CUDA) build.
$(DEPS_STAMP): | $(PY)
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)" pybind11 ninja pytest cmake numpy matplotlib "transformers==5.24.0"
	@if ! dpkg -s libgtest-dev >/dev/null 2>&1; then \
		echo "installing libgtest-dev"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q libgtest-dev; \
	fi
	touch $@

# The package, installed editable into .venv (its extension built in place under python/).
$(EXT_STAMP): $(DEPS_STAMP) $(NATIVE_SOURCES) csrc/sources.txt setup.py pyproject.toml
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	@mkdir -p build && touch $@

# torch_npu's Python files (its CP handlers, op schemas, meta functions), fetched once from
# the package index into .cache/torch_npu: the ground truth of the coexistence and fidelity
# tests and of `compare`.
$(WHEELS_STAMP): $(EXT_STAMP)
	$(PY) -m cp_cache.testing.torch_npu_wheel fetch
	@touch $@

$(GTEST_BIN): $(DEPS_STAMP) $(NATIVE_SOURCES) $(GTEST_SOURCES)
	$(VENV)/bin/cmake -S . -B build/cpp -G Ninja \
		-DCMAKE_MAKE_PROGRAM=$(CURDIR)/$(VENV)/bin/ninja \
		-DCMAKE_PREFIX_PATH="$$($(PY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
	$(VENV)/bin/cmake --build build/cpp

build: $(EXT_STAMP) $(GTEST_BIN)

torch-npu-wheels: $(WHEELS_STAMP)

pytest: $(EXT_STAMP) $(WHEELS_STAMP)
	$(PY) -m pytest tests/python

ctest: $(GTEST_BIN)
	$(VENV)/bin/ctest --test-dir build/cpp --output-on-failure --timeout 300

test: build
	$(MAKE) --no-print-directory pytest
	$(MAKE) --no-print-directory ctest

demo: $(EXT_STAMP)
	$(PY) -m cp_cache demo $(DEMO_ARGS)

bench: $(EXT_STAMP)
	$(PY) -m cp_cache bench $(DEMO_ARGS)

compare: $(EXT_STAMP) $(WHEELS_STAMP)
	$(PY) -m cp_cache compare $(DEMO_ARGS)

doctor: $(EXT_STAMP)
	$(PY) -m cp_cache doctor

clean:
	rm -rf build python/cp_cache/_C*.so python/*.egg-info
