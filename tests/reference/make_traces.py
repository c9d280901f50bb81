#!/usr/bin/env python3
"""Generate the golden optimizer traces in tests/reference/traces/ from PyTorch.

Usage (from anywhere):
    pip install torch safetensors numpy
    pip install --no-deps torch-optimizer pytorch-ranger came-pytorch
    pip install transformers
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

The layer-wise optimizers (lamb, adafactor, came) come from their reference
Python packages: torch_optimizer.Lamb (torch-optimizer), transformers'
Adafactor (transformers.optimization) and came_pytorch.CAME (came-pytorch).
Their traces run LW_STEPS steps over their own parameter set (LW_PARAM_SPECS)
and carry an extra metadata entry "reference" naming the package and version.

As an independent check of the references themselves (guarding against
misuse of the torch API), every case is also replayed by a float64 numpy
re-implementation and must agree with the torch float32 result to rtol 1e-5
(atol 1e-6); the AdamW default case is the one the brief requires, the rest
are checked the same way because it costs nothing. The layer-wise cases are
checked after every step, not only at the end, and each is also replayed with
deliberately wrong statistics (a column mean taken as a sum, a missing row
normalisation, CAME's two factored averages merged, a Lamb trust ratio without
the square root or over the whole model, ...): the script asserts that those
miss the expected result by far more than the tolerance and prints the margins.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
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
    optimizer: str  # sgd | adam | adamw | lion | lamb | adafactor | came
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
    # The reference packages' constructor defaults (see README.md).
    "lamb": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                 clamp_value=10.0, adam=False, debias=False),
    "adafactor": dict(lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8,
                      beta1=None, weight_decay=0.0, scale_parameter=True,
                      relative_step=True, warmup_init=False),
    "came": dict(eps=(1e-30, 1e-16), clip_threshold=1.0, betas=(0.9, 0.999, 0.9999),
                 weight_decay=0.0),  # lr has no usable default (None fails its assert)
}
# Numeric hyper-parameters always spelled out in cases.txt / metadata. For the
# layer-wise optimizers every constructor argument is written, booleans
# (true/false) and None included, in constructor order.
EXPLICIT = {
    "sgd": ["lr", "momentum", "dampening", "weight_decay"],
    "adam": ["lr", "betas", "eps", "weight_decay"],
    "adamw": ["lr", "betas", "eps", "weight_decay"],
    "lion": ["lr", "betas", "weight_decay"],
    "lamb": ["lr", "betas", "eps", "weight_decay", "clamp_value", "adam", "debias"],
    "adafactor": ["lr", "eps", "clip_threshold", "decay_rate", "beta1", "weight_decay",
                  "scale_parameter", "relative_step", "warmup_init"],
    "came": ["lr", "eps", "clip_threshold", "betas", "weight_decay"],
}
ORDER = ["lr", "betas", "momentum", "dampening", "eps", "weight_decay",
         "nesterov", "amsgrad", "maximize"]
# Constructor order for the layer-wise optimizers (all keys explicit).
ORDERS = {opt: EXPLICIT[opt] for opt in ("lamb", "adafactor", "came")}


def full_hparams(case: Case) -> dict:
    hp = dict(DEFAULTS[case.optimizer])
    hp.update(case.hparams)
    return hp


def fmt_value(v) -> str:
    if v is None:
        return "None"
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
    for k in ORDERS.get(case.optimizer, ORDER):
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
# Layer-wise optimizers (Lamb, Adafactor, CAME): their own parameter set
# --------------------------------------------------------------------------

LW_STEPS = 60
# (name, shape, grad scale). Small on purpose (60 steps x 11 cases must stay
# around 2 MB), yet it covers what the factored statistics need:
#   [9,29]   261 elements > one 256-element block; row 8 (elements 232..260)
#            straddles the block boundary and every column spans both blocks;
#            rows != cols.
#   [3,4,5]  3-D: transformers' Adafactor and CAME factor the last two dims,
#            batched over the first (row normalisation is per slice).
#   [7,5]    rows > cols; all-zero gradient on LW_ZERO_GRAD steps (factored
#            path with a zero gradient, including the first step).
#   [3]      vector; all-zero gradient on the same steps as the SGD/Adam set.
#   [257]    vector over two blocks (the last one holds 1 element).
#   [1]      one-element tensor (RMS = |x|, unfactored).
LW_PARAM_SPECS = [
    ("embed.weight", (9, 29), 1e-2),
    ("conv.weight", (3, 4, 5), 10.0),
    ("layer0.weight", (7, 5), 1.0),
    ("layer0.bias", (3,), 0.1),
    ("norm.weight", (257,), 1e-3),
    ("head.bias", (1,), 3.0),
]
LW_ZERO_GRAD = {
    "layer0.bias": {0, 8, 9, 10, 11, 12},
    "layer0.weight": {0, 40, 41, 42},
}


def make_lw_data(seed: int):
    """Params ~ N(0, 1); grads ~ N(0, 1) * scale * a fixed per-tensor profile.

    The profile of an n-D tensor is the outer product of one log-uniform factor
    in [0.1, 10] per index of every dimension, so rows, columns and 3-D slices
    have clearly different gradient magnitudes: a factored second moment with
    a wrong row or column statistic (or a row normalisation over the wrong
    extent) then gives visibly wrong updates instead of a uniform scale that
    the RMS clipping could hide. The profile is formed in float64 (numpy; torch's
    vectorised pow differs by an ulp between AVX2 and AVX-512) and rounded to
    float32 once; the float32 products are what the trace stores.
    """
    g = torch.Generator().manual_seed(seed)
    params, profile = {}, {}
    for name, shape, _ in LW_PARAM_SPECS:
        params[name] = torch.randn(shape, generator=g, dtype=torch.float32)
    for name, shape, _ in LW_PARAM_SPECS:
        prof = np.ones(shape, dtype=np.float64)
        if len(shape) >= 2:
            for d, size in enumerate(shape):
                u = torch.rand(size, generator=g, dtype=torch.float32).numpy().astype(np.float64)
                view = [1] * len(shape)
                view[d] = size
                prof = prof * np.power(10.0, 2.0 * u - 1.0).reshape(view)
        profile[name] = torch.from_numpy(prof.astype(np.float32))
    grads = []
    for k in range(LW_STEPS):
        step = {}
        for name, shape, scale in LW_PARAM_SPECS:
            t = torch.randn(shape, generator=g, dtype=torch.float32) * profile[name] * scale
            if k in LW_ZERO_GRAD.get(name, ()):
                t = torch.zeros(shape, dtype=torch.float32)
            step[name] = t.contiguous()
        grads.append(step)
    return params, grads


# Reference packages (imported lazily: the SGD/Adam/Lion cases need only torch).
LW_REFERENCE = {
    "lamb": ("torch-optimizer", "torch_optimizer.Lamb"),
    "adafactor": ("transformers", "transformers.optimization.Adafactor"),
    "came": ("came-pytorch", "came_pytorch.CAME"),
}

# lr / eps are chosen so that the 60 steps move the params by a visible amount
# (a wrong statistic then misses the tolerance by orders of magnitude).
LW_CASES = [
    Case("lamb_default", "lamb", dict(lr=1e-3)),
    Case("lamb_wd_debias", "lamb", dict(lr=1e-2, weight_decay=0.01, debias=True)),
    # clamp_value=1: the clamp min(||p||, 1) is active for every tensor but
    # head.bias ([1], |p| < 1); with the default 10 it is active for the two
    # tensors with ||p|| ~ 16 ([9,29], [257]).
    Case("lamb_clamp", "lamb", dict(lr=1e-2, clamp_value=1.0)),
    Case("lamb_adam", "lamb", dict(lr=1e-3, adam=True)),
    # lr=None: relative step min(1e-2, 1/sqrt(t)) times max(eps[1], RMS(p)).
    Case("adafactor_default", "adafactor", dict()),
    Case("adafactor_warmup", "adafactor", dict(warmup_init=True)),
    Case("adafactor_lr_beta1", "adafactor",
         dict(lr=1e-2, relative_step=False, scale_parameter=False, beta1=0.9,
              weight_decay=0.01)),
    # clip_threshold=0.1: the update RMS is ~1, so the clipping is active on
    # every step; scale_parameter=True with an external lr (the fourth
    # combination of the two lr flags).
    Case("adafactor_clip", "adafactor",
         dict(lr=0.05, clip_threshold=0.1, relative_step=False, scale_parameter=True)),
    # 2e-4: the value came-pytorch's README uses.
    Case("came_default", "came", dict(lr=2e-4)),
    Case("came_wd", "came", dict(lr=1e-3, weight_decay=0.01)),
    Case("came_clip", "came", dict(lr=1e-3, clip_threshold=0.1)),
]


def reference_version(optimizer: str) -> str:
    dist, cls = LW_REFERENCE[optimizer]
    return f"{cls} ({dist} {importlib.metadata.version(dist)})"


def make_lw_optimizer(case: Case, plist):
    hp = full_hparams(case)
    if case.optimizer == "lamb":
        import torch_optimizer
        return torch_optimizer.Lamb(plist, **hp)
    if case.optimizer == "adafactor":
        from transformers.optimization import Adafactor
        return Adafactor(plist, **hp)
    if case.optimizer == "came":
        from came_pytorch import CAME
        return CAME(plist, **hp)
    raise ValueError(case.optimizer)


def run_reference_lw(case: Case, params0, grads):
    """The reference package in float32 on CPU; the params after every step."""
    names = list(params0)
    plist = [torch.nn.Parameter(params0[n].clone()) for n in names]
    opt = make_lw_optimizer(case, plist)
    history = []
    for step in grads:
        for p, name in zip(plist, names):
            p.grad = step[name].clone()  # never None: zero grads still step
        opt.step()
        history.append({n: p.detach().clone().contiguous() for n, p in zip(names, plist)})
    return history


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
# Independent numpy re-implementations of Lamb, Adafactor and CAME
# --------------------------------------------------------------------------
#
# Written from the algorithms (the papers plus the semantics listed in
# README.md), not from the packages' code. `dtype` is float64 for the check
# (every scalar and array in double) or float32 for a single-precision port
# (arrays, norms and means in float32), which shows how much of the tolerance
# such a port uses. `coef` says how a float32 port forms the coefficients
# 1 - beta: "float" rounds beta to float32 and subtracts in float32 (what
# `1.0f - beta` does in C++), "double" subtracts in double and rounds the
# result (what PyTorch's `add_(x, alpha=1 - beta)` does). `bug` selects a
# deliberately wrong variant for the sensitivity check.

LW_BUGS = {
    "lamb": {
        "sumsq": "trust ratio from sums of squares (no sqrt)",
        "global": "trust ratio from whole-model norms, not per tensor",
        "noclamp": "weight norm not clamped to clamp_value",
        "nodebias": "debias ignored",
        "noadam": "adam=true ignored (trust ratio still applied)",
    },
    "adafactor": {
        "colsum": "column statistic a sum over rows, not a mean",
        "norownorm": "row statistic not divided by its mean",
        "slicenorm": "3-D: row statistic normalised over the whole tensor, not per slice",
        "noclip": "no RMS clipping of the update",
        "rowsum": "row statistic a sum over columns (cancelled by the row normalisation)",
    },
    "came": {
        "colsum": "column statistic a sum over rows, not a mean",
        "norownorm": "row statistic not divided by its mean",
        "slicenorm": "3-D: row statistic normalised over the whole tensor, not per slice",
        "merged": "one factored average: confidence from the squared-gradient statistic",
        "res_beta2": "instability averaged with beta2 instead of beta3",
        "vecconf": "vectors also divided by sqrt(EMA of the instability)",
        "noclip": "no RMS clipping of the update",
    },
}
# Variants every family's traces must catch (in every case of the family where
# the variant changes anything: with adam=true Lamb has no trust ratio).
LW_REQUIRED_BUGS = {
    "lamb": ["sumsq", "global"],
    "adafactor": ["colsum", "norownorm"],
    "came": ["colsum", "norownorm", "merged"],
}
SENSITIVITY_MIN = 100.0  # a wrong variant must miss by > 100x the tolerance
# Pairs where a required variant provably changes nothing: in adafactor_clip the
# update is clipped on every step, and a column sum instead of a mean only
# scales each tensor's update uniformly (by 1/sqrt(rows)), which the clipping
# to RMS = clip_threshold undoes. The other Adafactor cases catch it.
LW_MASKED = {("adafactor_clip", "colsum")}
# Variants that are not bugs in effect, printed for information: the row
# statistic only enters through row / mean(row), so any uniform scale cancels.
LW_INVARIANT = {"rowsum"}


def _rms(x):
    return np.sqrt(np.mean(x * x))


def _norm(x):
    return np.sqrt(np.sum(x * x))


def _factored_rsqrt(row, col, dt, bug=None):
    """rsqrt of the rank-1 estimate row_i * col_j / mean_i(row), per leading slice.

    row: shape[:-1] (the mean of a statistic over the last dim), col: shape[:-2]
    + shape[-1:] (the mean over the second-to-last dim).
    """
    if bug == "norownorm":
        r = row
    elif bug == "slicenorm":
        r = row / np.mean(row)
    else:
        r = row / np.mean(row, axis=-1, keepdims=True)
    return (dt(1) / np.sqrt(r))[..., :, None] * (dt(1) / np.sqrt(col))[..., None, :]


def _row_col(x, bug=None):
    row = np.sum(x, axis=-1) if bug == "rowsum" else np.mean(x, axis=-1)
    col = np.sum(x, axis=-2) if bug == "colsum" else np.mean(x, axis=-2)
    return row, col


def _one_minus(beta, dt, coef):
    return dt(1) - dt(beta) if coef == "float" else dt(1 - beta)


def _lamb_step(hp, p, g, st, t, dt, bug, coef):
    one = dt(1)
    b1, b2 = dt(hp["betas"][0]), dt(hp["betas"][1])
    c1, c2 = _one_minus(hp["betas"][0], dt, coef), _one_minus(hp["betas"][1], dt, coef)
    eps, wd, lr = dt(hp["eps"]), dt(hp["weight_decay"]), dt(hp["lr"])
    steps = {}
    for n in p:
        s = st[n]
        m = s.get("m", np.zeros_like(p[n]))
        v = s.get("v", np.zeros_like(p[n]))
        s["m"] = m = b1 * m + c1 * g[n]
        s["v"] = v = b2 * v + c2 * g[n] * g[n]
        a = m / (np.sqrt(v) + eps)
        if hp["weight_decay"] != 0:
            a = a + wd * p[n]
        steps[n] = a
    if hp["debias"] and bug != "nodebias":
        if coef == "float":
            tt = dt(t)
            step_size = lr * (np.sqrt(one - b2 ** tt) / (one - b1 ** tt))
        else:  # in double, rounded once
            b1d, b2d = hp["betas"]
            step_size = dt(hp["lr"] * math.sqrt(1 - b2d ** t) / (1 - b1d ** t))
    else:
        step_size = lr
    clamp = dt(hp["clamp_value"])
    if bug == "global":
        gw = np.sqrt(sum(np.sum(x * x) for x in p.values()))
        ga = np.sqrt(sum(np.sum(x * x) for x in steps.values()))
    for n in p:
        a = steps[n]
        if bug == "sumsq":
            w_norm, a_norm = np.sum(p[n] * p[n]), np.sum(a * a)
        elif bug == "global":
            w_norm, a_norm = gw, ga
        else:
            w_norm, a_norm = _norm(p[n]), _norm(a)
        if bug != "noclamp":
            w_norm = min(w_norm, clamp)  # clamp(0, clamp_value); norms are >= 0
        ratio = one if (w_norm == 0 or a_norm == 0) else w_norm / a_norm
        if hp["adam"] and bug != "noadam":
            ratio = one
        p[n] = p[n] - (step_size * ratio) * a


def _adafactor_step(hp, p, g, s, t, dt, bug, coef):
    one = dt(1)
    eps1, eps2 = dt(hp["eps"][0]), dt(hp["eps"][1])
    # Per-tensor step size: relative step min(1e-2 | 1e-6 t, 1/sqrt(t)) or the
    # external lr, times max(eps[1], RMS(p before the step)) if scale_parameter.
    if hp["relative_step"]:
        base = dt(1e-6) * dt(t) if hp["warmup_init"] else dt(1e-2)
        rel = min(base, one / np.sqrt(dt(t)))
    else:
        rel = dt(hp["lr"])
    scale = max(eps2, _rms(p)) if hp["scale_parameter"] else one
    alpha = scale * rel
    if coef == "float":
        beta2t = one - dt(t) ** dt(hp["decay_rate"])  # 0 on the first step
        c2 = one - beta2t
    else:
        beta2t_d = 1.0 - math.pow(t, hp["decay_rate"])
        beta2t, c2 = dt(beta2t_d), dt(1.0 - beta2t_d)
    sq = g * g + eps1
    if g.ndim >= 2:
        row, col = _row_col(sq, bug)
        s["row"] = beta2t * s.get("row", np.zeros_like(row)) + c2 * row
        s["col"] = beta2t * s.get("col", np.zeros_like(col)) + c2 * col
        u = g * _factored_rsqrt(s["row"], s["col"], dt, bug)
    else:
        s["v"] = beta2t * s.get("v", np.zeros_like(g)) + c2 * sq
        u = g / np.sqrt(s["v"])
    if bug != "noclip":
        u = u / max(_rms(u) / dt(hp["clip_threshold"]), one)
    u = alpha * u
    if hp["beta1"] is not None:  # the average is over lr-scaled updates
        b1 = dt(hp["beta1"])
        s["m"] = b1 * s.get("m", np.zeros_like(g)) + _one_minus(hp["beta1"], dt, coef) * u
        u = s["m"]
    if hp["weight_decay"] != 0:
        p = p - (dt(hp["weight_decay"]) * alpha) * p
    return p - u


def _came_step(hp, p, g, s, t, dt, bug, coef):
    one = dt(1)
    eps1, eps2 = dt(hp["eps"][0]), dt(hp["eps"][1])
    b1, b2, b3 = (dt(b) for b in hp["betas"])
    c1, c2, c3 = (_one_minus(b, dt, coef) for b in hp["betas"])
    lr = dt(hp["lr"])
    sq = g * g + eps1
    factored = g.ndim >= 2
    if factored:
        row, col = _row_col(sq, bug)
        s["row"] = b2 * s.get("row", np.zeros_like(row)) + c2 * row
        s["col"] = b2 * s.get("col", np.zeros_like(col)) + c2 * col
        u = g * _factored_rsqrt(s["row"], s["col"], dt, bug)
    else:
        s["v"] = b2 * s.get("v", np.zeros_like(g)) + c2 * sq
        u = g / np.sqrt(s["v"])
    if bug != "noclip":
        u = u / max(_rms(u) / dt(hp["clip_threshold"]), one)
    s["m"] = m = b1 * s.get("m", np.zeros_like(g)) + c1 * u
    # Instability of the update around its average, factored like the second
    # moment but averaged with beta3; vectors use the average m alone.
    res = (u - m) ** 2 + eps2
    b_res, c_res = (b2, c2) if bug == "res_beta2" else (b3, c3)
    if factored:
        if bug == "merged":
            conf = _factored_rsqrt(s["row"], s["col"], dt)
        else:
            rrow, rcol = _row_col(res, bug)
            s["rrow"] = b_res * s.get("rrow", np.zeros_like(rrow)) + c_res * rrow
            s["rcol"] = b_res * s.get("rcol", np.zeros_like(rcol)) + c_res * rcol
            conf = _factored_rsqrt(s["rrow"], s["rcol"], dt, bug)
        upd = m * conf
    elif bug == "vecconf":
        s["r"] = b_res * s.get("r", np.zeros_like(g)) + c_res * res
        upd = m / np.sqrt(s["r"])
    else:
        upd = m
    if hp["weight_decay"] != 0:
        p = p - (dt(hp["weight_decay"]) * lr) * p
    return p - lr * upd


def run_numpy_lw(case: Case, params0, grads, dtype=np.float64, bug=None, coef="double"):
    """The params after every step, in `dtype`."""
    hp = full_hparams(case)
    p = {n: t.numpy().astype(dtype) for n, t in params0.items()}
    st = {n: {} for n in p}
    history = []
    for t, step in enumerate(grads, start=1):
        g = {n: step[n].numpy().astype(dtype) for n in p}
        if case.optimizer == "lamb":
            _lamb_step(hp, p, g, st, t, dtype, bug, coef)
        else:
            fn = _adafactor_step if case.optimizer == "adafactor" else _came_step
            for n in p:
                p[n] = fn(hp, p[n], g[n], st[n], t, dtype, bug, coef)
        for n in p:
            assert p[n].dtype == dtype, (case.name, n, p[n].dtype)
        history.append({n: x.copy() for n, x in p.items()})
    return history


def tolerance_ratio(got: dict, expected: dict):
    """max |got - e| / (atol + rtol |e|) (as compare-safetensors reports it) and
    the max relative difference |got - e| / |e|, over all tensors."""
    worst = worst_rel = 0.0
    for n, e in expected.items():
        e = e.numpy().astype(np.float64) if isinstance(e, torch.Tensor) else e
        a = np.asarray(got[n], dtype=np.float64)
        err = np.abs(a - e)
        worst = max(worst, float(np.max(err / (ATOL + RTOL * np.abs(e)))))
        worst_rel = max(worst_rel, float(np.max(err / np.maximum(np.abs(e), 1e-300))))
    return worst, worst_rel


def check_lw(case: Case, params0, grads, history):
    """numpy float64 vs the reference after every step; the float32 port and the
    wrong variants at the end. Returns the report lines and the margins."""
    ref64 = run_numpy_lw(case, params0, grads)
    worst64 = 0.0
    for k, (got, ref) in enumerate(zip(history, ref64)):
        for n, t in got.items():
            np.testing.assert_allclose(
                t.numpy().astype(np.float64), ref[n], rtol=RTOL, atol=ATOL,
                err_msg=f"{case.name}: reference float32 vs numpy float64 mismatch "
                        f"in {n} after step {k + 1}")
        worst64 = max(worst64, tolerance_ratio(ref, got)[0])
    final = history[-1]
    worst32 = {coef: tolerance_ratio(run_numpy_lw(case, params0, grads, np.float32,
                                                  coef=coef)[-1], final)[0]
               for coef in ("double", "float")}
    moved = [float(np.linalg.norm(final[n].numpy() - params0[n].numpy())
                   / np.linalg.norm(params0[n].numpy())) for n in final]
    lines = [f"  {case.name}: tolerance used by numpy float64 {worst64:.3f} (worst step), "
             f"float32 port {worst32['double']:.3f} (1-beta in double) / "
             f"{worst32['float']:.3f} (1-beta in float); "
             f"||p_end - p_0|| / ||p_0|| from {min(moved):.2g} to {max(moved):.2g}"]
    margins = {}
    hp = full_hparams(case)
    for bug, what in LW_BUGS[case.optimizer].items():
        if bug == "nodebias" and not hp["debias"]:
            continue
        if bug == "noadam" and not hp["adam"]:
            continue
        if bug in ("sumsq", "global", "noclamp") and hp["adam"]:
            continue  # no trust ratio at all
        wrong = run_numpy_lw(case, params0, grads, bug=bug)[-1]
        ratio, rel = tolerance_ratio(wrong, final)
        margins[bug] = ratio
        lines.append(f"    {bug:10s} {ratio:12.4g} x tol  (max rel diff {rel:.3g})  {what}")
    return lines, margins


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
    meta = {
        "steps": str(steps),
        "optimizer": case.optimizer,
        "set": " ".join(set_args(case)),
        "case": case.name,
        "torch_version": torch.__version__,
        "generator": GENERATOR,
    }
    if case.optimizer in LW_REFERENCE:
        meta["reference"] = reference_version(case.optimizer)
    return meta


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


def save_checked(tensors: dict, path: str, meta: dict) -> None:
    """Writes float32 `tensors` with `meta`, canonicalises the header, and reads the file
    back with safetensors itself to check it."""
    for t in tensors.values():
        assert t.dtype == torch.float32
    save_file(tensors, path, metadata=meta)
    canonicalize_header(path)
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == meta, path
        assert sorted(f.keys()) == sorted(tensors), path
        for n in f.keys():
            assert torch.equal(f.get_tensor(n), tensors[n]), (path, n)


def write_case(case: Case, params0, grads, final):
    meta = metadata(case, len(grads))
    trace = {}
    for n, t in params0.items():
        trace[f"param.{n}"] = t.contiguous()
    for k, step in enumerate(grads):
        for n, t in step.items():
            trace[f"grad.{k}.{n}"] = t.contiguous()
    expected = {f"param.{n}": t.contiguous() for n, t in final.items()}
    tpath = os.path.join(TRACE_DIR, f"{case.name}.trace.safetensors")
    epath = os.path.join(TRACE_DIR, f"{case.name}.expected.safetensors")
    save_checked(trace, tpath, meta)
    save_checked(expected, epath, meta)
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

    lines.append("# Layer-wise optimizers, " + str(LW_STEPS) + " steps each, from "
                 + ", ".join(reference_version(o) for o in LW_REFERENCE) + ".")
    print("Layer-wise cases: agreement with numpy (fraction of the tolerance used) and")
    print("sensitivity (wrong variant vs expected, in multiples of the tolerance):")
    family_margins = {}
    for i, case in enumerate(LW_CASES):
        params0, grads = make_lw_data(seed=2000 + i)
        history = run_reference_lw(case, params0, grads)
        report, margins = check_lw(case, params0, grads, history)
        print("\n".join(report))
        for bug in LW_REQUIRED_BUGS[case.optimizer]:
            if bug not in margins or (case.name, bug) in LW_MASKED:
                continue
            assert margins[bug] > SENSITIVITY_MIN, (
                f"{case.name}: the trace would not catch '{bug}' "
                f"({margins[bug]:.3g} x tolerance)")
        for bug, m in margins.items():
            if (case.name, bug) not in LW_MASKED:
                family_margins.setdefault((case.optimizer, bug), []).append(m)
        write_case(case, params0, grads, history[-1])
        lines.append(" ".join([case.name, case.optimizer] +
                              [f"--set {s}" for s in set_args(case)]))
    print("Smallest margin per family and variant (over its cases; "
          + ", ".join(f"{c}/{b}" for c, b in sorted(LW_MASKED)) + " masked, left out):")
    for (opt, bug), ms in family_margins.items():
        note = "  (invariant, not a bug)" if bug in LW_INVARIANT else ""
        print(f"  {opt:9s} {bug:10s} {min(ms):12.4g} x tol  (largest {max(ms):.4g}){note}")

    with open(CASES_TXT, "w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(lines) + "\n")

    total = 0
    for fn in sorted(os.listdir(TRACE_DIR)):
        if fn.startswith("galore_"):  # make_galore_traces.py's, with their own budget
            continue
        size = os.path.getsize(os.path.join(TRACE_DIR, fn))
        total += size
        print(f"{size:9d}  traces/{fn}")
    print(f"{total:9d}  total")
    assert total < 4 * 1024 * 1024, "traces exceed the ~4 MB budget"
    return 0


if __name__ == "__main__":
    sys.exit(main())
