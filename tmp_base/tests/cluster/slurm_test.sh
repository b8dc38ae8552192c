#!/bin/bash
# tests/cluster/slurm_test.sh — Troupe under a real one-node Slurm cluster that the test
# starts itself: munged with its own key and socket, slurmctld and slurmd with their own
# slurm.conf (free ports, ProctrackType=proctrack/linuxproc, TaskPlugin=task/none), state,
# spool and logs all in one temporary directory, as root. Cases:
#   (a) sbatch scripts/slurm/troupe.sbatch: the Troupe job runs (scheduler on the batch
#       host, one troupe-agent per node by srun), its exit status is the Slurm job's
#       (0 and 3), it shows in squeue, and scancel stops every Troupe process within 10 s;
#   (b) salloc / srun + troupe run: --nproc from SLURM_NTASKS, the exit status, squeue,
#       scancel within 10 s; a multi-node allocation is refused naming troupe.sbatch.
# Every daemon is stopped at the end; no process of the test survives and nothing is
# left outside the temporary directory (HOME points into it too).
# Usage: slurm_test.sh <dir of troupe binaries> <source dir>. Not root or no Slurm: FAIL.
set -u
BIN=$(realpath "${1:?usage: slurm_test.sh BIN_DIR SOURCE_DIR}")
SRC=$(realpath "${2:?usage: slurm_test.sh BIN_DIR SOURCE_DIR}")
fails=0
T=""
pids=()
say() { echo "[slurm_test] $*"; }
bad() { echo "[slurm_test] FAIL: $*" >&2; fails=$((fails + 1)); }
die() { echo "[slurm_test] FAIL: $*" >&2; finish 1; }

# Processes of this test's Slurm jobs: each carries SLTEST_TAG=$TAG in its environment
# (given only to sbatch / salloc / srun, which hand it on to the jobs).
TAG="sltest-$$-$RANDOM"
tagged() {
  grep -lsz "^SLTEST_TAG=$TAG\$" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3
}
# How many tagged `sleep` processes run (a job's driver and workers).
sleeps() {
  local n=0 p
  for p in $(tagged); do [ "$(cat /proc/$p/comm 2>/dev/null)" = sleep ] && n=$((n + 1)); done
  echo $n
}
# Waits until no tagged process is left; prints the milliseconds it took (or fails).
wait_untagged() {
  local limit_ms=$1 t0 now left
  t0=$(date +%s%3N)
  while :; do
    left=$(tagged | tr '\n' ' ')
    now=$(date +%s%3N)
    [ -z "$left" ] && { echo $((now - t0)); return 0; }
    if [ $((now - t0)) -gt "$limit_ms" ]; then
      echo "left after ${limit_ms} ms: $(for p in $left; do tr '\0' ' ' < /proc/$p/cmdline; echo -n '; '; done 2>/dev/null)"
      return 1
    fi
    sleep 0.05
  done
}

finish() {
  local rc=$1
  trap - EXIT
  # Stop the daemons, newest first, and wait for each.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill -TERM "${pids[$i]}" 2>/dev/null; done
  for p in "${pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.05; done
    kill -KILL "$p" 2>/dev/null
    wait "$p" 2>/dev/null
  done
  local left=""
  if [ -n "$T" ]; then
    local c
    for p in /proc/[0-9]*; do
      [ "${p#/proc/}" = "$$" ] && continue
      c=$(tr '\0' ' ' < "$p/cmdline" 2>/dev/null)
      [[ "$c" == *"$T"* ]] && left+="$c; "
    done
  fi
  for p in $(tagged); do [ "$p" != "$$" ] && left+="$(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null); " && kill -KILL "$p" 2>/dev/null; done
  [ -n "$left" ] && { echo "[slurm_test] FAIL: processes left behind: $left" >&2; rc=1; }
  if [ "$rc" -eq 0 ] && [ $fails -eq 0 ]; then
    rm -rf "$T"
    say "PASS"
    exit 0
  fi
  [ -n "$T" ] && echo "[slurm_test] files kept in $T" >&2 && tail -n 20 "$T"/log/*.log >&2
  exit 1
}
trap 'finish 1' EXIT

[ "$(id -u)" -eq 0 ] || die "must run as root: slurmd runs jobs as their users and this test starts its own slurmd"
for b in munged slurmctld slurmd sbatch srun salloc squeue scancel sinfo scontrol python3; do
  command -v "$b" >/dev/null || die "$b not found: install Debian's slurmd slurmctld slurm-client munge (scripts/install-deps.sh)"
done
for b in troupe troupe-scheduler troupe-agent; do [ -x "$BIN/$b" ] || die "$BIN/$b is missing"; done

T=$(mktemp -d /tmp/troupe-slurm-test-XXXXXX)
chmod 755 "$T"
mkdir -p "$T/munge-key" "$T/munge" "$T/ctld" "$T/spool" "$T/log" "$T/home" "$T/out"
chmod 700 "$T/munge-key"; chmod 755 "$T/munge"
export HOME="$T/home"
dd if=/dev/urandom of="$T/munge-key/munge.key" bs=1024 count=1 2>/dev/null
chmod 400 "$T/munge-key/munge.key"
munged -F --socket="$T/munge/munge.sock" --key-file="$T/munge-key/munge.key" --log-file="$T/log/munged.log" \
  --pid-file="$T/munge/munged.pid" --seed-file="$T/munge/munged.seed" >"$T/log/munged.out" 2>&1 &
pids+=($!)

read -r CTLD_PORT SLURMD_PORT < <(python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])')
NODE=$(hostname -s)
CPUS=$(nproc)
cat >"$T/slurm.conf" <<CONF
ClusterName=troupetest
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$T/munge/munge.sock
CredType=cred/munge
StateSaveLocation=$T/ctld
SlurmdSpoolDir=$T/spool
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd.pid
SlurmctldLogFile=$T/log/slurmctld.log
SlurmdLogFile=$T/log/slurmd.log
PlugStackConfig=$T/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait=5
MailProg=/bin/true
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
touch "$T/plugstack.conf"
export SLURM_CONF="$T/slurm.conf"
for _ in $(seq 100); do [ -S "$T/munge/munge.sock" ] && break; sleep 0.05; done
slurmctld -D -i -f "$SLURM_CONF" >"$T/log/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -f "$SLURM_CONF" >"$T/log/slurmd.out" 2>&1 &
pids+=($!)
up=0
for _ in $(seq 300); do
  sinfo -h -o '%t' 2>/dev/null | grep -qx idle && { up=1; break; }
  sleep 0.1
done
[ $up -eq 1 ] || die "the Slurm cluster did not come up: $(sinfo 2>&1; tail -5 "$T"/log/*.log)"
say "one-node Slurm cluster up: node $NODE, $CPUS CPUs, slurmctld :$CTLD_PORT, slurmd :$SLURMD_PORT"
export PATH="$BIN:$PATH"
SB="$SRC/scripts/slurm/troupe.sbatch"
cd "$T/out"

# ---- (a) sbatch troupe.sbatch ------------------------------------------------------------
out="$T/out/a-ok.out"
SLTEST_TAG=$TAG sbatch --wait -N1 --cpus-per-task="$CPUS" --output="$out" --chdir="$T/out" "$SB" --nproc 2 -- \
  /bin/sh -c 'echo "troupe process $TROUPE_PROC_NAME of $TROUPE_WORLD_SIZE on $TROUPE_NODE"' >"$T/out/a-ok.sbatch" 2>&1
rc=$?
[ $rc -eq 0 ] || bad "(a) sbatch troupe.sbatch of a succeeding job: exit $rc: $(cat "$out")"
grep -q "runs Troupe job job-1 on 1 node(s)" "$out" || bad "(a) no Troupe job line in the output: $(cat "$out")"
grep -q "troupe process driver of 2 on $NODE" "$out" || bad "(a) the driver's output is missing: $(cat "$out")"
say "(a) sbatch troupe.sbatch, job exits 0: Slurm job exit $rc"

out="$T/out/a-fail.out"
SLTEST_TAG=$TAG sbatch --wait -N1 --cpus-per-task="$CPUS" --output="$out" "$SB" --nproc 2 -- /bin/sh -c 'exit 3' >"$T/out/a-fail.sbatch" 2>&1
rc=$?
id=$(grep -o '[0-9]\+' "$T/out/a-fail.sbatch" | head -1)
[ $rc -eq 3 ] || bad "(a) a Troupe job exiting 3: sbatch --wait returned $rc: $(cat "$out")"
scontrol show job "$id" 2>/dev/null | grep -q 'ExitCode=3:0' || bad "(a) scontrol shows no ExitCode=3:0 for Slurm job $id"
say "(a) Troupe job exits 3: Slurm job $id exit $rc ($(scontrol show job "$id" | grep -o 'ExitCode=[0-9:]*'))"

id=$(SLTEST_TAG=$TAG sbatch --parsable -N1 --cpus-per-task="$CPUS" --output="$T/out/a-cancel.out" "$SB" --nproc 2 -- sleep 1000)
ok=0
for _ in $(seq 600); do
  [ "$(sleeps)" -eq 3 ] && { ok=1; break; }
  squeue -h -j "$id" 2>/dev/null | grep -q . || break  # the Slurm job ended
  sleep 0.1
done
[ $ok -eq 1 ] || bad "(a) the Troupe job's 3 processes (driver + 2 workers) did not start: $(cat "$T/out/a-cancel.out")"
squeue -h -j "$id" -o '%i %j %T' | grep -q "^$id troupe RUNNING" || bad "(a) squeue does not show Slurm job $id running"
say "(a) squeue: $(squeue -h -j "$id" -o '%i %j %T %N')"
scancel "$id"
if ms=$(wait_untagged 10000); then say "(a) scancel: every Troupe process gone in $ms ms (limit 10000)"
else bad "(a) scancel: $ms"; fi

# ---- (b) salloc / srun + troupe run ---------------------------------------------------------
o=$(SLTEST_TAG=$TAG salloc -N1 -n2 troupe run -- /bin/sh -c 'echo "rank $TROUPE_RANK world $TROUPE_WORLD_SIZE"' 2>&1)
rc=$?
[ $rc -eq 0 ] || bad "(b) salloc -n2 troupe run: exit $rc: $o"
echo "$o" | grep -q '\[worker-1\] rank 1 world 2' || bad "(b) salloc -n2: troupe run did not take --nproc 2 from SLURM_NTASKS: $o"
say "(b) salloc -N1 -n2 troupe run (no --nproc): 2 workers, exit $rc"

SLTEST_TAG=$TAG srun -N1 -n1 -c"$CPUS" troupe run --nproc 2 -- /bin/sh -c 'exit 4' >"$T/out/b-fail.out" 2>&1
rc=$?
[ $rc -eq 4 ] || bad "(b) srun troupe run of a job exiting 4: exit $rc: $(cat "$T/out/b-fail.out")"
say "(b) srun troupe run, job exits 4: srun exit $rc"

o=$(SLURM_JOB_ID=77 SLURM_JOB_NUM_NODES=2 SLURM_JOB_NODELIST='n[1-2]' troupe run -- /bin/true 2>&1)
rc=$?
[ $rc -eq 2 ] && echo "$o" | grep -q 'troupe.sbatch' || bad "(b) a 2-node allocation: exit $rc, $o"

SLTEST_TAG=$TAG srun -N1 -n1 -c"$CPUS" -J trun troupe run --nproc 2 -- sleep 1000 >"$T/out/b-cancel.out" 2>&1 &
srun_pid=$!
ok=0
for _ in $(seq 600); do
  [ "$(sleeps)" -eq 3 ] && { ok=1; break; }
  kill -0 "$srun_pid" 2>/dev/null || break
  sleep 0.1
done
[ $ok -eq 1 ] || bad "(b) srun troupe run: the job's processes did not start: $(cat "$T/out/b-cancel.out")"
id=$(squeue -h -n trun -o '%i')
[ -n "$id" ] || bad "(b) squeue does not show the srun job"
say "(b) squeue: $(squeue -h -n trun -o '%i %j %T %N')"
scancel "$id"
if ms=$(wait_untagged 10000); then say "(b) scancel: every Troupe process gone in $ms ms (limit 10000)"
else bad "(b) scancel: $ms"; fi
wait "$srun_pid" 2>/dev/null

finish 0
