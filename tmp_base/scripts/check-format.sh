#!/usr/bin/env bash
# scripts/check-format.sh — clang-format (.clang-format) on the C++/CUDA lines changed since
# the commit in .ci/format-base (CI runs it before the tests; `make format-check` too).
# Prints the diff clang-format wants and exits 1 when a changed line is not formatted.
# Most of the tree predates the check: only changed lines are held to it. After a
# session's changes pass, move .ci/format-base forward to the newest commit.
set -euo pipefail
cd "$(dirname "$0")/.."
base=$(tr -d '[:space:]' < .ci/format-base)
if ! git cat-file -e "$base^{commit}" 2>/dev/null; then
  echo "check-format: .ci/format-base names $base, which is not a commit of this clone" >&2
  exit 2
fi
command -v git-clang-format >/dev/null || { echo "check-format: git-clang-format not found (apt: clang-format)" >&2; exit 2; }
out=$(git clang-format --style=file --diff "$base" -- '*.h' '*.cc' '*.cu' '*.cuh' 2>&1 || true)
case "$out" in
  ""|"no modified files to format"*|"clang-format did not modify any files"*)
    echo "check-format: every C++ line changed since ${base:0:12} is formatted"
    exit 0 ;;
esac
echo "$out"
echo "check-format: the lines above changed since ${base:0:12} are not clang-formatted (fix: git clang-format $base)" >&2
exit 1
