# Troupe — the two set-up commands:
#   make demo   install dependencies, build, run the main job
#   make test   install dependencies, build, run every test
# Other targets: deps, build, sanitize (ASan+UBSan CPU tests), cpu-only (build without CUDA), format.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
ifdef CI
CMAKE_FLAGS += -DTROUPE_WERROR=ON
endif

.PHONY: all deps configure build test demo sanitize cpu-only format clean

all: build

deps:
	@bash scripts/install-deps.sh

configure: deps
	@mkdir -p $(BUILD)
	@cmake -S . -B $(BUILD) -G Ninja $(CMAKE_FLAGS) > $(BUILD)/configure.log 2>&1 || (cat $(BUILD)/configure.log; exit 1)
	@grep -E "^-- Troupe" $(BUILD)/configure.log || true

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 900

demo: build
	@bash scripts/demo.sh $(BUILD)

sanitize: deps
	cmake -S . -B build-asan -G Ninja -DTROUPE_SANITIZE=ON -DTROUPE_WITH_CUDA=OFF -DTROUPE_BUILD_BENCH=OFF $(CMAKE_FLAGS)
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j $(JOBS) -LE gpu

cpu-only: deps
	cmake -S . -B build-cpu -G Ninja -DTROUPE_WITH_CUDA=OFF $(CMAKE_FLAGS)
	cmake --build build-cpu -j $(JOBS)

format:
	git ls-files '*.h' '*.cc' '*.cu' '*.cuh' | xargs clang-format -i

clean:
	rm -rf build build-asan build-cpu
