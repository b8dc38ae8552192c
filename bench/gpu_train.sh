#!/bin/bash
# bench/gpu_train.sh — one GPU-host run of train_moe on CUDA (one GPU): build
# train_moe and its GPU test, run the test (CUDA vs CPU losses), then train bench_1b on real
# text for STEPS steps (loss every 20 steps, metrics.jsonl with tokens/s, mfu and activation
# memory), optionally followed by `bench/e2e.sh --quick` (Troupe vs the PyTorch peer).
# Usage (repository root, deps environment sourced):
#   bash bench/gpu_train.sh DATA_DIR [STEPS=200] [notest] [e2e] [ncu]
# STEPS 0 skips the bench_1b run; notest skips the GPU test; e2e runs bench/e2e.sh --quick on
# one GPU; ncu times every kernel of one bench_1b step with Nsight Compute (the NVTX range
# "step") and writes ncu_step.csv and a per-kernel summary.
# DATA_DIR: the output of `train_moe prepare`. Logs go to $OUT (or ./gpu-out); the build to
# $BUILD (default /tmp/troupe-gpu-build); $LIMIT caps the bench_1b training seconds (default 170).
set -uo pipefail
data=${1:?usage: gpu_train.sh DATA_DIR [STEPS] [notest] [e2e] [ncu]}
steps=${2:-200}
shift 2 2>/dev/null || shift $#
opts=" $* "
has() { [[ "$opts" == *" $1 "* ]]; }
out=${OUT:-gpu-out}
build=${BUILD:-/tmp/troupe-gpu-build}
mkdir -p "$out"
t0=$(date +%s)
say() { echo "== [$(( $(date +%s) - t0 ))s] $*" | tee -a "$out/summary.txt"; }

if ! pkg-config --exists libsodium; then  # see bench/kernels/gpu_check.sh
  lib=$(dirname "$(find / -name 'libsodium.so.23*' -path '*troupe-deps*' 2>/dev/null | head -1)")
  mkdir -p /tmp/pc && printf 'Name: libsodium\nDescription: stub\nVersion: 1.0.18\nLibs: -L%s -l:libsodium.so.23\nCflags:\n' "$lib" >/tmp/pc/libsodium.pc
  export PKG_CONFIG_PATH=/tmp/pc:${PKG_CONFIG_PATH:-}
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv | tee "$out/gpu.txt"
cmake -S . -B "$build" -G Ninja -DTROUPE_WERROR=OFF -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release \
  >/tmp/cmake.log 2>&1 || { tail -30 /tmp/cmake.log; exit 1; }
if ! ninja -C "$build" -j16 train_moe train_moe_cuda_test >/tmp/build.log 2>&1; then
  grep -E "error|FAILED" -A3 /tmp/build.log | head -60
  exit 1
fi
say "build ok"

if ! has notest; then
  timeout 150 "$build/tests/apps/train_moe_cuda_test" >"$out/cuda_test.log" 2>&1
  say "train_moe_cuda_test rc=$?"
  grep -E "^step|OK|FAILED|Failure|Expected|Which is|skipping|Value of|Actual" "$out/cuda_test.log" | head -60
fi

# bench_1b: loss every 20 steps, validation at 0, 100 and the end.
run=/tmp/troupe-bench-run
rm -rf "$run"
if [ "$steps" -gt 0 ]; then
timeout $((${LIMIT:-170} + 90)) "$build/apps/train_moe" --config apps/configs/bench_1b.toml --backend cuda \
  --set train.steps="$steps" --set train.time_limit_s="${LIMIT:-170}" --set train.log_every=20 --set train.eval_every=100 --set train.eval_batches=2 \
  --set data.dir="$data" --run-dir "$run" >"$out/bench_1b.log" 2>&1
say "bench_1b $steps steps rc=$?"
cp "$run/metrics.jsonl" "$out/bench_1b.metrics.jsonl" 2>/dev/null
grep -vE "^\s*$" "$out/bench_1b.log" | tail -20
python3 - "$out/bench_1b.metrics.jsonl" <<'PY' | tee -a "$out/summary.txt"
import json, statistics, sys
try:
    recs = [json.loads(l) for l in open(sys.argv[1])]
except OSError:
    sys.exit(0)
st = [r for r in recs if "tokens_per_s" in r]
if not st:
    sys.exit(0)
steady = [r for r in st if r["step"] > 5] or st
med = lambda k: statistics.median(r[k] for r in steady if k in r)
print(f"steps {len(st)}: loss step1 {st[0]['loss']:.4f} last {st[-1]['loss']:.4f} | median tokens/s {med('tokens_per_s'):.0f}"
      f" | mfu {100*med('mfu'):.2f}% | step {med('step_ms'):.1f} ms | activation peak {med('activation_bytes')/2**30:.2f} GiB"
      f" | peak in use {med('peak_bytes')/2**30:.2f} GiB")
vals = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
print("val_loss", vals)
PY
rm -rf "$run"
fi

if has ncu; then
  # Every kernel of two training steps (inside the NVTX range "step"; evaluation and setup
  # run unprofiled; launch by launch, not replayed from a CUDA graph); the summary divides
  # by the step count.
  timeout ${NCU_LIMIT:-200} ncu --clock-control none --metrics gpu__time_duration.sum --nvtx \
    --nvtx-include "step/" --launch-count ${NCU_COUNT:-6000} --csv --page raw \
    "$build/apps/train_moe" --config apps/configs/bench_1b.toml --backend cuda --set train.steps=2 --allow-test-config --set bench.cuda_graph=false \
    --set train.eval_every=0 --set train.eval_batches=1 --set data.dir="$data" --run-dir "$run" \
    >"$out/ncu_step.csv" 2>"$out/ncu_stderr.log"
  say "ncu rc=$? ($(grep -c '^"' "$out/ncu_step.csv") rows)"
  rm -rf "$run"
  python3 bench/ncu_summary.py "$out/ncu_step.csv" 2 | tee "$out/ncu_summary.txt"
fi
if has e2e; then
  # e2e.sh writes many logs: they go to /tmp/e2e-out/e2e and come back as one archive.
  rm -rf /tmp/e2e-out
  OUT=/tmp/e2e-out timeout ${E2E_LIMIT:-330} bash bench/e2e.sh --quick --gpus 1 --timeout ${E2E_RUN_LIMIT:-150} \
    --build "$build" --data "$data"
  say "e2e rc=$?"
  tar -C /tmp/e2e-out -czf "$out/e2e.tgz" e2e 2>/dev/null
fi

say "done"
