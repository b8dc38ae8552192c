#!/usr/bin/env bash
# bench/one_gpu_paths.sh — train_moe on one GPU by its two launch forms, back to back on the
# same token shards, both the Trainer driving one Stage: `train_moe --backend cuda` (one
# process: the worker is a thread of the Trainer's) and `troupe run --nproc 1 -- train_moe
# --backend cuda` (the scheduler's driver process and one worker process). The regression
# bench of the two forms: prints tokens/s of each (median over the steps after the
# warm-up), MFU (6*N_active + 6*L*s*d FLOPs per token against 989 TFLOP/s), the ratio
# troupe run / one process, and the driver's place on the critical path: the median
# device_gap_ms (the GPU's idle time between a step's last op and the next step's first,
# from CUDA events on the Stage's stream) and the share of steps whose next command was
# already queued at the worker when it replied (next_queued; train.steps_in_flight).
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
      --set train.log_every=5 --set "data.dir=\"$DATA\"" --set checkpoint.final=false)
rm -rf "$OUTDIR/single" "$OUTDIR/trainer"
timeout 600 "$BUILD/apps/train_moe" --config "$CONFIG" --backend cuda "${SETS[@]}" --run-dir "$OUTDIR/single" \
  >"$OUTDIR/single.log" 2>&1 || { echo "one process: FAILED ($OUTDIR/single.log)"; tail -5 "$OUTDIR/single.log"; }
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
    gaps = [r["device_gap_ms"] for r in recs if "device_gap_ms" in r]
    gap = statistics.median(gaps) if gaps else float("nan")
    queued = sum(1 for r in recs if r.get("next_queued")) / len(recs)
    return tps, mfu, len(recs), recs[-1]["loss"], gap, queued
s, t = figures("single"), figures("trainer")
print("path                                tokens/s   MFU (989 TFLOP/s)   steps   last loss   device gap ms   next queued")
for name, f in (("train_moe (one process)", s), ("troupe run --nproc 1 (2 processes)", t)):
    if f:
        print(f"{name:35s} {f[0]:9.0f}   {100 * f[1]:6.1f}%             {f[2]:5d}   {f[3]:.5f}   "
              f"{f[4]:13.3f}   {100 * f[5]:5.0f}%")
    else:
        print(f"{name:35s} FAILED")
if s and t:
    print(f"ratio troupe run / one process: {t[0] / s[0]:.3f}x (median tokens/s after {warm} warm-up steps)")
PY
