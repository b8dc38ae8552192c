#!/usr/bin/env bash
# bench/recompute.sh — memory and speed of selective recomputation on one GPU:
# bench_1b (or --config) at the same tokens per step with longer sequences — seq 2048 x
# micro-batch 8, 8192 x 2, 16384 x 1 — each with model.recompute_swiglu off and on (the
# SwiGLU outputs of the experts are recomputed in backward instead of kept). Per run: the
# median over the steps after --warmup of tokens/s and the peak device memory of a step
# (metrics.jsonl peak_gib: the caching allocator's high-water mark), against the GPU's memory.
# usage: bench/recompute.sh [--build DIR] [--config FILE] [--data DIR] [--steps N] [--warmup N]
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=bench/common.sh
source bench/common.sh
BUILD=build CONFIG=apps/configs/bench_1b.toml DATA="" STEPS=10 WARMUP=3
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --config) CONFIG=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    -h|--help) sed -n 2,9p "$0"; exit 0 ;;
    *) echo "recompute.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
TRAIN=$BUILD/apps/train_moe
[ -x "$TRAIN" ] || { echo "recompute.sh: $TRAIN not built" >&2; exit 2; }
OUT=${OUT:-/tmp}/recompute
mkdir -p "$OUT"
if [ -z "$DATA" ]; then
  DATA=$(bench_data "$TRAIN" "$OUT") || exit 1
fi
GPU_GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
echo "# $CONFIG on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) (${GPU_GIB:-?} MiB), $STEPS steps, medians of the steps after $WARMUP, $(date -u +%FT%TZ)"
echo "| seq x micro-batch | recompute_swiglu | tokens/s | peak GiB | final loss |"
echo "| --- | --- | --- | --- | --- |"
for shape in 2048:8 8192:2 16384:1; do
  seq=${shape%:*} mb=${shape#*:}
  for rc in false true; do
    dir=$OUT/run_${seq}_$rc
    rm -rf "$dir"
    if ! timeout 300 "$TRAIN" --config "$CONFIG" --backend cuda --set "train.seq_len=$seq" \
      --set "train.micro_batch_size=$mb" --set "model.recompute_swiglu=$rc" --set "train.steps=$STEPS" \
      --set train.eval_every=0 --set train.eval_batches=1 --set train.log_every=1 \
      --set "data.dir=\"$DATA\"" --run-dir "$dir" >"$OUT/run_${seq}_$rc.log" 2>&1; then
      echo "| $seq x $mb | $rc | FAILED ($(grep -m1 -i -E 'error|out of memory' "$OUT/run_${seq}_$rc.log" | cut -c1-80)) | - | - |"
      continue
    fi
    python3 - "$seq x $mb" "$rc" "$WARMUP" "$dir/metrics.jsonl" <<'PY'
import json, statistics, sys
shape, rc, warm, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
recs = [json.loads(l) for l in open(path) if l.strip()]
s = [x for x in recs if "tokens_per_s" in x and x.get("step", 0) > warm]
print(f"| {shape} | {rc} | {statistics.median(x['tokens_per_s'] for x in s):,.0f} | "
      f"{max(x.get('peak_gib', 0) for x in s):.2f} | {s[-1]['loss']:.4f} |")
PY
  done
done
