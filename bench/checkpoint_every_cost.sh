#!/usr/bin/env bash
# bench/checkpoint_every_cost.sh — what a checkpoint after every step costs a CPU job: the tiny
# config (apps/configs/tiny.toml) under the standalone launcher (--parallel, default
# pp=2,n=2: a layout tiny.toml's global batch of 8 fits) with checkpoint.every = 1 and 0,
# interleaved REPEAT times (in-memory snapshots at their default interval in both). A checkpoint is written from the step's committed
# snapshot by each worker's writer thread, off the step; what the step pays is the
# snapshot's start and, when the previous write still holds the generation, the wait
# (ckpt_stall_ms in metrics.jsonl). Prints per run the median over the steps after WARMUP
# of the driver's step time (driver_step_ms) and of ckpt_stall_ms, then
#   cost = median step time with checkpoints / median step time without - 1   (target <= 5%)
# --snapshots compares elastic.snapshot_every = 1 with 0 instead (no checkpoints): what a
# snapshot after every step costs (target <= 2%).
# usage: bench/checkpoint_every_cost.sh [--build DIR] [--data DIR] [--parallel P]
#                                       [--steps N] [--warmup N] [--repeat R] [--snapshots]
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=bench/common.sh
source bench/common.sh
BUILD=build DATA="" PARALLEL=pp=2,n=2 STEPS=60 WARMUP=5 REPEAT=3 KNOB=checkpoint.every TARGET=5
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --parallel) PARALLEL=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --repeat) REPEAT=$2; shift 2 ;;
    --snapshots) KNOB=elastic.snapshot_every TARGET=2; shift ;;
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    *) echo "checkpoint_every_cost.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ -x "$BUILD/apps/train_moe" ] || { echo "checkpoint_every_cost.sh: build train_moe in $BUILD first" >&2; exit 2; }
OUT=${OUT:-/tmp}/checkpoint-every-cost
mkdir -p "$OUT"
rm -f "$OUT/summary"
if [ -z "$DATA" ]; then
  DATA=$OUT/data
  if [ ! -f "$DATA/tokenizer.json" ]; then
    "$BUILD/apps/train_moe" prepare --input layers kernels --out "$DATA" --vocab 1024 --max-bytes 2000000 \
      --ext .cc .h >"$OUT/prepare.log" 2>&1 || { echo "prepare failed: $OUT/prepare.log" >&2; exit 1; }
  fi
fi
echo "# tiny.toml, --parallel $PARALLEL (standalone launcher, CPU), $STEPS steps (medians of the steps after $WARMUP), $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg), $(date -u +%FT%TZ)"
for ((rep = 0; rep < REPEAT; rep++)); do
  for every in 1 0; do
    dir=$OUT/run_${every}_$rep
    rm -rf "$dir"
    if ! timeout 900 "$BUILD/apps/train_moe" --config apps/configs/tiny.toml --parallel "$PARALLEL" \
      --set "train.steps=$STEPS" --set train.eval_every=0 --set train.eval_batches=1 --set train.log_every=10 \
      --set "data.dir=\"$DATA\"" --set "$KNOB=$every" --run-dir "$dir" >"$OUT/run_${every}_$rep.log" 2>&1; then
      echo "$KNOB=$every: FAILED ($OUT/run_${every}_$rep.log)"
      continue
    fi
    python3 - "$KNOB=$every" "$WARMUP" "$dir" <<'PY' | tee -a "$OUT/summary"
import json, os, statistics, sys
label, warm, run = sys.argv[1], int(sys.argv[2]), sys.argv[3]
every = label.split("=")[1]
recs = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl")) if l.strip()]
s = [x for x in recs if "step_ms" in x and x.get("step", 0) > warm]
ms = statistics.median(x["driver_step_ms"] for x in s)
line = f"{label}: {len(s)} steps, driver step {ms:.1f} ms"
stall = [x["ckpt_stall_ms"] for x in s if "ckpt_stall_ms" in x]
if stall:
    line += f", stall per checkpoint {statistics.median(stall):.2f} ms (max {max(stall):.1f})"
ckpts = [e for e in map(json.loads, open(os.path.join(run, "events.jsonl"))) if e.get("event") == "checkpoint_committed"]
if ckpts:
    line += f", {len(ckpts)} checkpoints committed"
print(line)
print(f"MS {every} {ms}")
PY
  done
done
python3 - "$OUT/summary" "$KNOB" "$TARGET" <<'PY'
import statistics, sys
ms = {"1": [], "0": []}
for l in open(sys.argv[1]):
    if l.startswith("MS "):
        _, every, v = l.split()
        ms[every].append(float(v))
if ms["1"] and ms["0"]:
    a, b = statistics.median(ms["1"]), statistics.median(ms["0"])
    print(f"cost = median step time with {sys.argv[2]}=1 / with 0 - 1 = {a:.1f} / {b:.1f} - 1 = {100 * (a / b - 1):+.1f}% "
          f"(target <= {sys.argv[3]}%)")
PY
