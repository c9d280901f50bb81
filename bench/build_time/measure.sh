#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 the distopt authors
# What one translation unit costs to compile, header-only and with the compiled core
# (DISTOPT_COMPILED_CORE, target distopt::core): user + system CPU seconds of
#   g++ -std=c++20 -O2 -fno-math-errno -Iinclude -c FILE
# the minimum of RUNS runs, the two modes run alternately. Run it with nothing else running.
#   bench/build_time/measure.sh [BUILD_DIR]   (BUILD_DIR: where the readme_*.cpp blocks are,
#                                              default build/tests; RUNS=3, CXX=g++)
set -euo pipefail
cd "$(dirname "$0")/../.."
readme_dir=${1:-build/tests}
runs=${RUNS:-3}
cxx=${CXX:-g++}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo '#include <distopt/distopt.hpp>' > "$work/distopt_hpp_alone.cpp"
echo '#include <distopt/optimizer.hpp>' > "$work/optimizer_hpp_alone.cpp"
files=("$work/distopt_hpp_alone.cpp" "$work/optimizer_hpp_alone.cpp")
for f in readme_example readme_sharded readme_q8 readme_layerwise readme_policy readme_checkpoint; do
  if [[ -f "$readme_dir/$f.cpp" ]]; then files+=("$readme_dir/$f.cpp"); fi
done
files+=(bench/build_time/*.cpp)
cpu_seconds() {  # prints user+sys of one compile
  local t
  t=$( { /usr/bin/time -f "%U %S" "$cxx" -std=c++20 -O2 -fno-math-errno -Iinclude "$@" -o /dev/null; } 2>&1 | tail -1)
  awk '{printf "%.2f", $1 + $2}' <<< "$t"
}
min() { tr ' ' '\n' | sort -g | head -1; }
printf '| translation unit | header-only, CPU s | with distopt::core, CPU s |\n| --- | --- | --- |\n'
for f in "${files[@]}"; do
  h=() c=()
  for ((r = 0; r < runs; ++r)); do
    h+=("$(cpu_seconds -c "$f")")
    c+=("$(cpu_seconds -DDISTOPT_COMPILED_CORE -c "$f")")
  done
  printf '| %s | %s | %s |\n' "$(basename "$f" .cpp)" "$(echo "${h[*]}" | min)" "$(echo "${c[*]}" | min)"
done
