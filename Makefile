# Thin wrapper around CMake. Every target installs what the build needs first (see deps).
BUILD ?= build
JOBS  ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=
# the traces `make demo` replays (in the repository; TRACES=DIR reads others)
TRACES ?= tests/data
# The Python whose search path decides where `make install` puts the package (a venv's or a
# conda env's python for those).
PYTHON ?= python3

.PHONY: all build deps pydeps test test-gpu demo install clean sanitize sanitize-gpu

all: build

# Debian packages the build needs; installed only when missing. A machine that cannot reach a
# package registry (the GPU machine) may carry the .deb files in .debs/: those whose headers are
# missing are unpacked in place instead.
DEB_PKGS := cmake pkg-config zlib1g-dev libcmocka-dev uthash-dev
deps:
	@need=""; \
	[ -f /usr/include/zlib.h ]   || need="$$need zlib1g-dev"; \
	[ -f /usr/include/cmocka.h ] || need="$$need libcmocka0 libcmocka-dev"; \
	[ -f /usr/include/uthash.h ] || need="$$need uthash-dev"; \
	command -v cmake >/dev/null && command -v pkg-config >/dev/null || need="$$need cmake pkg-config"; \
	if [ -n "$$need" ]; then \
	  if ls .debs/*.deb >/dev/null 2>&1; then \
	    for p in $$need; do for f in .debs/$${p}_*.deb; do [ -f "$$f" ] && dpkg -x "$$f" /; done; done; \
	    ldconfig 2>/dev/null || true; \
	  else \
	    SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	    echo "installing:$$need"; \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(DEB_PKGS); \
	  fi; \
	fi

# The Python tests run with Debian's interpreter and CPU torch; the install check makes a venv
# and builds the package offline with Debian's setuptools and wheel. Installed only when missing.
pydeps:
	@need=""; \
	[ -x /usr/bin/python3 ] || need="$$need python3"; \
	/usr/bin/python3 -c 'import torch' 2>/dev/null || need="$$need python3-torch"; \
	/usr/bin/python3 -c 'import numpy' 2>/dev/null || need="$$need python3-numpy"; \
	/usr/bin/python3 -c 'import pytest' 2>/dev/null || need="$$need python3-pytest"; \
	/usr/bin/python3 -c 'import ensurepip' 2>/dev/null || need="$$need python3-venv"; \
	/usr/bin/python3 -c 'import setuptools, wheel' 2>/dev/null || need="$$need python3-setuptools python3-wheel"; \
	if [ -n "$$need" ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  echo "installing:$$need"; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$need; \
	fi

$(BUILD)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD) $(CMAKE_FLAGS)

build: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

# Every test; those labelled gpu need a CUDA device and, without one, are listed as skipped.
test: build pydeps
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	@cd $(BUILD) && gpu=$$(ctest -N -L gpu | sed -n 's/^ *Test *#[0-9]*: //p' | xargs); \
	  [ -z "$$gpu" ] || echo "GPU-only tests (label gpu, skipped above when no CUDA device is usable): $$gpu"

# The same suite against the cuda backend, plus GPU-only tests and the shim's scripts. The
# Python tests (emu, Debian's CPU torch) are left to `make test`; the GPU machine runs
# tests/gpu/test_torch_offload_gpu.py with its own torch (README).
test-gpu: build
	cd $(BUILD) && SPW_TEST_BACKEND=cuda ctest --output-on-failure -j 1 -LE python

# The demo's three parts: the offload engine streaming layers under a budget, an allocation
# trace replayed, and spillway.torch offloading a model (Debian's CPU torch, installed by pydeps).
demo: build pydeps
	./$(BUILD)/spillway bench stream --policy lru,plan --summary
	./$(BUILD)/spillway replay $(TRACES)/gpt2_train.trace.gz
	SPILLWAY_LIBRARY=$(CURDIR)/$(BUILD)/libspillway.so PYTHONPATH=$(CURDIR)/python PYTHONDONTWRITEBYTECODE=1 \
	  /usr/bin/python3 python/examples/offload_demo.py

# PREFIX/bin/spillway, the library and its interposer, spillway.h, spillway.pc, and the Python
# package where $(PYTHON) searches under PREFIX (PREFIX=~/.local: its user site).
install: build
	SPW_PYTHON="$(PYTHON)" cmake --install $(BUILD) $(if $(PREFIX),--prefix "$(PREFIX)")

sanitize: deps
	cmake -S . -B build-asan -DSPW_SANITIZE=address -DSPW_WITH_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ctest --output-on-failure -j $(JOBS) -LE "gpu|python|timing"
	cmake -S . -B build-tsan -DSPW_SANITIZE=thread -DSPW_WITH_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug
	cmake --build build-tsan -j $(JOBS)
	cd build-tsan && TSAN_OPTIONS=halt_on_error=1 ctest --output-on-failure -j $(JOBS) -L concurrency

# The cuda backend under AddressSanitizer + UndefinedBehaviorSanitizer (GPU machine). The CUDA
# driver needs the shadow gap; leaks are checked by the emu build above (the driver keeps
# allocations until exit).
sanitize-gpu: deps
	cmake -S . -B build-asan-cuda -DSPW_SANITIZE=address -DCMAKE_BUILD_TYPE=Debug
	cmake --build build-asan-cuda -j $(JOBS)
	cd build-asan-cuda && SPW_TEST_BACKEND=cuda ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=0 \
	  UBSAN_OPTIONS=halt_on_error=1 ctest --output-on-failure -j 1 -E '^shim' -LE "python|timing"

clean:
	rm -rf $(BUILD) build-asan build-tsan build-asan-cuda
