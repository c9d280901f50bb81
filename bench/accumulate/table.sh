#!/usr/bin/env bash
# Gradient accumulation's memory and bytes per step on the GPT-like layout: distopt-bench-zero
# (bench/zero_overlap.cpp) with the hooks, d ranks as threads, for each ZeRO stage, schedule
# and micro-batch count; one markdown row per run from rank 0's report.
#   bench/accumulate/table.sh [BUILD_DIR] [PARAMS] [RANKS] [offload]
# offload: ZeRO-Offload on the emulated device (bf16 params and grads, fp32 master), with a
# column for what the device holds (its lines of the report: params, grads, pools).
set -euo pipefail
build=${1:-build}
params=${2:-16777216}
ranks=${3:-4}
offload=()
[ "${4:-}" = offload ] && offload=(--offload)
bench="$build/bench/distopt-bench-zero"
[ -x "$bench" ] || { echo "table.sh: $bench not built" >&2; exit 1; }
device_head="" device_rule=""
[ ${#offload[@]} -gt 0 ] && device_head=" device |" device_rule=" --- |"
echo "| stage | schedule | micro-batches | sent / step (rank 0) | model | grads | grad buckets (peak) | fp32 accumulator |$device_head total |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |$device_rule --- |"
for stage in 1 2 3; do
  for run in "1 last" "4 last" "4 each"; do
    set -- $run
    out=$("$bench" --params "$params" --ranks "$ranks" --stage "$stage" --backward-ns 0.2 --repeats 2 \
      --accumulate "$1" --accumulate-schedule "$2" "${offload[@]}")
    sent=$(sed -n 's/^bytes sent per iteration (rank 0, hooks on): \([0-9]*\); model \([0-9]*\).*/\1 \2/p' <<< "$out")
    # A memory line: "  CATEGORY   BYTES B   X.XX B/param"; the category's B/param (0 when absent).
    field() {
      awk -v c="$1" '/^  / {j = 0; for (i = 1; i <= NF; ++i) if ($i == "B") { j = i; break }
        if (!j) next; cat = $1; for (i = 2; i < j - 1; ++i) cat = cat " " $i
        if (cat == c) { print $(j + 1); found = 1; exit } } END { if (!found) print "0" }' <<< "$out"
    }
    total=$(field total)
    schedule=$([ "$1" = 1 ] && echo "-" || echo "$2")
    device=""
    if [ ${#offload[@]} -gt 0 ]; then  # the B/param of the lines that start with "device"
      device=" $(awk '/^  device / {for (i = 1; i <= NF; ++i) if ($i == "B") { s += $(i + 1); break } }
        END { printf "%.2f", s }' <<< "$out") |"
    fi
    printf '| %s | %s | %s | %s | %s | %s | %s | %s |%s %s |\n' "$stage" "$schedule" "$1" ${sent% *} ${sent#* } \
      "$(field grads)" "$(field 'grad buckets (peak)')" "$(field 'grads fp32')" "$device" "$total"
  done
done
