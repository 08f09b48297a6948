# Thin wrapper around CMake. Every target installs what the build needs first (see deps).
BUILD ?= build
JOBS  ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=
TRACES ?= ../shared/traces

.PHONY: all build deps test test-gpu demo install clean sanitize

all: build

# Debian packages the build needs; installed only when missing. Where apt cannot reach a
# registry (the GPU machine), .debs/ may hold the packages, unpacked in place.
DEB_PKGS := cmake pkg-config zlib1g-dev libcmocka-dev uthash-dev
deps:
	@missing=""; \
	for h in /usr/include/zlib.h /usr/include/cmocka.h /usr/include/uthash.h; do \
	  [ -f $$h ] || missing="yes"; done; \
	command -v cmake >/dev/null && command -v pkg-config >/dev/null || missing="yes"; \
	if [ -n "$$missing" ]; then \
	  if [ -d .debs ] && ls .debs/*.deb >/dev/null 2>&1; then \
	    for f in .debs/*.deb; do dpkg -x $$f / ; done; ldconfig; \
	  else \
	    SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(DEB_PKGS); \
	  fi; \
	fi

$(BUILD)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD) $(CMAKE_FLAGS)

build: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -LE gpu

# The same suite against the cuda backend, plus GPU-only tests and the shim's scripts.
test-gpu: build
	cd $(BUILD) && SPW_TEST_BACKEND=cuda ctest --output-on-failure -j 1

demo: build
	./$(BUILD)/spillway replay $(TRACES)/gpt2_train.trace.gz --summary

install: build
	cmake --install $(BUILD) $(if $(PREFIX),--prefix $(PREFIX))

sanitize: deps
	cmake -S . -B build-asan -DSPW_SANITIZE=address -DSPW_WITH_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ctest --output-on-failure -j $(JOBS) -LE gpu
	cmake -S . -B build-tsan -DSPW_SANITIZE=thread -DSPW_WITH_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug
	cmake --build build-tsan -j $(JOBS)
	cd build-tsan && TSAN_OPTIONS=halt_on_error=1 ctest --output-on-failure -j $(JOBS) -L concurrency

clean:
	rm -rf $(BUILD) build-asan build-tsan
