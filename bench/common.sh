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
