#!/bin/bash
# bench/faults/gpu_health_check.sh BUILD — on a GPU host: a short train_moe job on one GPU
# under a troupe-scheduler and agent (loopback, a temporary state directory), then
#   1. `troupe status <job> --health` while it trains: the worker's NVML readings (SM clock,
#      power, temperature, utilisation, memory, ECC, XID) beside its host readings;
#   2. the scheduler's /metrics lines troupe_worker_gpu_*;
#   3. tensorboard's own reader (EventAccumulator) listing the run's scalar and histogram
#      tags (needs the `tensorboard` Python package).
# Everything it starts is stopped and its directory removed at the end.
set -euo pipefail
B=$(cd "${1:-build}" && pwd); SRC=$(cd "$(dirname "$0")/../.." && pwd)
T=$(mktemp -d /tmp/troupe-gpu-health-XXXXXX); export TROUPE_CONFIG_DIR=$T/cfg
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$T"; }
trap cleanup EXIT
"$B/apps/train_moe" prepare --input "$SRC/layers" --input "$SRC/kernels" --out "$T/data" --vocab 320 \
  --max-bytes 300000 --ext .cc --ext .h > "$T/prepare.log"
"$B/scheduler/troupe-scheduler" --listen tcp://127.0.0.1:0 --endpoint-file "$T/ep" --state-dir "$T/state" \
  --metrics-listen 127.0.0.1:0 > "$T/scheduler.log" 2>&1 & pids+=($!)
sleep 2; EP=$(sed 's|tcp://||' "$T/ep")
"$B/scheduler/troupe-agent" --scheduler "$EP" --id gpuhost --work-dir "$T/agent" > "$T/agent.log" 2>&1 & pids+=($!)
sleep 2
JOB=$("$B/scheduler/troupe" submit --scheduler "$EP" --nproc 1 --backend cuda -- "$B/apps/train_moe" \
  --config "$SRC/apps/configs/tiny.toml" --backend cuda --run-dir "$T/run" --set model.vocab_size=320 \
  --set train.steps=400 --set train.eval_every=0 --set "data.dir=\"$T/data\"")
echo "job $JOB"
for i in $(seq 60); do [ -s "$T/run/metrics.jsonl" ] && [ "$(wc -l < "$T/run/metrics.jsonl")" -gt 5 ] && break; sleep 1; done
sleep 3
"$B/scheduler/troupe" status "$JOB" --health --scheduler "$EP"
URL=$(grep -o 'http://[0-9.:]*/metrics' "$T/scheduler.log" | head -1)
python3 -c "import urllib.request,sys; [print(l) for l in urllib.request.urlopen(sys.argv[1]).read().decode().splitlines() if l.startswith('troupe_worker_gpu_')]" "$URL"
"$B/scheduler/troupe" wait "$JOB" --scheduler "$EP" || true
python3 - "$T/run/tensorboard" <<'PY'
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
ea = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0, "histograms": 0})
ea.Reload()
tags = ea.Tags()
print("scalars:", sorted(tags["scalars"]))
print("histograms:", sorted(tags["histograms"]))
loss = ea.Scalars("train/loss")
print(f"train/loss: {len(loss)} points, step {loss[0].step} = {loss[0].value:.4f} ... step {loss[-1].step} = {loss[-1].value:.4f}")
h = ea.Histograms("moe/expert_load/layer_1")[-1]
print(f"moe/expert_load/layer_1 at step {h.step}: {h.histogram_value.num:.0f} experts, max {h.histogram_value.max:.0f} tokens")
PY
