# bench/common.sh — helpers the bench scripts source (not run on its own).

# bench_data TRAIN_MOE OUT_DIR: prints the token data folder for a throughput bench — OUT_DIR/data,
# made once with `train_moe prepare` from this repository's sources (vocab 2048; throughput does
# not depend on the text). Returns 1 (and says why on stderr) when prepare fails.
bench_data() {
  local train=$1 data=$2/data
  if [ ! -f "$data/tokenizer.json" ]; then
    "$train" prepare --input core kernels layers apps comm scheduler docs --out "$data" --vocab 2048 \
      --val-fraction 0.1 --max-bytes 8000000 --ext .cc .h .cu .md >"$2/prepare.log" 2>&1 ||
      { echo "prepare failed: $2/prepare.log" >&2; return 1; }
  fi
  echo "$data"
}

# metrics_summary NAME METRICS: one line for a train_moe run's metrics.jsonl — steps, first and
# last loss, and the medians over steps after 5 of tokens/s, MFU, step time, peak device memory
# and (where the run reports them) host reads per step.
metrics_summary() {
  python3 - "$1" "$2" <<'PY'
import json, statistics, sys
name, path = sys.argv[1], sys.argv[2]
try:
    recs = [json.loads(l) for l in open(path)]
except OSError:
    print(f"{name}: no metrics"); sys.exit(0)
st = [r for r in recs if "tokens_per_s" in r]
if not st:
    print(f"{name}: no steps"); sys.exit(0)
steady = [r for r in st if r["step"] > 5] or st
has = lambda k: any(k in r for r in steady)
med = lambda k: statistics.median(r[k] for r in steady if k in r) if has(k) else float("nan")
line = (f"{name}: {len(st)} steps, loss {st[0]['loss']:.4f} -> {st[-1]['loss']:.4f} | median tokens/s "
        f"{med('tokens_per_s'):.0f} | mfu {100*med('mfu'):.2f}% | step {med('step_ms'):.1f} ms | peak "
        f"{med('peak_bytes')/2**30:.2f} GiB")
if has("host_syncs"):
    line += f" | host reads/step {med('host_syncs'):.0f}"
print(line)
PY
}
