#!/usr/bin/env python3
"""Generate the golden optimizer traces in tests/reference/traces/ from PyTorch.

Usage (from anywhere):
    pip install torch safetensors numpy
    python3 tests/reference/make_traces.py

For every case it writes
    traces/<case>.trace.safetensors     F32 `param.<name>` (initial values) and
                                        `grad.<k>.<name>` for k = 0..steps-1,
                                        __metadata__ {"steps", "optimizer", "set",
                                        "case", "torch_version", "generator"}
    traces/<case>.expected.safetensors  F32 `param.<name>` after all steps
and rewrites cases.txt, one line per case:
    <case> <optimizer> [--set KEY=VALUE]...
which the CMake glue turns into `distopt-replay --optimizer <optimizer>
--trace <case>.trace.safetensors --out ... --set ...` ctests compared
against <case>.expected.safetensors (rtol 1e-5, atol 1e-6).

Everything is float32 on CPU with fixed seeds and foreach=False, fused=False,
so re-running produces identical bytes with the same torch version.

As an independent check of the references themselves (guarding against
misuse of the torch API), every case is also replayed by a float64 numpy
re-implementation and must agree with the torch float32 result to rtol 1e-5
(atol 1e-6); the AdamW default case is the one the brief requires, the rest
are checked the same way because it costs nothing.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE_DIR = os.path.join(HERE, "traces")
CASES_TXT = os.path.join(HERE, "cases.txt")
GENERATOR = "tests/reference/make_traces.py"

RTOL = 1e-5
ATOL = 1e-6
STEPS = 24

# (name, shape, grad scale). Scales span 1e-3..10; "layer0.bias" gets all-zero
# gradients on ZERO_GRAD_STEPS (including step 0, so first-step state
# initialisation from a zero gradient is covered).
PARAM_SPECS = [
    ("embed.weight", (17, 33), 1e-2),
    ("conv.weight", (3, 4, 5), 10.0),
    ("layer0.weight", (7, 5), 1.0),
    ("layer0.bias", (3,), 0.1),
    ("norm.weight", (257,), 1e-3),
    ("head.bias", (1,), 3.0),
]
ZERO_GRAD_PARAM = "layer0.bias"
ZERO_GRAD_STEPS = {0, 8, 9, 10, 11, 12}


@dataclass
class Case:
    name: str
    optimizer: str  # sgd | adam | adamw | lion
    hparams: dict = field(default_factory=dict)  # PyTorch constructor names


# Hyper-parameters are written out explicitly (lr always; the numeric ones of
# each optimizer too, so the traces do not depend on the C++ defaults);
# booleans only when true.
CASES = [
    Case("sgd_plain", "sgd", dict(lr=0.1)),
    Case("sgd_momentum", "sgd", dict(lr=0.1, momentum=0.9)),
    Case("sgd_momentum_dampening", "sgd", dict(lr=0.1, momentum=0.9, dampening=0.5)),
    Case("sgd_nesterov", "sgd", dict(lr=0.1, momentum=0.9, nesterov=True)),
    Case("sgd_weight_decay_momentum", "sgd", dict(lr=0.1, momentum=0.9, weight_decay=1e-2)),
    Case("sgd_maximize", "sgd", dict(lr=0.1, maximize=True)),
    Case("adam_default", "adam", dict(lr=1e-2)),
    Case("adam_betas_eps", "adam", dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6)),
    Case("adam_weight_decay", "adam", dict(lr=1e-2, weight_decay=0.1)),
    Case("adam_amsgrad", "adam", dict(lr=1e-2, amsgrad=True)),
    Case("adam_maximize", "adam", dict(lr=1e-2, maximize=True)),
    Case("adamw_default", "adamw", dict(lr=1e-3, weight_decay=1e-2)),
    Case("adamw_wd_betas", "adamw", dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)),
    Case("adamw_amsgrad", "adamw", dict(lr=1e-3, weight_decay=1e-2, amsgrad=True)),
    Case("lion_default", "lion", dict(lr=1e-4)),
    Case("lion_wd_betas", "lion", dict(lr=1e-3, betas=(0.95, 0.98), weight_decay=0.1)),
]

DEFAULTS = {
    "sgd": dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False),
    "adam": dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False),
    "adamw": dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, maximize=False),
    "lion": dict(betas=(0.9, 0.99), weight_decay=0.0),
}
# Numeric hyper-parameters always spelled out in cases.txt / metadata.
EXPLICIT = {
    "sgd": ["lr", "momentum", "dampening", "weight_decay"],
    "adam": ["lr", "betas", "eps", "weight_decay"],
    "adamw": ["lr", "betas", "eps", "weight_decay"],
    "lion": ["lr", "betas", "weight_decay"],
}
ORDER = ["lr", "betas", "momentum", "dampening", "eps", "weight_decay",
         "nesterov", "amsgrad", "maximize"]


def full_hparams(case: Case) -> dict:
    hp = dict(DEFAULTS[case.optimizer])
    hp.update(case.hparams)
    return hp


def fmt_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (tuple, list)):
        return ",".join(fmt_value(x) for x in v)
    if isinstance(v, (int, float)):
        return repr(float(v))
    raise TypeError(v)


def set_args(case: Case) -> list[str]:
    hp = full_hparams(case)
    out = []
    for k in ORDER:
        if k not in hp:
            continue
        v = hp[k]
        if k in EXPLICIT[case.optimizer] or k in case.hparams and (not isinstance(v, bool) or v):
            out.append(f"{k}={fmt_value(v)}")
    return out


# --------------------------------------------------------------------------
# Trace data
# --------------------------------------------------------------------------

def make_data(seed: int):
    g = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape, _ in PARAM_SPECS:
        params[name] = torch.randn(shape, generator=g, dtype=torch.float32)
    grads = []
    for k in range(STEPS):
        step = {}
        for name, shape, scale in PARAM_SPECS:
            t = torch.randn(shape, generator=g, dtype=torch.float32) * scale
            if name == ZERO_GRAD_PARAM and k in ZERO_GRAD_STEPS:
                t = torch.zeros(shape, dtype=torch.float32)
            step[name] = t.contiguous()
        grads.append(step)
    return params, grads


# --------------------------------------------------------------------------
# torch float32 references
# --------------------------------------------------------------------------

def lion_step(params, grads, states, lr, betas, weight_decay):
    """float32 Lion in lion-pytorch's exact operation order."""
    beta1, beta2 = betas
    for name, p in params.items():
        grad = grads[name]
        if name not in states:
            states[name] = torch.zeros_like(p)
        exp_avg = states[name]
        # Guard against sign ties that float rounding in another implementation
        # could flip: the interpolation must not nearly cancel.
        a = (exp_avg * beta1).double()
        b = (grad * (1 - beta1)).double()
        c = a + b
        mag = a.abs() + b.abs()
        fragile = (mag > 0) & (c.abs() <= 1e-5 * mag)
        assert not bool(fragile.any()), f"near sign tie in Lion update of {name}"

        p.mul_(1 - lr * weight_decay)
        update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_()
        p.add_(update, alpha=-lr)
        exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)


def run_torch(case: Case, params0, grads):
    hp = full_hparams(case)
    params = {n: t.clone() for n, t in params0.items()}
    if case.optimizer == "lion":
        states = {}
        with torch.no_grad():
            for step in grads:
                lion_step(params, step, states, hp["lr"], hp["betas"], hp["weight_decay"])
        return params

    plist = [torch.nn.Parameter(t) for t in params.values()]
    if case.optimizer == "sgd":
        opt = torch.optim.SGD(plist, foreach=False, fused=False, **hp)
    elif case.optimizer == "adam":
        opt = torch.optim.Adam(plist, foreach=False, fused=False, **hp)
    elif case.optimizer == "adamw":
        opt = torch.optim.AdamW(plist, foreach=False, fused=False, **hp)
    else:
        raise ValueError(case.optimizer)
    for step in grads:
        for p, name in zip(plist, params):
            p.grad = step[name].clone()  # never None: zero grads still step
        opt.step()
    return {n: p.detach().clone().contiguous() for n, p in zip(params, plist)}


# --------------------------------------------------------------------------
# Independent float64 numpy references (sanity check of the torch usage)
# --------------------------------------------------------------------------

def run_numpy64(case: Case, params0, grads):
    hp = full_hparams(case)
    p = {n: t.numpy().astype(np.float64) for n, t in params0.items()}
    state = {n: {} for n in p}
    for t, step in enumerate(grads, start=1):
        for n in p:
            g = step[n].numpy().astype(np.float64)
            s = state[n]
            lr = hp["lr"]
            wd = hp["weight_decay"]
            if case.optimizer == "sgd":
                if hp["maximize"]:
                    g = -g
                if wd:
                    g = g + wd * p[n]
                mu = hp["momentum"]
                if mu:
                    if "buf" not in s:
                        s["buf"] = g.copy()
                    else:
                        s["buf"] = mu * s["buf"] + (1 - hp["dampening"]) * g
                    g = g + mu * s["buf"] if hp["nesterov"] else s["buf"]
                p[n] = p[n] - lr * g
            elif case.optimizer in ("adam", "adamw"):
                b1, b2 = hp["betas"]
                if hp["maximize"]:
                    g = -g
                if case.optimizer == "adamw":
                    p[n] = p[n] * (1 - lr * wd)
                elif wd:
                    g = g + wd * p[n]
                s.setdefault("m", np.zeros_like(g))
                s.setdefault("v", np.zeros_like(g))
                s["m"] = b1 * s["m"] + (1 - b1) * g
                s["v"] = b2 * s["v"] + (1 - b2) * g * g
                v = s["v"]
                if hp["amsgrad"]:
                    s["vmax"] = np.maximum(s.get("vmax", np.zeros_like(v)), v)
                    v = s["vmax"]
                bc1 = 1 - b1 ** t
                bc2 = 1 - b2 ** t
                p[n] = p[n] - (lr / bc1) * s["m"] / (np.sqrt(v) / np.sqrt(bc2) + hp["eps"])
            elif case.optimizer == "lion":
                b1, b2 = hp["betas"]
                s.setdefault("m", np.zeros_like(g))
                p[n] = p[n] * (1 - lr * wd)
                p[n] = p[n] - lr * np.sign(b1 * s["m"] + (1 - b1) * g)
                s["m"] = b2 * s["m"] + (1 - b2) * g
            else:
                raise ValueError(case.optimizer)
    return p


def check_against_numpy(case: Case, params0, grads, result):
    ref = run_numpy64(case, params0, grads)
    for n, t in result.items():
        np.testing.assert_allclose(
            t.numpy().astype(np.float64), ref[n], rtol=RTOL, atol=ATOL,
            err_msg=f"{case.name}: torch float32 vs numpy float64 mismatch in {n}")


# --------------------------------------------------------------------------
# Demo trace: a tiny 2-layer MLP trained with AdamW on a toy regression task
# --------------------------------------------------------------------------

DEMO = Case("demo_adamw", "adamw", dict(lr=1e-2, weight_decay=1e-2))
DEMO_STEPS = 30


def make_demo():
    torch.manual_seed(1234)
    g = torch.Generator().manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    names = {"0.weight": "fc1.weight", "0.bias": "fc1.bias",
             "2.weight": "fc2.weight", "2.bias": "fc2.bias"}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() > 1 else 0.1))
    x = torch.randn(64, 16, generator=g)
    w_true = torch.randn(16, 4, generator=g)
    y = torch.tanh(x @ w_true)
    params0 = {names[n]: p.detach().clone().contiguous() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), foreach=False, fused=False,
                            **full_hparams(DEMO))
    grads = []
    losses = []
    for _ in range(DEMO_STEPS):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({names[n]: p.grad.detach().clone().contiguous()
                      for n, p in model.named_parameters()})
        opt.step()
    assert losses[-1] < losses[0], "demo training did not reduce the loss"
    final = {names[n]: p.detach().clone().contiguous() for n, p in model.named_parameters()}
    # The optimizer step only sees params + grads, so replaying the recorded
    # grads through a fresh optimizer must reproduce the training run exactly.
    replay = run_torch(DEMO, params0, grads)
    for n in final:
        assert torch.equal(final[n], replay[n]), n
    return params0, grads, final


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------

def metadata(case: Case, steps: int) -> dict:
    return {
        "steps": str(steps),
        "optimizer": case.optimizer,
        "set": " ".join(set_args(case)),
        "case": case.name,
        "torch_version": torch.__version__,
        "generator": GENERATOR,
    }


def canonicalize_header(path: str) -> None:
    """Rewrite the safetensors JSON header of `path` in a canonical order.

    safetensors keeps `__metadata__` in a Rust HashMap, so the key order of the
    metadata object (and hence the file bytes) changes from run to run. The
    tensor data section is already deterministic; only the header is
    re-serialised here: `__metadata__` first with sorted keys, then the tensor
    entries in data-offset order, compact JSON, space-padded to 8 bytes like
    safetensors itself does. Data offsets are relative to the data section, so
    they stay valid.
    """
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    meta = header.pop("__metadata__", None)
    ordered = {}
    if meta is not None:
        ordered["__metadata__"] = {k: meta[k] for k in sorted(meta)}
    for name in sorted(header, key=lambda k: (header[k]["data_offsets"][0], k)):
        ordered[name] = header[name]
    text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def write_case(case: Case, params0, grads, final):
    meta = metadata(case, len(grads))
    trace = {}
    for n, t in params0.items():
        trace[f"param.{n}"] = t.contiguous()
    for k, step in enumerate(grads):
        for n, t in step.items():
            trace[f"grad.{k}.{n}"] = t.contiguous()
    expected = {f"param.{n}": t.contiguous() for n, t in final.items()}
    for d in (trace, expected):
        for t in d.values():
            assert t.dtype == torch.float32
    tpath = os.path.join(TRACE_DIR, f"{case.name}.trace.safetensors")
    epath = os.path.join(TRACE_DIR, f"{case.name}.expected.safetensors")
    save_file(trace, tpath, metadata=meta)
    save_file(expected, epath, metadata=meta)
    # Round-trip check of the canonicalised files with safetensors itself.
    for path, tensors in ((tpath, trace), (epath, expected)):
        canonicalize_header(path)
        with safe_open(path, framework="pt") as f:
            assert f.metadata() == meta, path
            assert sorted(f.keys()) == sorted(tensors), path
            for n in f.keys():
                assert torch.equal(f.get_tensor(n), tensors[n]), (path, n)
    return tpath, epath


def main() -> int:
    os.makedirs(TRACE_DIR, exist_ok=True)
    torch.manual_seed(0)
    lines = [
        "# Golden optimizer traces generated by tests/reference/make_traces.py",
        f"# (torch {torch.__version__}). Do not edit by hand; re-run the script.",
        "# <case> <optimizer> [--set KEY=VALUE]...",
        "# Trace: traces/<case>.trace.safetensors  Expected: traces/<case>.expected.safetensors",
    ]
    for i, case in enumerate(CASES):
        params0, grads = make_data(seed=1000 + i)
        final = run_torch(case, params0, grads)
        check_against_numpy(case, params0, grads, final)
        write_case(case, params0, grads, final)
        lines.append(" ".join([case.name, case.optimizer] +
                              [f"--set {s}" for s in set_args(case)]))

    params0, grads, final = make_demo()
    check_against_numpy(DEMO, params0, grads, final)
    write_case(DEMO, params0, grads, final)
    lines.append(" ".join([DEMO.name, DEMO.optimizer] +
                          [f"--set {s}" for s in set_args(DEMO)]))

    with open(CASES_TXT, "w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(lines) + "\n")

    total = 0
    for fn in sorted(os.listdir(TRACE_DIR)):
        size = os.path.getsize(os.path.join(TRACE_DIR, fn))
        total += size
        print(f"{size:9d}  traces/{fn}")
    print(f"{total:9d}  total")
    assert total < 3 * 1024 * 1024, "traces exceed the ~3 MB budget"
    return 0


if __name__ == "__main__":
    sys.exit(main())
