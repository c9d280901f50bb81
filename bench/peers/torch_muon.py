#!/usr/bin/env python3
"""torch.optim.Muon beside distopt-bench-muon: the same GPT-like blocks, the same threads.

Muon on each block's four matrices (attn.qkv [3d, d], attn.proj [d, d], mlp.fc [4d, d],
mlp.proj [d, 4d]), torch.optim.AdamW (fused) on its biases and LayerNorm weights, fp32
params and grads, adjust_lr_fn="match_rms_adamw"; torch's Newton-Schulz runs in bf16 (its
only choice). Times one step of both optimizers (best of --repeats after a warm-up) and,
with --distopt FILE (the JSON lines distopt-bench-muon wrote), prints distopt / torch.

    python3 bench/peers/torch_muon.py --width 512 --threads 2 --distopt bench/results/muon.jsonl

Needs torch >= 2.9 (pip); not part of the test suite.
"""
import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--distopt", default="")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    d = a.width
    g = torch.Generator().manual_seed(0)
    matrices, vectors = [], []
    for _ in range(a.layers):
        matrices += [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02)
                     for s in [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]]
        vectors += [torch.nn.Parameter(torch.zeros(n)) for n in [d, 3 * d, d, d, 4 * d, d]]
    for p in matrices + vectors:
        p.grad = torch.randn(p.shape, generator=g) * 0.01
    muon = torch.optim.Muon(matrices, lr=1e-3, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(vectors, lr=1e-3, weight_decay=0.1, fused=True)

    def step():
        muon.step()
        adamw.step()

    step()
    best = 1e30
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    params = sum(p.numel() for p in matrices + vectors)
    line = {"bench": "torch_muon", "width": d, "layers": a.layers, "params": params, "threads": a.threads,
            "ms_per_step": best * 1e3, "torch": torch.__version__}
    print(f"torch.optim.Muon (bf16 NS) + AdamW: {a.layers} x width {d} ({params} params), {a.threads} thread(s): "
          f"{best * 1e3:.1f} ms/step")
    if a.distopt:
        with open(a.distopt) as f:
            for row in map(json.loads, f):
                if (row.get("bench") == "muon" and row["width"] == d and row["layers"] == a.layers
                        and row["threads"] == a.threads and row.get("ranks", 1) == 1):
                    print(f"  distopt ns={row['ns']}: {row['ms_per_step']:.1f} ms/step, "
                          f"distopt / torch = {row['ms_per_step'] / (best * 1e3):.2f}")
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
