#!/bin/bash
# bench/gpu_dist.sh — one 2-GPU host run of distributed GPU training: builds
# train_moe, troupe and training_gpu_test, runs the test (n=2 and dp=2 on two GPUs against
# one), then bench_1b for STEPS steps on one GPU and on two (`troupe run --nproc 2
# --backend cuda -- train_moe ... --parallel n=2`, micro-batch MBS2 sequences split over the
# pair), and prints tokens/s, mfu and peak device memory per run (median over steps > 5).
# Usage (repository root, deps environment sourced): bash bench/gpu_dist.sh [STEPS=30] [MBS2=16] [notest] [no1gpu]
# Token data: this repository's text through `train_moe prepare` (throughput does not
# depend on the text). Logs go to $OUT (or ./gpu-out); the build to $BUILD (default build).
set -uo pipefail
source "$(cd "$(dirname "$0")" && pwd)/common.sh"
steps=${1:-30}
mbs2=${2:-16}
opts=" ${*:3} "
out=${OUT:-gpu-out}
build=${BUILD:-build}
mkdir -p "$out"
t0=$(date +%s)
say() { echo "== [$(( $(date +%s) - t0 ))s] $*" | tee -a "$out/summary.txt"; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}

if ! pkg-config --exists libsodium; then  # see bench/gpu_train.sh
  lib=$(dirname "$(find / -name 'libsodium.so.23*' -path '*troupe-deps*' 2>/dev/null | head -1)")
  mkdir -p /tmp/pc && printf 'Name: libsodium\nDescription: stub\nVersion: 1.0.18\nLibs: -L%s -l:libsodium.so.23\nCflags:\n' "$lib" >/tmp/pc/libsodium.pc
  export PKG_CONFIG_PATH=/tmp/pc:${PKG_CONFIG_PATH:-}
fi
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
cmake -S . -B "$build" -G Ninja -DTROUPE_WERROR=OFF -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release \
  >"$out/cmake.log" 2>&1 || { tail -30 "$out/cmake.log"; exit 1; }
if ! ninja -C "$build" -j16 train_moe troupe training_gpu_test >"$out/build.log" 2>&1; then
  grep -E "error|FAILED" -A3 "$out/build.log" | head -60
  exit 1
fi
say "build ok"

if [[ "$opts" != *" notest "* ]]; then
  timeout -s KILL 200 "$build/tests/training/training_gpu_test" >"$out/gpu_test.log" 2>&1
  say "training_gpu_test rc=$?"
  grep -E "^step [0-9]:|OK \]|FAILED|Failure|Expected|Which is|skipping|error" "$out/gpu_test.log" | head -40
fi

data=/tmp/troupe-dist-data
if [ ! -f "$data/tokenizer.json" ]; then
  timeout -s KILL 200 "$build/apps/train_moe" prepare --input core kernels layers apps comm scheduler docs --out "$data" \
    --vocab 2048 --val-fraction 0.1 --max-bytes 8000000 --ext .cc .h .cu .cuh .md >"$out/prepare.log" 2>&1
  say "prepare rc=$?"
fi
sets=(--set train.steps="$steps" --set train.eval_every=0 --set train.eval_batches=1 --set train.log_every=5
      --set data.dir="\"$data\"")

summary() { metrics_summary "$1" "$2" | tee -a "$out/summary.txt"; }  # summary NAME METRICS

if [[ "$opts" != *" no1gpu "* ]]; then
rm -rf /tmp/troupe-dist-1gpu
timeout -s KILL 130 "$build/apps/train_moe" --config apps/configs/bench_1b.toml --backend cuda "${sets[@]}" \
  --run-dir /tmp/troupe-dist-1gpu >"$out/bench_1gpu.log" 2>&1
say "bench_1b 1 GPU rc=$?"
tail -4 "$out/bench_1gpu.log"
cp /tmp/troupe-dist-1gpu/metrics.jsonl "$out/bench_1gpu.metrics.jsonl" 2>/dev/null
summary "1 GPU, micro-batch 8" "$out/bench_1gpu.metrics.jsonl"
fi

rm -rf /tmp/troupe-dist-2gpu
timeout -s KILL 160 "$build/scheduler/troupe" run --nproc 2 --backend cuda -- \
  "$PWD/$build/apps/train_moe" --config "$PWD/apps/configs/bench_1b.toml" --backend cuda --parallel n=2 "${sets[@]}" \
  --set train.micro_batch_size="$mbs2" --run-dir /tmp/troupe-dist-2gpu >"$out/bench_2gpu.log" 2>&1
say "bench_1b 2 GPUs (troupe run, n=2, micro-batch $mbs2) rc=$?"
grep -vE "^\s*$" "$out/bench_2gpu.log" | tail -6
m=$(find /tmp/troupe-dist-2gpu -name metrics.jsonl 2>/dev/null | head -1)
[ -n "$m" ] && cp "$m" "$out/bench_2gpu.metrics.jsonl"
summary "2 GPUs n=2, micro-batch $mbs2" "$out/bench_2gpu.metrics.jsonl"
say "done"
