#!/usr/bin/env bash
# bench/router_load.sh — the router-load question: is bench_1b's growing expert
# imbalance on the GPU (per-layer max/mean load 2-4x at step 1, 7-8x by steps 5-10) a defect
# of Troupe's GPU path or the model's dynamics?
#
# One GPU, the same weights and the same tokens in both systems:
#   1. Troupe, 1 step with lr 1e-30 (no weight changes): its step-1 expert counts, and its final
#      checkpoint = the initial weights.
#   2. The PyTorch peer (bench/peers/torch_moe.py) from that checkpoint on the same token shards
#      (Troupe's DataLoader sampling), 1 step with lr 0: its step-1 counts and loss.
#   3. Troupe and the peer, STEPS steps each from the same initial weights with the config's
#      optimizer: the per-step load of both.
#   4. The peer on uniform random tokens (its own init): does random text grow the load too?
#   5. Troupe with the knobs a user can set: aux_loss_coef 0.1, and a sigmoid router with the
#      aux-loss-free bias (bias_update_rate) and a small aux loss.
# Prints a table of per-step max/mean (worst layer and mean over layers) and the step-1
# per-layer comparison; JSON and logs under OUTDIR.
#
# usage: bench/router_load.sh DATA_DIR OUTDIR [STEPS] [BUILD] [PYTHON] [CONFIG]
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DATA=${1:?usage: bench/router_load.sh DATA_DIR OUTDIR [STEPS] [BUILD] [PYTHON] [CONFIG]}
OUTDIR=${2:?usage: bench/router_load.sh DATA_DIR OUTDIR [STEPS] [BUILD] [PYTHON] [CONFIG]}
STEPS=${3:-40}
BUILD=${4:-build}
PY=${5:-python3}
CONFIG=${6:-apps/configs/bench_1b.toml}
[ -f "$DATA/tokenizer.json" ] || { echo "router_load.sh: $DATA has no tokenizer.json (train_moe prepare's output)" >&2; exit 2; }
[ -x "$BUILD/apps/train_moe" ] || { echo "router_load.sh: $BUILD/apps/train_moe not built" >&2; exit 2; }
RUNS=${TMPDIR:-/tmp}/troupe-router-load
mkdir -p "$OUTDIR" "$RUNS" || exit 2

troupe() {  # troupe NAME STEPS [--set ...]: metrics.jsonl copied to OUTDIR/NAME.metrics.jsonl
  local name=$1 steps=$2
  shift 2
  rm -rf "${RUNS:?}/$name"
  echo "== troupe $name ($steps steps) $*"
  timeout 400 "$BUILD/apps/train_moe" --config "$CONFIG" --backend cuda --set "train.steps=$steps" \
    --set train.eval_every=0 --set train.eval_batches=1 --set train.log_every=1 --set "data.dir=$DATA" \
    --set checkpoint.final=false "$@" --run-dir "$RUNS/$name" >"$OUTDIR/$name.log" 2>&1
  local rc=$?
  tail -n 2 "$OUTDIR/$name.log" | sed 's/^/    /'
  cp "$RUNS/$name/metrics.jsonl" "$OUTDIR/$name.metrics.jsonl" 2>/dev/null
  return $rc
}
peer() {  # peer NAME STEPS [args...]
  local name=$1 steps=$2
  shift 2
  echo "== peer $name ($steps steps) $*"
  timeout 300 "$PY" bench/peers/torch_moe.py --config "$CONFIG" --mode eager --steps "$steps" --warmup 0 \
    --load-log --json-out "$OUTDIR/$name.json" "$@" >"$OUTDIR/$name.log" 2>&1
  local rc=$?
  tail -n 2 "$OUTDIR/$name.log" | sed 's/^/    /'
  return $rc
}

# Updates far below an f32 ulp: the final checkpoint holds the initial weights.
troupe troupe_lr0 1 --set optim.lr=1e-30 --set optim.min_lr=0 --set checkpoint.final=true
peer peer_lr0 1 --data "$DATA" --init-weights "$RUNS/troupe_lr0" --set optim.lr=0 --set optim.min_lr=0
troupe troupe "$STEPS"
peer peer "$STEPS" --data "$DATA" --init-weights "$RUNS/troupe_lr0"
peer peer_random "$STEPS"
# The knobs (same weights, tokens and steps; the schedule's warm-up is the config's).
troupe troupe_aux0.1 "$STEPS" --set model.moe.aux_loss_coef=0.1
troupe troupe_aux1 "$STEPS" --set model.moe.aux_loss_coef=1.0
troupe troupe_softmax_bias0.01 "$STEPS" --set model.moe.bias_update_rate=0.01
for r in 0.001 0.01 0.05; do
  troupe "troupe_sigmoid_bias$r" "$STEPS" --set 'model.moe.router="sigmoid"' --set "model.moe.bias_update_rate=$r" \
    --set model.moe.aux_loss_coef=0.001
done
rm -rf "$RUNS/troupe_lr0/checkpoints"  # the weights and moments of bench_1b: ~12 GB

"$PY" - "$OUTDIR" "$STEPS" <<'PYEOF'
import json, os, sys
out, nsteps = sys.argv[1], int(sys.argv[2])
show = [s for s in (1, 2, 3, 5, 10, 20, 30, 40, 60, 80, 100, 150, 200) if s <= nsteps]

def troupe(name):
    p = f"{out}/{name}.metrics.jsonl"
    if not os.path.exists(p):
        return None
    recs = [json.loads(l) for l in open(p) if l.strip()]
    return {r["step"]: (r["expert_load"], r["loss"]) for r in recs if "expert_load" in r}

def peer(name):
    p = f"{out}/{name}.json"
    if not os.path.exists(p):
        return None
    d = json.load(open(p))
    return {i + 1: (l, d["losses"][i]) for i, l in enumerate(d["expert_load"])}

def ratio(row):
    return max(row) * len(row) / max(1, sum(row))

lines = []
runs = [("troupe (softmax, aux 0.01)", troupe("troupe")), ("peer, same weights and tokens", peer("peer")),
        ("peer, uniform random tokens", peer("peer_random")), ("troupe, aux 0.1", troupe("troupe_aux0.1")),
        ("troupe, aux 1.0", troupe("troupe_aux1")), ("troupe, softmax + bias 0.01, aux 0.01", troupe("troupe_softmax_bias0.01"))]
runs += [(f"troupe, sigmoid + bias {r}, aux 0.001", troupe(f"troupe_sigmoid_bias{r}")) for r in ("0.001", "0.01", "0.05")]
lines.append("per-step expert load max/mean: worst layer / mean over layers (loss)")
lines.append("| run | " + " | ".join(f"step {s}" for s in show) + " |")
lines.append("| --- |" + " --- |" * len(show))
for name, r in runs:
    if r is None:
        lines.append(f"| {name} | FAILED (see logs) |")
        continue
    cells = []
    for s in show:
        if s not in r:
            cells.append("-")
            continue
        rs = [ratio(l) for l in r[s][0]]
        cells.append(f"{max(rs):.2f} / {sum(rs) / len(rs):.2f} ({r[s][1]:.3f})")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
t0, p0 = troupe("troupe_lr0"), peer("peer_lr0")
if t0 and p0 and 1 in t0 and 1 in p0:
    tl, pl = t0[1][0], p0[1][0]
    lines.append("")
    lines.append(f"step 1, same weights and tokens: loss troupe {t0[1][1]:.5f}, peer {p0[1][1]:.5f}")
    lines.append("| layer | troupe max/mean | peer max/mean | routings that differ | troupe counts | peer counts |")
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for i, (a, b) in enumerate(zip(tl, pl)):
        diff = sum(abs(x - y) for x, y in zip(a, b)) / 2 / max(1, sum(a))
        lines.append(f"| {i} | {ratio(a):.2f} | {ratio(b):.2f} | {100 * diff:.2f}% | {a} | {b} |")
text = "\n".join(lines)
print(text)
open(f"{out}/router_load.md", "w").write(text + "\n")
PYEOF
