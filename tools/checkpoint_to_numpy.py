#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 the distopt authors
"""Reads a distopt checkpoint directory into whole numpy arrays (needs only numpy).

    python3 tools/checkpoint_to_numpy.py CHECKPOINT_DIR [--tp T] [--npz OUT.npz] [--print]

Each rank file is safetensors; its "distopt.items" metadata says which elements
[first, first + count) of each flat vector it holds. The slices of every item are put
together into the item's whole shape: "<tensor>/param", "<tensor>/master",
"<tensor>/state.K" (8-bit states: "state.K.codes" and "state.K.absmax"), "row_states", ...
With the `safetensors` package the same files open with safetensors.numpy.load_file.
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

DTYPES = {"F32": np.float32, "F16": np.float16, "U8": np.uint8, "BF16": np.uint16}


def read_checkpoint(directory, tp=0):
    with open(os.path.join(directory, "index.json")) as f:
        index = json.load(f)
    whole = {}
    for entry in index["files"][tp]:
        with open(os.path.join(directory, entry["file"]), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            data = f.read()
        items = json.loads(header["__metadata__"]["distopt.items"])
        for name, rec in items.items():
            begin, end = header[name]["data_offsets"]
            values = np.frombuffer(data[begin:end], dtype=DTYPES[rec["dtype"]])
            if name not in whole:
                whole[name] = np.zeros(rec["total"], dtype=values.dtype)
            whole[name][rec["first"]:rec["first"] + rec["count"]] = values
            whole[name + "/shape"] = rec["shape"]
    arrays = {}
    for name, values in whole.items():
        if name.endswith("/shape"):
            continue
        if values.dtype == np.uint16:  # bfloat16: the upper half of a float32
            values = (values.astype(np.uint32) << 16).view(np.float32)
        arrays[name] = values.reshape(whole[name + "/shape"])
    return index, arrays


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--tp", type=int, default=0, help="tensor-parallel part to read (default 0)")
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
