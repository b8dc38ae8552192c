#!/usr/bin/env bash
# scripts/run-demo.sh — the main job of `make demo` (called by scripts/demo.sh once
# <build>/apps/train_moe exists): prepare the demo corpus (this machine's Python standard
# library sources), train apps/configs/tiny.toml on CPU for a few minutes, print the
# validation loss at the start and the end, a sample, and plot the metrics.
# Usage: scripts/run-demo.sh [build dir]; DEMO_DATA, DEMO_RUN, DEMO_TIME_LIMIT override.
set -euo pipefail
build=${1:-build}
bin=$build/apps/train_moe
data=${DEMO_DATA:-data/demo}
run=${DEMO_RUN:-runs/demo}
limit=${DEMO_TIME_LIMIT:-420}   # training stops after this many seconds whatever the step
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

echo "== demo 2/4: train apps/configs/tiny.toml on CPU (run dir $run) =="
"$bin" --config apps/configs/tiny.toml --run-dir "$run" --set "data.dir=\"$data\"" \
  --set "train.time_limit_s=$limit"

echo "== demo 3/4: sample =="
"$bin" sample --run "$run" --prompt "def " --tokens 150 --temperature 0.8 --top-k 40 --seed 1

echo "== demo 4/4: plot =="
"$bin" plot --run "$run" || echo "demo: plotting failed (is python3-matplotlib installed?); metrics are in $run/metrics.jsonl"

/usr/bin/python3 - "$run/metrics.jsonl" "$(( $(date +%s) - t0 ))" <<'PY'
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
val = [r for r in rows if "val_loss" in r]
steps = [r for r in rows if "loss" in r]
print(f"demo: validation loss {val[0]['val_loss']:.3f} at step 0 (ln 1024 = {math.log(1024):.3f}) -> "
      f"{val[-1]['val_loss']:.3f} at step {val[-1]['step']}; {steps[-1]['tokens']} tokens trained; "
      f"{sys.argv[2]} s in all")
PY
