#!/usr/bin/env bash
# bench/e2e.sh — Troupe against the PyTorch peer (bench/peers/torch_moe.py), back to back on
# this host's GPUs: one GPU, and two GPUs when `nvidia-smi -L` lists at least two.
# For each GPU count: Troupe's train_moe (1 GPU directly and under `troupe run --nproc 1`, 2
# GPUs under `troupe run`), then the peer eager and compiled. Prints one table: config, GPUs,
# system, tokens/s, MFU (model FLOPs per token = 6*N_active + 6*L*s*d, attention counted
# causal, against 989 TFLOP/s per GPU) and the ratio to the faster peer variant at the same
# GPU count. A run that fails or times out
# becomes a FAILED row; the script goes on. Logs and JSON under ${OUT:-/tmp}/e2e/.
#
# Tokens: both systems train on the same tokens. Troupe reads the token shards of --data (or
# of the config's data.dir, or shards made once with `train_moe prepare` from this repository's
# text); the peer reads the same shards with Troupe's DataLoader sampling (torch_moe.py --data),
# so step s of both is the same batch, and routing sees the same token distribution. Without
# shards (no Troupe build, --device cpu) the peer falls back to uniform random ids, and the
# table says so.
#
# Troupe's figures: the median over steps after the warm-up of `tokens_per_s` (and `mfu`, where
# metrics.jsonl has it; else computed from tokens/s with the formula above) in the run dir's
# metrics.jsonl. tokens/s is taken as the whole job's (all GPUs), as the peer reports it.
set -u -o pipefail

usage() {
  cat <<'EOF'
usage: bench/e2e.sh [options]
  --config FILE      model config (default apps/configs/bench_1b.toml)
  --steps N          timed steps per run (default 10)
  --warmup N         untimed steps before them (default 3; compilation happens there)
  --gpus LIST        GPU counts to run, e.g. "1" or "1 2" (default: 1, and 2 if there are >= 2 GPUs)
  --build DIR        Troupe build folder (default build)
  --data DIR         token data for train_moe (default: data.dir of the config if it exists, else
                     made once with `train_moe prepare` from this repository's text into the log folder)
  --python PY        python with torch (default python3)
  --skip-troupe      only the peer rows
  --skip-peer        only the Troupe rows
  --no-run-row       on one GPU, skip the row launched as `troupe run --nproc 1` (the
                     scheduler's driver and one worker) beside `train_moe --backend cuda`
  --peer-gpus LIST   GPU counts with peer rows (default: every count of --gpus)
  --device cpu       run the peer on CPU (a test of this script; --spawn for 2 ranks, f32)
  --peer-args "..."  extra arguments for every peer run (e.g. "--d-model 256 --layers 2")
  --timeout S        limit for one run in seconds (default 300 for compiled runs, 150 for others)
  --quick            --steps 5 --warmup 2
  --dp               on each GPU count > 1 also a Troupe row with --parallel dp=N (data parallelism,
                     ZeRO-1 and the in-memory state of the elastic workers, the config's micro-batch
                     per GPU) beside the n=N row
  --troupe-set K=V   one more `--set K=V` for every Troupe run (repeatable; e.g. an A/B of a switch
                     such as bench.fold_grad_norm=false)
  --no-selfcheck     skip the peer's numerical self-check (a small model: dispatch path with
                     torch._grouped_mm and all-to-all against a naive per-expert reference)
EOF
}

cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

CONFIG=apps/configs/bench_1b.toml
STEPS=10
WARMUP=3
GPUS=""
BUILD=build
DATA=""
PY=python3
SKIP_TROUPE=0
RUN_ROW=1
TROUPE_SETS=""
SKIP_PEER=0
DEVICE=cuda
PEER_ARGS=""
TIMEOUT=""
SELFCHECK=1
DP_ROWS=0
PEER_GPUS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --config) CONFIG=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --gpus) GPUS=$2; shift 2 ;;
    --build) BUILD=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --skip-troupe) SKIP_TROUPE=1; shift ;;
    --no-run-row) RUN_ROW=0; shift ;;
    --skip-peer) SKIP_PEER=1; shift ;;
    --peer-gpus) PEER_GPUS=$2; shift 2 ;;
    --device) DEVICE=$2; shift 2 ;;
    --peer-args) PEER_ARGS=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --quick) STEPS=5; WARMUP=2; shift ;;
    --dp) DP_ROWS=1; shift ;;
    --troupe-set) TROUPE_SETS="${TROUPE_SETS:-} --allow-test-config --set $2"; shift 2 ;;
    --no-selfcheck) SELFCHECK=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "e2e.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
case "$STEPS$WARMUP" in *[!0-9]*) echo "e2e.sh: --steps and --warmup take integers" >&2; exit 2 ;; esac
[ "$STEPS" -ge 1 ] || { echo "e2e.sh: --steps must be >= 1" >&2; exit 2; }
[ -f "$CONFIG" ] || { echo "e2e.sh: config '$CONFIG' not found" >&2; exit 2; }

LOG=${OUT:-/tmp}/e2e
# Troupe's run dirs (weights: GBs) and prepared token data stay out of $OUT; metrics.jsonl is copied.
RUNROOT=${TMPDIR:-/tmp}/troupe-e2e-runs
mkdir -p "$LOG" "$RUNROOT" || exit 2
ROWS=$LOG/rows.tsv
: > "$ROWS"
CFG_NAME=$(basename "$CONFIG" .toml)

if [ -z "$GPUS" ]; then
  if [ "$DEVICE" = cpu ]; then
    GPUS="1 2"
  else
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    NGPU=${NGPU:-0}
    if [ "$NGPU" -lt 1 ]; then
      echo "e2e.sh: nvidia-smi lists no GPU (use --device cpu to test the script)" >&2
      exit 2
    fi
    GPUS="1"
    [ "$NGPU" -ge 2 ] && GPUS="1 2"
  fi
fi

echo "e2e.sh: $(date -u +%FT%TZ) config $CONFIG, GPU counts: $GPUS, steps $STEPS after $WARMUP warm-up, logs in $LOG"
if [ "$DEVICE" = cuda ]; then
  nvidia-smi -L 2>&1 | tee "$LOG/gpus.txt"
fi
"$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tee "$LOG/torch.txt"
# shellcheck disable=SC2086
FPT=$("$PY" bench/peers/torch_moe.py --config "$CONFIG" $PEER_ARGS --print-flops 2>"$LOG/flops.err")
if [ -z "$FPT" ]; then
  echo "e2e.sh: cannot compute FLOPs/token (see $LOG/flops.err)" >&2
  FPT=0
fi

run_limited() {  # run_limited SECONDS LOGFILE CMD... : the command's status (124 on time-out)
  local limit=$1 logf=$2
  shift 2
  echo "+ $*" | tee "$logf"
  timeout --signal=TERM --kill-after=20 "$limit" "$@" >>"$logf" 2>&1
  local rc=$?
  tail -n 3 "$logf" | sed 's/^/    /'
  return $rc
}

add_row() {  # add_row GPUS SYSTEM STATUS SOURCE (STATUS ok|FAILED..., SOURCE a json or jsonl path)
  printf '%s\t%s\t%s\t%s\t%s\n' "$CFG_NAME" "$1" "$2" "$3" "$4" >> "$ROWS"
}

# ---- Troupe data ------------------------------------------------------------------------
troupe_data() {
  if [ -n "$DATA" ]; then echo "$DATA"; return; fi
  local d
  d=$(sed -n 's/^[[:space:]]*dir[[:space:]]*=[[:space:]]*"\([^"]*\)".*/\1/p' "$CONFIG" | head -n 1)
  if [ -n "$d" ] && [ -f "$d/tokenizer.json" ]; then echo "$d"; return; fi
  d=$RUNROOT/data
  if [ ! -f "$d/tokenizer.json" ]; then
    # Throughput does not depend on the text: a small tokenizer over this repository's sources.
    local inputs=()
    for p in core kernels layers apps comm runtime scheduler bench docs README.md DESIGN.md; do
      [ -e "$p" ] && inputs+=("$p")
    done
    run_limited 300 "$LOG/prepare.log" "$BUILD/apps/train_moe" prepare --input "${inputs[@]}" --out "$d" \
      --vocab 2048 --val-fraction 0.1 --max-bytes 8000000 --ext .cc .h .cu .cuh .md .py .txt .toml .sh >&2 || true
  fi
  echo "$d"
}

# The config's micro-batch is sequences per GPU. On n GPUs Troupe's n-group splits every
# sequence over the n GPUs (Ulysses), while each peer rank trains its own micro-batch, so
# Troupe's micro-batch is n times the config's: the same tokens per GPU per step.
MBS=$(sed -n 's/^[[:space:]]*micro_batch_size[[:space:]]*=[[:space:]]*\([0-9]*\).*/\1/p' "$CONFIG" | head -n 1)
# A step of n GPUs takes n micro-batches' worth of sequences (train.global_batch = MBS * n):
# one micro-batch of MBS * n sequences in the n-group, or MBS per replica with --dp.
troupe_sets() {  # troupe_sets DATA NGPU [n|dp]
  local steps=$((STEPS + WARMUP))
  local sets="--set train.steps=$steps --set train.eval_every=0 --set train.eval_batches=1 --set train.log_every=1 --set data.dir=$1${TROUPE_SETS:-}"
  if [ -n "$MBS" ] && [ "$2" -gt 1 ]; then
    sets="$sets --set train.global_batch=$((MBS * $2))"
    if [ "${3:-n}" = n ]; then sets="$sets --set train.micro_batch_size=$((MBS * $2))"; fi
  fi
  echo "$sets"
}

run_troupe() {  # run_troupe NGPU [n|dp|run]: the GPUs form the n-group (default) or dp replicas;
  # "run" (one GPU): launched as `troupe run --nproc 1` (the scheduler's driver and worker)
  local n=$1 kind=${2:-n}
  local tag=troupe_${n}gpu system=troupe
  if [ "$kind" = dp ]; then tag=troupe_dp${n}_${n}gpu; system=troupe-dp$n; fi
  if [ "$kind" = run ]; then tag=troupe_run_${n}gpu; system=troupe-run; fi
  local dir=$RUNROOT/$tag logf=$LOG/$tag.log data sets
  local limit=${TIMEOUT:-150}
  rm -rf "$dir"
  if [ ! -x "$BUILD/apps/train_moe" ]; then
    echo "troupe ${n} GPU: $BUILD/apps/train_moe not built" | tee "$logf"
    add_row "$n" "$system" "FAILED (no $BUILD/apps/train_moe)" ""
    return
  fi
  data=$(troupe_data)
  if [ "$kind" = dp ]; then
    sets=$(troupe_sets "$data" "$n" dp)  # each dp rank its own micro-batch of the config's size
  else
    sets=$(troupe_sets "$data" "$n")
  fi
  echo "== $system, $n GPU(s)"
  local rc
  if [ "$n" -eq 1 ] && [ "$kind" != run ]; then
    # shellcheck disable=SC2086
    run_limited "$limit" "$logf" "$BUILD/apps/train_moe" --config "$CONFIG" --backend cuda $sets --run-dir "$dir"
    rc=$?
  elif [ "$n" -eq 1 ]; then
    # shellcheck disable=SC2086
    run_limited "$limit" "$logf" "$BUILD/scheduler/troupe" run --nproc 1 --backend cuda -- \
      "$BUILD/apps/train_moe" --config "$CONFIG" --backend cuda $sets --run-dir "$dir"
    rc=$?
  else
    if [ ! -x "$BUILD/scheduler/troupe" ]; then
      echo "troupe ${n} GPUs: $BUILD/scheduler/troupe not built" | tee "$logf"
      add_row "$n" "$system" "FAILED (no $BUILD/scheduler/troupe)" ""
      return
    fi
    # shellcheck disable=SC2086
    run_limited "$limit" "$logf" "$BUILD/scheduler/troupe" run --nproc "$n" --backend cuda -- \
      "$BUILD/apps/train_moe" --config "$CONFIG" --backend cuda --parallel "$kind=$n" $sets --run-dir "$dir"
    rc=$?
  fi
  local metrics
  metrics=$(find "$dir" -name metrics.jsonl 2>/dev/null | sort | head -n 1)
  if [ -n "$metrics" ]; then
    cp "$metrics" "$LOG/$tag.metrics.jsonl" && metrics=$LOG/$tag.metrics.jsonl
  fi
  if [ $rc -ne 0 ]; then
    add_row "$n" "$system" "FAILED (exit $rc$([ $rc -eq 124 ] && echo ', time-out'); $logf)" "$metrics"
  elif [ -z "$metrics" ]; then
    add_row "$n" "$system" "FAILED (no metrics.jsonl under $dir)" ""
  else
    add_row "$n" "$system" ok "$metrics"
  fi
}

run_peer() {  # run_peer NGPU MODE
  local n=$1 mode=$2
  local json=$LOG/peer_${mode}_${n}gpu.json logf=$LOG/peer_${mode}_${n}gpu.log
  local limit=${TIMEOUT:-$([ "$mode" = compile ] && echo 300 || echo 150)}
  local args=(bench/peers/torch_moe.py --config "$CONFIG" --mode "$mode" --steps "$STEPS" --warmup "$WARMUP"
              --json-out "$json")
  if [ -n "$PEER_DATA" ]; then args+=(--data "$PEER_DATA"); fi
  # One micro-batch a rank: a step of n ranks is n micro-batches.
  if [ -n "$MBS" ] && [ "$n" -gt 1 ]; then args+=(--set "train.global_batch=$((MBS * n))"); fi
  if [ "$DEVICE" = cpu ]; then args+=(--device cpu --dtype f32); fi
  # shellcheck disable=SC2206
  args+=($PEER_ARGS)
  rm -f "$json"
  echo "== pytorch $mode, $n GPU(s)"
  local rc
  if [ "$n" -eq 1 ]; then
    run_limited "$limit" "$logf" "$PY" "${args[@]}"
    rc=$?
  elif [ "$DEVICE" = cuda ] && "$PY" -c 'import torch.distributed.run' 2>/dev/null; then
    run_limited "$limit" "$logf" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$n" "${args[@]}"
    rc=$?
  else
    run_limited "$limit" "$logf" "$PY" "${args[@]}" --spawn "$n"
    rc=$?
  fi
  if [ $rc -ne 0 ] || [ ! -f "$json" ]; then
    add_row "$n" "pytorch-$mode" "FAILED (exit $rc$([ $rc -eq 124 ] && echo ', time-out'); $logf)" ""
  else
    add_row "$n" "pytorch-$mode" ok "$json"
  fi
}

SMALL=(--d-model 256 --layers 2 --heads 4 --kv-heads 2 --experts 8 --top-k 2 --expert-hidden 512 --vocab 4096
       --seq 256 --micro-batch 4)
selfcheck_peer() {  # selfcheck_peer NGPU: informational; a failure is reported, the benchmark goes on
  local n=$1 logf=$LOG/peer_selfcheck_${1}gpu.log
  local args=(bench/peers/torch_moe.py --selfcheck "${SMALL[@]}")
  if [ "$DEVICE" = cpu ]; then args+=(--device cpu --dtype f32); fi
  if [ "$n" -gt 1 ]; then args+=(--spawn "$n"); fi
  echo "== pytorch peer selfcheck, $n GPU(s)"
  if run_limited 240 "$logf" "$PY" "${args[@]}"; then
    echo "peer selfcheck ($n GPU): passed" | tee -a "$LOG/selfcheck.txt"
  else
    echo "peer selfcheck ($n GPU): FAILED, see $logf" | tee -a "$LOG/selfcheck.txt"
  fi
}
: > "$LOG/selfcheck.txt"

# The token shards both systems read (made here once if needed; needs the Troupe build).
PEER_DATA=""
if [ -x "$BUILD/apps/train_moe" ] || [ -n "$DATA" ]; then
  PEER_DATA=$(troupe_data)
  [ -f "$PEER_DATA/tokenizer.json" ] || PEER_DATA=""
fi
if [ -n "$PEER_DATA" ]; then
  TOKENS_NOTE="tokens: both systems read the shards in $PEER_DATA (Troupe's DataLoader sampling; step s = the same batch)"
else
  TOKENS_NOTE="tokens: NOT the same - no token shards (no $BUILD/apps/train_moe, no --data): the peer ran on uniform random ids"
fi
echo "$TOKENS_NOTE" | tee "$LOG/tokens.txt"

peer_rows() {  # peer_rows NGPU: whether the peer runs at this GPU count (--skip-peer, --peer-gpus)
  [ "$SKIP_PEER" -eq 0 ] && { [ -z "$PEER_GPUS" ] || [[ " $PEER_GPUS " == *" $1 "* ]]; }
}

for n in $GPUS; do
  if peer_rows "$n" && [ "$SELFCHECK" -eq 1 ]; then selfcheck_peer "$n"; fi
  if [ "$SKIP_TROUPE" -eq 0 ]; then
    if [ "$DEVICE" = cuda ]; then
      run_troupe "$n"
      if [ "$n" -eq 1 ] && [ "$RUN_ROW" -eq 1 ]; then run_troupe 1 run; fi
      if [ "$DP_ROWS" -eq 1 ] && [ "$n" -gt 1 ]; then run_troupe "$n" dp; fi
    else
      add_row "$n" troupe "skipped (--device cpu)" ""
    fi
  fi
  if peer_rows "$n"; then
    run_peer "$n" eager
    run_peer "$n" compile
  fi
done

"$PY" - "$ROWS" "$WARMUP" "$FPT" "$LOG" "$TOKENS_NOTE" <<'PYEOF'
import json, statistics, sys

rows_path, warmup, fpt, log, tokens_note = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
PEAK = 989e12
rows = []
for line in open(rows_path):
    cfg, gpus, system, status, src = line.rstrip("\n").split("\t")
    r = {"config": cfg, "gpus": int(gpus), "system": system, "status": status, "tokens_per_s": None,
         "mfu": None, "mfu_computed": False, "source": src}
    if status == "ok":
        try:
            if src.endswith(".jsonl"):
                recs = [json.loads(l) for l in open(src) if l.strip()]
                steps = [x for x in recs if "tokens_per_s" in x and x.get("step", 0) > warmup]
                if not steps:
                    steps = [x for x in recs if "tokens_per_s" in x]
                if not steps:
                    raise ValueError("no step records with tokens_per_s")
                r["tokens_per_s"] = statistics.median(x["tokens_per_s"] for x in steps)
                mfus = [x["mfu"] for x in steps if "mfu" in x]
                if mfus:
                    r["mfu"] = statistics.median(mfus)
                syncs = [x["host_syncs"] for x in steps if "host_syncs" in x]
                if syncs:
                    r["host_syncs"] = max(syncs)
                r["steps"] = len(steps)
            else:
                d = json.load(open(src))
                r["tokens_per_s"], r["mfu"], r["steps"] = d["tokens_per_s"], d["mfu"], len(d["step_ms"])
            if r["mfu"] is None and fpt > 0:
                r["mfu"] = r["tokens_per_s"] * fpt / (PEAK * r["gpus"])
                r["mfu_computed"] = True
        except Exception as ex:  # a truncated or malformed file
            r["status"] = f"FAILED (cannot read {src}: {ex})"
    rows.append(r)

best = {}
for r in rows:
    if r["system"].startswith("pytorch") and r["tokens_per_s"]:
        best[r["gpus"]] = max(best.get(r["gpus"], 0), r["tokens_per_s"])
lines = [f"model FLOPs/token = 6*N_active + 6*L*s*d (attention causal) = {fpt / 1e9:.4f} GFLOP; "
         f"MFU against {PEAK / 1e12:.0f} TFLOP/s per GPU; ratio = tokens/s / faster PyTorch variant at the same GPU count",
         tokens_note,
         "",
         "weak scaling = tokens/s / (GPUs x the same system's 1-GPU tokens/s; Troupe's rows against Troupe's 1-GPU row)",
         "",
         "| config | GPUs | system | tokens/s | MFU | vs faster peer | weak scaling |",
         "| --- | --- | --- | --- | --- | --- | --- |"]
one = {}
for r in rows:
    if r["gpus"] == 1 and r["tokens_per_s"]:
        one["troupe" if r["system"].startswith("troupe") else r["system"]] = r["tokens_per_s"]
for r in rows:
    if r["tokens_per_s"]:
        tps = f"{r['tokens_per_s']:,.0f}"
        mfu = f"{100 * r['mfu']:.1f}%{'*' if r['mfu_computed'] else ''}" if r["mfu"] is not None else "-"
        # Three decimals: two printed 1.2956 as "1.30x" against a 1.30x target.
        ratio = f"{r['tokens_per_s'] / best[r['gpus']]:.3f}x" if r["gpus"] in best else "-"
        base = one.get("troupe" if r["system"].startswith("troupe") else r["system"])
        weak = f"{100 * r['tokens_per_s'] / (r['gpus'] * base):.0f}%" if base and r["gpus"] > 1 else "-"
    else:
        tps, mfu, ratio, weak = r["status"], "-", "-", "-"
    lines.append(f"| {r['config']} | {r['gpus']} | {r['system']} | {tps} | {mfu} | {ratio} | {weak} |")
for r in rows:
    if "host_syncs" in r:
        lines.append(f"{r['system']} ({r['gpus']} GPU): at most {r['host_syncs']} device->host read-backs per timed step "
                     f"before its metrics read (metrics.jsonl host_syncs)")
if any(r["mfu_computed"] for r in rows):
    lines.append("* MFU computed here from tokens/s (metrics.jsonl has no mfu)")
text = "\n".join(lines)
print()
print(text)
open(f"{log}/e2e.md", "w").write(text + "\n")
json.dump(rows, open(f"{log}/e2e.json", "w"), indent=1)
print(f"\n(table in {log}/e2e.md, rows in {log}/e2e.json)")
PYEOF
cat "$LOG/selfcheck.txt"
