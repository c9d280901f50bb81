#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 the distopt authors
"""Reads a distopt checkpoint directory into whole numpy arrays (needs only numpy).

    python3 tools/checkpoint_to_numpy.py CHECKPOINT_DIR [--tp T] [--npz OUT.npz] [--print]

Each rank file is safetensors; its "distopt.items" metadata says which elements
[first, first + count) of each flat vector it holds. The slices of every item are put
together into the item's whole shape: "<tensor>/param", "<tensor>/master",
"<tensor>/state.K" (8-bit states: "state.K.codes" and "state.K.absmax"), "row_states", ...
With tensor parallelism each TP part has its own files. --tp T gives part T's vectors;
without it the parts' boxes (the items' "tp" records) are put together into the whole
TP-unsplit arrays, so that checkpoints of any TP size give the same arrays. (8-bit absmax
of blocks that a TP cut splits have no whole array: they are left out, with a note.)
With the `safetensors` package the same files open with safetensors.numpy.load_file.
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

DTYPES = {"F32": np.float32, "F16": np.float16, "U8": np.uint8, "BF16": np.uint16}


def read_part(directory, index, tp):
    """Part tp's vectors: name -> (flat array, shape, tp record or None)."""
    vectors = {}
    for entry in index["files"][tp]:
        with open(os.path.join(directory, entry["file"]), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            data = f.read()
        items = json.loads(header["__metadata__"]["distopt.items"])
        for name, rec in items.items():
            begin, end = header[name]["data_offsets"]
            values = np.frombuffer(data[begin:end], dtype=DTYPES[rec["dtype"]])
            if name not in vectors:
                vectors[name] = (np.zeros(rec["total"], dtype=values.dtype), rec["shape"], rec.get("tp"))
            vectors[name][0][rec["first"]:rec["first"] + rec["count"]] = values
    return vectors


def as_float(values):
    if values.dtype == np.uint16:  # bfloat16: the upper half of a float32
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values


def read_checkpoint(directory, tp=None):
    """The arrays of TP part `tp`, or (None) the whole arrays over every part."""
    with open(os.path.join(directory, "index.json")) as f:
        index = json.load(f)
    if tp is not None:
        part = read_part(directory, index, tp)
        return index, {name: as_float(v).reshape(shape) for name, (v, shape, _) in part.items()}
    parts = [read_part(directory, index, p) for p in range(index["tp_size"])]
    if index["tp_size"] > 1 and all(box is None for part in parts for (_, _, box) in part.values()):
        print("note: written before TP resharding (no tp records): TP part 0's arrays", file=sys.stderr)
        return index, {name: as_float(v).reshape(shape) for name, (v, shape, _) in parts[0].items()}
    whole, covered = {}, {}
    for part in parts:
        for name, (values, shape, box) in part.items():
            if box is None and index["tp_size"] == 1:  # files from before TP resharding, or a TP-cut absmax
                whole[name] = values.reshape(shape)
                continue
            if box is None:
                if name not in whole:
                    print(f"note: {name} has no place in a whole array (kept per TP part): left out", file=sys.stderr)
                whole[name] = None
                continue
            if name in whole and whole[name] is None:
                continue
            if name not in whole:
                whole[name] = np.zeros(box["whole"], dtype=values.dtype)
                covered[name] = np.zeros(box["whole"], dtype=bool)
            cut = tuple(slice(o, o + b) for o, b in zip(box["offset"], box["box"]))
            # The lowest part holding an element gives it, as the C++ loader reads it.
            fresh = ~covered[name][cut]
            whole[name][cut][fresh] = values.reshape(box["box"])[fresh]
            covered[name][cut] = True
    for name, c in covered.items():
        if whole[name] is not None and not c.all():
            raise SystemExit(f"{name}: the TP parts' files leave {int((~c).sum())} elements of its whole array unwritten")
    return index, {name: as_float(a) for name, a in whole.items() if a is not None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--tp", type=int, help="the tensor-parallel part to read (default: the whole arrays over all parts)")
    parser.add_argument("--npz", help="write the arrays into this .npz file")
    parser.add_argument("--print", action="store_true", help="print each array's name, shape and sum")
    args = parser.parse_args()
    index, arrays = read_checkpoint(args.directory, args.tp)
    print(f"{index['identity']['policy']} at step {index['state']['step']}, written by "
          f"{index['dp_size']} x {index['tp_size']} ranks: {len(arrays)} arrays")
    if args.print:
        for name in sorted(arrays):
            a = arrays[name]
            print(f"{name} {list(a.shape)} sum {float(np.sum(a, dtype=np.float64)):.9g}")
    if args.npz:
        np.savez(args.npz, **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
