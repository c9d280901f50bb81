#!/usr/bin/env python3
"""PyTorch's optimizer step on the CPU, for a side-by-side with distopt-bench-step.

Same model shape as bench/step_bandwidth.cpp (GPT-like tensors up to --params), fp32,
one step timed after a warm-up, best of --repeats. Prints one JSON line per case with
the bytes moved per parameter under the same model (each input read once, each output
written once). Needs torch (pip install torch); not part of the test suite.

    python3 bench/peers/torch_step.py --params 67108864 --threads 2
"""
import argparse
import json
import time

import torch


def gpt_like(n, d=1024):
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


def bench(name, make_opt, params, bytes_per_param, repeats, threads):
    opt = make_opt(params)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t0)
    n = sum(p.numel() for p in params)
    print(json.dumps({"bench": "step", "peer": "torch " + torch.__version__, "case": name, "params": n,
                      "threads": threads, "ns_per_param": round(best / n * 1e9, 4),
                      "bytes_per_param": bytes_per_param, "gbps": round(n * bytes_per_param / best / 1e9, 2)}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=64 << 20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    shapes = gpt_like(a.params)
    for name, make, nbytes in [
        ("adamw foreach", lambda ps: torch.optim.AdamW(ps, foreach=True), 28),
        ("adamw fused", lambda ps: torch.optim.AdamW(ps, fused=True), 28),
        ("adamw for-loop", lambda ps: torch.optim.AdamW(ps, foreach=False), 28),
        ("sgd for-loop", lambda ps: torch.optim.SGD(ps, lr=1e-3, foreach=False), 12),
    ]:
        params = [torch.zeros(s, requires_grad=True) for s in shapes]
        bench(name, make, params, nbytes, a.repeats, a.threads)
        del params


if __name__ == "__main__":
    main()
