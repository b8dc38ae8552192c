#!/usr/bin/env bash
# make demo: the main job. Runs scripts/run-demo.sh once the train_moe app is built.
set -euo pipefail
build=${1:-build}
if [ -x "$build/apps/train_moe" ]; then
  exec bash scripts/run-demo.sh "$build"
fi
echo "make demo: $build/apps/train_moe is not built (the build failed or was skipped: run make build)" >&2
exit 1
