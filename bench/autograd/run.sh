#!/bin/bash
# bench/autograd/run.sh — what the autograd tape costs, on one GPU: dense_lm (its block's
# forward on a layers::Tape, the backward derived; apps/examples/dense_lm) against
# dense_handwritten (the same model — parameters, names, values, kernels — with its
# backward written by hand; bench/autograd/dense_handwritten.cc), both trained through the
# same Stage (standalone launcher, one worker, --backend cuda) on bench/autograd/dense_1b.toml
# (bench_1b's size as a dense model: 235 M parameters besides the embedding, 1.56 GFLOP a
# token), alternately ROUNDS times for STEPS steps each. Prints each run's median tokens/s
# over the steps after 5 with its MFU (6N + 6Lsd FLOPs per token against 989 TFLOP/s),
# the median over rounds of each, and ratio = autograd / hand-written (target >= 0.98),
# and the first losses of both (the same model and batches: they agree to bf16 rounding).
# Usage (repository root, on the GPU host, deps environment sourced):
#   bash bench/autograd/run.sh [STEPS=30] [ROUNDS=3]
# The build goes to $BUILD (default /tmp/troupe-autograd-build), logs to $OUT (./autograd-out).
set -uo pipefail
steps=${1:-30}
rounds=${2:-3}
out=${OUT:-autograd-out}
build=${BUILD:-/tmp/troupe-autograd-build}
mkdir -p "$out"
t0=$(date +%s)
say() { echo "== [$(($(date +%s) - t0))s] $*" | tee -a "$out/summary.txt"; }

if ! pkg-config --exists libsodium; then  # see bench/kernels/gpu_check.sh
  lib=$(dirname "$(find / -name 'libsodium.so.23*' -path '*troupe-deps*' 2>/dev/null | head -1)")
  mkdir -p /tmp/pc && printf 'Name: libsodium\nDescription: libsodium (runtime of the Debian bundle)\nVersion: 1.0.18\nLibs: -L%s -l:libsodium.so.23\nCflags:\n' "$lib" >/tmp/pc/libsodium.pc
  export PKG_CONFIG_PATH=/tmp/pc:${PKG_CONFIG_PATH:-}
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv | tee "$out/gpu.txt"
cmake -S . -B "$build" -G Ninja -DTROUPE_WERROR=OFF -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release \
  -DTROUPE_BUILD_TESTS=ON >"$out/cmake.log" 2>&1 || { tail -30 "$out/cmake.log"; exit 1; }
if ! ninja -C "$build" -j16 dense_lm dense_handwritten troupe-prepare layers_autograd_cuda_test >"$out/build.log" 2>&1; then
  grep -E "error|FAILED" -A3 "$out/build.log" | head -60
  exit 1
fi
say "build ok"
timeout 120 "$build/tests/layers/layers_autograd_cuda_test" >"$out/autograd_cuda_test.log" 2>&1
say "layers_autograd_cuda_test rc=$? (0: the tape is bitwise the hand-written block on CUDA, and replays from a CUDA graph)"
grep -E "\[autograd cuda\]|OK|FAILED|Failure" "$out/autograd_cuda_test.log" | head -20

data=/tmp/troupe-autograd-data
if [ ! -f "$data/tokenizer.json" ]; then
  "$build/apps/troupe-prepare" --input core kernels layers apps comm scheduler docs --out "$data" --vocab 2048 \
    --val-fraction 0.1 --max-bytes 8000000 --ext .cc .h .cu .md >"$out/prepare.log" 2>&1 ||
    { echo "prepare failed: $out/prepare.log" >&2; exit 1; }
fi

bin_of() { [ "$1" = autograd ] && echo "$build/apps/examples/dense_lm/dense_lm" || echo "$build/bench/autograd/dense_handwritten"; }
for r in $(seq 1 "$rounds"); do
  for kind in autograd handwritten; do
    run=/tmp/troupe-autograd-run-$kind
    rm -rf "$run"
    timeout 600 "$(bin_of $kind)" --config bench/autograd/dense_1b.toml --backend cuda --run-dir "$run" \
      --set train.steps="$steps" --set data.dir="\"$data\"" >"$out/$kind.$r.log" 2>&1
    say "$kind round $r rc=$?"
    cp "$run/metrics.jsonl" "$out/$kind.$r.metrics.jsonl" 2>/dev/null
    rm -rf "$run"
  done
done

python3 - "$out" "$rounds" <<'PY' | tee -a "$out/summary.txt"
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
flops = 6 * 235_000_000 + 6 * 12 * 2048 * 1024  # per token: dense_1b.toml's 6N + 6 L s d
def run(kind, r):
    try:
        recs = [json.loads(l) for l in open(f"{out}/{kind}.{r}.metrics.jsonl")]
    except OSError:
        return None
    st = [x for x in recs if "tokens_per_s" in x]
    steady = [x for x in st if x["step"] > 5]
    if not steady:
        return None
    return statistics.median(x["tokens_per_s"] for x in steady), [x["loss"] for x in st[:3]]
med = {}
for kind in ("autograd", "handwritten"):
    vals = []
    for r in range(1, rounds + 1):
        got = run(kind, r)
        if got is None:
            print(f"{kind} round {r}: no steps"); continue
        tps, losses = got
        vals.append(tps)
        print(f"{kind:11s} round {r}: {tps:,.0f} tokens/s, MFU {100 * tps * flops / 989e12:.1f}% "
              f"(tokens/s x {flops / 1e9:.3f} GFLOP / 989 TFLOP/s); first losses {[round(l, 5) for l in losses]}")
    med[kind] = statistics.median(vals) if vals else float("nan")
print(f"median tokens/s: autograd {med['autograd']:,.0f}, hand-written {med['handwritten']:,.0f}; "
      f"ratio autograd / hand-written = {med['autograd'] / med['handwritten']:.4f} (target >= 0.98)")
PY
say "done"
