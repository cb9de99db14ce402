"""The sums an NCCL all-reduce must give, computed with numpy from every rank's inputs.

    nccl_reference.py < INPUT.json > OUTPUT.json

INPUT is ``{"ranks": [[float, ...] per rank]}`` (every rank's values, the same length);
OUTPUT is ``{"f32": [...], "bf16_bits": [...]}``: the element-wise float32 sum over the
ranks, in rank order, and that sum rounded once to bfloat16 (nearest, ties to even), as
the uint16 bit patterns. Each rank's values are taken as float32 first (what the rank
holds), and as bfloat16 first for the bf16 sum (the bf16 all-reduce's inputs are bf16).
"""

from __future__ import annotations

import json
import sys

import numpy as np


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest, ties to even (finite inputs)."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns -> float32, exactly."""
    return (np.asarray(b, dtype=np.uint32) << 16).view(np.float32)


def main() -> None:
    """Reads the ranks' values from stdin and prints their sums as JSON."""
    ranks = [np.asarray(r, dtype=np.float32) for r in json.load(sys.stdin)["ranks"]]
    total = np.zeros_like(ranks[0])
    wide = np.zeros_like(ranks[0])
    for r in ranks:
        total = (total + r).astype(np.float32)
        wide = (wide + from_bf16_bits(to_bf16_bits(r))).astype(np.float32)
    json.dump(
        {"f32": [float(v) for v in total], "bf16_bits": [int(b) for b in to_bf16_bits(wide)]},
        sys.stdout,
    )


if __name__ == "__main__":
    main()
