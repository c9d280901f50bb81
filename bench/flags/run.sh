#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 the distopt authors
# The step as users build it (issue 56): bench/flags_step.cpp compiled once per build below,
# with the usage requirements distopt::distopt gives a CMake user (-std=c++20
# -fno-math-errno -ffp-contract=off) and nothing else, each linked with the same plain loop
# (plain_loops.cpp, g++ -O3 -march=native -fopenmp); then ROUNDS rounds, each running every
# build in turn, so that all builds see the same moments of a machine whose bandwidth
# drifts. Raw JSON lines go to OUT (default bench/results/flags.jsonl, appended, each with
# the round and the commit); bench/flags/table.py prints the best and the median round per
# build and case, each with its ratio to the best build of the row, and checks that every
# build printed the same params.
#   bench/flags/run.sh [--params N] [--rounds R] [--repeats K] [--out FILE] [--only L1,L2]
# Builds: gcc -O2, gcc -O3, gcc RelWithDebInfo (-O2 -g -DNDEBUG), and with CLANG (default
# clang++-16, skipped when absent) -O2 and -O3.
set -euo pipefail
cd "$(dirname "$0")/../.."
params=$((16 << 20)) rounds=3 repeats=5 out=bench/results/flags.jsonl only=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --params) params=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --repeats) repeats=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    *) echo "usage: bench/flags/run.sh [--params N] [--rounds R] [--repeats K] [--out FILE] [--only L1,L2]" >&2; exit 2 ;;
  esac
done
gxx=${GXX:-g++}
clang=${CLANG:-clang++-16}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(-std=c++20 -fno-math-errno -ffp-contract=off -Iinclude -Ibench)
echo "flags: plain loop (g++ -O3 -march=native -fopenmp)" >&2
"$gxx" -std=c++20 -O3 -march=native -fno-math-errno -ffp-contract=fast -fopenmp -c bench/plain_loops.cpp -o "$work/plain.o"
builds=("gcc-O2|$gxx|-O2" "gcc-O3|$gxx|-O3" "gcc-RelWithDebInfo|$gxx|-O2 -g -DNDEBUG")
if command -v "$clang" > /dev/null; then
  builds+=("clang-O2|$clang|-O2" "clang-O3|$clang|-O3")
else
  echo "flags: no $clang, the Clang builds are left out" >&2
fi
labels=()
for b in "${builds[@]}"; do
  IFS='|' read -r label cxx flags <<< "$b"
  if [[ -n $only && ",$only," != *",$label,"* ]]; then continue; fi
  echo "flags: building $label ($cxx $flags)" >&2
  # shellcheck disable=SC2086
  /usr/bin/time -f "flags: $label compiled in %e s" "$cxx" "${common[@]}" $flags bench/flags_step.cpp "$work/plain.o" \
    -lgomp -lpthread -o "$work/$label"
  labels+=("$label")
done
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
mkdir -p "$(dirname "$out")"
raw="$work/raw.jsonl"
for ((r = 1; r <= rounds; ++r)); do
  for label in "${labels[@]}"; do
    echo "flags: round $r/$rounds: $label" >&2
    "$work/$label" "$label" --params "$params" --repeats "$repeats" |
      sed "s/^{/{\"round\": $r, \"commit\": \"$commit\", \"params\": $params, /" >> "$raw"
  done
done
cat "$raw" >> "$out"
python3 bench/flags/table.py "$raw"
