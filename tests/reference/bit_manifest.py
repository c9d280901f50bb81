#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 the distopt authors
"""The bit manifest: every run of tests/reference/bit_runs.txt (distopt-replay over the
committed traces, distopt-fashion-mnist with checkpoints) gives the SHA-256 digests that
tests/reference/bits.sha256 records. A refactor keeps every bit: this test passes unchanged
at each of its commits.

    bit_manifest.py --replay PROG --fmnist PROG --runs FILE --manifest FILE --work DIR
                    [--group G] [--skip G,...] [--update]

--group runs the lines whose name starts with "G." (ctest has one test per group);
--skip leaves out groups this build lacks (a line of a skipped group is not checked);
--update prints the manifest lines of the runs instead of checking them.

What is digested, per run: the output file (distopt-replay's params), the --log file (a
line per step: skipped, norms, loss scale, as hexadecimal floats; Fashion-MNIST's
per-step losses), and every file of the checkpoint directory. A checkpoint names each save
with a random generation, which its rank files' names and metadata and the index carry:
the digest of a rank file is that of its header without "distopt.generation" plus its
data, and the index is read without "generation", "checksum" and the rank files' names and
header hashes (their sizes stay)."""

import argparse
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys


def safetensors_digest(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.get("__metadata__", {})
    meta.pop("distopt.generation", None)
    canonical = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical + b"\0" + raw[8 + n :]).hexdigest()


def index_digest(path):
    with open(path) as f:
        index = json.load(f)
    for key in ("generation", "checksum"):
        index.pop(key, None)
    for part in index.get("files", []):
        for record in part:
            record.pop("header_xxh3", None)
            record["file"] = generation_free(record.get("file", ""))
    return hashlib.sha256(json.dumps(index, sort_keys=True).encode()).hexdigest()


def generation_free(name):
    """distopt-GEN-tpT-of-TT-rankR-of-D.safetensors without GEN."""
    return re.sub(r"^distopt-[^-]+-[^-]+-(tp)", r"distopt-\1", name)


def file_digest(path):
    if path.endswith(".safetensors"):
        return safetensors_digest(path)
    if os.path.basename(path) == "index.json":
        return index_digest(path)
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def parse_runs(path):
    runs = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            words = line.split()
            if len(words) < 2 or words[1] not in ("replay", "fmnist") or "." not in words[0]:
                sys.exit(f"{path}:{number}: expected 'GROUP.NAME replay|fmnist ARGS...', got '{line}'")
            runs.append((words[0], words[1], words[2:]))
    names = [r[0] for r in runs]
    if len(set(names)) != len(names):
        sys.exit(f"{path}: a run name appears twice")
    return runs


def command_of(args, run, work):
    name, program, words = run
    out = os.path.join(work, name)
    ckpt = out + ".ckpt"
    words = [ckpt if w == "{ckpt}" else w for w in words]
    if program == "replay":
        case, optimizer, rest = words[0], words[1], words[2:]
        trace = os.path.join(args.traces, case + ".trace.safetensors")
        cmd = [args.replay, "--optimizer", optimizer, "--trace", trace, "--out", out + ".safetensors",
               "--log", out + ".log"] + rest
        return cmd, [("out", out + ".safetensors"), ("log", out + ".log")], ckpt
    cmd = [args.fmnist] + words + ["--log", out + ".csv", "--checkpoint", ckpt]
    if args.data:
        cmd += ["--data", args.data]
    return cmd, [("log", out + ".csv")], ckpt


def digests_of(args, run):
    cmd, files, ckpt = command_of(args, run, args.work)
    for _, f in files:
        if os.path.exists(f):
            os.remove(f)
    shutil.rmtree(ckpt, ignore_errors=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.exit(f"bit_manifest: {run[0]}: '{' '.join(cmd)}' exited with {p.returncode}:\n{p.stdout}")
    out = [(label, file_digest(f)) for label, f in files]
    if os.path.isdir(ckpt):
        for f in sorted(os.listdir(ckpt)):
            out.append(("ckpt/" + generation_free(f), file_digest(os.path.join(ckpt, f))))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--replay", required=True)
    ap.add_argument("--fmnist", required=True)
    ap.add_argument("--runs", required=True)
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--traces", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--data", default="")
    ap.add_argument("--group", default="")
    ap.add_argument("--skip", default="")
    ap.add_argument("--update", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    runs = [r for r in parse_runs(args.runs)
            if (not args.group or r[0].split(".")[0] == args.group) and r[0].split(".")[0] not in skip]
    if not runs:
        sys.exit(f"bit_manifest: no run in group '{args.group}' (a test of nothing proves nothing)")
    expected = {}
    if not args.update:
        with open(args.manifest) as f:
            for line in f:
                if line.strip() and not line.startswith("#"):
                    name, label, digest = line.split()
                    expected[(name, label)] = digest
    failures = 0
    checked = 0
    for run in runs:
        got = digests_of(args, run)
        if args.update:
            for label, digest in got:
                print(f"{run[0]} {label} {digest}")
            continue
        want = {label: d for (name, label), d in expected.items() if name == run[0]}
        if not want:
            print(f"FAIL {run[0]}: not in the manifest {args.manifest}")
            failures += 1
            continue
        mine = dict(got)
        for label in sorted(set(want) | set(mine)):
            checked += 1
            if want.get(label) != mine.get(label):
                failures += 1
                print(f"FAIL {run[0]} {label}: expected {want.get(label, '(none)')}, got {mine.get(label, '(none)')}")
        print(f"{'ok  ' if all(want.get(l) == mine.get(l) for l in set(want) | set(mine)) else 'FAIL'} {run[0]}: "
              f"{len(mine)} digests")
    if args.update:
        return 0
    print(f"bit_manifest: {len(runs)} runs, {checked} digests checked, {failures} differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
