#!/usr/bin/env bash
# bench/gpu_host.sh — the one-GPU host steps, one per argument, run in order:
#   build    Release build (sm_90a) of train_moe, the CUDA op-table and bf16 tests, kernel_bench
#   tests    kernels_op_table_cuda_test, kernels_cuda_bf16_test, then `ctest -L gpu`
#   kernels  bench/kernels/gpu_check.sh's timing half: kernel_bench, torch_kernels.py, compare.py
#   router   bench/router_load.sh on bench_1b (same weights and tokens in Troupe and the peer)
#   e2e      bench/e2e.sh --gpus 1 on bench_1b (Troupe and both peer variants, same tokens)
#   stage    the Stage's GPU tests: tests/apps/stage_gpu_test (its CUDA graph against op by
#            op, the Trainer path) and train_moe_cuda_test (TARGETS must build them)
#   paths    bench/one_gpu_paths.sh: the single-process loop against `troupe run --nproc 1`
#   hoststats  Troupe on bench_1b with bench.device_stats=false (per-layer read-backs), to compare
#   graph    Troupe on bench_1b with bench.cuda_graph=true and false, alternating, twice
#   pdl      Troupe on bench_1b with programmatic dependent launch on and off
#            (bench.pdl=false), alternating, twice
#   profile  every kernel of two bench_1b steps (Nsight Compute, launch by launch): time and
#            launches per step by group and by kernel (bench/ncu_summary.py), all kernels
#   gaps     where the device idles between kernels in a bench_1b step (a CUPTI trace,
#            bench/kernels/kernel_trace.cc; the step replayed from its CUDA graph and launch
#            by launch, or only GAPS_GRAPH's value; bench/kernel_gaps.py, which also gives
#            each kernel's device time and launches in the step)
#   clocks   SM clock, power and the clock-event reasons every 100 ms while Troupe trains
#            bench_1b, then while the compiled PyTorch peer does (does sustained load lower
#            the clock below what an isolated kernel sees, and for both?)
#   attnprof Nsight Compute counters of the Dh-64 attention kernels (kernel_bench's shape)
#   gemmprof Nsight Compute counters of the grouped GEMM's TMA kernel on kernel_bench's
#            bench_1b load (up forward, up dx, down dW written)
#   envab    Troupe alone on bench_1b under each value of the environment variable AB_ENV
#            (AB_VALUES, space-separated), alternating, two rounds: a run-time switch's cost
#   grads    Troupe on bench_1b with train.expert_grads "bf16" and "f32", alternating, twice
#   ahead    Troupe on bench_1b with bench.launch_ahead true and false, alternating, twice
#   master   Troupe on bench_1b with train.master_weights "split" and "f32", alternating, twice
#   dq       Troupe on bench_1b with the attention's dQ inside the dK/dV kernel (the default
#            at head dim 64 on Hopper) and in its own (train.attention_fused_dq=false), twice
#   ab       Troupe alone on bench_1b, this tree's build ($BUILD) against a copy of this tree
#            with AB_PATCH applied (a `git diff` file; built into $BUILD-ab), alternating, two
#            rounds: a kernel change's end-to-end cost measured with nothing else changed.
#            To land a change, make the tree the candidate and AB_PATCH the way back to the
#            baseline: then build, tests, ctest and kernels run on the candidate in one call
#   kvar     kernel_bench's KERNEL_BENCH_ONLY rows for this tree and for copies of it patched
#            with each of VAR_PATCHES (space-separated `git diff` files), alternating, two
#            rounds: kernel variants compared on one machine in one call
#   final    the final run, most important first, each part's failure reported and passed:
#            build (train_moe + the CUDA tests) -> e2e -> tests -> train_moe_cuda_test ->
#            kernels (builds kernel_bench) -> hoststats
# Logs and tables under $OUT (default ./gpu-out). Run from the repository root with the
# dependency environment sourced (scripts/gpu-host/unpack-debs.sh; DEVELOPERS.md).
set -u -o pipefail
# Logs go to a work folder; at exit the tables come to $OUT with all logs in $OUT/logs.tgz
# (the GPU host returns only a few files).
final=${OUT:-gpu-out}
export OUT=$final
out=${TMPDIR:-/tmp}/troupe-gpu-host-out
mkdir -p "$final"
finish() {
  find "$out" -name '*.md' -exec cp {} "$final"/ \;
  cp "$out/summary.txt" "$final"/ 2>/dev/null
  tar czf "$final/logs.tgz" -C "$out" . 2>/dev/null
}
trap finish EXIT
# Outside the source folder: a carried source folder is replaced on every call, a build
# folder elsewhere stays while the machine is held.
B=${BUILD:-/tmp/troupe-build}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
stamp() { echo "== $(date -u +%T) $*" | tee -a "$out/summary.txt"; }
# Troupe alone on bench_1b, alternating the values of one switch, two rounds (same machine,
# same token shards): troupe_ab TAG KIND NAME VALUE..., KIND "set" (a config key, given
# to every Troupe run with --troupe-set) or "env" (an environment variable).
troupe_ab() {
  local tag=$1 kind=$2 name=$3 round v dir
  shift 3
  for round in 1 2; do
    for v in "$@"; do
      local envs=() sets=()
      if [ "$kind" = env ]; then envs=("$name=$v"); else sets=(--troupe-set "$name=$v"); fi
      dir="$out/e2e-$tag-$v"
      rm -rf "$dir"
      env "${envs[@]}" OUT="$dir" bash bench/e2e.sh --build "$B" --gpus 1 --quick --skip-peer --no-run-row --no-selfcheck \
        "${sets[@]}" >"$out/$tag-$v-$round.log" 2>&1
      stamp "$name=$v round $round rc=$?: $(grep -h '| troupe |' "$dir/e2e/e2e.md" 2>/dev/null)"
    done
  done
}

# Configures and builds TARGETS of source folder $1 into build folder $2 (Release, sm_90a).
build_tree() {
  local src=$1 bld=$2 tag=$3
  shift 3
  cmake -S "$src" -B "$bld" -G Ninja -DTROUPE_WERROR=OFF -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release \
    >"$out/cmake$tag.log" 2>&1 || { tail -30 "$out/cmake$tag.log"; return 1; }
  if ! ninja -C "$bld" -j16 "$@" >"$out/build$tag.log" 2>&1; then
    grep -E "error|FAILED" -A3 "$out/build$tag.log" | head -60
    return 1
  fi
}

for step in "$@"; do
  case "$step" in
    build)
      # The host bundle has libsodium's runtime, not its -dev package (see gpu_check.sh).
      if ! pkg-config --exists libsodium; then
        lib=$(dirname "$(find / -name 'libsodium.so.23*' -path '*troupe-deps*' 2>/dev/null | head -1)")
        mkdir -p /tmp/pc && printf 'Name: libsodium\nDescription: libsodium (runtime of the Debian bundle)\nVersion: 1.0.18\nLibs: -L%s -l:libsodium.so.23\nCflags:\n' "$lib" >/tmp/pc/libsodium.pc
        export PKG_CONFIG_PATH=/tmp/pc:${PKG_CONFIG_PATH:-}
      fi
      nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv | tee "$out/gpu.txt"
      targets=${TARGETS:-"train_moe kernels_op_table_cuda_test kernels_cuda_bf16_test kernel_bench"}
      # shellcheck disable=SC2086
      build_tree . "$B" "" $targets || exit 1
      stamp "build ok ($targets)"
      # ptxas 13.0 once reused the Dh-64 attention kernels' own-row A fragment registers
      # (wrong gradients, no error; attention_hopper.cu kBranchFreeTiles): check the SASS.
      obj="$B/kernels/CMakeFiles/troupe_kernels.dir/cuda/attention_hopper.cu.o"
      if command -v cuobjdump >/dev/null && [ -f "$obj" ]; then
        python3 scripts/sass-own-frags.py "$obj" >"$out/sass_own_frags.txt" 2>&1
        rc=$?
        stamp "sass-own-frags rc=$rc"
        if [ "$rc" -ne 0 ]; then cat "$out/sass_own_frags.txt"; exit 1; fi
      fi
      ;;
    tests)
      timeout 90 "$B"/tests/kernels/kernels_op_table_cuda_test >"$out/op_table_cuda.log" 2>&1
      stamp "kernels_op_table_cuda_test rc=$? ($(grep -c '^\[       OK' "$out/op_table_cuda.log") ok)"
      grep -E "^\[  FAILED|differ" "$out/op_table_cuda.log" | head -20
      timeout 90 "$B"/tests/kernels/kernels_cuda_bf16_test >"$out/bf16_test.log" 2>&1
      stamp "kernels_cuda_bf16_test rc=$?"
      grep -E "^\[  FAILED|Failure" "$out/bf16_test.log" | head -20
      ;;
    ctest)
      (cd "$B" && timeout 500 ctest -L gpu --output-on-failure) >"$out/ctest_gpu.log" 2>&1
      stamp "ctest -L gpu rc=$?"
      grep -E "tests passed|tests failed|Failed|\*\*\*" "$out/ctest_gpu.log" | head -20
      ;;
    kernels)
      # TARGETS may have left it out: build it here rather than time nothing (rc 127).
      if [ ! -x "$B"/bench/kernels/kernel_bench ]; then
        ninja -C "$B" -j16 kernel_bench >"$out/build_kernel_bench.log" 2>&1 ||
          { stamp "kernels: kernel_bench build FAILED"; tail "$out/build_kernel_bench.log"; continue; }
      fi
      timeout 100 "$B"/bench/kernels/kernel_bench >"$out/kernel_bench.log" 2>&1
      stamp "kernel_bench rc=$?"
      timeout 100 python3 bench/kernels/torch_kernels.py >"$out/torch.log" 2>&1
      stamp "torch_kernels rc=$?"
      python3 bench/kernels/compare.py "$out/kernel_bench.log" "$out/torch.log" | tee "$out/compare.md"
      ;;
    router)
      OUT=$out bash bench/e2e.sh --build "$B" --skip-troupe --skip-peer --gpus 1 >/dev/null 2>&1  # prepares the shared shards
      bash bench/router_load.sh "${TMPDIR:-/tmp}/troupe-e2e-runs/data" "$out/router" "${ROUTER_STEPS:-60}" "$B"
      stamp "router_load rc=$?"
      ;;
    graph)
      # The step replayed from one CUDA graph against its launches enqueued one by one.
      troupe_ab graph set bench.cuda_graph true false
      for g in true false; do
        grep -h "captured as a CUDA graph\|^step 2/" "$out/e2e-graph-$g/e2e/troupe_1gpu.log" 2>/dev/null | cut -c1-200
      done
      ;;
    pdl)
      # Kernels launched with programmatic dependent launch (the default on sm_90) and without.
      troupe_ab pdl set bench.pdl true false
      ;;
    envab)
      if [ -z "${AB_ENV:-}" ] || [ -z "${AB_VALUES:-}" ]; then
        echo "gpu_host.sh envab: set AB_ENV (a variable name) and AB_VALUES (its values)" >&2
        exit 2
      fi
      # shellcheck disable=SC2086
      troupe_ab "env-$AB_ENV" env "$AB_ENV" $AB_VALUES
      ;;
    ahead)
      # A replayed step's successor enqueued before its statistics are read, and not.
      troupe_ab ahead set bench.launch_ahead true false
      ;;
    grads)
      # The experts' weight gradients in bf16 (bench_1b's setting, as the peer's autocast
      # rounds its gradients) and in f32 (the default elsewhere).
      troupe_ab grads set train.expert_grads bf16 f32
      ;;
    master)
      # The matrices' f32 masters split into their bf16 working copies and 16-bit low halves
      # (bench_1b's setting) and kept as separate f32 values.
      troupe_ab master set train.master_weights split f32
      ;;
    dq)
      # The attention backward with dQ inside the dK/dV kernel (the default at head dim 64 on
      # Hopper) and in its own kernel.
      troupe_ab fused set train.attention_fused_dq true false
      ;;
    gemmprof)
      # Nsight Compute counters of the grouped GEMM's TMA kernel on kernel_bench's bench_1b
      # load: the up projection forward and dx, the down dW written (bench/ncu_counters.py:
      # per kernel, the median over its launches): time, SM clock, tensor-pipe use, L2 and
      # DRAM throughput, L2 bytes read. (At 02dbb77, H200: the tensor pipe 81-92% busy, L2 at 56-67% of its peak.)
      m=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second
      m=$m,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
      m=$m,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,lts__t_sectors_srcunit_tex_op_read.sum
      m=$m,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum
      for only in grouped_up_wgmmatma grouped_up_dx grouped_down_dw_write_wgmmatma; do
        KERNEL_BENCH_ONLY=$only timeout 200 ncu --clock-control none -k "regex:grouped_gemm_tma" --metrics "$m" \
          --csv --page raw "$B"/bench/kernels/kernel_bench >"$out/gemmprof-$only.csv" 2>"$out/gemmprof-$only.err"
        stamp "gemmprof $only rc=$?"
        python3 bench/ncu_counters.py "$out/gemmprof-$only.csv" | tee -a "$out/summary.txt"
      done
      ;;
    attnprof)
      # Nsight Compute counters of the Dh-64 attention kernels on kernel_bench's bench_1b
      # shape: the forward, the fused backward (rowdot, dK/dV with dQ, convert) and the split
      # backward (dK/dV, dQ): time, tensor-pipe use, L2 reduction sectors, stall reasons.
      m=gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
      m=$m,lts__t_sectors_op_red.sum,lts__t_sectors_op_atom.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed
      m=$m,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_executed.sum
      m=$m,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
      for r in barrier long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle lg_throttle \
        membar sleeping dispatch_stall no_instruction selected not_selected branch_resolving; do
        m=$m,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
      done
      for what in "attention_fwd_hopper attention_fwd_hopper 1" "attention_bwd_hopper attention_(bwd_fused|dkdv|dq|rowdot) 3" \
        "attention_bwd_hopper_split_dq attention_(dkdv|dq|rowdot) 3"; do
        # shellcheck disable=SC2086
        set -- $what
        KERNEL_BENCH_ONLY=$1 timeout 200 ncu --clock-control none -k "regex:$2" --launch-count "$3" --metrics "$m" \
          --csv --page raw "$B"/bench/kernels/kernel_bench >"$out/attnprof-$1.csv" 2>"$out/attnprof-$1.err"
        stamp "attnprof $1 rc=$?"
        python3 bench/ncu_counters.py "$out/attnprof-$1.csv"
      done
      ;;
    profile)
      d=${TMPDIR:-/tmp}/troupe-e2e-runs
      [ -d "$d/data" ] || OUT=$out bash bench/e2e.sh --build "$B" --skip-troupe --skip-peer --gpus 1 >/dev/null 2>&1
      rm -rf "$d/profile"
      timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --nvtx --nvtx-include "step/" \
        --launch-count 8000 --csv --page raw "$B"/apps/train_moe --config apps/configs/bench_1b.toml --backend cuda \
        --set train.steps=2 --allow-test-config --set bench.cuda_graph=false --set train.eval_every=0 --set train.eval_batches=1 \
        --set "data.dir=$d/data" --run-dir "$d/profile" >"$out/ncu_step.csv" 2>"$out/ncu_stderr.log"
      stamp "profile rc=$? ($(grep -c '^"' "$out/ncu_step.csv") rows)"
      python3 bench/ncu_summary.py "$out/ncu_step.csv" 2 0 >"$out/profile.md"
      head -20 "$out/profile.md"
      ;;
    gaps)
      # bench/kernels/kernel_trace.cc (CUPTI through the driver's injection hook) records
      # every kernel, memset and copy; bench/kernel_gaps.py finds the idle time in the last
      # step, the graph replayed (true) and launched one by one (false).
      d=${TMPDIR:-/tmp}/troupe-e2e-runs
      [ -d "$d/data" ] || OUT=$out bash bench/e2e.sh --build "$B" --skip-troupe --skip-peer --gpus 1 >/dev/null 2>&1
      ninja -C "$B" troupe_kernel_trace >"$out/build_trace.log" 2>&1 || { stamp "gaps: troupe_kernel_trace build FAILED"; tail "$out/build_trace.log"; continue; }
      for g in ${GAPS_GRAPH:-true false}; do
        rm -rf "$d/gaps"
        CUDA_INJECTION64_PATH="$B/bench/kernels/libtroupe_kernel_trace.so" TROUPE_KERNEL_TRACE="$out/gaps-$g.csv" \
          timeout 200 "$B"/apps/train_moe --config apps/configs/bench_1b.toml --backend cuda --set train.steps=6 \
          --allow-test-config --set bench.cuda_graph=$g --set train.eval_every=0 --set train.eval_batches=1 --set "data.dir=$d/data" \
          --run-dir "$d/gaps" >"$out/gaps-$g.log" 2>&1
        stamp "gaps cuda_graph=$g rc=$? ($(grep -h 'kernel_trace:' "$out/gaps-$g.log" | tail -1))"
        grep -h "^step [56]/" "$out/gaps-$g.log" | cut -c1-200
        python3 bench/kernel_gaps.py "$out/gaps-$g.csv" adamw_multi_kernel 40 >"$out/gaps-$g.md" 2>&1
        head -100 "$out/gaps-$g.md"
      done
      ;;
    clocks)
      # Troupe, then the compiled PyTorch peer (the same model and token shards), each for
      # 40 steps while nvidia-smi samples every 100 ms.
      d=${TMPDIR:-/tmp}/troupe-e2e-runs
      [ -d "$d/data" ] || OUT=$out bash bench/e2e.sh --build "$B" --skip-troupe --skip-peer --gpus 1 >/dev/null 2>&1
      rm -rf "$d/clocks"
      why=clocks_event_reasons.active  # clocks_throttle_reasons.active before driver 535
      nvidia-smi --query-gpu=$why --format=csv >/dev/null 2>&1 || why=clocks_throttle_reasons.active
      for sys in troupe peer; do
        nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,utilization.gpu,$why \
          --format=csv,noheader -lms 100 >"$out/clocks-$sys.csv" 2>&1 &
        smi=$!
        if [ "$sys" = troupe ]; then
          timeout 200 "$B"/apps/train_moe --config apps/configs/bench_1b.toml --backend cuda --set train.steps=40 \
            --set train.eval_every=0 --set train.eval_batches=1 --set "data.dir=$d/data" --run-dir "$d/clocks" \
            >"$out/clocks-$sys.log" 2>&1
        else
          timeout 300 python3 bench/peers/torch_moe.py --config apps/configs/bench_1b.toml --mode compile --steps 40 \
            --warmup 2 --json-out "$out/clocks-peer.json" --data "$d/data" >"$out/clocks-$sys.log" 2>&1
        fi
        stamp "clocks: $sys rc=$?"
        kill $smi
        grep -h "^step \(10\|20\|40\)/\|result:" "$out/clocks-$sys.log" | cut -c1-200
        # Samples while a step ran (utilisation above 90%): SM clock and power, median and range.
        python3 - "$out/clocks-$sys.csv" "$sys" <<'PY' | tee -a "$out/clocks.md"
import statistics, sys
rows = [[c.strip() for c in l.split(",")] for l in open(sys.argv[1]) if l.count(",") >= 7]
def num(s): return float(s.split()[0])
busy = [r for r in rows if r[6].endswith("%") and num(r[6]) > 90]
if not busy:
    print(sys.argv[2], "no busy samples"); sys.exit(0)
sm = [num(r[1]) for r in busy]; pw = [num(r[3]) for r in busy]
print(f"{sys.argv[2]}: {len(busy)} busy samples of {len(rows)}: SM clock median {statistics.median(sm):.0f} MHz (min {min(sm):.0f}, max {max(sm):.0f});"
      f" power median {statistics.median(pw):.0f} W of {busy[0][4]} (max {max(pw):.0f}); temperature max {max(num(r[5]) for r in busy):.0f} C")
reasons = {}
for r in busy: reasons[r[7]] = reasons.get(r[7], 0) + 1
print("  clock-event reasons (bitmask: 0x4 SW power cap, 0x20 SW thermal, 0x40 HW thermal, 0x80 HW power brake):", reasons)
PY
      done
      ;;
    hoststats)
      d=${TMPDIR:-/tmp}/troupe-e2e-runs
      # The token shards e2e makes (without it having run first, train_moe finds no tokenizer).
      [ -d "$d/data" ] || OUT=$out bash bench/e2e.sh --build "$B" --skip-troupe --skip-peer --gpus 1 >/dev/null 2>&1
      timeout 200 "$B"/apps/train_moe --config apps/configs/bench_1b.toml --backend cuda \
        --allow-test-config --set bench.device_stats=false --set train.steps=7 --set train.eval_every=0 --set train.eval_batches=1 --set "data.dir=$d/data" \
        --run-dir "$d/hoststats" >"$out/hoststats.log" 2>&1
      stamp "hoststats rc=$?"
      grep "^step [0-9]*/7" "$out/hoststats.log" | cut -c1-220
      ;;
    ab)
      # The patched copy: every tracked and untracked source file of this tree (not the
      # dependency bundle, not build or run outputs), then AB_PATCH on top.
      if [ -z "${AB_PATCH:-}" ] || [ ! -f "$AB_PATCH" ]; then
        echo "gpu_host.sh ab: set AB_PATCH to a patch file (git diff) of this tree" >&2
        exit 2
      fi
      if [ ! -x "$B/apps/train_moe" ]; then
        echo "gpu_host.sh ab: $B/apps/train_moe not built (run the build step first)" >&2
        exit 2
      fi
      src=${TMPDIR:-/tmp}/troupe-ab-src
      rm -rf "$src" && mkdir -p "$src"
      tar -c --exclude=./.gpu-deps --exclude=./.git --exclude='./build*' --exclude=./gpu-out . | tar -x -C "$src"
      if ! (cd "$src" && git apply --verbose "$(realpath "$AB_PATCH")") >"$out/ab-apply.log" 2>&1; then
        cat "$out/ab-apply.log"
        exit 1
      fi
      stamp "ab: $(grep -c '^Applied patch' "$out/ab-apply.log") file(s) patched from $AB_PATCH"
      build_tree "$src" "$B-ab" "-ab" train_moe || exit 1
      stamp "ab: build ok ($B-ab)"
      for round in 1 2; do
        for v in tree patched; do
          bld=$B
          [ "$v" = patched ] && bld=$B-ab
          dir="$out/e2e-ab-$v"
          rm -rf "$dir"
          OUT="$dir" bash bench/e2e.sh --build "$bld" --gpus 1 --quick --skip-peer --no-run-row --no-selfcheck \
            >"$out/ab-$v-$round.log" 2>&1
          stamp "ab $v round $round rc=$?: $(grep -h '| troupe |' "$dir/e2e/e2e.md" 2>/dev/null)"
        done
      done
      ;;
    kvar)
      if [ -z "${VAR_PATCHES:-}" ] || [ ! -x "$B/bench/kernels/kernel_bench" ]; then
        echo "gpu_host.sh kvar: set VAR_PATCHES (git diff files) and build kernel_bench first" >&2
        exit 2
      fi
      n=0
      builds=("$B")
      for p in $VAR_PATCHES; do
        n=$((n + 1))
        src=${TMPDIR:-/tmp}/troupe-var$n-src
        rm -rf "$src" && mkdir -p "$src"
        tar -c --exclude=./.gpu-deps --exclude=./.git --exclude='./build*' --exclude=./gpu-out . | tar -x -C "$src"
        if ! (cd "$src" && git apply "$(realpath "$p")") >"$out/var$n-apply.log" 2>&1; then
          stamp "kvar: $p does not apply: $(head -3 "$out/var$n-apply.log")"
          continue
        fi
        if build_tree "$src" "$B-var$n" "-var$n" kernel_bench; then
          builds+=("$B-var$n")
          stamp "kvar: var$n = $p built"
        else
          stamp "kvar: var$n = $p FAILED to build"
        fi
      done
      for round in 1 2; do
        for bld in "${builds[@]}"; do
          tag=$(basename "$bld")
          timeout 100 "$bld"/bench/kernels/kernel_bench >"$out/kvar-$tag-$round.log" 2>&1
          stamp "kvar $tag round $round rc=$?"
          grep -v "^RESULT" "$out/kvar-$tag-$round.log" | grep -E "${KVAR_ROWS:-ms}" | head -20 | tee -a "$out/summary.txt"
        done
      done
      ;;
    final)
      TARGETS="train_moe kernels_op_table_cuda_test kernels_cuda_bf16_test train_moe_cuda_test" bash "$0" build || exit 1
      bash "$0" e2e
      bash "$0" tests
      if ninja -C "$B" -j16 kernel_bench >"$out/build_bench.log" 2>&1; then bash "$0" kernels; else stamp "kernel_bench build FAILED"; fi
      (cd "$B" && timeout 120 ctest -R train_moe_cuda_test --output-on-failure) >"$out/train_moe_cuda_test.log" 2>&1
      stamp "train_moe_cuda_test rc=$?"
      tail -3 "$out/train_moe_cuda_test.log"
      finish
      bash "$0" hoststats
      ;;
    stage)
      # The Stage's step engine on one GPU (build with TARGETS including stage_gpu_test,
      # train_moe_cuda_test, dense_lm and troupe): its CUDA graph against op by op, bitwise,
      # host_syncs 0; the Trainer path against the single loop; Model's ParamBuffer on CUDA.
      timeout 400 "$B"/tests/apps/stage_gpu_test --gtest_filter="${STAGE_FILTER:-*}" >"$out/stage_gpu_test.log" 2>&1
      stamp "stage_gpu_test rc=$? ($(grep -c '^\[       OK' "$out/stage_gpu_test.log") ok)"
      grep -E "^\[  FAILED|Failure|^\[stage-gpu" -A3 "$out/stage_gpu_test.log" | head -40
      timeout 200 "$B"/tests/apps/train_moe_cuda_test >"$out/train_moe_cuda_test.log" 2>&1
      stamp "train_moe_cuda_test rc=$? ($(grep -c '^\[       OK' "$out/train_moe_cuda_test.log") ok)"
      grep -E "^\[  FAILED|Failure" -A3 "$out/train_moe_cuda_test.log" | head -20
      ;;
    paths)
      # bench/one_gpu_paths.sh: the single-process loop against `troupe run --nproc 1`.
      OUT=$out bash bench/one_gpu_paths.sh --build "$B" ${PATHS_ARGS:-} | tee "$out/paths.md"
      stamp "paths done"
      for f in single trainer; do
        grep -h "^step [0-9]*/\|captured\|note:" "$out/one_gpu_paths/$f.log" | tail -4 | cut -c1-200
        python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if '\"loss\"' in l]; print(sys.argv[2], [(x['step'], round(x.get('step_ms',0),1), x.get('device_ms'), x.get('device_gap_ms'), x.get('host_syncs'), round(x.get('peak_gib',0),2)) for x in r[-4:]])" "$out/one_gpu_paths/$f/metrics.jsonl" "$f" 2>&1 | cut -c1-400
      done
      ;;
    e2e)
      OUT=$out bash bench/e2e.sh --build "$B" --gpus 1 ${E2E_ARGS:---quick --no-selfcheck}
      stamp "e2e rc=$?"
      grep -h "^step [0-9]*/" "$out/e2e/troupe_1gpu.log" | cut -c1-230
      ;;
    *) echo "gpu_host.sh: unknown step '$step'" >&2; exit 2 ;;
  esac
  finish  # after every step, so a later kill loses only the step it interrupted
done
