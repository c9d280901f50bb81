#!/usr/bin/env python3
"""The PyTorch-side layer-wise optimizers beside distopt-bench-layerwise, same shapes, same threads.

Times one optimizer step (best and median of --repeats after a warm-up) of the reference
implementations distopt's policies follow, and torch's own, on the GPT-like tensors of
bench/layerwise_bench.hpp (lwbench::gpt_layers: an [8d, d] embedding, then --layers layers
of d = --width), fp32 params and grads:

  torch.optim.Adafactor (torch >= 2.5; foreach off and on)   vs distopt adafactor
  transformers.optimization.Adafactor (defaults; beta1=0.9)  vs distopt adafactor (same options)
  came_pytorch.CAME (lr 2e-4)                                 vs distopt came
  torch_optimizer.Lamb (defaults)                             vs distopt lamb
  torch.optim.AdamW fused=True                                vs distopt adamw

With --distopt FILE (the JSON lines distopt-bench-layerwise wrote for the same --threads)
it prints distopt's time beside each and the ratio distopt / torch (below 1: distopt is
faster). Writes JSON lines to --json (with --label as "run"; bench/layerwise_table.py
--torch makes the side-by-side table of several runs from them).

    python3 bench/peers/torch_layerwise.py --layers 4 --width 1024 --threads 2 \\
        --distopt bench/results/layerwise-2threads.jsonl --json bench/results/layerwise-torch.jsonl

Needs torch, transformers, came-pytorch and torch-optimizer (pip); not part of the test suite.
"""
import argparse
import json
import statistics
import time

import torch


def gpt_layers(layers, d):
    """The tensor shapes of lwbench::gpt_layers (tp = 1)."""
    shapes = [(8 * d, d)]
    for _ in range(layers):
        shapes += [(d,), (3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d)]
    return shapes


def cases():
    """(name, constructor or None when not installed, distopt (policy, options) it is compared with)."""
    out = []
    if hasattr(torch.optim, "Adafactor"):
        out.append(("torch.optim.Adafactor foreach=False",
                    lambda ps: torch.optim.Adafactor(ps, foreach=False), ("adafactor", "")))
        out.append(("torch.optim.Adafactor foreach=True",
                    lambda ps: torch.optim.Adafactor(ps, foreach=True), ("adafactor", "")))
    try:
        from transformers.optimization import Adafactor
        out.append(("transformers Adafactor", lambda ps: Adafactor(ps), ("adafactor", "")))
        out.append(("transformers Adafactor beta1=0.9", lambda ps: Adafactor(ps, beta1=0.9),
                    ("adafactor", "beta1=0.9")))
    except ImportError:
        pass
    try:
        from came_pytorch import CAME
        out.append(("came_pytorch CAME", lambda ps: CAME(ps, lr=2e-4), ("came", "")))
    except ImportError:
        pass
    try:
        import torch_optimizer
        out.append(("torch_optimizer Lamb", lambda ps: torch_optimizer.Lamb(ps), ("lamb", "")))
    except ImportError:
        pass
    out.append(("torch.optim.AdamW fused=True", lambda ps: torch.optim.AdamW(ps, fused=True), ("adamw", "")))
    return out


def time_case(make, shapes, repeats):
    params = [torch.full(s, 0.02, dtype=torch.float32, requires_grad=True) for s in shapes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = make(params)
    with torch.no_grad():
        opt.step()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    n = sum(p.numel() for p in params)
    del opt, params
    return min(times), statistics.median(times), n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--distopt", help="distopt-bench-layerwise JSON lines (same --threads)")
    ap.add_argument("--json", help="append JSON lines here")
    ap.add_argument("--label", default="", help="stored as \"run\" in every JSON line")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    shapes = gpt_layers(a.layers, a.width)

    ref = {}
    if a.distopt:
        with open(a.distopt) as f:
            for line in f:
                r = json.loads(line)
                if (r.get("bench") == "layerwise_step" and r["param"] == "fp32" and r["grad"] == "fp32"
                        and r["threads"] == a.threads):
                    key = (r["policy"], r["options"])  # the best of the runs in the file
                    ref[key] = min(ref.get(key, float("inf")), r["ns_per_param"])

    print(f"torch {torch.__version__}, {a.threads} threads, {sum(1 for _ in shapes)} tensors, best of {a.repeats}")
    print(f"{'case':38s} {'ns/param':>9s} {'median':>9s} {'distopt':>9s} {'distopt/torch':>14s}")
    rows = []
    for name, make, match in cases():
        best, med, n = time_case(make, shapes, a.repeats)
        ns, ns_med = best / n * 1e9, med / n * 1e9
        d = ref.get(match)
        print(f"{name:38s} {ns:9.3f} {ns_med:9.3f} {d if d else float('nan'):9.3f} "
              f"{d / ns if d else float('nan'):14.3f}", flush=True)
        rows.append({"bench": "layerwise_torch", "run": a.label, "case": name, "policy": match[0], "options": match[1],
                     "torch": torch.__version__, "params": n, "threads": a.threads, "ns_per_param": round(ns, 4),
                     "ns_per_param_median": round(ns_med, 4),
                     "distopt_ns_per_param": d, "distopt_over_torch": round(d / ns, 4) if d else None})
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
