#!/usr/bin/env bash
# bench/gpu_state_cost.sh — what the elastic in-memory state costs a data-parallel GPU job:
# the same `troupe run --nproc 2 --backend cuda -- train_moe --parallel dp=2`
# job with elastic.gpu_state = "memory" (the default: the column's optimizer moments
# all-gathered over dp and the values copied after every step, so a lost worker is restored
# from its peer with no step lost) and "checkpoint" (nothing kept), interleaved REPEAT times.
# Prints per run the median over the steps after WARMUP of tokens/s (the driver's wall time
# per step: it includes the commit), the metrics' step_ms (which ends before the commit) and
# the final loss (the same in both: the state kept does not change the arithmetic).
# Needs 2 GPUs. usage: bench/gpu_state_cost.sh [--build DIR] [--config FILE] [--data DIR]
#                        [--steps N] [--warmup N] [--repeat R]
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=bench/common.sh
source bench/common.sh
BUILD=build CONFIG=apps/configs/bench_1b.toml DATA="" STEPS=10 WARMUP=3 REPEAT=2
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --config) CONFIG=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --repeat) REPEAT=$2; shift 2 ;;
    -h|--help) sed -n 2,11p "$0"; exit 0 ;;
    *) echo "gpu_state_cost.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -x "$BUILD/apps/train_moe" ] && [ -x "$BUILD/scheduler/troupe" ] ||
  { echo "gpu_state_cost.sh: build train_moe and troupe in $BUILD first" >&2; exit 2; }
OUT=${OUT:-/tmp}/gpu-state-cost
mkdir -p "$OUT"
if [ -z "$DATA" ]; then
  DATA=$(bench_data "$BUILD/apps/train_moe" "$OUT") || exit 1
fi
echo "# dp=2 on 2 GPUs, $CONFIG, $STEPS steps (medians of the steps after $WARMUP), $(date -u +%FT%TZ)"
for ((rep = 0; rep < REPEAT; rep++)); do
  for mode in memory checkpoint; do
    dir=$OUT/run_${mode}_$rep
    rm -rf "$dir"
    if ! timeout 300 "$BUILD/scheduler/troupe" run --nproc 2 --backend cuda -- "$BUILD/apps/train_moe" \
      --config "$CONFIG" --backend cuda --parallel dp=2 --set "train.steps=$STEPS" --set train.eval_every=0 \
      --set train.eval_batches=1 --set train.log_every=1 --set "data.dir=\"$DATA\"" \
      --set "elastic.gpu_state=\"$mode\"" --run-dir "$dir" >"$OUT/run_${mode}_$rep.log" 2>&1; then
      echo "gpu_state=$mode: FAILED ($OUT/run_${mode}_$rep.log)"
      continue
    fi
    python3 - "$mode" "$WARMUP" "$dir/metrics.jsonl" <<'PY'
import json, statistics, sys
mode, warm, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
recs = [json.loads(l) for l in open(path) if l.strip()]
s = [x for x in recs if "step_ms" in x and x.get("step", 0) > warm]
print(f"gpu_state={mode}: {len(s)} steps, tokens/s {statistics.median(x['tokens_per_s'] for x in s):,.0f}, "
      f"step_ms {statistics.median(x['step_ms'] for x in s):.1f}, final loss {s[-1]['loss']:.4f}")
PY
  done
done
