#!/usr/bin/env bash
# scripts/run-demo.sh — the main job of `make demo` (called by scripts/demo.sh once the
# binaries exist), the way users run Troupe: prepare the demo corpus (this machine's
# Python standard library sources), then `troupe run` trains apps/configs/tiny.toml with 4
# CPU workers (dp=2, n=2); mid-run this script kills one worker with SIGKILL and the job
# replaces it live (the recovery lines come from the job's driver as it happens). Then a
# sample from the last checkpoint and the plots (loss.png marks the recovery).
# Usage: scripts/run-demo.sh [build dir]; DEMO_DATA, DEMO_RUN, DEMO_TIME_LIMIT, DEMO_KILL_AT
# override.
set -euo pipefail
build=${1:-build}
bin=$build/apps/train_moe
troupe=$build/scheduler/troupe
data=${DEMO_DATA:-runs/data/demo}
run=${DEMO_RUN:-runs/demo}
limit=${DEMO_TIME_LIMIT:-420}   # training stops after this many seconds whatever the step
kill_at=${DEMO_KILL_AT:-100}    # the worker is killed once this step is done
t0=$(date +%s)

corpus=$(/usr/bin/python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])' 2>/dev/null || true)
if [ -z "$corpus" ] || [ ! -d "$corpus" ]; then
  corpus=$(ls -d /usr/lib/python3* 2>/dev/null | head -1)
fi
if [ -z "$corpus" ] || [ ! -d "$corpus" ]; then
  echo "demo: no Python standard library found under /usr/lib to use as the corpus" >&2
  exit 1
fi

echo "== demo 1/4: prepare the corpus ($corpus, *.py, up to 16 MB) =="
"$bin" prepare --input "$corpus" --ext .py --out "$data" --vocab 1024 --max-bytes 16000000

echo "== demo 2/4: troupe run: apps/configs/tiny.toml on 4 CPU workers (dp=2, n=2), run dir $run;"
echo "   worker rank 1 is killed with SIGKILL after step $kill_at and replaced while the job runs =="
rm -rf "$run"
# Two data-parallel replicas of 4 sequences: the same 8 sequences per step as one process.
"$troupe" run --nproc 4 -- "$bin" --config apps/configs/tiny.toml --run-dir "$run" --parallel dp=2,n=2 \
  --set "data.dir=\"$data\"" --set "train.time_limit_s=$limit" --set train.micro_batch_size=4 \
  --set checkpoint.every=100 &
job=$!
trap 'kill $job 2>/dev/null || true' INT TERM

# The killer: once step $kill_at is in metrics.jsonl, the pid of worker rank 1 comes from
# the actor table the Trainer keeps in status.json (its stage actor's process).
killed=0
while kill -0 "$job" 2>/dev/null; do
  if [ "$killed" = 0 ] && [ -f "$run/status.json" ] && [ -f "$run/metrics.jsonl" ]; then
    victim=$(/usr/bin/python3 - "$run" "$kill_at" <<'PY' 2>/dev/null || true
import json, sys
run, at = sys.argv[1], int(sys.argv[2])
steps = [json.loads(l).get("step", 0) for l in open(f"{run}/metrics.jsonl") if l.strip()]
if max(steps, default=0) >= at:
    st = json.load(open(f"{run}/status.json"))
    pid = [a["pid"] for a in st.get("actors", []) if a.get("id") == "stage.1" and a.get("pid", 0) > 0]
    if pid:
        print(pid[0], st["step"])
PY
)
    if [ -n "$victim" ]; then
      set -- $victim
      echo "demo: kill -9 $1 (worker rank 1: stage.1, attention.1, experts.1) after step $2"
      kill -9 "$1" 2>/dev/null || true
      killed=1
    fi
  fi
  sleep 0.2
done
wait "$job"
trap - INT TERM
if [ "$killed" = 0 ]; then
  echo "demo: the run ended before step $kill_at; nothing was killed" >&2
fi

echo "== demo 3/4: sample (from the run's newest checkpoint) =="
"$bin" sample --run "$run" --prompt "def " --tokens 150 --temperature 0.8 --top-k 40 --seed 1

echo "== demo 4/4: plot =="
"$bin" plot --run "$run" || echo "demo: plotting failed (is python3-matplotlib installed?); metrics are in $run/metrics.jsonl"

/usr/bin/python3 - "$run" "$(( $(date +%s) - t0 ))" <<'PY'
import json, math, os, sys
run = sys.argv[1]
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if l.strip()]
val = [r for r in rows if "val_loss" in r]
steps = [r for r in rows if "loss" in r]
events = []
if os.path.exists(f"{run}/events.jsonl"):
    events = [json.loads(l) for l in open(f"{run}/events.jsonl") if l.strip()]
for e in events:
    if e.get("event") == "recovered":
        print(f"demo: recovery ({e['cause']}): step {e['step']} completed {e['recovery_s']:.2f} s after the "
              f"failure was detected; steps lost {e['steps_lost']}")
print(f"demo: validation loss {val[0]['val_loss']:.3f} at step 0 (ln 1024 = {math.log(1024):.3f}) -> "
      f"{val[-1]['val_loss']:.3f} at step {val[-1]['step']}; {steps[-1]['tokens']} tokens trained; "
      f"{sys.argv[2]} s in all")
PY
