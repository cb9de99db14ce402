"""Reference block codecs from the `gguf` package, for tests/quant_formats.rs.

Usage: ``python gguf_blocks.py DIR``. For every ``NAME.blocks`` in DIR (raw GGUF blocks of
the format NAME, e.g. ``q4_k``) writes ``NAME.f32`` (``gguf.quants.dequantize``) and
``NAME.bf16`` (those values through gguf's f32-to-bf16 rounding); for every ``NAME.values``
(little-endian f32) writes ``NAME.quant`` (``gguf.quants.quantize``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize


def qtype(name: str) -> GGMLQuantizationType:
    """The gguf type of a lower-case format name."""
    return GGMLQuantizationType[name.upper()]


def dequantize_file(path: Path) -> None:
    """Writes the f32 and bf16 dequantization of the blocks in ``path``."""
    kind = qtype(path.stem)
    _, type_size = GGML_QUANT_SIZES[kind]
    raw = np.fromfile(path, dtype=np.uint8).reshape(-1, type_size)
    values = np.asarray(dequantize(raw, kind), dtype=np.float32).reshape(-1)
    values.tofile(path.with_suffix(".f32"))
    rounded = quantize(values, GGMLQuantizationType.BF16)
    np.asarray(rounded).tofile(path.with_suffix(".bf16"))


def quantize_file(path: Path) -> None:
    """Writes gguf's quantization of the f32 values in ``path``."""
    kind = qtype(path.stem)
    block_size, _ = GGML_QUANT_SIZES[kind]
    values = np.fromfile(path, dtype=np.float32).reshape(-1, block_size)
    np.asarray(quantize(values, kind)).tofile(path.with_suffix(".quant"))


def main() -> None:
    """Processes every request file in the directory given on the command line."""
    folder = Path(sys.argv[1])
    for path in sorted(folder.glob("*.blocks")):
        dequantize_file(path)
    for path in sorted(folder.glob("*.values")):
        quantize_file(path)


if __name__ == "__main__":
    main()
