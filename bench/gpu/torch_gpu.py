#!/usr/bin/env python3
"""PyTorch's GPU optimizer steps on the GPT-like tensors of distopt-bench-gpu-update.

Times one step per case (best of --repeats after a warm-up, CUDA events), with the bytes
per parameter each case must move at least, and the device-to-device copy bandwidth
measured in the same run. Writes JSON lines with the fields of distopt-bench-gpu-update,
and, given --distopt FILE (that program's JSON lines from the same run), prints distopt's
time ratio against each torch case of the same optimizer and dtypes.

    python3 bench/gpu/torch_gpu.py --params 321000000 --json out/torch.jsonl \\
        --distopt out/distopt.jsonl

Needs torch with CUDA; bench/gpu/run.sh calls it when torch imports.
"""
import argparse
import json
import os
import sys

import torch

# torch_step.py: beside this file in the carried bundle (bench/gpu/build.sh), in ../peers in the repository.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_step import gpt_like  # noqa: E402  (the same shapes as bench::gpt_like)


def best_seconds(repeats, fn):
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e-3)
    return best


def copy_gbps(n, repeats):
    src = torch.zeros(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    s = best_seconds(repeats, lambda: dst.copy_(src))
    return 2.0 * n * 4 / s * 1e-9


def case(shapes, dtype, make_opt, repeats):
    params = [torch.zeros(s, dtype=dtype, device="cuda", requires_grad=True) for s in shapes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = make_opt(params)
    s = best_seconds(repeats, opt.step)
    del opt, params
    torch.cuda.empty_cache()
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=321_000_000)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", required=True)
    ap.add_argument("--distopt", help="distopt-bench-gpu-update's and -step's JSON lines from the same run")
    a = ap.parse_args()
    shapes = gpt_like(a.params)
    n = sum(int(torch.Size(s).numel()) for s in shapes)
    copy = copy_gbps(a.params, a.repeats)
    dev = torch.cuda.get_device_name()
    f32, b16 = torch.float32, torch.bfloat16
    # (impl, policy, param, grad, state, dtype, bytes per param, optimizer)
    cases = [
        ("torch-fused", "adamw", "fp32", "fp32", "fp32", f32, 28, lambda p: torch.optim.AdamW(p, fused=True)),
        ("torch-foreach", "adamw", "fp32", "fp32", "fp32", f32, 28, lambda p: torch.optim.AdamW(p, foreach=True)),
        ("torch-fused", "adamw", "bf16", "bf16", "bf16", b16, 14, lambda p: torch.optim.AdamW(p, fused=True)),
        ("torch-fused", "sgd", "fp32", "fp32", "fp32", f32, 20,
         lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, fused=True)),
    ]
    if hasattr(torch.optim, "Adafactor"):
        # Factored second moments: param read + write, grad read, row/col statistics
        # negligible; torch's implementation makes several passes over the grads.
        cases.append(("torch", "adafactor", "fp32", "fp32", "fp32", f32, 12, lambda p: torch.optim.Adafactor(p)))
    try:
        from transformers.optimization import Adafactor as HFAdafactor  # the reference of distopt's adafactor
        cases.append(("transformers", "adafactor", "fp32", "fp32", "fp32", f32, 12, lambda p: HFAdafactor(p)))
    except ImportError:
        print("torch_gpu.py: no transformers here: its Adafactor is skipped")
    models = [("gpt-like", shapes, n)] * len(cases)
    # Many small tensors: 65,536 of 1,024 elements (distopt-bench-gpu-step's second model).
    cases.append(("torch-fused", "adamw", "fp32", "fp32", "fp32", f32, 28, lambda p: torch.optim.AdamW(p, fused=True)))
    models.append(("65536x1024", [(1024,)] * 65536, 65536 * 1024))
    rows = []
    for (impl, policy, param, grad, state, dtype, bpp, make), (model, model_shapes, count) in zip(cases, models):
        s = case(model_shapes, dtype, make, a.repeats)
        gbps = bpp * count / s * 1e-9
        rows.append(dict(bench="gpu-update", impl=impl, device=dev, model=model, policy=policy, param=param,
                         grad=grad, state=state, params=count, bytes_per_param=bpp, ns_per_param=s / count * 1e9,
                         gbps=gbps, copy_gbps=copy, ratio=gbps / copy))
        print(f"{impl:14} {policy:10} {param:5} {model:11} {s / count * 1e9:8.4f} ns/param {gbps:7.0f} GB/s "
              f"{gbps / copy:5.2f} of copy ({copy:.0f} GB/s)")
    with open(a.json, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    if a.distopt:
        ours = [json.loads(line) for line in open(a.distopt) if line.strip()]
        print("\ndistopt against torch, same run (time ratio torch / distopt: above 1, distopt is faster)")
        for r in rows:
            for o in ours:
                if o.get("bench") == "gpu-update" and r["model"] == "gpt-like":  # the update kernels alone
                    same = o["policy"] == r["policy"] and o["param"].split("+")[0] == r["param"]
                    if same and o["state"] == r["state"]:
                        print(f"  {o['policy']} {o['param']}/{o['state']} vs {r['impl']} {r['param']}/{r['state']}: "
                              f"{r['ns_per_param'] / o['ns_per_param']:.2f}x")
                elif o.get("bench") == "gpu-layerwise-step" and r["model"] == "gpt-like":  # layer-wise step
                    if o["policy"] == r["policy"] and o["precision"] == r["param"]:
                        print(f"  {o['policy']} {o['precision']} step() ({o['params'] / 1e6:.0f} M params) vs "
                              f"{r['impl']} {r['param']}: {r['ns_per_param'] / o['ns_per_param']:.2f}x")
                elif o.get("bench") == "gpu-step" and o["model"] == r["model"]:  # the optimizer's whole step
                    if o["policy"] == r["policy"] and o["precision"].split("+")[0] == r["param"]:
                        print(f"  step() {o['policy']} {o['precision']} {o['model']}, check {o['check']} vs "
                              f"{r['impl']} {r['param']}: {r['ns_per_param'] / o['ns_per_param']:.2f}x")


if __name__ == "__main__":
    main()
