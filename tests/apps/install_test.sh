#!/bin/bash
# tests/apps/install_test.sh BUILD_DIR SOURCE_DIR — an app built out of tree against an
# installed Troupe: `cmake --install` of the build's Development component (libraries,
# headers, the CMake package) into a fresh prefix, then apps/examples/parallel_lm's own
# CMakeLists.txt configured and built on its own (find_package(Troupe), Troupe::app; no
# compiler cache), and the binary it makes runs (--gradcheck). Prints each phase's time.
# The installed package must not point into the source or build tree.
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/troupe-install-test-XXXXXX")
trap 'rm -rf "$work"' EXIT
now() { date +%s.%N; }
took() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

t0=$(now)
cmake --install "$build" --prefix "$work/prefix" --component Development >"$work/install.log"
echo "[install] cmake --install --component Development: $(du -sh "$work/prefix" | cut -f1) in $(took "$t0") s"
test -f "$work/prefix/lib/cmake/Troupe/TroupeConfig.cmake"
test -f "$work/prefix/include/troupe/training/app/transformer_program.h"
if grep -rlE "$src|$build" "$work/prefix/lib/cmake/Troupe" >/dev/null; then
  echo "the installed package names the source or build tree:" >&2
  grep -rnE "$src|$build" "$work/prefix/lib/cmake/Troupe" | head -5 >&2
  exit 1
fi

# A copy of the example, alone: nothing of the source tree is reachable from it.
cp -r "$src/apps/examples/parallel_lm" "$work/parallel_lm"
t1=$(now)
CCACHE_DISABLE=1 cmake -S "$work/parallel_lm" -B "$work/b" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Release >"$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
t2=$(now)
CCACHE_DISABLE=1 cmake --build "$work/b" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
echo "[install] parallel_lm out of tree: configure and build $(took "$t1") s (the build $(took "$t2") s)"

"$work/b/parallel_lm" --config "$work/parallel_lm/parallel_lm.toml" --gradcheck --set model.d_model=32 \
  --set model.ffn_hidden=48 --set model.n_heads=4 --set model.n_kv_heads=2 >"$work/run.log" 2>&1 ||
  { cat "$work/run.log"; exit 1; }
grep "gradcheck of" "$work/run.log"
echo "[install] ok: total $(took "$t0") s"
