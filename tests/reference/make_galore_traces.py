#!/usr/bin/env python3
"""Generate the golden GaLore-AdamW traces in tests/reference/traces/ from galore-torch.

Usage (from anywhere):
    pip install torch safetensors numpy
    pip install --no-deps galore-torch==1.0   # imports transformers.utils.versions
    pip install transformers
    python3 tests/reference/make_galore_traces.py

The reference is galore_torch.GaLoreAdamW (galore-torch 1.0) in float32 on CPU. Every
case runs STEPS steps over one parameter set in two groups:

  * the GaLore group (`rank`, `update_proj_gap`, `scale`, `proj_type`): the 2-D tensors
    whose names do not end in ".bias";
  * the plain group (no `rank`: galore-torch's AdamW): every 1-D tensor and every tensor
    whose name ends in ".bias" (here also one 2-D tensor, `rel_pos.bias`).

Both groups share lr, betas, eps, weight_decay and correct_bias (galore-torch's
constructor defaults, overridden per case). Files, in make_traces.py's format:

    traces/<case>.trace.safetensors     F32 param.<name>, grad.<k>.<name>, __metadata__
                                        {steps, optimizer, set, case, torch_version,
                                        generator, reference, galore_params}
    traces/<case>.expected.safetensors  F32 param.<name> after all steps (same metadata)
    traces/galore_svd_reference.safetensors
                                        torch.linalg.svd(A, full_matrices=False) of the
                                        GaLore gradients at the refresh steps (the same
                                        in every case) and of a few random matrices:
                                        a.<key>, u.<key>, s.<key>, vh.<key>
and rewrites galore_cases.txt (one `<case> galore_adamw --set KEY=VALUE ...` per line).
`galore_params` (metadata) lists the GaLore group's tensors, comma separated.

Checks, as make_traces.py does for the other optimizers: an independent float64 numpy
re-implementation (written from the algorithm; it takes the projection matrices that
galore-torch computed at each refresh, since singular-vector signs are LAPACK's choice)
must agree with the reference after every step (rtol 1e-5, atol 1e-6), and deliberately
wrong variants (refresh one step late, states reset at a refresh, scale ignored, one
singular vector's sign flipped at a later refresh, ...) must miss the expected params by
far more than the tolerance; the margins are printed.

make_galore_one_refresh.py adds, from the traces written here, each case with a single
refresh (expectations that do not depend on singular-vector signs); run it after this.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import sys
import warnings

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_traces import ATOL, RTOL, Case, fmt_value, save_checked  # noqa: E402

TRACE_DIR = os.path.join(HERE, "traces")
CASES_TXT = os.path.join(HERE, "galore_cases.txt")
SVD_FILE = os.path.join(TRACE_DIR, "galore_svd_reference.safetensors")
GENERATOR = "tests/reference/make_galore_traces.py"
REFERENCE = "galore_torch.GaLoreAdamW"
DIST = "galore-torch"

STEPS = 60
GAP = 20  # refreshes before steps 0, 20 and 40 (iter = steps already taken)
RANK = 4
SEED = 3000
MIN_GAP = 0.05  # relative gap between the leading rank+1 singular values at refreshes
SENSITIVITY_MIN = 100.0

# (name, shape, grad scale). 2-D tensors not named *.bias form the GaLore group; the
# shapes cover m > n, m < n, m == n and an odd m > n. Small on purpose: 60 steps of
# them make a trace of ~150 kB.
PARAM_SPECS = [
    ("layers.0.attn.weight", (14, 10), 1e-2),
    ("layers.0.mlp.weight", (6, 18), 3e-3),
    ("layers.1.attn.weight", (10, 10), 1e-2),
    ("layers.1.mlp.weight", (11, 7), 3e-2),
    ("norm.weight", (7,), 1e-2),
    ("head.bias", (1,), 0.1),
    ("rel_pos.bias", (3, 5), 1e-2),
]
# All-zero gradients (real zero tensors; the step still runs), never on a refresh step
# of a GaLore tensor (the SVD of a zero matrix is arbitrary).
ZERO_GRAD = {"layers.1.attn.weight": {7, 8}, "head.bias": {0, 8, 9, 10}}


def in_galore_group(name: str, shape) -> bool:
    return len(shape) == 2 and not name.endswith(".bias")


GALORE_NAMES = [n for n, s, _ in PARAM_SPECS if in_galore_group(n, s)]

DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=True,
                rank=RANK, update_proj_gap=GAP, scale=1.0, proj_type="std")
ORDER = ["lr", "betas", "eps", "weight_decay", "correct_bias", "rank", "update_proj_gap",
         "scale", "proj_type"]

CASES = [
    Case("galore_std", "galore_adamw", dict(lr=1e-2)),
    Case("galore_reverse_std", "galore_adamw", dict(lr=1e-2, proj_type="reverse_std")),
    Case("galore_left", "galore_adamw", dict(lr=1e-2, proj_type="left")),
    Case("galore_right", "galore_adamw", dict(lr=1e-2, proj_type="right")),
    Case("galore_full", "galore_adamw", dict(lr=1e-2, proj_type="full")),
    # GaLore's usual scale 0.25 with decoupled weight decay.
    Case("galore_wd_scale", "galore_adamw", dict(lr=1e-2, weight_decay=0.1, scale=0.25)),
    Case("galore_nobias", "galore_adamw",
         dict(lr=5e-3, betas=(0.9, 0.95), eps=1e-5, correct_bias=False, scale=2.0,
              proj_type="reverse_std")),
]

# Random matrices for the SVD sign study (the shapes of the brief, N(0, 1)).
STUDY_SHAPES = [(48, 32), (24, 64), (40, 40), (33, 17)]


def hparams(case: Case) -> dict:
    hp = dict(DEFAULTS)
    hp.update(case.hparams)
    return hp


def set_args(case: Case) -> list[str]:
    hp = hparams(case)
    out = []
    for k in ORDER:
        v = hp[k]
        if k in ("rank", "update_proj_gap"):
            out.append(f"{k}={int(v)}")
        elif k == "proj_type":
            out.append(f"{k}={v}")
        else:
            out.append(f"{k}={fmt_value(v)}")
    return out


def reference_version() -> str:
    return f"{REFERENCE} ({DIST} {importlib.metadata.version(DIST)})"


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------

def singular_gaps(a: np.ndarray) -> float:
    s = np.linalg.svd(a.astype(np.float64), compute_uv=False)
    k = min(RANK + 1, len(s) - 1)
    return float(min((s[i] - s[i + 1]) / s[i] for i in range(k)))


def make_data(seed: int):
    """Params ~ N(0, 1) / 2. GaLore gradients: a drifting low-rank signal plus noise,
    (A + 0.35 E_t) diag(0.6^i) (B + 0.35 F_t)^T / sqrt(mn) + 0.01 N_t, times the tensor's
    scale, formed in float64 from float32 draws and rounded once; at the refresh steps
    the leading RANK + 1 singular values are at least MIN_GAP apart (relatively), so the
    singular vectors are well defined and any two LAPACKs agree on them up to sign.
    Other tensors: N(0, 1) x scale."""
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=g, dtype=torch.float32) * 0.5
              for n, s, _ in PARAM_SPECS}
    factors = {}
    for n, s, _ in PARAM_SPECS:
        if in_galore_group(n, s):
            q = min(s)
            a = torch.randn(s[0], q, generator=g).numpy().astype(np.float64)
            b = torch.randn(s[1], q, generator=g).numpy().astype(np.float64)
            factors[n] = (a, b, 0.6 ** np.arange(q))
    grads = []
    for k in range(STEPS):
        step = {}
        for n, s, scale in PARAM_SPECS:
            if n in factors:
                a, b, d = factors[n]
                ea = torch.randn(a.shape, generator=g).numpy().astype(np.float64)
                eb = torch.randn(b.shape, generator=g).numpy().astype(np.float64)
                noise = torch.randn(s, generator=g).numpy().astype(np.float64)
                x = ((a + 0.35 * ea) * d) @ (b + 0.35 * eb).T / math.sqrt(s[0] * s[1])
                t = torch.from_numpy(((x + 0.01 * noise) * scale).astype(np.float32))
            else:
                t = torch.randn(s, generator=g, dtype=torch.float32) * scale
            if k in ZERO_GRAD.get(n, ()):
                t = torch.zeros(s, dtype=torch.float32)
            step[n] = t.contiguous()
        grads.append(step)
    worst = min(singular_gaps(grads[k][n].numpy()) for n in factors for k in range(0, STEPS, GAP))
    return params, grads, worst


def find_data():
    for seed in range(SEED, SEED + 100):
        params, grads, worst = make_data(seed)
        if worst >= MIN_GAP:
            return seed, params, grads, worst
    raise RuntimeError("no seed gives well-separated singular values")


# --------------------------------------------------------------------------
# The reference
# --------------------------------------------------------------------------

def run_reference(case: Case, params0, grads):
    """galore-torch in float32; the params after every step and, per GaLore tensor, the
    projection matrix (or [left, right] pair) taken at each refresh step."""
    from galore_torch import GaLoreAdamW
    hp = hparams(case)
    names = list(params0)
    plist = {n: torch.nn.Parameter(params0[n].clone()) for n in names}
    common = {k: hp[k] for k in ("lr", "betas", "eps", "weight_decay", "correct_bias")}
    groups = [
        {"params": [plist[n] for n in names if n not in GALORE_NAMES]},
        {"params": [plist[n] for n in GALORE_NAMES], "rank": hp["rank"],
         "update_proj_gap": hp["update_proj_gap"], "scale": hp["scale"],
         "proj_type": hp["proj_type"]},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # "This implementation of AdamW is deprecated"
        opt = GaLoreAdamW(groups, **common)
    history, orthos = [], {n: {} for n in GALORE_NAMES}
    for k, step in enumerate(grads):
        for n in names:
            plist[n].grad = step[n].clone()
        opt.step()
        history.append({n: p.detach().clone().contiguous() for n, p in plist.items()})
        for n in GALORE_NAMES:
            o = opt.state[plist[n]]["projector"].ortho_matrix
            if k % GAP == 0:
                orthos[n][k] = [x.clone() for x in o] if isinstance(o, list) else o.clone()
    return history, orthos


# --------------------------------------------------------------------------
# Independent float64 re-implementation (and wrong variants)
# --------------------------------------------------------------------------

BUGS = {
    "late_refresh": "refresh when iter % gap == 1 (one step late)",
    "reset_states": "Adam states reset to zero at each refresh",
    "sign_flip": "first singular vector's sign flipped at the refreshes after the first",
    "no_scale": "scale ignored",
    "no_bias_correction": "bias correction ignored",
    "decay_first": "weight decay applied before the update",
}


def side_of(proj_type: str, m: int, n: int) -> str:
    if proj_type == "std":
        return "right" if m >= n else "left"
    if proj_type == "reverse_std":
        return "left" if m >= n else "right"
    return proj_type


def ortho_from_svd(g: np.ndarray, side: str, r: int):
    u, _, vh = np.linalg.svd(g, full_matrices=False)
    return {"left": u[:, :r], "right": vh[:r, :], "full": [u[:, :r], vh[:r, :]]}[side]


def run_numpy(case: Case, params0, grads, orthos, bug=None):
    hp = hparams(case)
    b1, b2 = hp["betas"]
    p = {n: t.numpy().astype(np.float64) for n, t in params0.items()}
    st = {n: {} for n in p}
    history = []
    for k, step in enumerate(grads):
        t = k + 1
        for n in p:
            g = step[n].numpy().astype(np.float64)
            s = st[n]
            galore = n in GALORE_NAMES
            if galore:
                m_, n_ = g.shape
                side = side_of(hp["proj_type"], m_, n_)
                due = (k % GAP == 1) if bug == "late_refresh" else (k % GAP == 0)
                if "ortho" not in s or due:
                    if bug == "late_refresh" and k % GAP != 0:
                        o = ortho_from_svd(g, side, hp["rank"])
                    else:
                        o = orthos[n][k]
                        o = ([x.numpy().astype(np.float64) for x in o] if side == "full"
                             else o.numpy().astype(np.float64))
                    if bug == "sign_flip" and k > 0:
                        if side == "full":
                            o = [o[0].copy(), o[1].copy()]
                            o[0][:, 0] *= -1
                            o[1][0, :] *= -1
                        else:
                            o = o.copy()
                            if side == "left":
                                o[:, 0] *= -1
                            else:
                                o[0, :] *= -1
                    s["ortho"] = o
                    if bug == "reset_states":
                        s.pop("m", None)
                        s.pop("v", None)
                o = s["ortho"]
                x = {"left": lambda: o.T @ g, "right": lambda: g @ o.T,
                     "full": lambda: o[0].T @ g @ o[1].T}[side]()
            else:
                x = g
            s.setdefault("m", np.zeros_like(x))
            s.setdefault("v", np.zeros_like(x))
            s["m"] = b1 * s["m"] + (1 - b1) * x
            s["v"] = b2 * s["v"] + (1 - b2) * x * x
            nrm = s["m"] / (np.sqrt(s["v"]) + hp["eps"])
            step_size = hp["lr"]
            if hp["correct_bias"] and bug != "no_bias_correction":
                step_size = step_size * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
            if galore:
                o = s["ortho"]
                u = {"left": lambda: o @ nrm, "right": lambda: nrm @ o,
                     "full": lambda: o[0] @ nrm @ o[1]}[side]()
                if bug != "no_scale":
                    u = u * hp["scale"]
            else:
                u = nrm
            wd = hp["weight_decay"]
            if bug == "decay_first" and wd > 0:
                p[n] = p[n] - hp["lr"] * wd * p[n]
            p[n] = p[n] - step_size * u
            if bug != "decay_first" and wd > 0:
                p[n] = p[n] - hp["lr"] * wd * p[n]
        history.append({n: x.copy() for n, x in p.items()})
    return history


def tolerance_ratio(got: dict, expected: dict) -> float:
    worst = 0.0
    for n, e in expected.items():
        e = e.numpy().astype(np.float64) if isinstance(e, torch.Tensor) else e
        err = np.abs(np.asarray(got[n], dtype=np.float64) - e)
        worst = max(worst, float(np.max(err / (ATOL + RTOL * np.abs(e)))))
    return worst


def check(case: Case, params0, grads, history, orthos):
    ref = run_numpy(case, params0, grads, orthos)
    worst = 0.0
    for k, (got, want) in enumerate(zip(history, ref)):
        for n, t in got.items():
            np.testing.assert_allclose(
                t.numpy().astype(np.float64), want[n], rtol=RTOL, atol=ATOL,
                err_msg=f"{case.name}: galore-torch vs numpy float64 in {n} after step {k + 1}")
        worst = max(worst, tolerance_ratio(want, got))
    final = history[-1]
    moved = [float(np.linalg.norm(final[n].numpy() - params0[n].numpy())
                   / np.linalg.norm(params0[n].numpy())) for n in final]
    lines = [f"  {case.name}: numpy float64 uses {worst:.3f} of the tolerance (worst step); "
             f"||p_end - p_0|| / ||p_0|| from {min(moved):.2g} to {max(moved):.2g}"]
    hp = hparams(case)
    margins = {}
    for bug, what in BUGS.items():
        if bug == "no_scale" and hp["scale"] == 1.0:
            continue
        if bug == "no_bias_correction" and not hp["correct_bias"]:
            continue
        if bug == "decay_first" and hp["weight_decay"] == 0.0:
            continue
        ratio = tolerance_ratio(run_numpy(case, params0, grads, orthos, bug)[-1], final)
        margins[bug] = ratio
        lines.append(f"    {bug:18s} {ratio:12.4g} x tol  {what}")
    return lines, margins


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------

def metadata(case: Case) -> dict:
    return {
        "steps": str(STEPS),
        "optimizer": case.optimizer,
        "set": " ".join(set_args(case)),
        "case": case.name,
        "torch_version": torch.__version__,
        "generator": GENERATOR,
        "reference": reference_version(),
        "galore_params": ",".join(GALORE_NAMES),
    }


def write_case(case: Case, params0, grads, final) -> None:
    meta = metadata(case)
    trace = {f"param.{n}": t.contiguous() for n, t in params0.items()}
    for k, step in enumerate(grads):
        for n, t in step.items():
            trace[f"grad.{k}.{n}"] = t.contiguous()
    expected = {f"param.{n}": t.contiguous() for n, t in final.items()}
    save_checked(trace, os.path.join(TRACE_DIR, f"{case.name}.trace.safetensors"), meta)
    save_checked(expected, os.path.join(TRACE_DIR, f"{case.name}.expected.safetensors"), meta)


def write_svd_reference(grads) -> None:
    """torch.linalg.svd of every GaLore gradient at a refresh step (key <name>.<step>) and
    of the study matrices (key study_<m>x<n>)."""
    mats = {}
    for n in GALORE_NAMES:
        for k in range(0, STEPS, GAP):
            mats[f"{n}.{k}"] = grads[k][n]
    g = torch.Generator().manual_seed(SEED + 1000)
    for m, n in STUDY_SHAPES:
        mats[f"study_{m}x{n}"] = torch.randn(m, n, generator=g, dtype=torch.float32)
    tensors = {}
    for key, a in mats.items():
        u, s, vh = torch.linalg.svd(a, full_matrices=False)
        tensors[f"a.{key}"] = a.contiguous()
        tensors[f"u.{key}"] = u.contiguous()
        tensors[f"s.{key}"] = s.contiguous()
        tensors[f"vh.{key}"] = vh.contiguous()
    meta = {
        "what": "torch.linalg.svd(a, full_matrices=False) on CPU in float32",
        "torch_version": torch.__version__,
        "lapack": "MKL" if torch.backends.mkl.is_available() else "torch's bundled LAPACK",
        "generator": GENERATOR,
        "refresh_steps": ",".join(str(k) for k in range(0, STEPS, GAP)),
    }
    save_checked(tensors, SVD_FILE, meta)


def main() -> int:
    os.makedirs(TRACE_DIR, exist_ok=True)
    torch.manual_seed(0)
    seed, params0, grads, worst_gap = find_data()
    print(f"data seed {seed}: smallest relative singular-value gap at a refresh {worst_gap:.3f}")
    lines = [
        "# Golden GaLore-AdamW traces generated by tests/reference/make_galore_traces.py",
        f"# ({reference_version()}, torch {torch.__version__}). Do not edit by hand.",
        "# <case> galore_adamw [--set KEY=VALUE]...   Trace: traces/<case>.trace.safetensors",
        "# Two parameter groups, as galore-torch's param_groups list: the GaLore group (the keys",
        "# rank, update_proj_gap, scale, proj_type apply) holds the 2-D tensors whose names do not",
        "# end in '.bias' (metadata 'galore_params' lists them); the plain group holds every 1-D",
        "# tensor and every tensor named '*.bias' (here also the 2-D rel_pos.bias): it is",
        "# galore-torch's AdamW with no projection, no rank and no scale. lr, betas, eps,",
        "# weight_decay and correct_bias apply to both groups.",
    ]
    print(f"Cases ({STEPS} steps, refresh every {GAP}, rank {RANK}): agreement with numpy "
          "float64 and sensitivity (wrong variant vs expected):")
    smallest = {}
    for case in CASES:
        history, orthos = run_reference(case, params0, grads)
        report, margins = check(case, params0, grads, history, orthos)
        print("\n".join(report))
        for bug, m in margins.items():
            smallest[bug] = min(smallest.get(bug, math.inf), m)
            assert m > SENSITIVITY_MIN, f"{case.name}: the trace would not catch {bug} ({m:.3g})"
        write_case(case, params0, grads, history[-1])
        lines.append(" ".join([case.name, case.optimizer] + [f"--set {s}" for s in set_args(case)]))
    print("Smallest margin per variant: " +
          ", ".join(f"{b} {m:.3g}" for b, m in smallest.items()))
    write_svd_reference(grads)
    with open(CASES_TXT, "w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(lines) + "\n")
    total = 0
    for fn in sorted(os.listdir(TRACE_DIR)):
        if fn.startswith("galore_"):
            size = os.path.getsize(os.path.join(TRACE_DIR, fn))
            assert size < 200 * 1024, f"{fn} is {size} bytes (keep each file under 200 kB)"
            total += size
            print(f"{size:9d}  traces/{fn}")
    print(f"{total:9d}  total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
