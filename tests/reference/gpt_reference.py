#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 the distopt authors
"""PyTorch reference for distopt-gpt: a small Llama-style decoder (fp32, no biases, RMSNorm,
rope "halves" convention, SwiGLU, untied output), written by hand in plain torch ops.

    gpt_reference.py --init DIR/init.safetensors --batches DIR/batches.safetensors
                     [--steps 20] --out gpt_golden.json [--grads-out grads.safetensors]

Builds the model from the init file's tensors and __metadata__ (vocab, dim, layers, heads, ffn,
seq, batch, norm_eps, rope_theta), writes the step-0 gradients (mean cross-entropy over every
position of batch 0) to --grads-out under the init file's tensor names, then trains --steps steps
from the initial weights twice, with torch.optim.AdamW and with transformers' Adafactor, and
writes each step's loss (computed before that step's update) to --out as JSON.
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

INT_KEYS = ("vocab", "dim", "layers", "heads", "ffn", "seq", "batch")
FLOAT_KEYS = ("norm_eps", "rope_theta")


def fail(msg):
    sys.exit(f"gpt_reference.py: {msg}")


def read_config(meta, path):
    """The metadata's strings as numbers; every key must be there."""
    cfg = {}
    for key in INT_KEYS + FLOAT_KEYS:
        if meta is None or key not in meta:
            fail(f"{path}: __metadata__ lacks the key '{key}'")
        try:
            cfg[key] = int(meta[key]) if key in INT_KEYS else float(meta[key])
        except ValueError:
            fail(f"{path}: __metadata__ '{key}' = '{meta[key]}' is not a number")
    if cfg["dim"] % cfg["heads"] or (cfg["dim"] // cfg["heads"]) % 2:
        fail(f"{path}: dim {cfg['dim']} / heads {cfg['heads']} must be an even integer")
    return cfg


def expected_shapes(cfg):
    """Every tensor name of the spec and its shape, [out, in] as torch.nn.Linear stores it."""
    V, d, f = cfg["vocab"], cfg["dim"], cfg["ffn"]
    shapes = {"tok_embeddings.weight": (V, d)}
    for l in range(cfg["layers"]):
        p = f"layers.{l}."
        shapes[p + "attention_norm.weight"] = (d,)
        for w in ("wq", "wk", "wv", "wo"):
            shapes[p + f"attention.{w}.weight"] = (d, d)
        shapes[p + "ffn_norm.weight"] = (d,)
        shapes[p + "feed_forward.w1.weight"] = (f, d)
        shapes[p + "feed_forward.w3.weight"] = (f, d)
        shapes[p + "feed_forward.w2.weight"] = (d, f)
    shapes["norm.weight"] = (d,)
    shapes["output.weight"] = (V, d)
    return shapes


def load_init(path):
    """(config, {name: fp32 tensor}) from the init file, checked against the spec."""
    if not os.path.isfile(path):
        fail(f"init file not found: {path}")
    with safe_open(path, framework="pt") as fh:
        cfg = read_config(fh.metadata(), path)
        tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    shapes = expected_shapes(cfg)
    for name, shape in shapes.items():
        if name not in tensors:
            fail(f"{path}: missing tensor '{name}'")
        t = tensors[name]
        if t.dtype != torch.float32 or tuple(t.shape) != shape:
            fail(f"{path}: '{name}' is {t.dtype} {list(t.shape)}, expected float32 {list(shape)}")
    extra = sorted(set(tensors) - set(shapes))
    if extra:
        fail(f"{path}: unexpected tensors {extra}")
    return cfg, {name: tensors[name] for name in shapes}


def load_batches(path, cfg, steps):
    """The int64 tokens [steps, B, T + 1] of the first `steps` steps."""
    if not os.path.isfile(path):
        fail(f"batches file not found: {path}")
    with safe_open(path, framework="pt") as fh:
        if "tokens" not in fh.keys():
            fail(f"{path}: no tensor 'tokens'")
        tok = fh.get_tensor("tokens")
    want = (cfg["batch"], cfg["seq"] + 1)
    if tok.dtype != torch.int32 or tok.dim() != 3 or tuple(tok.shape[1:]) != want:
        fail(f"{path}: 'tokens' is {tok.dtype} {list(tok.shape)}, expected int32 [steps, {want[0]}, {want[1]}]")
    if tok.shape[0] < steps:
        fail(f"{path}: {tok.shape[0]} batches, fewer than --steps {steps}")
    if tok.numel() and (tok.min() < 0 or tok.max() >= cfg["vocab"]):
        fail(f"{path}: a token is outside [0, {cfg['vocab']})")
    return tok[:steps].long()


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(cfg):
    """cos, sin [T, hd/2]: angle = t * theta^(-2i/hd); computed in float64, rounded to fp32."""
    hd = cfg["dim"] // cfg["heads"]
    i = torch.arange(hd // 2, dtype=torch.float64)
    inv_freq = 1.0 / cfg["rope_theta"] ** (2.0 * i / hd)
    angle = torch.arange(cfg["seq"], dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(angle).float(), torch.sin(angle).float()


def rope(x, cos, sin):
    """x [B, H, T, hd]: the first half pairs with the second half (HF's rotate_half)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def forward_loss(p, cfg, rope_cs, tokens):
    """Mean cross-entropy over all B*T positions; tokens [B, T + 1]."""
    x, y = tokens[:, :-1], tokens[:, 1:]
    B, T = x.shape
    d, H, eps = cfg["dim"], cfg["heads"], cfg["norm_eps"]
    hd = d // H
    cos, sin = rope_cs
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # True where key position > query position
    h = p["tok_embeddings.weight"][x]  # [B, T, d]
    for l in range(cfg["layers"]):
        pre = f"layers.{l}."
        a = rmsnorm(h, p[pre + "attention_norm.weight"], eps)
        # [B, T, d] -> [B, H, T, hd]: head `n` holds features n*hd .. n*hd + hd - 1
        q, k, v = (
            (a @ p[pre + f"attention.{w}.weight"].T).view(B, T, H, hd).transpose(1, 2)
            for w in ("wq", "wk", "wv")
        )
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        s = s.masked_fill(causal, float("-inf"))
        o = torch.softmax(s, dim=-1) @ v  # [B, H, T, hd]
        o = o.transpose(1, 2).reshape(B, T, d)
        h = h + o @ p[pre + "attention.wo.weight"].T
        m = rmsnorm(h, p[pre + "ffn_norm.weight"], eps)
        gate = m @ p[pre + "feed_forward.w1.weight"].T
        up = m @ p[pre + "feed_forward.w3.weight"].T
        h = h + (gate * torch.sigmoid(gate) * up) @ p[pre + "feed_forward.w2.weight"].T
    logits = rmsnorm(h, p["norm.weight"], eps) @ p["output.weight"].T  # [B, T, V]
    return F.cross_entropy(logits.reshape(B * T, -1), y.reshape(B * T), reduction="mean")


def make_params(init):
    return {name: torch.nn.Parameter(t.clone()) for name, t in init.items()}


def make_optimizer(kind, p):
    if kind == "adamw":
        decay = [t for t in p.values() if t.dim() == 2]
        no_decay = [t for t in p.values() if t.dim() == 1]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
            lr=1e-3, betas=(0.9, 0.999), eps=1e-8, foreach=False, fused=False)
    from transformers.optimization import Adafactor
    return Adafactor(list(p.values()))  # the defaults: lr=None, relative_step=True, ...


def train(kind, init, cfg, rope_cs, batches):
    """Losses of each step (before its update), and the gradients of step 0."""
    p = make_params(init)
    opt = make_optimizer(kind, p)
    losses, grads0 = [], None
    for s in range(batches.shape[0]):
        opt.zero_grad(set_to_none=True)
        loss = forward_loss(p, cfg, rope_cs, batches[s])
        loss.backward()
        if s == 0:
            grads0 = {name: t.grad.detach().clone().contiguous() for name, t in p.items()}
        losses.append(float(loss.item()))  # the float64 value of the fp32 loss, exactly
        opt.step()
    return losses, grads0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--init", required=True)
    ap.add_argument("--batches", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", required=True)
    ap.add_argument("--grads-out")
    args = ap.parse_args()
    if args.steps < 1:
        fail("--steps must be at least 1")

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    cfg, init = load_init(args.init)
    batches = load_batches(args.batches, cfg, args.steps)
    rope_cs = rope_tables(cfg)

    import transformers
    adamw_loss, grads0 = train("adamw", init, cfg, rope_cs, batches)
    adafactor_loss, _ = train("adafactor", init, cfg, rope_cs, batches)

    if args.grads_out:
        save_file(grads0, args.grads_out,
                  metadata={"generated_by": "tests/reference/gpt_reference.py", "step": "0"})
    golden = {
        "generated_by": "tests/reference/gpt_reference.py",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "config": cfg,
        "steps": args.steps,
        "adamw": {"loss": adamw_loss},
        "adafactor": {"loss": adafactor_loss},
    }
    with open(args.out, "w") as fh:
        json.dump(golden, fh, indent=1)  # json writes floats as repr: full precision
        fh.write("\n")
    print(f"adamw loss {adamw_loss[0]!r} -> {adamw_loss[-1]!r}; "
          f"adafactor loss {adafactor_loss[0]!r} -> {adafactor_loss[-1]!r}")


if __name__ == "__main__":
    main()
