#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 the distopt authors
"""The tables of bench/flags/run.sh from its raw JSON lines (one run's, or a saved file's):
per build and case the best and the median of the rounds, each with its ratio to the best
build of the row. Exits 1 when two builds printed different params (digest) for a case.
    bench/flags/table.py FILE.jsonl"""
import json
import statistics
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
runs = {}
for r in rows:
    runs.setdefault((r["case"], r["build"]), []).append(r["ns_per_param"])
builds = list(dict.fromkeys(r["build"] for r in rows))
cases = list(dict.fromkeys(r["case"] for r in rows))
rounds = max(len(v) for v in runs.values())


def table(statistic, title):
    print("| case | " + " | ".join(builds) + " | worst / best |")
    print("| --- |" + " --- |" * (len(builds) + 1))
    for c in cases:
        vals = [statistic(runs[(c, b)]) for b in builds]
        lo = min(vals)
        cells = [f"{v:.3f} ({v / lo:.2f}x)" for v in vals]
        print(f"| {c} | " + " | ".join(cells) + f" | {max(vals) / lo:.2f} |")
    print(f"ns per param, {title} of {rounds} rounds; (ratio to the best build of the row)")


table(min, "best")
print()
# The best of a few rounds takes one lucky round of one build; the median is steadier.
table(statistics.median, "median")
bad = 0
for c in cases:
    d = {r["digest"] for r in rows if r["case"] == c and "digest" in r}
    if len(d) > 1:
        print(f"flags: the builds' params differ for {c}: {sorted(d)}", file=sys.stderr)
        bad = 1
sys.exit(bad)
