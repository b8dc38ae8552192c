#!/usr/bin/env bash
# bench/overlap/ablation.sh — MegaScale-MoE's ablation table for Troupe's communication
# features: the same job run with the overlap and compression switches of
# [parallel] turned on one after the other, starting from the sequential schedule:
#
#   sequential      overlap_a2a, overlap_grad_sync, overlap_param_gather off, chunks = 1
#   +a2a overlap    Ulysses/expert all-to-alls in flight behind compute, chunks = C
#   +grad overlap   dp gradient reduce-scatter per bucket during backward
#   +param overlap  dp parameter all-gather behind the next forward (= the default schedule)
#   +compression    bf16 gradient exchange and fp8 token dispatch on top
#
# Per row: median over the timed steps (after --warmup) of the step time, of the exposed
# communication time (wall time the step thread waited on the data plane: CommTime, i.e.
# metrics.jsonl's comm_ms) and of tokens/s = tokens per step / step time; and the speed-up
# over the sequential row. Works on CPU (Gloo ranks on loopback; train_moe's standalone
# launcher) and on GPUs (`troupe run --nproc W --backend cuda`, one GPU per rank): the same
# command for 2, 4 and 8 GPUs with --backend cuda --parallel n=8 etc.
#
# usage: bench/overlap/ablation.sh [--backend cpu|cuda] [--parallel P] [--config FILE]
#          [--steps N] [--warmup N] [--chunks C] [--set key=value]... [--data DIR] [--build DIR]
#          [--out DIR] [--repeat R]
# --repeat R runs the whole list R times, interleaved (so load that comes and goes hits
# every row alike), and reports the median over the R runs of each row's medians.
# Defaults: cpu, --parallel dp=2,n=2 (4 ranks), the tests' tiny model on
# apps/configs/tiny.toml with micro-batch 8 and sequence 64, 12 steps after 3 warm-up.
set -u -o pipefail
cd "$(dirname "$0")/../.." || exit 2

BACKEND=cpu
PARALLEL="dp=2,n=2"
CONFIG=apps/configs/tiny.toml
STEPS=12
WARMUP=3
CHUNKS=2
BUILD=build
DATA=""
OUT=${OUT:-/tmp}/overlap-ablation
REPEAT=1
SETS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --backend) BACKEND=$2; shift 2 ;;
    --parallel) PARALLEL=$2; shift 2 ;;
    --config) CONFIG=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --chunks) CHUNKS=$2; shift 2 ;;
    --set) SETS+=("$2"); shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --build) BUILD=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --repeat) REPEAT=$2; shift 2 ;;
    -h|--help) sed -n 2,24p "$0"; exit 0 ;;
    *) echo "ablation.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

TRAIN=$BUILD/apps/train_moe
TROUPE=$BUILD/scheduler/troupe
[ -x "$TRAIN" ] || { echo "ablation.sh: $TRAIN not built (ninja -C $BUILD train_moe troupe)" >&2; exit 2; }
mkdir -p "$OUT"
if [ -z "$DATA" ]; then
  DATA=$OUT/data
  if [ ! -f "$DATA/tokenizer.json" ]; then
    "$TRAIN" prepare --input layers --input kernels --out "$DATA" --vocab 320 --max-bytes 300000 \
      --ext .cc --ext .h > "$OUT/prepare.log" 2>&1 || { echo "prepare failed: $OUT/prepare.log" >&2; exit 1; }
  fi
fi

# The world size of the layout (pp * dp * n).
WORLD=$(python3 -c "
import sys
d={'pp':1,'dp':1,'n':1}
for kv in '$PARALLEL'.split(','):
    k,_,v=kv.partition('=')
    if k in d: d[k]=int(v)
print(d['pp']*d['dp']*d['n'])")

BASE=()
if [ "$CONFIG" = apps/configs/tiny.toml ]; then
  BASE=(model.vocab_size=320 model.d_model=64 model.ffn_hidden=128 model.moe.num_experts=8 model.moe.expert_hidden=64
        train.seq_len=64 train.micro_batch_size=8 train.global_batch=8 train.eval_every=0 train.log_every=1)
fi
BASE+=("train.steps=$((STEPS + WARMUP))" "data.dir=\"$DATA\"" "${SETS[@]}")

declare -a NAMES=("sequential" "+a2a overlap" "+grad overlap" "+param overlap" "+compression")
declare -a VARIANTS=(
  "bench.overlap_a2a=false bench.overlap_grad_sync=false bench.overlap_param_gather=false parallel.chunks=1"
  "bench.overlap_a2a=true bench.overlap_grad_sync=false bench.overlap_param_gather=false parallel.chunks=$CHUNKS"
  "bench.overlap_a2a=true bench.overlap_grad_sync=true bench.overlap_param_gather=false parallel.chunks=$CHUNKS"
  "bench.overlap_a2a=true bench.overlap_grad_sync=true bench.overlap_param_gather=true parallel.chunks=$CHUNKS"
  "bench.overlap_a2a=true bench.overlap_grad_sync=true bench.overlap_param_gather=true parallel.chunks=$CHUNKS parallel.compression=true parallel.fp8_dispatch=true"
)

echo "# overlap ablation: backend $BACKEND, --parallel $PARALLEL ($WORLD ranks), config $CONFIG, $STEPS timed steps after $WARMUP, $REPEAT repetition(s)"
RESULTS=()
for ((rep = 0; rep < REPEAT; rep++)); do
for i in "${!NAMES[@]}"; do
  dir=$OUT/run$i.$rep
  rm -rf "$dir"
  args=(--config "$CONFIG" --backend "$BACKEND" --run-dir "$dir" --parallel "$PARALLEL" --allow-test-config)
  for s in "${BASE[@]}" ${VARIANTS[$i]}; do args+=(--set "$s"); done
  if [ "$BACKEND" = cuda ] && [ "$WORLD" -gt 1 ]; then
    cmd=("$TROUPE" run --nproc "$WORLD" --backend cuda -- "$TRAIN" "${args[@]}")
  else
    cmd=("$TRAIN" "${args[@]}")
  fi
  if ! timeout 600 "${cmd[@]}" > "$OUT/run$i.$rep.log" 2>&1; then
    echo "FAILED: ${NAMES[$i]} (log $OUT/run$i.$rep.log)"
    RESULTS+=("${NAMES[$i]}|FAILED")
    continue
  fi
  RESULTS+=("${NAMES[$i]}|$dir/metrics.jsonl")
done
done

python3 - "$WARMUP" "${RESULTS[@]}" <<'PY'
import json, statistics, sys
warm = int(sys.argv[1])
runs = {}
order = []
for item in sys.argv[2:]:
    name, _, path = item.partition('|')
    if name not in runs:
        runs[name] = []
        order.append(name)
    if path == 'FAILED':
        continue
    recs = [json.loads(l) for l in open(path) if l.strip()]
    recs = [r for r in recs if 'step_ms' in r and r.get('step', 0) > warm]
    med = lambda k: statistics.median(r[k] for r in recs)
    runs[name].append((med('step_ms'), med('comm_ms'), med('tokens_per_s'), recs[-1]['loss']))
rows = []
for name in order:
    rs = runs[name]
    if not rs:
        rows.append((name, None)); continue
    rows.append((name, tuple(statistics.median(r[j] for r in rs) for j in range(3)) + (rs[-1][3], len(rs))))
base = rows[0][1][0] if rows and rows[0][1] else None
print("tokens/s = tokens per step / step time; exposed comm = time the step thread waited on the data plane")
print("| schedule | step ms | exposed comm ms | tokens/s | speed-up vs sequential | final loss |")
print("| --- | --- | --- | --- | --- | --- |")
for name, v in rows:
    if v is None:
        print(f"| {name} | FAILED | | | | |"); continue
    step, comm, tps, loss, n = v
    sp = f"{base / step:.2f}x" if base else "-"
    print(f"| {name} | {step:.1f} | {comm:.1f} | {tps:,.0f} | {sp} | {loss:.4f} |")
PY
