#!/usr/bin/env python3
"""PyTorch's CPU optimizer step beside distopt's, same sizes, same threads, same run.

Builds the model shape of bench/step_bandwidth.cpp (GPT-like tensors up to --params),
times one torch.optim step per case (best of --repeats after a warm-up), runs
distopt-bench-step with the same --params and --threads, and prints both in the same
columns with the ratio of times (distopt / torch: below 1 means distopt is faster).
Writes JSON lines of every case to --json, for bench/plot_step.py.

    python3 bench/peers/torch_step.py --distopt build/bench/distopt-bench-step \\
        --params 67108864 --threads 2 --json bench/results-cpu.jsonl

Needs torch from PyPI (pip install torch); not part of the test suite.
"""
import argparse
import json
import subprocess
import sys
import time

import torch


def gpt_like(n, d=1024):
    """The tensor shapes of bench::gpt_like."""
    shapes, total = [], 0

    def add(shape):
        nonlocal total
        numel = 1
        for s in shape:
            numel *= s
        if total + numel > n:
            return False
        shapes.append(shape)
        total += numel
        return True

    add((8192, d))
    while total < n:
        if not all(add(s) for s in [(d,), (3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d)]):
            break
    if total < n:
        shapes.append((n - total,))
    return shapes


# (name, torch constructor, dtype, bytes/param, the distopt row it is compared with:
# policy, options, param, grad, state, finite check). Both sides at their default options:
# torch's optimizers check nothing, distopt's default checks the grads for NaN/Inf (the exact
# norm pass, 4 more B/param read) and skips the step if it finds one.
CASES = [
    ("adamw foreach", lambda ps: torch.optim.AdamW(ps, foreach=True), torch.float32, 28,
     ("adamw", "", "fp32", "fp32", "fp32", True)),
    ("adamw fused", lambda ps: torch.optim.AdamW(ps, fused=True), torch.float32, 28,
     ("adamw", "", "fp32", "fp32", "fp32", True)),
    ("adam fused", lambda ps: torch.optim.Adam(ps, fused=True), torch.float32, 28,
     ("adam", "", "fp32", "fp32", "fp32", True)),
    ("sgd momentum foreach", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
     torch.float32, 20, ("sgd", "momentum=0.9", "fp32", "fp32", "fp32", True)),
    ("sgd momentum fused", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
     torch.float32, 20, ("sgd", "momentum=0.9", "fp32", "fp32", "fp32", True)),
    # torch keeps bf16 params without a master copy and its states in the param dtype:
    # compared with distopt's bf16 params + stochastic rounding and fp32 states (it moves
    # 22 B/param to torch's 14, and stays exact where torch's bf16 states lose bits).
    ("adamw fused bf16", lambda ps: torch.optim.AdamW(ps, fused=True), torch.bfloat16, 14,
     ("adamw", "", "bf16+sr", "bf16", "fp32", False)),
]

# bitsandbytes' 8-bit block-wise optimizers (pip install bitsandbytes; 0.50 runs them on
# CPU through its C++ CPU backend), against distopt's q8 states. Skipped without it.
try:
    import bitsandbytes as bnb  # noqa: E402

    Q8 = 4 + 4 + 4 + 2 * (2 + 8 / 256)  # fp32 param r/w, grad, two codes r/w, absmax
    CASES += [
        ("bnb AdamW8bit", lambda ps: bnb.optim.AdamW8bit(ps), torch.float32, Q8,
         ("adamw", "", "fp32", "fp32", "q8", False)),
        ("bnb Adam8bit", lambda ps: bnb.optim.Adam8bit(ps), torch.float32, Q8,
         ("adam", "", "fp32", "fp32", "q8", False)),
        ("bnb Lion8bit", lambda ps: bnb.optim.Lion8bit(ps), torch.float32, 12 + 2 + 8 / 256,
         ("lion", "", "fp32", "fp32", "q8", False)),
        ("bnb SGD8bit momentum", lambda ps: bnb.optim.SGD8bit(ps, lr=1e-2, momentum=0.9), torch.float32,
         12 + 2 + 8 / 256, ("sgd", "momentum=0.9", "fp32", "fp32", "q8", False)),
    ]
    BNB = f"bitsandbytes {bnb.__version__}"
except ImportError:
    BNB = None


def time_case(make, dtype, shapes, repeats):
    params = [torch.zeros(s, dtype=dtype, requires_grad=True) for s in shapes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = make(params)
    opt.step()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t0)
    return best, sum(p.numel() for p in params)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--distopt", required=True, help="path of distopt-bench-step")
    ap.add_argument("--params", type=int, default=64 << 20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write every case (distopt's and torch's) as JSON lines here")
    a = ap.parse_args()

    out = subprocess.run([a.distopt, "--params", str(a.params), "--threads", str(a.threads),
                          "--repeats", str(a.repeats)], check=True, capture_output=True, text=True).stdout
    sys.stdout.write(out)
    ours = {}
    rows = []
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            rows.append(r)
            if r.get("bench") == "step":
                ours[(r["policy"], r["options"], r["param"], r["grad"], r["state"], r["finite_check"])] = r

    torch.set_num_threads(a.threads)
    shapes = gpt_like(a.params)
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, same tensors\n")
    print(f"{'torch case':<22} {'ns/param':>9} {'B/param':>8} {'GB/s':>7} {'distopt ns/param':>17} {'distopt/torch':>14}")
    for name, make, dtype, nbytes, key in CASES:
        try:
            secs, n = time_case(make, dtype, shapes, a.repeats)
        except (RuntimeError, ValueError) as e:  # e.g. a fused kernel this torch lacks on CPU
            print(f"{name:<22} not available in this torch: {str(e).splitlines()[0]}")
            continue
        ns = secs / n * 1e9
        mine = ours.get(key)
        ratio = mine["ns_per_param"] / ns if mine else float("nan")
        print(f"{name:<22} {ns:>9.3f} {nbytes:>8} {n * nbytes / secs / 1e9:>7.1f} "
              f"{mine['ns_per_param'] if mine else float('nan'):>17.3f} {ratio:>14.2f}")
        peer = BNB if name.startswith("bnb ") else "torch " + torch.__version__
        rows.append({"bench": "step", "peer": peer, "case": name, "params": n,
                     "threads": a.threads, "ns_per_param": round(ns, 4), "bytes_per_param": nbytes,
                     "gbps": round(n * nbytes / secs / 1e9, 2), "distopt_over_torch": round(ratio, 3)})
    if a.json:
        with open(a.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
