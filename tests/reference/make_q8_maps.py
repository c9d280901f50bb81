#!/usr/bin/env python3
"""Write bitsandbytes' 8-bit optimizer codebooks to tests/reference/q8/.

Usage (from anywhere):
    pip install bitsandbytes torch
    python3 tests/reference/make_q8_maps.py

bitsandbytes' block-wise 8-bit optimizers keep each state element as a uint8
index into a 256-entry float32 codebook, scaled by a per-block absmax. The
first moment uses the signed "dynamic" map, the second moment the unsigned
"udynamic" map; both come from bitsandbytes.functional.create_dynamic_map.
We commit the maps as text so that CI needs neither torch nor bitsandbytes.

Output, one file per map:
    q8/dynamic_signed.txt    create_dynamic_map(signed=True)
    q8/dynamic_unsigned.txt  create_dynamic_map(signed=False)
Each has '#' header lines (generator, versions, ordering facts), then 256
lines `<index> <value as C hex float> <value as %.9g>`. The hex form is the
exact float32 value (strtof reads it back bit for bit); %.9g also
round-trips through float32 and is there for human readers.
"""

import math
import pathlib
import struct

import bitsandbytes
import bitsandbytes.functional as F
import torch

OUT_DIR = pathlib.Path(__file__).resolve().parent / "q8"
GENERATOR = "tests/reference/make_q8_maps.py"


def as_f32(x: float) -> float:
    # Round through a 4-byte float, so the asserts below test float32 values.
    return struct.unpack("<f", struct.pack("<f", x))[0]


def write_map(name: str, signed: bool, optimizer_state: str) -> None:
    code = F.create_dynamic_map(signed=signed)
    assert code.dtype == torch.float32 and code.numel() == 256
    # tolist() widens float32 to Python float (double) exactly.
    values = code.tolist()
    assert all(as_f32(v) == v for v in values)

    ascending = all(a <= b for a, b in zip(values, values[1:]))
    duplicates = len(values) - len(set(values))
    header = [
        f"# generator: {GENERATOR}; bitsandbytes {bitsandbytes.__version__}; "
        f"torch {torch.__version__}",
        f"# bitsandbytes.functional.create_dynamic_map(signed={signed}): "
        f"the {optimizer_state} codebook of the 8-bit optimizers",
        f"# sorted ascending: {'yes' if ascending else 'no'}; "
        f"duplicate values: {duplicates}; 256 float32 entries",
        "# columns: index, value as C hex float (exact), value as %.9g",
    ]
    lines = []
    for i, v in enumerate(values):
        text = "%.9g" % v
        # Both spellings must give back the same float32 bits.
        assert as_f32(float.fromhex(v.hex())) == v and as_f32(float(text)) == v
        assert not math.isnan(v)
        lines.append(f"{i} {v.hex()} {text}")

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / name
    path.write_text("\n".join(header + lines) + "\n")
    print(f"wrote {path}: sorted={ascending} duplicates={duplicates} "
          f"min={values[0]!r} max={values[-1]!r}")


def main() -> None:
    write_map("dynamic_signed.txt", signed=True,
              optimizer_state='first-moment ("dynamic", qmap1)')
    write_map("dynamic_unsigned.txt", signed=False,
              optimizer_state='second-moment ("udynamic", qmap2)')


if __name__ == "__main__":
    main()
