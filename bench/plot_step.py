#!/usr/bin/env python3
"""Plots achieved GB/s against the same-shape ceiling for every case of a JSON-lines file
written by bench/peers/torch_step.py (or distopt-bench-step's JSON lines), with gnuplot.

    python3 bench/plot_step.py bench/results-cpu.jsonl bench/step_cpu.png
"""
import json
import os
import subprocess
import sys
import tempfile


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot_step.py RESULTS.jsonl OUT.png")
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
    rows = [r for r in rows if r.get("bench") != "step-plain"]  # the plain loops' own line
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        with open(data, "w") as f:
            for r in rows:
                if "policy" in r:
                    label = " ".join(x for x in (r["policy"], r["options"], r["param"], "g:" + r["grad"],
                                                 "s:" + r["state"],
                                                 "check" if r.get("finite_check") else "") if x)
                    f.write(f'"{label}" {r["gbps"]} {r["ceiling_gbps"]}\n')
                else:
                    f.write(f'"torch {r["case"]}" {r["gbps"]} NaN\n')
        threads = rows[0].get("threads", "?")
        script = f"""
set terminal pngcairo size 1400,{220 + 22 * len(rows)} font ",10"
set output "{sys.argv[2]}"
set title "optimizer step, {rows[0]['params']} params, {threads} threads: achieved vs same-shape stream ceiling"
set style data histogram
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set xtics rotate by -60 scale 0
set ylabel "GB/s"
set key top left
set grid ytics
set bmargin 22
set yrange [0:*]
plot "{data}" using 2:xtic(1) title "achieved", "" using 3 title "ceiling (same access shape)"
"""
        subprocess.run(["gnuplot"], input=script, text=True, check=True)


if __name__ == "__main__":
    main()
