#!/usr/bin/env bash
# scripts/ptxas-guard.sh — the CUDA compiler launcher of troupe_kernels (kernels/CMakeLists.txt):
# runs the compile and fails it when ptxas reports that it serialised wgmma instructions.
# ptxas prints that as "info" and builds the kernel anyway, without the overlap it was
# written for: the Hopper attention forward ran ~20% slower that way for days unnoticed
# (bench/RESULTS.md, 2026-11-26 20:58). Usage: ptxas-guard.sh <compiler> <args...>
err=$(mktemp)
trap 'rm -f "$err"' EXIT
"$@" 2>"$err"
rc=$?
cat "$err" >&2
if [ "$rc" -eq 0 ] && grep -q "wgmma.mma_async instructions are serialized" "$err"; then
  echo "ptxas-guard: ptxas serialised wgmma instructions (the messages above name the kernel and the cause);" \
    "fix the kernel so that every wait_group retires a group ptxas can identify" >&2
  exit 1
fi
exit "$rc"
