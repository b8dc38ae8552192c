#!/usr/bin/env bash
# bench/snapshot_cost.sh — what in-memory snapshots cost a GPU job: bench_1b through
# `troupe run --nproc 1 --backend cuda` (one worker: its state lives only in the snapshots
# its agent holds) with snapshots every K steps (elastic.snapshot_every, the default unless
# --every is given) and with none (elastic.snapshot_every = 0), interleaved REPEAT times.
# Prints per run the throughput over the steps after WARMUP, the bytes of one snapshot
# (<run dir>/snapshots.json), the slowest steps and the step thread's
# median time per snapshot (snapshot_ms: the device-side staging copy is issued, the
# device -> host copy and the checksums run off the step), then
#   tokens/s = tokens of the steps after WARMUP / the driver's wall time of those steps
#   ratio = median over repeats of tokens/s with snapshots / the same without  (target >= 0.98)
# Needs 1 GPU. usage: bench/snapshot_cost.sh [--build DIR] [--config FILE] [--data DIR]
#                       [--steps N] [--warmup N] [--repeat R] [--every K]
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=bench/common.sh
source bench/common.sh
BUILD=build CONFIG=apps/configs/bench_1b.toml DATA="" STEPS=60 WARMUP=10 REPEAT=2 EVERY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --config) CONFIG=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --repeat) REPEAT=$2; shift 2 ;;
    --every) EVERY=$2; shift 2 ;;
    -h|--help) sed -n 2,14p "$0"; exit 0 ;;
    *) echo "snapshot_cost.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -x "$BUILD/apps/train_moe" ] && [ -x "$BUILD/scheduler/troupe" ] ||
  { echo "snapshot_cost.sh: build train_moe and troupe in $BUILD first" >&2; exit 2; }
OUT=${OUT:-/tmp}/snapshot-cost
mkdir -p "$OUT"
if [ -z "$DATA" ]; then
  DATA=$(bench_data "$BUILD/apps/train_moe" "$OUT") || exit 1
fi
rm -f "$OUT/summary_on" "$OUT/summary_off"
on_set=()
[ -n "$EVERY" ] && on_set=(--set "elastic.snapshot_every=$EVERY")
echo "# 1 GPU, troupe run --nproc 1, $CONFIG, $STEPS steps (medians of the steps after $WARMUP), $(date -u +%FT%TZ)"
for ((rep = 0; rep < REPEAT; rep++)); do
  for mode in on off; do
    dir=$OUT/run_${mode}_$rep
    rm -rf "$dir"
    sets=()
    if [ "$mode" = on ]; then sets=("${on_set[@]}"); else sets=(--set elastic.snapshot_every=0); fi
    if ! timeout 600 "$BUILD/scheduler/troupe" run --nproc 1 --backend cuda -- "$BUILD/apps/train_moe" \
      --config "$CONFIG" --backend cuda --set "train.steps=$STEPS" --set train.eval_every=0 \
      --set train.eval_batches=1 --set train.log_every=10 --set "data.dir=\"$DATA\"" "${sets[@]}" \
      --run-dir "$dir" >"$OUT/run_${mode}_$rep.log" 2>&1; then
      echo "snapshots $mode: FAILED ($OUT/run_${mode}_$rep.log)"
      continue
    fi
    python3 - "$mode" "$WARMUP" "$dir" <<'PY' | tee -a "$OUT/summary_$mode"
import json, os, statistics, sys
mode, warm, run = sys.argv[1], int(sys.argv[2]), sys.argv[3]
recs = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl")) if l.strip()]
s = [x for x in recs if "step_ms" in x and x.get("step", 0) > warm]
# Throughput over the whole window (tokens / the driver's wall time): a snapshot step's extra
# time counts in full (a median over steps would hide it).
tps = sum(x["tokens_per_s"] * x["driver_step_ms"] for x in s) / sum(x["driver_step_ms"] for x in s)
line = (f"snapshots {mode}: {len(s)} steps, tokens/s {tps:,.0f} (window), median step {statistics.median(x['tokens_per_s'] for x in s):,.0f}, "
        f"device step_ms {statistics.median(x['step_ms'] for x in s):.1f}")
slow = sorted(((x["driver_step_ms"], x["step"]) for x in s), reverse=True)[:4]
line += ", slowest steps " + " ".join(f"{st}:{ms:.0f}ms" for ms, st in slow)
snap = [x["snapshot_ms"] for x in s if "snapshot_ms" in x]
if snap:
    line += f", {len(snap)} snapshots, step thread per snapshot {statistics.median(snap):.1f} ms"
try:
    committed = json.load(open(os.path.join(run, "snapshots.json")))
    if committed:
        b = sum(p["bytes"] for p in committed[0]["parts"])
        line += f", {b / 1e9:.2f} GB per snapshot"
except (OSError, ValueError, KeyError):
    pass
print(line)
print(f"TPS {mode} {tps}")
PY
  done
done
python3 - "$OUT/summary_on" "$OUT/summary_off" <<'PY'
import statistics, sys
def tps(p):
    try:
        return [float(l.split()[2]) for l in open(p) if l.startswith("TPS ")]
    except OSError:
        return []
on, off = tps(sys.argv[1]), tps(sys.argv[2])
if on and off:
    r = statistics.median(on) / statistics.median(off)
    print(f"ratio = tokens/s with snapshots / without = {statistics.median(on):,.0f} / {statistics.median(off):,.0f} "
          f"= {r:.4f} (target >= 0.98)")
PY
rm -f "$OUT/summary_on" "$OUT/summary_off"
