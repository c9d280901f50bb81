#!/usr/bin/env python3
"""Generate the one-refresh GaLore-AdamW expectations in tests/reference/traces/ from
galore-torch, for comparisons that do not depend on the signs of singular vectors.

Usage (from anywhere; the packages of make_galore_traces.py, and bitsandbytes, which
galore_torch/__init__.py imports):
    pip install torch safetensors numpy transformers bitsandbytes
    pip install --no-deps galore-torch==1.0
    python3 tests/reference/make_galore_one_refresh.py

Why. galore-torch keeps its Adam states across projection refreshes. An SVD fixes each
singular pair (u_i, v_i) only up to a common sign, and two LAPACKs (MKL under torch,
OpenBLAS under distopt) may choose differently at each refresh. When the choice relates to
torch's in the same way at every refresh the run is the same (the states live in the
flipped coordinates from the start); when the relation changes at a later refresh, the
first moment carried over meets the new gradient with the opposite sign and the params
differ by far more than any rounding. So galore_cases.txt's traces (a refresh every 20
steps) cannot compare a matrix whose signs change relation between refreshes: with
OpenBLAS that is both mlp matrices, one of them the only wide one (m < n).

What is sign-invariant: a run whose only refresh is the first step. There the states start
at zero in the projected coordinates, so negating pair i negates row/column i of the
projected gradient, of exp_avg and of exp_avg / (sqrt(exp_avg_sq) + eps) alike, and the
projection back multiplies by the negated vector again: every param is unchanged (exactly:
a negation rounds nowhere).

What it writes. For every case of galore_cases.txt, the committed trace
traces/<case>.trace.safetensors (nothing is regenerated: its params and its STEPS
gradients are read back) is run by galore_torch.GaLoreAdamW with the case's settings but
update_proj_gap = ONE_REFRESH_GAP (> STEPS, so only step 0 refreshes):

    traces/<case>_one_refresh.expected.safetensors   F32 param.<name> after all steps
    galore_one_refresh_cases.txt   <case>_one_refresh <case> galore_adamw --set KEY=VALUE ...
                                   (the second word names the trace)

Checks (asserted; the numbers are printed):
  * the case's settings are those of its line in galore_cases.txt, and of the trace's
    metadata, but update_proj_gap;
  * sign invariance: galore-torch with torch.linalg.svd's pairs 0 and 2 negated gives the
    same params bit for bit, while the same negation at the later refreshes only, with the
    trace's own gap of 20, misses the committed expectation by more than SENSITIVITY_MIN x
    the tolerance (that is why galore_cases.txt's traces skip such matrices);
  * an independent float64 numpy re-implementation, with numpy's own float64 SVD (its own
    signs), agrees with galore-torch after every step (rtol 1e-5, atol 1e-6);
  * deliberately wrong variants miss the expectation by more than SENSITIVITY_MIN x the
    tolerance: the side chosen for a wide (m < n) or a tall (m > n) matrix flipped (std
    and reverse_std), the scale ignored, the bias correction ignored, weight decay first.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import numpy as np
import torch
from safetensors import safe_open

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_galore_traces as mgt  # noqa: E402
from make_traces import ATOL, RTOL, Case, save_checked  # noqa: E402

TRACE_DIR = mgt.TRACE_DIR
CASES_TXT = os.path.join(HERE, "galore_one_refresh_cases.txt")
GENERATOR = "tests/reference/make_galore_one_refresh.py"
ONE_REFRESH_GAP = 1000
SENSITIVITY_MIN = 100.0
FLIPPED_PAIRS = (0, 2)


def read_trace(name: str):
    with safe_open(os.path.join(TRACE_DIR, f"{name}.trace.safetensors"), framework="pt") as f:
        meta = f.metadata()
        steps = int(meta["steps"])
        params0 = {k[len("param."):]: f.get_tensor(k) for k in f.keys() if k.startswith("param.")}
        grads = [{n: f.get_tensor(f"grad.{k}.{n}") for n in params0} for k in range(steps)]
    return meta, params0, grads


def read_expected(name: str):
    with safe_open(os.path.join(TRACE_DIR, f"{name}.expected.safetensors"), framework="pt") as f:
        return {k[len("param."):]: f.get_tensor(k) for k in f.keys()}


def committed_lines() -> dict:
    out = {}
    with open(mgt.CASES_TXT, encoding="utf-8") as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                out[line.split()[0]] = line.split()
    return out


class negated_svd:
    """torch.linalg.svd with the singular pairs FLIPPED_PAIRS negated (u_i and v_i both, an
    equally valid SVD) at the refreshes `when(iter)` says; galore-torch calls svd once per
    GaLore matrix per refresh, and this counts the calls to know the refresh step."""

    def __init__(self, when, matrices: int, gap: int):
        self.when, self.matrices, self.gap, self.calls = when, matrices, gap, 0
        self.orig = torch.linalg.svd

    def __enter__(self):
        def svd(a, full_matrices=True):
            u, s, vh = self.orig(a, full_matrices=full_matrices)
            it = (self.calls // self.matrices) * self.gap
            self.calls += 1
            if self.when(it):
                u, vh = u.clone(), vh.clone()
                for i in FLIPPED_PAIRS:
                    u[:, i] = -u[:, i]
                    vh[i, :] = -vh[i, :]
            return u, s, vh
        torch.linalg.svd = svd
        return self

    def __exit__(self, *exc):
        torch.linalg.svd = self.orig


def run_numpy(hp: dict, params0, grads, galore_names, orthos=None, bug=None):
    """GaLore-AdamW in float64, written from galore-torch's algorithm, with one refresh (step
    0) taking galore-torch's projection (`orthos`, as make_galore_traces.py's run_numpy) or,
    with orthos None, numpy's own float64 SVD; params after every step."""
    b1, b2 = hp["betas"]
    p = {n: t.numpy().astype(np.float64) for n, t in params0.items()}
    st = {n: {} for n in p}
    history = []
    for k, step in enumerate(grads):
        t = k + 1
        for n in p:
            g = step[n].numpy().astype(np.float64)
            s = st[n]
            galore = n in galore_names
            if galore:
                rows, cols = g.shape
                side = mgt.side_of(hp["proj_type"], rows, cols)
                if bug == "wide_side_flipped" and rows < cols or bug == "tall_side_flipped" and rows > cols:
                    side = {"left": "right", "right": "left"}.get(side, side)
                if "ortho" not in s:
                    if orthos is not None and not bug:
                        o = orthos[n][0]
                        o = ([x.numpy().astype(np.float64) for x in o] if side == "full"
                             else o.numpy().astype(np.float64))
                    else:
                        u, _, vh = np.linalg.svd(g, full_matrices=False)
                        r = hp["rank"]
                        o = {"left": u[:, :r], "right": vh[:r, :], "full": (u[:, :r], vh[:r, :])}[side]
                    s["ortho"], s["side"] = o, side
                o, side = s["ortho"], s["side"]
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
                step_size *= math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
            if galore:
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


def main() -> int:
    lines_in = committed_lines()
    out_lines = [
        "# One-refresh GaLore-AdamW expectations generated by tests/reference/make_galore_one_refresh.py",
        f"# ({mgt.reference_version()}, torch {torch.__version__}). Do not edit by hand.",
        "# <case> <trace> galore_adamw [--set KEY=VALUE]...   Trace: traces/<trace>.trace.safetensors",
        "# galore_cases.txt's cases with update_proj_gap above the trace's steps: the projection is",
        "# taken once, at step 0, with the Adam states still zero, so the params do not depend on",
        "# the signs the SVD gives its singular vectors and every tensor is compared, the matrices",
        "# whose signs LAPACKs choose differently from refresh to refresh included.",
    ]
    print(f"One refresh (update_proj_gap={ONE_REFRESH_GAP}), the committed traces:")
    smallest = {}
    for base in mgt.CASES:
        meta, params0, grads = read_trace(base.name)
        galore_names = meta["galore_params"].split(",")
        steps = len(grads)
        assert ONE_REFRESH_GAP > steps
        # The committed case line and the trace's metadata are this case's settings.
        assert lines_in[base.name] == [base.name, base.optimizer] + sum(
            (["--set", s] for s in mgt.set_args(base)), []), base.name
        assert meta["set"] == " ".join(mgt.set_args(base)), base.name
        case = Case(f"{base.name}_one_refresh", base.optimizer,
                    dict(base.hparams, update_proj_gap=ONE_REFRESH_GAP))
        hp = mgt.hparams(case)
        history, orthos = mgt.run_reference(case, params0, grads)
        final = history[-1]

        # Sign invariance, and why the gap-20 traces cannot do without it.
        with negated_svd(lambda it: True, len(galore_names), ONE_REFRESH_GAP):
            flipped = mgt.run_reference(case, params0, grads)[0][-1]
        for n in final:
            assert torch.equal(flipped[n], final[n]), f"{case.name}: {n} depends on the SVD's signs"
        with negated_svd(lambda it: it > 0, len(galore_names), base.hparams.get("update_proj_gap", mgt.GAP)):
            later = mgt.run_reference(base, params0, grads)[0][-1]
        later_ratio = mgt.tolerance_ratio(later, read_expected(base.name))
        assert later_ratio > SENSITIVITY_MIN, f"{base.name}: later flips {later_ratio}"

        # Independent float64 re-computation with galore-torch's projection, after every step;
        # with numpy's own SVD (other signs, other rounding) it is reported.
        ref = run_numpy(hp, params0, grads, galore_names, orthos)
        worst = 0.0
        for k, (got, want) in enumerate(zip(history, ref)):
            for n, t in got.items():
                np.testing.assert_allclose(
                    t.numpy().astype(np.float64), want[n], rtol=RTOL, atol=ATOL,
                    err_msg=f"{case.name}: galore-torch vs numpy float64 in {n} after step {k + 1}")
            worst = max(worst, mgt.tolerance_ratio(want, got))
        own = max(mgt.tolerance_ratio(want, got)
                  for got, want in zip(history, run_numpy(hp, params0, grads, galore_names)))
        report = [f"  {case.name}: pairs {FLIPPED_PAIRS} negated: bit-identical (at the later "
                  f"refreshes only, gap {mgt.hparams(base)['update_proj_gap']}: {later_ratio:.4g} x tol); "
                  f"numpy float64 uses {worst:.3f} of the tolerance (worst step), {own:.3f} with its own SVD"]
        bugs = {"wide_side_flipped": "the side of the wide 6 x 18 matrix flipped",
                "tall_side_flipped": "the side of the tall matrices flipped",
                "no_scale": "scale ignored", "no_bias_correction": "bias correction ignored",
                "decay_first": "weight decay applied before the update"}
        for bug, what in bugs.items():
            if bug.endswith("side_flipped") and hp["proj_type"] not in ("std", "reverse_std"):
                continue
            if bug == "no_scale" and hp["scale"] == 1.0:
                continue
            if bug == "no_bias_correction" and not hp["correct_bias"]:
                continue
            if bug == "decay_first" and hp["weight_decay"] == 0.0:
                continue
            ratio = mgt.tolerance_ratio(run_numpy(hp, params0, grads, galore_names, None, bug)[-1], final)
            smallest[bug] = min(smallest.get(bug, math.inf), ratio)
            assert ratio > SENSITIVITY_MIN, f"{case.name}: the expectation would not catch {bug} ({ratio:.3g})"
            report.append(f"    {bug:18s} {ratio:12.4g} x tol  {what}")
        print("\n".join(report))

        meta_out = mgt.metadata(case)
        meta_out["generator"] = GENERATOR
        meta_out["trace"] = f"traces/{base.name}.trace.safetensors"
        save_checked({f"param.{n}": t.contiguous() for n, t in final.items()},
                     os.path.join(TRACE_DIR, f"{case.name}.expected.safetensors"), meta_out)
        out_lines.append(" ".join([case.name, base.name, case.optimizer] +
                                  [f"--set {s}" for s in mgt.set_args(case)]))
    print("Smallest margin per variant: " + ", ".join(f"{b} {m:.3g}" for b, m in smallest.items()))
    with open(CASES_TXT, "w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(out_lines) + "\n")
    return 0


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        sys.exit(main())
