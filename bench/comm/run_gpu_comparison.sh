#!/usr/bin/env bash
# bench/comm/run_gpu_comparison.sh — on the GPU host, in one run: the NCCL GPU tests,
# comm_bench's NCCL all-to-all, PyTorch's all_to_all_single at the same sizes, and the
# ratio at the largest size (target: >= 95% of PyTorch at large sizes).
#   bench/comm/run_gpu_comparison.sh [build-dir] [python]
set -euo pipefail
BUILD=${1:-build}
PYTHON=${2:-python3}
export NCCL_NVLS_ENABLE=0   # never NVLink multicast on the shared hosts
GPUS=$(nvidia-smi -L | wc -l)
(cd "$BUILD" && ctest -L gpu -R '^comm_' --output-on-failure) || echo "comm GPU tests FAILED"
OURS=$(mktemp) THEIRS=$(mktemp)
BENCH="$BUILD/bench/comm/comm_bench_nccl"   # no Gloo needed on the GPU host
[ -x "$BENCH" ] || BENCH="$BUILD/bench/comm/comm_bench"
"$BENCH" --backend nccl --ranks "$GPUS" --min-bytes 1M --max-bytes 1G \
  --ops all_to_all,all_to_all_v,all_gather,reduce_scatter,all_reduce | tee "$OURS"
"$PYTHON" "$(dirname "$0")/torch_all_to_all.py" --gpus "$GPUS" --min-bytes 1M --max-bytes 1G | tee "$THEIRS"
# Largest all_to_all row of each table: column 5 is busbw.
ours=$(awk '/^all_to_all on nccl/{f=1;next} /^$/{f=0} f && $1 ~ /^[0-9]+$/ {b=$5} END{print b}' "$OURS")
theirs=$(awk '/^all_to_all on torch-nccl/{f=1;next} f && $1 ~ /^[0-9]+$/ {b=$5} END{print b}' "$THEIRS")
echo
echo "all_to_all busbw at the largest size: troupe ${ours} GB/s, PyTorch ${theirs} GB/s," \
     "ratio $(awk -v a="$ours" -v b="$theirs" 'BEGIN{printf "%.3f", a/b}') (target >= 0.95)"
rm -f "$OURS" "$THEIRS"
