"""``specdraft quantize``: NVFP4 checkpoints in NVIDIA ModelOpt's layout.

Layout of a quantized ``NAME.weight`` of logical shape ``[out, in]``: ``NAME.weight`` uint8
``[out, in // 2]`` (two E2M1 codes a byte, the low nibble the even column),
``NAME.weight_scale`` float8_e4m3fn ``[out, in // 16]`` and ``NAME.weight_scale_2`` a float32
scalar, with ``W[r, c] = e2m1(code) * fp8(weight_scale[r, c // 16]) * weight_scale_2``. The
quantization itself is the Rust quantizer's (:func:`specdraft.quantize_nvfp4`), the one
``MtpHead`` uses when it quantizes at load.

Command line::

    specdraft quantize --nvfp4 IN_DIR OUT_DIR
    python -m specdraft.quantize --nvfp4 IN_DIR OUT_DIR

quantizes every 2-d projection weight (``*_proj``, ``fc``, ``lm_head``, ``shared_head.head``
...) of the BF16/F16/F32 safetensors in IN_DIR whose input width is a multiple of 16, copies
every other tensor unchanged, and copies the other files (``config.json``, tokenizer, ...).
Norms, embeddings, biases and MoE routers stay as they are.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

# Re-exported: the checked reader lives beside its checks.
from specdraft.safetensors_file import read_safetensors

BLOCK = 16

__all__ = [
    "quantize_checkpoint",
    "read_safetensors",
    "write_safetensors",
    "to_float32",
    "add_quantize",
    "main",
]


# Raw safetensors I/O, so BF16 needs no extra package (reading: specdraft.safetensors_file).

_DTYPES = {
    "F32": (np.float32, 4),
    "F16": (np.float16, 2),
    "BF16": (np.uint16, 2),
    "U8": (np.uint8, 1),
    "F8_E4M3": (np.uint8, 1),
    "I32": (np.int32, 4),
    "I64": (np.int64, 8),
    "U32": (np.uint32, 4),
}


def to_float32(dtype: str, shape: list[int], raw: bytes) -> np.ndarray:
    """A tensor's raw BF16, F16 or F32 bytes as a float32 array of ``shape``."""
    if dtype == "BF16":
        u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return u.view(np.float32).reshape(shape)
    if dtype in ("F32", "F16"):
        return np.frombuffer(raw, dtype=_DTYPES[dtype][0]).astype(np.float32).reshape(shape)
    raise ValueError(f"cannot read {dtype} as float")


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """Writes ``{name: (dtype, shape, raw bytes)}`` as one safetensors file."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def _quantizable(name: str, dtype: str, shape: list[int]) -> bool:
    if not name.endswith(".weight") or len(shape) != 2 or dtype not in ("BF16", "F16", "F32"):
        return False
    if shape[1] % BLOCK or "embed" in name or "norm" in name:
        return False
    # MoE routers and gates stay in full precision, as in ModelOpt checkpoints.
    return not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))


def quantize_checkpoint(in_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Writes an NVFP4 copy of the checkpoint in ``in_dir`` to ``out_dir``.

    Returns the names of the quantized weights.
    """
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    files = sorted(in_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{in_dir} holds no *.safetensors file")
    if out_dir.resolve() == in_dir.resolve():
        raise ValueError("OUT_DIR must differ from IN_DIR")
    # A refused input leaves no output folder behind (nor a half-written one).
    created = not out_dir.exists()
    try:
        return _quantize_files(files, in_dir, out_dir)
    except BaseException:
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _quantize_files(files: list[Path], in_dir: Path, out_dir: Path) -> list[str]:
    from specdraft import quantize_nvfp4

    done = []
    for f in files:
        tensors = read_safetensors(f)
        out_dir.mkdir(parents=True, exist_ok=True)
        out = {}
        for name, (dtype, shape, raw) in tensors.items():
            if not _quantizable(name, dtype, shape):
                out[name] = (dtype, shape, raw)
                continue
            w, s, g = quantize_nvfp4(to_float32(dtype, shape, raw))
            base = name[: -len(".weight")]
            out[name] = ("U8", list(w.shape), w.tobytes())
            out[base + ".weight_scale"] = ("F8_E4M3", list(s.shape), s.tobytes())
            out[base + ".weight_scale_2"] = ("F32", [], np.float32(g).tobytes())
            done.append(name)
        write_safetensors(out_dir / f.name, out)
    for other in in_dir.iterdir():
        if other.is_file() and other.suffix != ".safetensors":
            shutil.copy2(other, out_dir / other.name)
    return done


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nvfp4", action="store_true", required=True, help="NVFP4 in the ModelOpt layout"
    )
    p.add_argument("in_dir", help="checkpoint folder with BF16/F16/F32 *.safetensors")
    p.add_argument("out_dir", help="folder to write the quantized checkpoint to")


def run_quantize(args: argparse.Namespace) -> int:
    """Runs ``specdraft quantize``; returns the exit status."""
    from specdraft import SpecdraftError

    try:
        done = quantize_checkpoint(args.in_dir, args.out_dir)
    except (OSError, ValueError, SpecdraftError) as e:
        print(f"specdraft quantize: {e}", file=sys.stderr)
        return 2
    print(f"quantized {len(done)} weights to NVFP4 into {args.out_dir}")
    return 0


def add_quantize(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``specdraft quantize`` (see ``specdraft.cli.SUBCOMMANDS``)."""
    p = subparsers.add_parser("quantize", help="quantize a checkpoint's projections (NVFP4)")
    _add_arguments(p)
    p.set_defaults(run=run_quantize)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m specdraft.quantize --nvfp4 IN_DIR OUT_DIR``."""
    p = argparse.ArgumentParser(
        prog="specdraft quantize", description="Quantize a checkpoint's projections."
    )
    _add_arguments(p)
    return run_quantize(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
