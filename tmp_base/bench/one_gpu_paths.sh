#!/usr/bin/env bash
# bench/one_gpu_paths.sh — train_moe on one GPU two ways, back to back on the same token
# shards: the single-process loop (`train_moe --backend cuda`, apps/train_moe/train.cc) and
# the framework's path (`troupe run --nproc 1 -- train_moe --backend cuda`: the Trainer and
# one worker whose Stage runs train_moe's stage program). Prints tokens/s of each (median
# over the steps after the warm-up), MFU (6*N_active + 6*L*s*d FLOPs per token against
# 989 TFLOP/s) and the ratio framework / single process — what it costs to run one GPU
# through the Trainer (docs/architecture.md "One process").
#
#   bench/one_gpu_paths.sh [--build DIR] [--config FILE] [--steps N] [--warmup N] [--data DIR]
set -u
BUILD=build CONFIG=apps/configs/bench_1b.toml STEPS=20 WARMUP=5 DATA="" OUTDIR=${OUT:-/tmp}/one_gpu_paths
while [ $# -gt 0 ]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --config) CONFIG=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    *) echo "one_gpu_paths.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUTDIR"
for b in "$BUILD/apps/train_moe" "$BUILD/scheduler/troupe"; do
  [ -x "$b" ] || { echo "one_gpu_paths.sh: $b not built" >&2; exit 1; }
done
if [ -z "$DATA" ]; then
  DATA=$OUTDIR/data
  if [ ! -f "$DATA/tokenizer.json" ]; then
    # Throughput does not depend on the text: a small tokenizer over this repository's sources.
    "$BUILD/apps/train_moe" prepare --input core kernels layers apps comm --out "$DATA" --vocab 2048 \
      --val-fraction 0.1 --max-bytes 8000000 --ext .cc .h .cu .cuh >"$OUTDIR/prepare.log" 2>&1 ||
      { echo "one_gpu_paths.sh: prepare failed ($OUTDIR/prepare.log)" >&2; exit 1; }
  fi
fi
SETS=(--set "train.steps=$((STEPS + WARMUP))" --set train.eval_every=0 --set train.eval_batches=1
      --set train.log_every=5 --set "data.dir=\"$DATA\"")
rm -rf "$OUTDIR/single" "$OUTDIR/trainer"
timeout 600 "$BUILD/apps/train_moe" --config "$CONFIG" --backend cuda "${SETS[@]}" --run-dir "$OUTDIR/single" \
  >"$OUTDIR/single.log" 2>&1 || { echo "single process: FAILED ($OUTDIR/single.log)"; tail -5 "$OUTDIR/single.log"; }
timeout 600 "$BUILD/scheduler/troupe" run --nproc 1 --backend cuda -- "$BUILD/apps/train_moe" --config "$CONFIG" \
  --backend cuda "${SETS[@]}" --run-dir "$OUTDIR/trainer" >"$OUTDIR/trainer.log" 2>&1 ||
  { echo "trainer: FAILED ($OUTDIR/trainer.log)"; tail -5 "$OUTDIR/trainer.log"; }
python3 - "$OUTDIR" "$WARMUP" <<'PY'
import json, statistics, sys
out, warm = sys.argv[1], int(sys.argv[2])
def figures(name):
    try:
        recs = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl") if '"loss"' in l]
    except OSError:
        return None
    recs = [r for r in recs if r.get("step", 0) > warm]
    if not recs:
        return None
    tps = statistics.median(r["tokens_per_s"] for r in recs)
    mfu = statistics.median(r.get("mfu", 0.0) for r in recs)
    return tps, mfu, len(recs), recs[-1]["loss"]
s, t = figures("single"), figures("trainer")
print("path                         tokens/s   MFU (989 TFLOP/s)   steps   last loss")
for name, f in (("single process (train.cc)", s), ("trainer + 1 worker (Stage)", t)):
    if f:
        print(f"{name:28s} {f[0]:9.0f}   {100 * f[1]:6.1f}%             {f[2]:5d}   {f[3]:.5f}")
    else:
        print(f"{name:28s} FAILED")
if s and t:
    print(f"ratio trainer / single process: {t[0] / s[0]:.3f}x (median tokens/s after {warm} warm-up steps)")
PY
