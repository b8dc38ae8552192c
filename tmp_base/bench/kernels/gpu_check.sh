#!/bin/bash
# bench/kernels/gpu_check.sh — one GPU-host run of the CUDA backend: build the CUDA test
# and bench targets, run the op-table CUDA test and the bf16 test (the latter also under
# compute-sanitizer memcheck), then kernel_bench and the PyTorch peer on the same shapes,
# and print the comparison table last. Logs go to $OUT (or ./gpu-out).
# Usage (from the repository root, with the deps environment sourced): bash bench/kernels/gpu_check.sh [quick]
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
log() { echo "== $*" | tee -a /tmp/summary.txt; }

# The GPU host's bundle (.gpu-deps) has libsodium's runtime but not its -dev package, and
# the top-level CMake requires it by pkg-config; the CUDA targets never link it, so a
# pkg-config file pointing at the runtime library is enough here.
if ! pkg-config --exists libsodium; then
  lib=$(dirname "$(find / -name 'libsodium.so.23*' -path '*troupe-deps*' 2>/dev/null | head -1)")
  mkdir -p /tmp/pc && printf 'Name: libsodium\nDescription: stub\nVersion: 1.0.18\nLibs: -L%s -l:libsodium.so.23\nCflags:\n' "$lib" >/tmp/pc/libsodium.pc
  export PKG_CONFIG_PATH=/tmp/pc:${PKG_CONFIG_PATH:-}
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv | tee "$out/gpu.txt"
cmake -S . -B build -G Ninja -DTROUPE_WERROR=OFF -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release \
  >/tmp/cmake.log 2>&1 || { tail -30 /tmp/cmake.log; exit 1; }
targets="kernels_op_table_cuda_test kernels_cuda_bf16_test kernel_bench"
if ! ninja -C build -j16 $targets >/tmp/build.log 2>&1; then
  grep -E "error|FAILED" -A3 /tmp/build.log | head -60
  exit 1
fi
log "build ok"

timeout 200 ./build/tests/kernels/kernels_cuda_bf16_test >"$out/bf16_test.log" 2>&1
log "kernels_cuda_bf16_test rc=$?"
grep -E "rel err|FAILED|PASSED|Failure|Expected|Which is" "$out/bf16_test.log" | head -80
timeout 240 ./build/tests/kernels/kernels_op_table_cuda_test >"$out/op_table_cuda.log" 2>&1
log "kernels_op_table_cuda_test rc=$?"
grep -E "^\[  FAILED|PASSED|differ" "$out/op_table_cuda.log" | head -40
if [ "${1:-}" != "quick" ]; then
  timeout 150 compute-sanitizer --tool memcheck --print-limit 20 ./build/tests/kernels/kernels_cuda_bf16_test \
    --gtest_filter='*GroupedMatmul*:*Attention*:*MoeAndElementwise*' >"$out/memcheck.log" 2>&1
  log "memcheck rc=$? ($(grep -c 'Invalid' "$out/memcheck.log") invalid accesses)"
  grep -E "ERROR SUMMARY|Invalid" "$out/memcheck.log" | head -10
fi

timeout 180 ./build/bench/kernels/kernel_bench >"$out/kernel_bench.log" 2>&1
log "kernel_bench rc=$?"
grep -v "^RESULT" "$out/kernel_bench.log"
PYTHONUNBUFFERED=1 timeout 150 python3 bench/kernels/torch_kernels.py >"$out/torch.log" 2>&1
log "torch_kernels rc=$? ($(python3 -c 'import torch; print(torch.__version__)'))"
tail -3 "$out/torch.log"
timeout 120 ./build/bench/kernels/kernel_bench >"$out/kernel_bench_repeat.log" 2>&1
log "kernel_bench (repeat) rc=$?"
python3 bench/kernels/compare.py "$out/kernel_bench.log" "$out/torch.log" "$out/kernel_bench_repeat.log" |
  tee "$out/compare.md"
