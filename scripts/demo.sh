#!/usr/bin/env bash
# make demo: the main job. Until the train_moe app lands (issue: model and app), says so.
set -euo pipefail
build=${1:-build}
if [ -x "$build/apps/train_moe" ]; then
  exec bash scripts/run-demo.sh "$build"
fi
echo "make demo: the train_moe app is not built yet; see README 'Status'."
exit 1
