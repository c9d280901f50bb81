#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 the distopt authors
# CI's guard on the README's first example's compile time (issue 56): it is compiled
# header-only (g++ -std=c++20 -O2 -fno-math-errno -Iinclude -c, as measure.sh does) RUNS
# times, alternating with reference_tu.cpp (standard library only), and the ratio of the two
# minima of user + system CPU seconds is compared with the recorded one
# (first_example_ratio.txt): more than 1.3 times it fails. The ratio cancels the machine's
# speed; the recorded figure changes only with --record, in a commit that says why.
#   bench/build_time/guard.sh [--record] FILE   (FILE: build/tests/readme_example.cpp)
set -euo pipefail
cd "$(dirname "$0")/../.."
record=0
if [[ ${1:-} == --record ]]; then record=1; shift; fi
[[ $# -eq 1 && -f $1 ]] || { echo "usage: bench/build_time/guard.sh [--record] FILE (the README's first example, e.g. build/tests/readme_example.cpp)" >&2; exit 2; }
example=$1
runs=${RUNS:-3}
cxx=${CXX:-g++}
recorded_file=bench/build_time/first_example_ratio.txt
cpu_seconds() {
  local t
  t=$( { /usr/bin/time -f "%U %S" "$cxx" -std=c++20 -O2 -fno-math-errno -Iinclude -c "$1" -o /dev/null; } 2>&1 | tail -1)
  awk '{printf "%.2f", $1 + $2}' <<< "$t"
}
ex=() ref=()
for ((r = 0; r < runs; ++r)); do
  ex+=("$(cpu_seconds "$example")")
  ref+=("$(cpu_seconds bench/build_time/reference_tu.cpp)")
done
min() { tr ' ' '\n' | sort -g | head -1; }
ex_min=$(echo "${ex[*]}" | min)
ref_min=$(echo "${ref[*]}" | min)
ratio=$(awk -v a="$ex_min" -v b="$ref_min" 'BEGIN { printf "%.3f", a / b }')
echo "guard: first example ${ex[*]} s, reference ${ref[*]} s (CPU, $cxx); ratio of minima $ratio"
if [[ $record == 1 ]]; then
  printf '%s  # %s s against %s s, %s, %s, commit %s\n' "$ratio" "$ex_min" "$ref_min" "$("$cxx" --version | head -1)" \
    "$(date -u +%F)" "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" > "$recorded_file"
  echo "guard: recorded in $recorded_file"
  exit 0
fi
recorded=$(awk '{print $1; exit}' "$recorded_file")
limit=$(awk -v r="$recorded" 'BEGIN { printf "%.3f", 1.3 * r }')
if awk -v x="$ratio" -v l="$limit" 'BEGIN { exit !(x > l) }'; then
  echo "guard: the first example's compile time grew: ratio $ratio against the recorded $recorded (limit $limit, $recorded_file)" >&2
  exit 1
fi
echo "guard: within 1.3x of the recorded $recorded (limit $limit)"
