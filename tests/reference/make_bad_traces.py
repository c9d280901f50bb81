#!/usr/bin/env python3
"""Writes the small malformed traces that distopt-replay must refuse (exit 2, one line).

Pure Python (no torch, no safetensors package), deterministic; run from anywhere:
    python3 tests/reference/make_bad_traces.py
"""
import json
import os
import struct

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bad")


def safetensors_bytes(tensors, metadata):
    """tensors: list of (name, shape, list of floats) written as F32."""
    header = {}
    data = b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, shape, values in sorted(tensors):
        raw = struct.pack("<%df" % len(values), *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def write(name, content):
    with open(os.path.join(HERE, name), "wb") as f:
        f.write(content)


def main():
    os.makedirs(HERE, exist_ok=True)
    p = ("param.w", [3], [1.0, 2.0, 3.0])
    g0 = ("grad.0.w", [3], [0.1, 0.2, 0.3])
    g1 = ("grad.1.w", [3], [0.1, 0.2, 0.3])
    good = safetensors_bytes([p, g0, g1], {"steps": "2"})
    write("truncated.safetensors", good[: len(good) - 5])
    write("missing_grad.safetensors", safetensors_bytes([p, g0], {"steps": "2"}))
    write("missing_steps.safetensors", safetensors_bytes([p, g0], None))
    write("wrong_shape.safetensors", safetensors_bytes([p, ("grad.0.w", [2], [0.1, 0.2])], {"steps": "1"}))
    write("no_params.safetensors", safetensors_bytes([g0], {"steps": "1"}))
    # 2^31 - 1 steps in a file of three tensors: refused before anything is allocated.
    write("huge_steps.safetensors", safetensors_bytes([p, g0, g1], {"steps": "2147483647"}))
    write("not_safetensors.safetensors", b"this is not a safetensors file\n")


if __name__ == "__main__":
    main()
