#!/usr/bin/env python3
"""Write golden traces of the 8-bit block-wise optimizers to tests/reference/q8/.

Usage (from anywhere; plain Python 3, no packages):
    python3 tests/reference/make_q8_traces.py

A float64 model of block-wise quantized optimizer states, written from the
definitions and apart from the library (the unit test `q8` compares distopt's
fused 8-bit loop with it):

- the update is PyTorch's (torch.optim.AdamW, Adam with amsgrad, SGD with
  Nesterov momentum) or the Lion paper's, in float64;
- each state is kept as one code per element into bitsandbytes' dynamic map
  (the committed q8/dynamic_signed.txt for first moments and SGD momentum,
  q8/dynamic_unsigned.txt for second moments) and one absmax per block of 256
  elements, counted from each tensor's first element;
- a step decodes each state (map value times the block's absmax), runs the
  update, takes each block's new absmax and stores the nearest code of
  state / absmax (a binary search over the midpoints between map values,
  ties to the larger code).

distopt computes in float32, so its states differ from the model's by a few
float32 roundings. A code could then differ where state / absmax lies within
that distance of a midpoint between two codes (or, for Lion, where the sign
of the interpolated update is that close to zero); after that the two runs
would no longer take the same path. The script bounds the float32 error of
every quantized value (ERR times the magnitudes of the terms that made it)
and picks the first gradient offset whose whole trajectory keeps every value
farther than that from a decision: then the codes must agree exactly, and
absmax and params to float32 rounding.

Output: q8/<case>.trace.txt, one per case; the format is in the header of
each file and in tests/reference/README.md.
"""

import bisect
import math
import pathlib
import struct

HERE = pathlib.Path(__file__).resolve().parent
OUT_DIR = HERE / "q8"
GENERATOR = "tests/reference/make_q8_traces.py"
BLOCK = 256
STEPS = 4
# Relative float32 error allowed for before a decision counts as too close: about 17
# float32 ulps of the terms' magnitudes (distopt's error is a few ulps per step).
ERR = 1e-6
MASK64 = (1 << 64) - 1

# (name, elements, grad scale): partial blocks at the end of both tensors, and one
# tensor with small gradients (small absmax).
TENSORS = [("a", 600, 1.0), ("b", 520, 1e-4)]


def f32(x):
    """x rounded to float32 (round to nearest even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def splitmix64_finalise(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def grad_value(step, tensor, i):
    """tests/unit/sharded_harness.hpp's grad_value, in the same float32 operations."""
    z = (((step & MASK64) << 40) & MASK64) ^ (tensor << 32) ^ i
    z = splitmix64_finalise((z + 0x9E3779B97F4A7C15) & MASK64)
    u = (z >> 40) / float(1 << 24) * 2.0 - 1.0  # exact in float32
    return f32(u * (0.5 + tensor % 3))


def init_value(tensor, i):
    return f32(0.5 * grad_value(-1, tensor, i))


def read_map(name):
    values = []
    for line in (OUT_DIR / name).read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        index, hexval = line.split()[:2]
        assert int(index) == len(values)
        values.append(float.fromhex(hexval))
    assert len(values) == 256 and values == sorted(values)
    return values


SIGNED = read_map("dynamic_signed.txt")
UNSIGNED = read_map("dynamic_unsigned.txt")


class TooClose(Exception):
    pass


def quantize(block, mags, codebook):
    """Codes and absmax of one block of new state values; `mags` bounds each value's
    float32 error (in units of ERR). Raises TooClose where a code is not certain."""
    amax = max(abs(x) for x in block)
    mids = [(codebook[c] + codebook[c + 1]) / 2 for c in range(255)]
    codes = []
    for x, mag in zip(block, mags):
        y = x / amax if amax > 0 else 0.0
        c = bisect.bisect_right(mids, y)
        margin = ERR * (mag / amax + abs(y)) if amax > 0 else 0.0
        near = [mids[k] for k in (c - 1, c) if 0 <= k < 255]
        if any(abs(y - t) <= margin for t in near):
            raise TooClose
        codes.append(c)
    return codes, amax


# Each policy's update of one element, from PyTorch's (or the Lion paper's) definition.
# It takes the param, grad, step t (from 1) and the decoded states, and returns the new
# param, the new states and, per state, the sum of the magnitudes of the terms that made
# it (the scale of its float32 rounding error).

def adamw_update(h, p, g, t, st):
    m, v = st
    b1, b2 = h["betas"]
    p = p * (1 - h["lr"] * h["weight_decay"])
    m2 = b1 * m + (1 - b1) * g
    v2 = b2 * v + (1 - b2) * g * g
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    p = p - h["lr"] / bc1 * m2 / (math.sqrt(v2) / math.sqrt(bc2) + h["eps"])
    return p, [m2, v2], [abs(b1 * m) + abs((1 - b1) * g), v2]


def adam_amsgrad_update(h, p, g, t, st):
    m, v, vmax = st
    b1, b2 = h["betas"]
    m2 = b1 * m + (1 - b1) * g
    v2 = b2 * v + (1 - b2) * g * g
    vmax2 = max(vmax, v2)
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    p = p - h["lr"] / bc1 * m2 / (math.sqrt(vmax2) / math.sqrt(bc2) + h["eps"])
    return p, [m2, v2, vmax2], [abs(b1 * m) + abs((1 - b1) * g), v2, vmax2]


def sgd_nesterov_update(h, p, g, t, st):
    (buf,) = st
    mom = h["momentum"]
    buf2 = g if t == 1 else mom * buf + (1 - h["dampening"]) * g
    d = g + mom * buf2
    return p - h["lr"] * d, [buf2], [abs(mom * buf) + abs(g)]


def lion_update(h, p, g, t, st):
    (m,) = st
    b1, b2 = h["betas"]
    c = b1 * m + (1 - b1) * g
    if abs(c) <= ERR * (abs(b1 * m) + abs((1 - b1) * g)):
        raise TooClose  # the sign could go either way in float32
    p = p * (1 - h["lr"] * h["weight_decay"]) - h["lr"] * math.copysign(1.0, c)
    m2 = b2 * m + (1 - b2) * g
    return p, [m2], [abs(b2 * m) + abs((1 - b2) * g)]


# (case, policy, hyper-parameters in distopt's --set spelling, update, signed per slot)
CASES = [
    ("adamw", "adamw", {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2},
     adamw_update, [True, False]),
    ("adam_amsgrad", "adam", {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                              "amsgrad": True},
     adam_amsgrad_update, [True, False, False]),
    ("sgd_nesterov", "sgd", {"lr": 0.05, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0,
                             "nesterov": True},
     sgd_nesterov_update, [True]),
    ("lion", "lion", {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0}, lion_update, [True]),
]


def run(update, h, signed, offset):
    """The model's trajectory with gradients grad_value(offset + s, ...): per step, per
    tensor, (params, [codes per slot], [absmax per slot])."""
    slots = len(signed)
    books = [SIGNED if s else UNSIGNED for s in signed]
    zero = [book.index(0.0) for book in books]
    trace = []
    state = []
    for ti, (_, n, _) in enumerate(TENSORS):
        nb = (n + BLOCK - 1) // BLOCK
        state.append(([init_value(ti, i) for i in range(n)], [[zero[k]] * n for k in range(slots)],
                      [[0.0] * nb for _ in range(slots)]))
    for s in range(STEPS):
        step = []
        for ti, (_, n, scale) in enumerate(TENSORS):
            params, codes, amax = state[ti]
            new_p = list(params)
            new_codes = [[0] * n for _ in range(slots)]
            new_amax = [[0.0] * len(amax[0]) for _ in range(slots)]
            for b0 in range(0, n, BLOCK):
                m = min(BLOCK, n - b0)
                fresh = [[0.0] * m for _ in range(slots)]
                mags = [[0.0] * m for _ in range(slots)]
                for i in range(m):
                    e = b0 + i
                    g = f32(grad_value(offset + s, ti, e) * scale)
                    st = [books[k][codes[k][e]] * amax[k][b0 // BLOCK] for k in range(slots)]
                    new_p[e], st2, mag = update(h, params[e], g, s + 1, st)
                    for k in range(slots):
                        fresh[k][i], mags[k][i] = st2[k], mag[k]
                for k in range(slots):
                    c, a = quantize(fresh[k], mags[k], books[k])
                    new_codes[k][b0:b0 + m] = c
                    new_amax[k][b0 // BLOCK] = a
            state[ti] = (new_p, new_codes, new_amax)
            step.append(state[ti])
        trace.append(step)
    return trace


def setting(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(repr(v) for v in value)
    return repr(value)


def write(case, policy, h, signed, offset, trace):
    lines = [
        f"# generator: {GENERATOR} (a float64 model of block-wise 8-bit states, apart from distopt)",
        f"# {case}: {STEPS} steps from zero states; gradients tests/unit/sharded_harness.hpp's",
        f"# grad_value(offset + step, tensor, i) * scale (float32), params init_value(tensor, i);",
        "# min_8bit_size 256, so both tensors are quantized. After each step, per tensor:",
        "# 'absmax TENSOR SLOT v...' (one per block), 'codes TENSOR SLOT hex' (two hex digits",
        "# per element) and 'params TENSOR v...' (float64 values, %.12g).",
        f"policy {policy}",
        "hyper " + " ".join(f"{k}={setting(v)}" for k, v in h.items()),
        f"offset {offset}",
    ]
    for name, n, scale in TENSORS:
        lines.append(f"tensor {name} {n} {scale!r}")
    for s, step in enumerate(trace):
        lines.append(f"step {s + 1}")
        for (name, _, _), (params, codes, amax) in zip(TENSORS, step):
            for k in range(len(signed)):
                lines.append(f"absmax {name} {k} " + " ".join(repr(a) for a in amax[k]))
                lines.append(f"codes {name} {k} " + "".join(f"{c:02x}" for c in codes[k]))
            lines.append(f"params {name} " + " ".join(f"{p:.12g}" for p in params))
    (OUT_DIR / f"{case}.trace.txt").write_text("\n".join(lines) + "\n")


def main():
    for case, policy, h, update, signed in CASES:
        for offset in range(1000):
            try:
                trace = run(update, h, signed, offset)
            except TooClose:
                continue
            write(case, policy, h, signed, offset, trace)
            print(f"{case}: gradient offset {offset}")
            break
        else:
            raise SystemExit(f"{case}: no offset below 1000 keeps every decision clear")


if __name__ == "__main__":
    main()
