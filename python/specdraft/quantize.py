"""NVFP4 quantization in NVIDIA ModelOpt's checkpoint layout, with numpy.

Layout of a quantized ``NAME.weight`` of logical shape ``[out, in]``:

* ``NAME.weight``: uint8 ``[out, in // 2]``, two E2M1 codes a byte, the LOW nibble holds
  the even column; code bit 3 is the sign, bits 0-2 index ``[0, .5, 1, 1.5, 2, 3, 4, 6]``.
* ``NAME.weight_scale``: float8_e4m3fn ``[out, in // 16]``, one scale per 16 columns.
* ``NAME.weight_scale_2``: float32 scalar.

``W[r, c] = e2m1(code) * fp8(weight_scale[r, c // 16]) * weight_scale_2``.

Quantization, all in float32 and in this order (the Rust quantizer in
``rust/speculative/mtp/nvfp4.rs`` makes the same bytes): ``weight_scale_2 = amax / (6 * 448)``;
per block ``scale = fp8(block_amax / (6 * weight_scale_2))``; each code is the E2M1 value
nearest to ``w / (fp8_value(scale) * weight_scale_2)``, ties to the even code, saturating at 6.
An all-zero tensor gets ``weight_scale_2 = 0`` and zero codes and scales.

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

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
FP8_E4M3_MAX = np.float32(448.0)
E2M1_MAX = np.float32(6.0)
BLOCK = 16

__all__ = [
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "fp8_e4m3_encode",
    "fp8_e4m3_decode",
    "quantize_checkpoint",
    "add_quantize",
    "main",
]


def fp8_e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes to float32 (``S.1111.111`` is NaN, no infinities)."""
    c = np.asarray(codes, dtype=np.uint8).astype(np.int32)
    sign = np.where(c & 0x80, np.float32(-1.0), np.float32(1.0))
    exp = (c >> 3) & 0x0F
    man = (c & 0x07).astype(np.float32)
    sub = man / np.float32(8.0) * np.float32(2.0**-6)
    norm = (np.float32(1.0) + man / np.float32(8.0)) * np.exp2(
        exp.astype(np.float32) - np.float32(7.0)
    )
    v = np.where(exp == 0, sub, norm).astype(np.float32) * sign
    return np.where((exp == 0x0F) & ((c & 0x07) == 0x07), np.float32(np.nan), v).astype(np.float32)


def fp8_e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 to float8_e4m3fn bytes: nearest, ties to even, saturating at 448."""
    x = np.asarray(x, dtype=np.float32)
    sign = np.where(np.signbit(x), 0x80, 0).astype(np.int32)
    a = np.abs(x)
    out = np.zeros(x.shape, dtype=np.int32)
    sub = a < np.float32(2.0**-6)
    out[sub] = np.rint(a[sub] * np.float32(512.0)).astype(np.int32)  # rint: ties to even
    an = a[~sub]
    m_, e_ = np.frexp(an)  # an = m_ * 2**e_, m_ in [0.5, 1)
    e = e_.astype(np.int32) - 1
    frac = np.ldexp(an, -e) - np.float32(1.0)  # exact: power-of-two scaling
    m = np.rint(frac * np.float32(8.0)).astype(np.int32)
    carry = m == 8
    m[carry] = 0
    e[carry] += 1
    out[~sub] = ((e + 7) << 3) | m
    out = np.minimum(out, 0x7E)
    out[a >= FP8_E4M3_MAX] = 0x7E
    res = np.where(out == 0, 0, sign | out)
    res = np.where(np.isnan(x), 0x7F, res)
    return res.astype(np.uint8)


def _e2m1_encode(v: np.ndarray) -> np.ndarray:
    a = np.abs(v)
    # Midpoints; at a tie the even code wins (inclusive bound for even codes).
    mag = np.select(
        [a <= 0.25, a < 0.75, a <= 1.25, a < 1.75, a <= 2.5, a < 3.5, a <= 5.0],
        [0, 1, 2, 3, 4, 5, 6],
        default=7,
    ).astype(np.uint8)
    mag = np.where(np.isnan(a), 0, mag).astype(np.uint8)
    return np.where((mag != 0) & (v < 0), mag | 0x08, mag).astype(np.uint8)


def quantize_nvfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """Quantizes a ``[out, in]`` matrix to NVFP4.

    Returns ``(weight u8 [out, in/2], weight_scale u8 (fp8 bytes) [out, in/16],
    weight_scale_2 float32)``.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] == 0 or w.shape[1] % BLOCK:
        raise ValueError(
            f"expected a [out, in] matrix with in a multiple of {BLOCK}, got shape {w.shape}"
        )
    if not np.all(np.isfinite(w)):
        raise ValueError("only finite weights can be quantized")
    out_f, in_f = w.shape
    amax = np.float32(np.max(np.abs(w))) if w.size else np.float32(0)
    g = np.float32(amax / (E2M1_MAX * FP8_E4M3_MAX))
    blocks = w.reshape(out_f, in_f // BLOCK, BLOCK)
    if g == 0:
        return (
            np.zeros((out_f, in_f // 2), np.uint8),
            np.zeros((out_f, in_f // BLOCK), np.uint8),
            np.float32(0.0),
        )
    bamax = np.max(np.abs(blocks), axis=2).astype(np.float32)
    scales = fp8_e4m3_encode((bamax / (E2M1_MAX * g)).astype(np.float32))
    denom = (fp8_e4m3_decode(scales) * g).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = (blocks / denom[:, :, None]).astype(np.float32)
    codes = _e2m1_encode(v)
    codes = np.where(denom[:, :, None] == 0, 0, codes).astype(np.uint8).reshape(out_f, in_f)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, scales, g


def dequantize_nvfp4(
    weight: np.ndarray, weight_scale: np.ndarray, weight_scale_2: float
) -> np.ndarray:
    """The float32 ``[out, in]`` matrix the format describes."""
    weight = np.asarray(weight, dtype=np.uint8)
    codes = np.empty((weight.shape[0], weight.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2] = weight & 0x0F
    codes[:, 1::2] = weight >> 4
    vals = E2M1_VALUES[codes & 0x07] * np.where(codes & 0x08, np.float32(-1), np.float32(1))
    scales = np.repeat(fp8_e4m3_decode(weight_scale), BLOCK, axis=1)
    return (vals.astype(np.float32) * scales * np.float32(weight_scale_2)).astype(np.float32)


# --- safetensors I/O (raw, so BF16 needs no extra package) -----------------------------

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


def read_safetensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """``{name: (dtype, shape, raw bytes)}`` of one safetensors file."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], data[8 + n + a : 8 + n + b])
    return out


def to_float32(dtype: str, shape: list[int], raw: bytes) -> np.ndarray:
    if dtype == "BF16":
        u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return u.view(np.float32).reshape(shape)
    if dtype in ("F32", "F16"):
        return np.frombuffer(raw, dtype=_DTYPES[dtype][0]).astype(np.float32).reshape(shape)
    raise ValueError(f"cannot read {dtype} as float")


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
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
    out_dir.mkdir(parents=True, exist_ok=True)
    done = []
    for f in files:
        tensors = read_safetensors(f)
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
    try:
        done = quantize_checkpoint(args.in_dir, args.out_dir)
    except (OSError, ValueError) as e:
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
