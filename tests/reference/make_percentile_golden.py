#!/usr/bin/env python3
"""Write tests/reference/q8/percentile_golden.txt: bitsandbytes' percentile clipping, step by step.

Usage (from anywhere):
    python3 tests/reference/make_percentile_golden.py            # the model alone (plain Python)
    pip install torch "bitsandbytes<0.50"                         # optional: bitsandbytes' own code
    python3 tests/reference/make_percentile_golden.py

bitsandbytes' 8-bit optimizers took `percentile_clipping=p` (p < 100): each parameter
tensor keeps a float32 vector `gnorm_vec` of 100 squared gradient norms. At optimizer step
`step` (1 on the first step), bitsandbytes.functional.percentile_clipping(grad, gnorm_vec,
step, p) ran the CUDA kernel cpercentile_clipping_g32 (csrc/ops.cu percentileClipping:
cudaMemset(&gnorm_vec[step % 100], 0), then kPercentileClipping: per 2048-element block a
float32 sum of squares, atomicAdd'ed into gnorm_vec[step % 100], or on step 1 into all 100
entries), then, in Python:

    current_gnorm = sqrt(gnorm_vec[step % 100])
    vals, _ = torch.sort(gnorm_vec)                      # ascending
    clip_value = sqrt(vals[p])
    gnorm_scale = clip_value / current_gnorm if current_gnorm > clip_value else 1.0

and the optimizer update multiplied the gradient by gnorm_scale. p = 100 turns it off.

Where it runs: bitsandbytes 0.50 removed it (PR #1871, "Remove deprecated APIs"), and up
to 0.49.2 it is CUDA only (functional.is_on_gpu refuses CPU tensors and
libbitsandbytes_cpu.so has no cpercentile_clipping symbol). So this script

  1. always computes the values with its own float32 model, written from the description
     above (pure Python, `struct` for float32 rounding; it shares no code with distopt);
  2. when the installed bitsandbytes still has functional.percentile_clipping (<= 0.49),
     also runs bitsandbytes' own function on CPU tensors, with only its CUDA kernel call
     replaced by a CPU emulation of the kernel (below) and the GPU check lifted, and
     asserts that bitsandbytes' current_gnorm, clip_value and gnorm_scale equal the
     model's (the Python half of the algorithm, the index step % 100, the sort and the
     percentile index, is then bitsandbytes' own). The golden values written are
     bitsandbytes' when it ran, the model's otherwise; the header says which.

Input: two tensors, `w` (2500 elements: two of the kernel's 2048-element blocks) and `b`
(7). The gradient of tensor t at step s (1..STEPS) is float32(base_t[i] * factor[s][t]),
a float32 product of two float32 numbers, with base_w[i] = ((37 i) mod 101 - 50) / 64 and
base_b[i] = ((11 i) mod 13 - 6) / 8, both exact; the factors are in the file. The factors
come from a grid of values spaced far enough apart that every pair of different squared
norms of a tensor differs by more than 1e-4 (relative), asserted here: how a sum of
squares is rounded (a float32 kernel's order, an exact sum) cannot change which entry is
the p-th smallest. Some factors repeat an earlier step's exactly (ties in the history),
some steps spike (x 16 to 24), the first step's norm of `w` is below every later one (its
100 copies are the smallest entries until steps 101.. overwrite them), and steps 101..130
wrap the history.

Output: '#' header lines, then
    tensor NAME ELEMENTS
    percentiles P...
    step S FACTOR_w FACTOR_b                   (factors as %.9g, exact float32)
    clip P TENSOR SQ CURRENT CLIP SCALE        (one per percentile and tensor; float32 %.9g)
SQ is gnorm_vec[step % 100] after the step (the squared norm), CURRENT and CLIP the square
roots bitsandbytes returns, SCALE its gnorm_scale (1 exactly when not clipped). For p = 100
(off) the line reads SQ CURRENT CURRENT 1 (bitsandbytes skips the call).
"""

import math
import pathlib
import struct
import sys

OUT = pathlib.Path(__file__).resolve().parent / "q8" / "percentile_golden.txt"
GENERATOR = "tests/reference/make_percentile_golden.py"
STEPS = 130
PERCENTILES = (0, 5, 50, 95, 99, 100)
TENSORS = (("w", 2500), ("b", 7))


def f32(x: float) -> float:
    """x rounded to float32 (round to nearest even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def base(t: int, i: int) -> float:
    return ((37 * i) % 101 - 50) / 64.0 if t == 0 else ((11 * i) % 13 - 6) / 8.0


def factors() -> list:
    """factor[s] = (w, b) for s = 1..STEPS (index 0 unused), float32 values."""
    out = [None]
    for s in range(1, STEPS + 1):
        # w: a slow upward drift over a grid of 1/32 with a 7-step wobble, so later norms
        # tend to exceed earlier ones; spikes every 17 steps; steps 40 and 90 repeat step
        # 20's factor, step 120 repeats step 101's.
        k = (s * 29) % 47
        w = 1.0 + s / 16.0 + k / 32.0 + (s % 7) / 128.0
        if s % 17 == 0:
            w *= 16.0 + (s % 5)
        # b: a downward drift (clipping is rare at high percentiles), its own wobble and
        # spikes every 23 steps.
        k = (s * 13) % 31
        b = 12.0 - s / 16.0 + k / 16.0 + (s % 3) / 256.0
        if s % 23 == 0:
            b *= 20.0 + (s % 3)
        out.append([f32(w), f32(b)])
    out[1][0] = f32(0.75)  # the first step's w norm: below every later one
    out[40][0] = out[90][0] = out[20][0]
    out[120][0] = out[101][0]
    out[60][1] = out[30][1]
    return out


def grad(t: int, n: int, factor: float) -> list:
    # A product of two float32 numbers is exact in a double: f32() rounds it once, as a
    # float32 multiply does.
    return [f32(base(t, i) * factor) for i in range(n)]


# --- the model -------------------------------------------------------------------------


def model_square_sum(g: list) -> float:
    """The squared norm as float32: the exact sum of the squares, rounded once."""
    return f32(math.fsum(v * v for v in g))


def model_step(vec: list, g: list, step: int, p: int):
    """One call of percentile_clipping on the 100-entry history `vec` (updated in place)."""
    sq = model_square_sum(g)
    if step == 1:
        for j in range(100):
            vec[j] = sq
    else:
        vec[step % 100] = sq
    current = f32(math.sqrt(vec[step % 100]))
    clip = f32(math.sqrt(sorted(vec)[p]))
    scale = f32(clip / current) if current > clip else 1.0
    return vec[step % 100], current, clip, scale


# --- bitsandbytes' own function, its kernel emulated on the CPU ---------------------------


def kernel_block_sums(values: list) -> list:
    """kPercentileClipping's per-block float32 sums: 2048-element blocks, 512 threads of 4
    consecutive elements each (float32 multiply-adds), the threads' sums added pairwise."""
    sums = []
    for start in range(0, len(values), 2048):
        block = values[start:start + 2048]
        block = block + [0.0] * (2048 - len(block))
        lanes = []
        for t in range(512):
            acc = 0.0
            for v in block[4 * t:4 * t + 4]:
                acc = f32(acc + v * v)
            lanes.append(acc)
        while len(lanes) > 1:
            lanes = [f32(lanes[j] + lanes[j + 1]) for j in range(0, len(lanes), 2)]
        sums.append(lanes[0])
    return sums


def bitsandbytes_runner():
    """A function (grad list, gnorm_vec state, step, p) -> (sq, current, clip, scale) that
    calls bitsandbytes.functional.percentile_clipping, or None when it is not installed."""
    try:
        import ctypes

        import bitsandbytes
        import bitsandbytes.functional as F
        import torch
    except ImportError:
        return None, None
    if not hasattr(F, "percentile_clipping"):
        return None, f"bitsandbytes {bitsandbytes.__version__} has no functional.percentile_clipping"

    class KernelOnCpu:
        """Stands for bitsandbytes' native library in F: the one call it makes here."""

        @staticmethod
        def cpercentile_clipping_g32(g_ptr, vec_ptr, step, n):
            g = (ctypes.c_float * n.value).from_address(g_ptr.value)
            vec = (ctypes.c_float * 100).from_address(vec_ptr.value)
            s = step.value
            vec[s % 100] = 0.0  # ops.cu's cudaMemset of the step's entry
            for block_sum in kernel_block_sums(list(g)):  # atomicAdd of each block's sum
                if s == 1:
                    for j in range(100):
                        vec[j] = f32(vec[j] + block_sum)
                else:
                    vec[s % 100] = f32(vec[s % 100] + block_sum)

    F.lib = KernelOnCpu()
    F.is_on_gpu = lambda tensors: True

    def run(g: list, vec, step: int, p: int):
        grad_t = torch.tensor(g, dtype=torch.float32)
        current, clip, scale = F.percentile_clipping(grad_t, vec, step, p)
        scale = float(scale)  # a 0-d float32 tensor when clipped, the float 1.0 otherwise
        return float(vec[step % 100]), float(current), float(clip), scale

    def new_vec():
        return torch.zeros((100,), dtype=torch.float32)  # the optimizer's state["gnorm_vec"]

    run.new_vec = new_vec
    run.version = f"bitsandbytes {bitsandbytes.__version__}, torch {torch.__version__}"
    return run, None


def check_margins(fac: list) -> None:
    for t, (name, n) in enumerate(TENSORS):
        sqs = sorted({model_square_sum(grad(t, n, fac[s][t])) for s in range(1, STEPS + 1)})
        for a, b in zip(sqs, sqs[1:]):
            assert (b - a) / b > 1e-4, f"{name}: squared norms {a} and {b} too close"


def main() -> int:
    fac = factors()
    check_margins(fac)
    bnb, why_not = bitsandbytes_runner()
    grads = {(s, t): grad(t, n, fac[s][t]) for s in range(1, STEPS + 1) for t, (_, n) in enumerate(TENSORS)}

    lines = {}  # (step, p, t) -> (sq, current, clip, scale)
    clipped = {p: 0 for p in PERCENTILES}
    for p in PERCENTILES:
        for t, (name, _) in enumerate(TENSORS):
            vec = [0.0] * 100
            bvec = bnb.new_vec() if bnb else None
            for s in range(1, STEPS + 1):
                g = grads[(s, t)]
                if p == 100:  # off: bitsandbytes does not call percentile_clipping
                    sq = model_square_sum(g)
                    lines[(s, p, t)] = (sq, f32(math.sqrt(sq)), f32(math.sqrt(sq)), 1.0)
                    continue
                got = model_step(vec, g, s, p)
                if bnb:
                    theirs = bnb(g, bvec, s, p)
                    # The squared norm may differ in its last bits (the kernel's float32
                    # order against an exact sum); every decision must agree, the values
                    # to float32 rounding.
                    assert (theirs[3] == 1.0) == (got[3] == 1.0), (name, p, s, theirs, got)
                    for x, y in zip(theirs, got):
                        assert abs(x - y) <= 4e-7 * abs(y), (name, p, s, theirs, got)
                    got = theirs
                lines[(s, p, t)] = got
                clipped[p] += got[3] != 1.0

    source = (f"values from bitsandbytes' own functional.percentile_clipping ({bnb.version}), "
              "its CUDA kernel emulated on the CPU by this script; the script's model agrees"
              if bnb else
              f"values from the script's float32 model of bitsandbytes' algorithm "
              f"(bitsandbytes not run: {why_not or 'not installed'})")
    out = [
        f"# generator: {GENERATOR}",
        f"# {source}",
        "# gradient of tensor t at step s: float32(base_t[i] * factor_t[s]); base_w[i] = ((37 i) mod 101 - 50) / 64,",
        "# base_b[i] = ((11 i) mod 13 - 6) / 8. Per step and percentile P, per tensor:",
        "# 'clip P TENSOR SQ CURRENT CLIP SCALE' (gnorm_vec[step % 100], current_gnorm, clip_value, gnorm_scale).",
        "# Clipped steps per percentile: " + ", ".join(f"{p}: {clipped[p]}" for p in PERCENTILES),
    ]
    for name, n in TENSORS:
        out.append(f"tensor {name} {n}")
    out.append("percentiles " + " ".join(str(p) for p in PERCENTILES))
    for s in range(1, STEPS + 1):
        out.append(f"step {s} " + " ".join("%.9g" % fac[s][t] for t in range(len(TENSORS))))
        for p in PERCENTILES:
            for t, (name, _) in enumerate(TENSORS):
                out.append(f"clip {p} {name} " + " ".join("%.9g" % v for v in lines[(s, p, t)]))
    OUT.write_text("\n".join(out) + "\n")
    print(f"wrote {OUT} ({source}); clipped steps per percentile: {clipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
