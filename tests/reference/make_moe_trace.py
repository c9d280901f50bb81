#!/usr/bin/env python3
"""Generate the mixture-of-experts trace in tests/reference/traces/ from PyTorch.

Usage (from anywhere):
    pip install torch safetensors numpy
    python3 tests/reference/make_moe_trace.py

A small mixture-of-experts model trained for STEPS steps on random tokens: an input
projection, a router over E = 8 experts with top-2 gating (softmax over the two chosen
logits, as Mixtral), each expert an MLP (w_in, SiLU, w_out), a residual and a classifier
head. Each step clips the gradient of every parameter, dense and expert alike, by one global
norm (torch.nn.utils.clip_grad_norm_, max_norm MAX_NORM), then takes a torch.optim.AdamW
step. Experts that no token chose in a step get zero gradients, which AdamW still steps
(weight decay, moments), as with a framework's preallocated grad buffers.

It writes
    traces/moe_adamw_clip.trace.safetensors     F32 `param.<name>` (initial values) and
                                                `grad.<k>.<name>`: the unclipped gradients
    traces/moe_adamw_clip.expected.safetensors  F32 `param.<name>` after all steps
and moe_cases.txt, whose line the CMake glue turns into `distopt-replay --optimizer adamw
... --max-grad-norm MAX_NORM` against the expected params (rtol 1e-5, atol 1e-6): the
replay clips inside its step by the norm it computes, where torch clipped before its step.
The expert tensors are named `experts.<e>.w_in` and `experts.<e>.w_out`.

As a check of the reference itself, the recorded gradients are replayed here in float64
(clip_grad_norm_ and AdamW on double tensors): the float32 run must agree within the
tolerance, and replaying them in float32 through fresh modules must give the run's bits.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_traces import ATOL, RTOL, TRACE_DIR, save_checked  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CASES_TXT = os.path.join(HERE, "moe_cases.txt")
CASE = "moe_adamw_clip"
STEPS = 12
E, TOP_K = 8, 2
D_IN, D, H, CLASSES, TOKENS = 12, 8, 16, 5, 10
MAX_NORM = 1.0
HPARAMS = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


class MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = torch.nn.Linear(D_IN, D, bias=False)
        self.router = torch.nn.Linear(D, E, bias=False)
        self.w_in = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(H, D)) for _ in range(E)])
        self.w_out = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(D, H)) for _ in range(E)])
        self.head = torch.nn.Linear(D, CLASSES, bias=False)

    def named(self):
        out = {"in_proj.weight": self.in_proj.weight, "router.weight": self.router.weight}
        for e in range(E):
            out[f"experts.{e}.w_in"] = self.w_in[e]
            out[f"experts.{e}.w_out"] = self.w_out[e]
        out["head.weight"] = self.head.weight
        return out

    def forward(self, x):
        h = self.in_proj(x)
        logits = self.router(h)
        top, idx = logits.topk(TOP_K, dim=-1)
        gate = torch.softmax(top, dim=-1)
        mixed = torch.zeros_like(h)
        for e in range(E):
            for k in range(TOP_K):
                rows = (idx[:, k] == e).nonzero(as_tuple=True)[0]
                if rows.numel() == 0:
                    continue
                y = torch.nn.functional.silu(h[rows] @ self.w_in[e].T) @ self.w_out[e].T
                mixed = mixed.index_add(0, rows, gate[rows, k:k + 1] * y)
        return self.head(h + mixed)


def train():
    g = torch.Generator().manual_seed(58)
    model = MoE()
    with torch.no_grad():
        for p in model.named().values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    params0 = {n: p.detach().clone().contiguous() for n, p in model.named().items()}
    opt = torch.optim.AdamW(model.named().values(), foreach=False, fused=False, **HPARAMS)
    for p in model.named().values():  # zero grads, never None: an idle expert still steps (as DDP's buffers)
        p.grad = torch.zeros_like(p)
    grads, idle = [], 0
    for _ in range(STEPS):
        x = torch.randn(TOKENS, D_IN, generator=g)
        labels = torch.randint(0, CLASSES, (TOKENS,), generator=g)
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        step = {n: p.grad.detach().clone().contiguous() for n, p in model.named().items()}
        idle += sum(1 for e in range(E) if not step[f"experts.{e}.w_in"].any())
        grads.append(step)
        torch.nn.utils.clip_grad_norm_(list(model.named().values()), MAX_NORM, foreach=False)
        opt.step()
    final = {n: p.detach().clone().contiguous() for n, p in model.named().items()}
    return params0, grads, final, idle


def replay(params0, grads, dtype):
    """clip_grad_norm_ + AdamW over the recorded gradients on fresh tensors of `dtype`."""
    ps = {n: t.to(dtype).clone().requires_grad_(True) for n, t in params0.items()}
    opt = torch.optim.AdamW(list(ps.values()), foreach=False, fused=False, **HPARAMS)
    for step in grads:
        for n, p in ps.items():
            p.grad = step[n].to(dtype).clone()
        torch.nn.utils.clip_grad_norm_(list(ps.values()), MAX_NORM, foreach=False)
        opt.step()
    return {n: p.detach() for n, p in ps.items()}


def main() -> int:
    torch.manual_seed(0)
    params0, grads, final, idle = train()
    again = replay(params0, grads, torch.float32)
    for n in final:
        assert torch.equal(final[n], again[n]), n
    wide = replay(params0, grads, torch.float64)
    worst = 0.0  # the largest |float32 - float64| / (atol + rtol |float64|), allclose's test
    for n in final:
        err = (final[n].double() - wide[n]).abs()
        worst = max(worst, float((err / (ATOL + RTOL * wide[n].abs())).max()))
    assert worst < 1.0, f"float32 run against float64: {worst:.3g} x the tolerance"
    print(f"float32 against float64: {worst:.3g} x tolerance; {idle} idle expert-steps of {E * STEPS}")
    meta = {
        "steps": str(STEPS),
        "optimizer": "adamw",
        "set": " ".join(f"{k}={','.join(map(repr, map(float, v))) if isinstance(v, tuple) else repr(float(v))}"
                        for k, v in HPARAMS.items()),
        "case": CASE,
        "max_grad_norm": repr(MAX_NORM),
        "experts": str(E),
        "top_k": str(TOP_K),
        "torch_version": torch.__version__,
        "generator": "tests/reference/make_moe_trace.py",
    }
    trace = {f"param.{n}": t for n, t in params0.items()}
    for k, step in enumerate(grads):
        for n, t in step.items():
            trace[f"grad.{k}.{n}"] = t
    save_checked(trace, os.path.join(TRACE_DIR, f"{CASE}.trace.safetensors"), meta)
    save_checked({f"param.{n}": t for n, t in final.items()},
                 os.path.join(TRACE_DIR, f"{CASE}.expected.safetensors"), meta)
    for kind in ("trace", "expected"):
        os.chmod(os.path.join(TRACE_DIR, f"{CASE}.{kind}.safetensors"), 0o644)
    sets = " ".join(f"--set {s}" for s in meta["set"].split())
    with open(CASES_TXT, "w", encoding="utf-8", newline="\n") as f:
        f.write(f"# The mixture-of-experts trace of tests/reference/make_moe_trace.py (torch {torch.__version__}):\n"
                f"# {E} experts, top-{TOP_K}, clip_grad_norm_({MAX_NORM}) over every parameter, then AdamW.\n"
                f"# <case> <optimizer> [--set KEY=VALUE]... [replay options]\n"
                f"{CASE} adamw {sets} --max-grad-norm {MAX_NORM!r}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
