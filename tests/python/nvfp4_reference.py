"""An independent numpy NVFP4 quantizer (NVIDIA ModelOpt's checkpoint layout), the
reference the Rust quantizer (``specdraft.quantize_nvfp4``) is checked against.

Layout of a quantized ``NAME.weight`` of logical shape ``[out, in]``:

* ``NAME.weight``: uint8 ``[out, in // 2]``, two E2M1 codes a byte, the LOW nibble holds
  the even column; code bit 3 is the sign, bits 0-2 index ``[0, .5, 1, 1.5, 2, 3, 4, 6]``.
* ``NAME.weight_scale``: float8_e4m3fn ``[out, in // 16]``, one scale per 16 columns.
* ``NAME.weight_scale_2``: float32 scalar.

``W[r, c] = e2m1(code) * fp8(weight_scale[r, c // 16]) * weight_scale_2``.

Quantization, all in float32 and in this order: ``weight_scale_2 = amax / (6 * 448)``;
per block ``scale = fp8(block_amax / (6 * weight_scale_2))``; each code is the E2M1 value
nearest to ``w / (fp8_value(scale) * weight_scale_2)``, ties to the even code, saturating at
6. An all-zero tensor gets ``weight_scale_2 = 0`` and zero codes and scales.
"""

from __future__ import annotations

import numpy as np

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
FP8_E4M3_MAX = np.float32(448.0)
E2M1_MAX = np.float32(6.0)
BLOCK = 16


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
