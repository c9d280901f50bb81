#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 the distopt authors
"""Checkpoints of the same run saved on several DP x TP grids hold the same whole arrays.

    tp_whole_identical.py REPLAY TRACE OUTDIR STEP "GRID" "GRID"... -- REPLAY ARGS...

Runs distopt-replay with --save-at STEP on each grid (e.g. "--tp 3", "--ranks 2 --tp 5",
"" for one rank), reads each checkpoint with tools/checkpoint_to_numpy.py (which puts the
TP parts' boxes together into the whole arrays, a reader apart from the C++ loader), and
requires the same names and the same bytes from every grid: params, states, and row and
column states of tensors split by rows, by columns, or not at all.
"""
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import checkpoint_to_numpy  # noqa: E402


def main(argv):
    split = argv.index("--")
    replay, trace, outdir, step, *grids = argv[1:split]
    args = argv[split + 1:]
    os.makedirs(outdir, exist_ok=True)
    results = []
    for k, grid in enumerate(grids):
        directory = os.path.join(outdir, f"grid{k}")
        shutil.rmtree(directory, ignore_errors=True)
        cmd = [replay, "--trace", trace, "--out", os.path.join(outdir, f"grid{k}.safetensors"), *args, *grid.split(),
               "--save-at", step, directory]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        index, arrays = checkpoint_to_numpy.read_checkpoint(directory)
        print(f"grid '{grid}': {index['dp_size']} x {index['tp_size']} ranks, {len(arrays)} arrays")
        results.append((grid, arrays))
    first_grid, first = results[0]
    failures = 0
    for grid, arrays in results[1:]:
        if sorted(arrays) != sorted(first):
            print(f"grid '{grid}' holds {sorted(set(arrays) ^ set(first))} that grid '{first_grid}' does not, or the reverse")
            failures += 1
            continue
        for name, a in first.items():
            b = arrays[name]
            if a.shape != b.shape or a.tobytes() != b.tobytes():
                print(f"{name}: grid '{grid}' differs from grid '{first_grid}' ({list(b.shape)} against {list(a.shape)})")
                failures += 1
    if failures:
        return 1
    print(f"{len(first)} whole arrays identical over {len(results)} grids")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
