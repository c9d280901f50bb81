#!/usr/bin/env python3
"""Generate the golden Muon traces in tests/reference/traces/ from torch.optim.Muon.

Usage (from anywhere):
    pip install torch safetensors numpy
    python3 tests/reference/make_muon_traces.py

Every case runs STEPS steps over one parameter set in two groups, as Moonlight's recipe
trains and as distopt's `muon` policy does in one optimizer:

  * the Muon group: the 2-D tensors whose names do not end in ".bias" (torch.optim.Muon);
  * the AdamW group: every other tensor (torch.optim.AdamW, foreach=False), with the same
    lr and weight_decay, and `betas`, `adamw_eps`.

Two kinds of case:

  * `ns_dtype=bf16`: the expected params are torch.optim.Muon's own, whose Newton–Schulz
    runs in bfloat16. Two bf16 implementations agree only to bf16 noise, so the case's
    tolerance is derived from that noise (see `bf16_tolerance`) and written into
    muon_cases.txt; deliberately wrong variants must miss by far more.
  * `ns_dtype=fp32`: the expected params are an independent float64 numpy re-computation
    of the algorithm (distopt keeps NS in fp32; rtol 1e-5, atol 1e-6 as every other case).
    As a guard against misreading torch's API, torch.optim.Muon with its Newton–Schulz
    swapped for a float64 one must agree with the numpy result at that tolerance.

Files, in make_traces.py's format, one trace for every case (only the settings differ):
    traces/muon.trace.safetensors       F32 param.<name>, grad.<k>.<name>, __metadata__
    traces/<case>.expected.safetensors  F32 param.<name> after all steps (metadata: the
                                        case, its settings and its reference)
and muon_cases.txt: one `<case> <rtol> <atol> muon --set KEY=VALUE ...` per line.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import torch
import torch.optim._muon as torch_muon

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_traces import ATOL, RTOL, Case, fmt_value, save_checked  # noqa: E402

TRACE_DIR = os.path.join(HERE, "traces")
CASES_TXT = os.path.join(HERE, "muon_cases.txt")
GENERATOR = "tests/reference/make_muon_traces.py"
STEPS = 60
SEED = 4000

# (name, shape, grad scale): tall, wide, square and odd matrices in the Muon group; a
# 2-D bias, a 3-D tensor and vectors in the AdamW group.
PARAM_SPECS = [
    ("layers.0.attn.weight", (24, 16), 1e-2),
    ("layers.0.mlp.weight", (12, 30), 3e-3),
    ("layers.1.attn.weight", (16, 16), 1e-2),
    ("layers.1.mlp.weight", (11, 7), 3e-2),
    ("norm.weight", (16,), 1e-2),
    ("head.bias", (1,), 0.1),
    ("rel_pos.bias", (3, 5), 1e-2),
    ("conv.kernel", (2, 3, 4), 1e-2),
]
# All-zero gradients (real zero tensors; the step still runs). Step 0 of a Muon matrix:
# NS of a zero matrix (its norm clamped to eps) is zero.
ZERO_GRAD = {"layers.1.attn.weight": {0, 8}, "head.bias": {0, 8, 9, 10}}


def in_muon_group(name: str, shape) -> bool:
    return len(shape) == 2 and not name.endswith(".bias")


MUON_NAMES = [n for n, s, _ in PARAM_SPECS if in_muon_group(n, s)]

DEFAULTS = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5,
                adjust_lr_fn="original", ns_dtype="fp32", betas=(0.9, 0.999), adamw_eps=1e-8)
ORDER = ["lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
         "adjust_lr_fn", "ns_dtype", "betas", "adamw_eps"]

CASES = [
    Case("muon_default", "muon", dict(lr=2e-2)),
    Case("muon_rms_adamw", "muon", dict(lr=3e-3, adjust_lr_fn="match_rms_adamw", betas=(0.9, 0.95))),
    Case("muon_plain_momentum", "muon",
         dict(lr=1e-2, nesterov=False, momentum=0.9, ns_steps=6, weight_decay=0.0,
              adjust_lr_fn="spectral_unclamped")),
    Case("muon_default_bf16", "muon", dict(lr=2e-2, ns_dtype="bf16")),
    Case("muon_rms_adamw_bf16", "muon",
         dict(lr=3e-3, adjust_lr_fn="match_rms_adamw", betas=(0.9, 0.95), ns_dtype="bf16")),
]


def hparams(case: Case) -> dict:
    hp = dict(DEFAULTS)
    hp.update(case.hparams)
    return hp


def set_args(case: Case) -> list[str]:
    hp = hparams(case)
    out = []
    for k in ORDER:
        v = hp[k]
        if k == "ns_steps":
            out.append(f"{k}={int(v)}")
        elif k in ("adjust_lr_fn", "ns_dtype"):
            out.append(f"{k}={v}")
        else:
            out.append(f"{k}={fmt_value(v)}")
    return out


def make_data(seed: int):
    """Params ~ N(0, 1) / 2; grads N(0, 1) x the tensor's scale."""
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=g, dtype=torch.float32) * 0.5 for n, s, _ in PARAM_SPECS}
    grads = []
    for k in range(STEPS):
        step = {}
        for n, s, scale in PARAM_SPECS:
            t = torch.randn(s, generator=g, dtype=torch.float32) * scale
            if k in ZERO_GRAD.get(n, ()):
                t = torch.zeros(s, dtype=torch.float32)
            step[n] = t.contiguous()
        grads.append(step)
    return params, grads


# --------------------------------------------------------------------------
# torch
# --------------------------------------------------------------------------

def ns_float64(grad, ns_coefficients, ns_steps, eps):
    """torch's _zeropower_via_newtonschulz with float64 in place of bfloat16."""
    a, b, c = ns_coefficients
    x = grad.to(dtype=torch.float64, copy=True)
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    if grad.size(0) > grad.size(1):
        x = x.T
    return x.to(grad.dtype)


def run_torch(case: Case, params0, grads, ns64: bool):
    hp = hparams(case)
    names = list(params0)
    plist = {n: torch.nn.Parameter(params0[n].clone()) for n in names}
    muon = torch.optim.Muon([plist[n] for n in MUON_NAMES], lr=hp["lr"], weight_decay=hp["weight_decay"],
                            momentum=hp["momentum"], nesterov=hp["nesterov"],
                            ns_coefficients=tuple(hp["ns_coefficients"]), eps=hp["eps"],
                            ns_steps=hp["ns_steps"], adjust_lr_fn=hp["adjust_lr_fn"])
    adamw = torch.optim.AdamW([plist[n] for n in names if n not in MUON_NAMES], lr=hp["lr"],
                              betas=tuple(hp["betas"]), eps=hp["adamw_eps"],
                              weight_decay=hp["weight_decay"], foreach=False)
    original = torch_muon._zeropower_via_newtonschulz
    if ns64:
        torch_muon._zeropower_via_newtonschulz = ns_float64
    try:
        for step in grads:
            for n in names:
                plist[n].grad = step[n].clone()
            muon.step()
            adamw.step()
    finally:
        torch_muon._zeropower_via_newtonschulz = original
    return {n: p.detach().clone().contiguous() for n, p in plist.items()}


# --------------------------------------------------------------------------
# Independent float64 re-implementation (and wrong variants)
# --------------------------------------------------------------------------

BUGS = {
    "no_nesterov": "the momentum buffer itself orthogonalised when nesterov is on",
    "nesterov": "the Nesterov blend when nesterov is off",
    "wrong_adjust": "adjust_lr_fn 'original' read as 'spectral_unclamped' and back",
    "spectral_norm": "X divided by its spectral norm instead of its Frobenius norm",
    "decay_adjusted": "weight decay with the adjusted lr",
    "steps_minus_1": "one Newton-Schulz iteration fewer",
}


def adjusted_ratio(fn: str, m: int, n: int) -> float:
    if fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    if fn == "spectral_unclamped":
        return math.sqrt(m / n)
    return math.sqrt(max(1.0, m / n))


def ns_numpy(u: np.ndarray, hp: dict, bug=None) -> np.ndarray:
    a, b, c = hp["ns_coefficients"]
    tall = u.shape[0] > u.shape[1]  # NS(U^T) = NS(U)^T: the transpose only saves work
    x = u.T.copy() if tall else u.copy()
    x = x / max(np.linalg.norm(x, 2 if bug == "spectral_norm" else None), hp["eps"])
    for _ in range(hp["ns_steps"] - (1 if bug == "steps_minus_1" else 0)):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def run_numpy(case: Case, params0, grads, bug=None):
    hp = hparams(case)
    mu = hp["momentum"]
    b1, b2 = hp["betas"]
    lr, wd = hp["lr"], hp["weight_decay"]
    p = {n: t.numpy().astype(np.float64) for n, t in params0.items()}
    st = {n: [np.zeros_like(x), np.zeros_like(x)] for n, x in p.items()}
    for k, step in enumerate(grads):
        t = k + 1
        for n in p:
            g = step[n].numpy().astype(np.float64)
            s = st[n]
            if n in MUON_NAMES:
                s[0] = mu * s[0] + (1 - mu) * g
                nesterov = hp["nesterov"]
                if bug in ("no_nesterov", "nesterov"):
                    nesterov = not nesterov
                u = (1 - mu) * g + mu * s[0] if nesterov else s[0]
                fn = hp["adjust_lr_fn"]
                if bug == "wrong_adjust":
                    fn = {"original": "spectral_unclamped"}.get(fn, "original")
                alr = lr * adjusted_ratio(fn, *g.shape)
                p[n] = p[n] * (1 - (alr if bug == "decay_adjusted" else lr) * wd)
                p[n] = p[n] - alr * ns_numpy(u, hp, bug)
            else:
                p[n] = p[n] * (1 - lr * wd)
                s[0] = b1 * s[0] + (1 - b1) * g
                s[1] = b2 * s[1] + (1 - b2) * g * g
                denom = np.sqrt(s[1]) / math.sqrt(1 - b2 ** t) + hp["adamw_eps"]
                p[n] = p[n] - lr / (1 - b1 ** t) * s[0] / denom
    return p


def max_ratio(got: dict, expected: dict, rtol: float, atol: float) -> float:
    worst = 0.0
    for n, e in expected.items():
        e = e.numpy().astype(np.float64) if isinstance(e, torch.Tensor) else np.asarray(e, dtype=np.float64)
        g = got[n].numpy().astype(np.float64) if isinstance(got[n], torch.Tensor) else got[n]
        worst = max(worst, float(np.max(np.abs(g - e) / (atol + rtol * np.abs(e)))))
    return worst


def bf16_tolerance(torch_bf16: dict, exact: dict) -> float:
    """The bf16 cases' atol (rtol 0). torch's bf16 Newton-Schulz rounds every product to 8
    significant bits; after STEPS steps its params lie D = max |torch - float64| from the
    float64 re-computation, and so does any NS that does not round (fp32 NS lies within
    1e-5 D of float64). An implementation that rounds at the same points as torch (each
    matrix product with its addmm terms, the norm, the division) reproduces most of torch's
    roundings: the two differ only in the order of their fp32 accumulations, which moves a
    bf16 rounding rarely. So it must lie within D / 2 of torch's params, a bound that
    an unrounded NS misses by 2x; D / 2 rounded up to 2 significant digits is the tolerance.
    (distopt's bf16 NS lies 0.07 D and 0.12 D away in the two cases, with OpenBLAS 0.3.21.)"""
    d = max(float(np.max(np.abs(torch_bf16[n].numpy().astype(np.float64) - exact[n]))) for n in exact)
    digits = 10 ** (math.floor(math.log10(d / 2)) - 1)
    return math.ceil(d / 2 / digits) * digits


def metadata(case: Case | None, reference: str) -> dict:
    meta = {
        "steps": str(STEPS),
        "optimizer": "muon",
        "torch_version": torch.__version__,
        "generator": GENERATOR,
        "muon_params": ",".join(MUON_NAMES),
    }
    if case is None:
        meta["cases"] = ",".join(c.name for c in CASES)
    else:
        meta.update({"set": " ".join(set_args(case)), "case": case.name, "reference": reference})
    return meta


def write_trace(params0, grads) -> None:
    trace = {f"param.{n}": t.contiguous() for n, t in params0.items()}
    for k, step in enumerate(grads):
        for n, t in step.items():
            trace[f"grad.{k}.{n}"] = t.contiguous()
    save_checked(trace, os.path.join(TRACE_DIR, "muon.trace.safetensors"), metadata(None, ""))


def write_expected(case: Case, final: dict, reference: str) -> None:
    expected = {f"param.{n}": t.contiguous() if isinstance(t, torch.Tensor)
                else torch.from_numpy(np.asarray(t, dtype=np.float32)).contiguous() for n, t in final.items()}
    save_checked(expected, os.path.join(TRACE_DIR, f"{case.name}.expected.safetensors"), metadata(case, reference))


def main() -> None:
    params0, grads = make_data(SEED)
    write_trace(params0, grads)
    lines = [
        "# Golden Muon traces generated by tests/reference/make_muon_traces.py",
        f"# (torch.optim.Muon and torch.optim.AdamW, torch {torch.__version__}). Do not edit by hand.",
        "# <case> <rtol> <atol> muon [--set KEY=VALUE]...   Trace: traces/muon.trace.safetensors (all cases)",
        "# The Muon group holds the 2-D tensors not named *.bias (metadata 'muon_params'); AdamW",
        "# (use_muon=false: lr, weight_decay, betas, adamw_eps) the rest. ns_dtype=fp32 cases expect",
        "# a float64 re-computation; ns_dtype=bf16 cases expect torch's own bf16 result, within half",
        "# its distance from the float64 result (make_muon_traces.py, bf16_tolerance): a Newton-Schulz",
        "# that does not round where torch's rounds misses it.",
    ]
    for case in CASES:
        hp = hparams(case)
        exact = run_numpy(case, params0, grads)
        torch64 = run_torch(case, params0, grads, ns64=True)
        guard = max_ratio(torch64, exact, RTOL, ATOL)
        assert guard <= 1.0, f"{case.name}: torch (float64 NS) vs numpy float64: {guard:.3g} x tol"
        moved = min(float(np.linalg.norm(exact[n] - params0[n].numpy()) / np.linalg.norm(params0[n].numpy()))
                    for n in exact)
        if hp["ns_dtype"] == "fp32":
            rtol, atol = RTOL, ATOL
            final, reference = exact, "numpy float64 re-computation of torch.optim.Muon + torch.optim.AdamW"
        else:
            final = run_torch(case, params0, grads, ns64=False)
            rtol, atol = 0.0, bf16_tolerance(final, exact)
            reference = f"torch.optim.Muon (bf16 Newton-Schulz) + torch.optim.AdamW (torch {torch.__version__})"
        print(f"{case.name}: torch(float64 NS) uses {guard:.3f} of the tolerance; "
              f"min ||p_end - p_0|| / ||p_0|| = {moved:.3g}; rtol {rtol:g}, atol {atol:g}")
        for bug, what in BUGS.items():
            if bug == "nesterov" and hp["nesterov"]:
                continue
            if bug == "no_nesterov" and not hp["nesterov"]:
                continue
            if bug == "wrong_adjust" and hp["adjust_lr_fn"] == "match_rms_adamw":
                continue
            if bug == "decay_adjusted" and hp["weight_decay"] == 0.0:
                continue
            ratio = max_ratio(run_numpy(case, params0, grads, bug), final, rtol, atol)
            print(f"    {bug:16s} {ratio:10.4g} x tol  {what}")
            assert ratio > 3.0, f"{case.name}: the wrong variant '{bug}' passes ({ratio:.3g} x tol)"
        write_expected(case, final, reference)
        lines.append(f"{case.name} {rtol:g} {atol:g} muon " + " ".join(f"--set {a}" for a in set_args(case)))
    with open(CASES_TXT, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
