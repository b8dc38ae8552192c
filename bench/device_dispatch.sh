#!/bin/bash
# bench/device_dispatch.sh — the device-driven expert dispatch on a host
# with two GPUs: builds train_moe, troupe and training_gpu_test, runs the GPU tests that
# FILTER selects (gtest filter; "none" skips them), then trains bench_1b at n=2 under
# `troupe run` three ways: router statistics and expert counts read on the host (host),
# the statistics on the device (stats: bench.device_stats), both on the device (device:
# parallel.device_dispatch too), ROUNDS interleaved rounds of STEPS steps each, and prints
# per run the median tokens/s, step time, peak device memory and host reads per step
# (steps > 5). Usage (repository root, deps environment sourced):
#   bash bench/device_dispatch.sh [STEPS=20] [ROUNDS=1] [FILTER='*Dispatch*:*ExpertAndSequence*'] [EXTRA sets...]
# Logs go to $OUT (or ./gpu-out), the build to $BUILD (default build).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/common.sh"
steps=${1:-20}
rounds=${2:-1}
filter=${3:-'*Dispatch*:*ExpertAndSequence*'}
extra=("${@:4}")
out=${OUT:-gpu-out}
build=${BUILD:-build}
mkdir -p "$out"
t0=$(date +%s)
say() { echo "== [$(($(date +%s) - t0))s] $*" | tee -a "$out/summary.txt"; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}

nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
cmake -S . -B "$build" -G Ninja -DTROUPE_WERROR=OFF -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release \
  >"$out/cmake.log" 2>&1 || { tail -30 "$out/cmake.log"; exit 1; }
if ! ninja -C "$build" -j"$(nproc)" train_moe troupe training_gpu_test >"$out/build.log" 2>&1; then
  grep -E "error|FAILED" -A3 "$out/build.log" | head -60
  exit 1
fi
say "build ok ($(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo +changes))"

if [ "$filter" != none ]; then
  timeout -s KILL 400 "$build/tests/training/training_gpu_test" --gtest_filter="$filter" >"$out/gpu_test.log" 2>&1
  say "training_gpu_test ($filter) rc=$?"
  grep -E "^\[device dispatch|^step [0-9]:|OK \]|FAILED|Failure|Expected|Which is|error|host counts" \
    "$out/gpu_test.log" | head -60
fi

data=$(bench_data "$build/apps/train_moe" "$out") || exit 1
sets=(--set train.steps="$steps" --set train.eval_every=0 --set train.eval_batches=1 --set train.log_every=5
  --set data.dir="\"$(realpath "$data")\"")
for s in "${extra[@]}"; do sets+=(--set "$s"); done

summary() { metrics_summary "$1" "$2" | tee -a "$out/summary.txt"; }  # summary NAME METRICS

# host: router statistics and expert counts read on the host (the previous path);
# stats: the routers' statistics on the device, the counts on the host; device: both.
variants=("host:parallel.device_dispatch=false:bench.device_stats=false"
  "stats:parallel.device_dispatch=false:bench.device_stats=true"
  "device:parallel.device_dispatch=true:bench.device_stats=true")
for r in $(seq 1 "$rounds"); do
  for v in "${variants[@]}"; do
    IFS=: read -r name dd ds <<<"$v"
    dir=/tmp/troupe-dd-$name
    rm -rf "$dir"
    timeout -s KILL 200 "$build/scheduler/troupe" run --nproc 2 --backend cuda -- \
      "$PWD/$build/apps/train_moe" --config "$PWD/apps/configs/bench_1b.toml" --backend cuda --parallel n=2 --allow-test-config \
      "${sets[@]}" --set train.micro_batch_size=16 --set "$dd" --set "$ds" \
      --run-dir "$dir" >"$out/bench_n2_$name.$r.log" 2>&1
    say "bench_1b n=2 $name ($dd, $ds) round $r rc=$?"
    m=$(find "$dir" -name metrics.jsonl 2>/dev/null | head -1)
    [ -n "$m" ] && cp "$m" "$out/bench_n2_$name.$r.metrics.jsonl"
    summary "n=2 $name round $r" "$out/bench_n2_$name.$r.metrics.jsonl"
  done
done
say "done"
