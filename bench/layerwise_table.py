#!/usr/bin/env python3
"""Markdown tables of distopt-bench-layerwise runs (JSON lines, several runs per file).

Every run is one invocation, named by its --label. Per case and thread count the table
gives the best run (its ns/param; its GB/s and ratio against the ceilings measured in that
same run) and the median over runs of each run's best step. The per-phase table is taken
from the run whose full step was best.

A run is left out when its stream ceiling for 1 read + 3 read/written arrays (AdamW's shape)
came out below 0.75 of the best run's at the same thread count: another job held a core
then (on this 2-core machine a compiler beside a 2-thread run halves its bandwidth). The
runs left out are named, and stay in the files.

    python3 bench/layerwise_table.py bench/results/layerwise-2threads.jsonl \\
        bench/results/layerwise-1thread.jsonl [--torch bench/results/layerwise-torch.jsonl]

With --torch (JSON lines of bench/peers/torch_layerwise.py, several runs) it adds the
side-by-side table: per torch case and thread count the best run, and distopt's best step
of the matching fp32 case, ratio distopt / torch.
"""
import json
import statistics
import sys
from collections import defaultdict


def contended_runs(paths):
    """(threads, label) of the runs whose AdamW-shaped ceiling is below 0.75 of the best."""
    ceil = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r["bench"] == "layerwise_ceiling" and (r["read"], r["read_write"], r["write"]) == (1, 3, 0):
                    ceil[(r["threads"], r["label"])] = r["gbps"]
    best = defaultdict(float)
    for (t, _), g in ceil.items():
        best[t] = max(best[t], g)
    return {k for k, g in ceil.items() if g < 0.75 * best[k[0]]}, ceil


def load(paths):
    steps, phases = defaultdict(list), defaultdict(list)
    skip, _ = contended_runs(paths)
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if (r.get("threads"), r.get("label")) in skip:
                    continue
                if r["bench"] == "layerwise_step":
                    steps[(r["policy"], r["options"], r["param"], r["threads"])].append(r)
                elif r["bench"] == "layerwise_phase":
                    phases[(r["policy"], r["options"], r["param"], r["threads"], r["label"])].append(r)
    return steps, phases


def main(paths):
    steps, phases = load(paths)
    threads = sorted({k[3] for k in steps}, reverse=True)
    cases = []
    for k in steps:
        if k[:3] not in cases:
            cases.append(k[:3])
    best = {k: min(v, key=lambda r: r["ns_per_param"]) for k, v in steps.items()}
    med = {k: statistics.median(r["ns_per_param"] for r in v) for k, v in steps.items()}
    runs = {k: len(v) for k, v in steps.items()}

    head = "| policy | options | params / grads | passes | B/param phases | loaded | one pass |"
    sep = "| --- | --- | --- | ---: | ---: | ---: | ---: |"
    for t in threads:
        head += f" {t}T ns/param | median | GB/s | ceiling GB/s | ratio | one-pass bound ns | x adamw |"
        sep += " ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    print(head)
    print(sep)
    for c in cases:
        any_row = next(best[c + (t,)] for t in threads if c + (t,) in best)
        line = (f"| {c[0]} | {c[1] or '-'} | {c[2]} / {any_row['grad']} | {any_row['passes']} | "
                f"{any_row['bytes_per_param']:.0f} | {any_row['bytes_per_param_loaded']:.0f} | "
                f"{any_row['bytes_per_param_one_pass']:.0f} |")
        for t in threads:
            r = best.get(c + (t,))
            if r is None:
                line += " - | - | - | - | - | - | - |"
                continue
            a = best.get(("adamw", "", c[2], t))
            x = r["ns_per_param"] / a["ns_per_param"] if a else float("nan")
            line += (f" {r['ns_per_param']:.3f} | {med[c + (t,)]:.3f} | {r['gbps']:.1f} | {r['ceiling_gbps']:.1f} | "
                     f"{r['ratio']:.2f} | {r['one_pass_ns_per_param']:.3f} | {x:.2f} |")
        print(line)
    print()
    skip, ceil = contended_runs(paths)
    print("runs per case:", sorted(set(runs.values())), "; left out (threads, run, 4-array ceiling GB/s):",
          ", ".join(f"{t}T {l} {ceil[(t, l)]:.1f}" for t, l in sorted(skip)) or "none")
    print()
    print("| policy | options | params / grads | phase | B/param | grad used |"
          + "".join(f" {t}T ns/param | GB/s | ceiling ns | ratio | busy |" for t in threads))
    print("| --- | --- | --- | ---: | ---: | --- |" + " ---: | ---: | ---: | ---: | ---: |" * len(threads))
    for c in cases:
        per_t = {}
        for t in threads:
            r = best.get(c + (t,))
            if r is None:
                continue
            per_t[t] = {p["phase"]: p for p in phases.get(c + (t, r["label"]), [])}
        if not any(per_t.values()):
            continue
        nphase = max(len(v) for v in per_t.values())
        for ph in range(nphase):
            ref = next(v[ph] for v in per_t.values() if ph in v)
            line = f"| {c[0]} | {c[1] or '-'} | {c[2]} / {ref['grad']} | {ph} | {ref['bytes_per_param']:.0f} | {ref['grad_used']} |"
            for t in threads:
                p = per_t.get(t, {}).get(ph)
                if p is None:
                    line += " - | - | - | - | - |"
                    continue
                ns = p["ns_per_param"]
                line += (f" {ns:.3f} | {p['bytes_per_param'] / ns if ns > 0 else 0:.1f} | {p['ceiling_ns_per_param']:.3f} |"
                         f" {p['ceiling_ns_per_param'] / ns if ns > 0 else 0:.2f} | {p.get('busy', float('nan')):.2f} |")
            print(line)
        line = f"| {c[0]} | {c[1] or '-'} | {c[2]} / {ref['grad']} | host | - | - |"
        for t in threads:
            r = best.get(c + (t,))
            line += f" {r.get('host_ns_per_param', float('nan')):.3f} | | | | |" if r else " - | | | | |"
        print(line)


def torch_table(torch_path, paths):
    steps, _ = load(paths)
    best = {k: min(r["ns_per_param"] for r in v) for k, v in steps.items()}
    # Runs whose fused AdamW (a one-pass kernel at the memory ceiling) took more than 1/0.75
    # of its best time at the same thread count were contended: left out, as above.
    raw = [json.loads(line) for line in open(torch_path)]
    adamw = {(r["threads"], r.get("run", "")): r["ns_per_param"] for r in raw if r["case"] == "torch.optim.AdamW fused=True"}
    fastest = defaultdict(lambda: float("inf"))
    for (t, _), ns in adamw.items():
        fastest[t] = min(fastest[t], ns)
    skip = {k for k, ns in adamw.items() if ns > fastest[k[0]] / 0.75}
    rows = defaultdict(list)
    for r in raw:
        if (r["threads"], r.get("run", "")) not in skip:
            rows[(r["case"], r["threads"])].append(r)
    threads = sorted({k[1] for k in rows}, reverse=True)
    cases = []
    for k in rows:
        if k[0] not in cases:
            cases.append(k[0])
    print("| torch case | matched with | " + " | ".join(
        f"{t}T torch ns/param | median of runs | runs | distopt ns/param | distopt / torch" for t in threads) + " |")
    print("| --- | --- |" + " ---: | ---: | ---: | ---: | ---: |" * len(threads))
    for c in cases:
        first = rows[(c, threads[0])][0] if (c, threads[0]) in rows else rows[(c, threads[-1])][0]
        line = f"| {c} | {first['policy']}{' ' + first['options'] if first['options'] else ''} |"
        for t in threads:
            v = rows.get((c, t), [])
            if not v:
                line += " - | - | - | - | - |"
                continue
            tb = min(r["ns_per_param"] for r in v)
            tm = statistics.median(r["ns_per_param"] for r in v)
            d = best.get((first["policy"], first["options"], "fp32", t))
            line += f" {tb:.3f} | {tm:.3f} | {len(v)} | {d:.3f} | {d / tb:.2f} |" if d else f" {tb:.3f} | {tm:.3f} | {len(v)} | - | - |"
        print(line)
    print()
    print("torch runs left out (threads, run, fused AdamW ns/param):",
          ", ".join(f"{t}T {r} {adamw[(t, r)]:.3f}" for t, r in sorted(skip)) or "none")


if __name__ == "__main__":
    args = sys.argv[1:]
    torch_file = None
    if "--torch" in args:
        i = args.index("--torch")
        torch_file = args[i + 1]
        del args[i:i + 2]
    main(args)
    if torch_file:
        print()
        torch_table(torch_file, args)
