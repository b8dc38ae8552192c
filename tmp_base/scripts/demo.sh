#!/usr/bin/env bash
# make demo: the main job. Runs scripts/run-demo.sh once the train_moe app is built.
set -euo pipefail
build=${1:-build}
if [ -x "$build/apps/train_moe" ]; then
  exec bash scripts/run-demo.sh "$build"
fi
echo "make demo: the train_moe app is not built yet; see README 'Status'."
exit 1
