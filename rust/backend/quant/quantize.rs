//! Quantization of f32 weights into GGUF block formats (quantize-on-load of float checkpoints).
//!
//! The legacy formats follow ggml's reference quantizers (`quantize_row_*_ref`) operation for
//! operation, so their bytes equal ggml's and the `gguf` package's. Per-element error bounds
//! (`amax` = largest |x| of the block, `d` the stored f16 scale, `u = 2^-24`):
//! - Q8_0: `|x - x^| <= d/2 + 127 |d - amax/127|`, about `amax/254 * (1 + 2^-4)`.
//! - Q4_0 / Q5_0: the block's extreme value maps to code 0; a value of the opposite sign and
//!   the same magnitude clamps one step short, so `|x - x^| <= amax/8` (Q4_0), `amax/16`
//!   (Q5_0), plus the f16 rounding of `d` (`2^-11` relative per step of the code).
//! - Q4_1 / Q5_1: `|x - x^| <= (max - min)/30` (`/62`), plus the f16 rounding of `d` and `m`.
//!
//! The K-quants are in [`super::quantize_k`].

use super::blocks::{pack_codes, spec};
use super::dequant::check_lengths;
use super::quantize_k;
use super::{BlockFormat, QuantError};
use half::{bf16, f16};

/// Quantizes `values` (a whole number of blocks) into `out` (exactly their bytes).
pub fn quantize(format: BlockFormat, values: &[f32], out: &mut [u8]) -> Result<(), QuantError> {
    check_lengths(format, out.len(), values.len())?;
    let n = format.block_len();
    let bytes = format.block_bytes();
    let blocks = values.chunks_exact(n).zip(out.chunks_exact_mut(bytes));
    match format {
        BlockFormat::F32 => blocks.for_each(|(x, o)| o.copy_from_slice(&x[0].to_le_bytes())),
        BlockFormat::F16 => {
            blocks.for_each(|(x, o)| o.copy_from_slice(&f16::from_f32(x[0]).to_le_bytes()))
        }
        BlockFormat::BF16 => {
            blocks.for_each(|(x, o)| o.copy_from_slice(&bf16::from_f32(x[0]).to_le_bytes()))
        }
        BlockFormat::Q8_0 => blocks.for_each(|(x, o)| q8_0(x, o)),
        BlockFormat::Q4_0 | BlockFormat::Q5_0 => blocks.for_each(|(x, o)| symmetric(format, x, o)),
        BlockFormat::Q4_1 | BlockFormat::Q5_1 => blocks.for_each(|(x, o)| affine(format, x, o)),
        BlockFormat::Q4_K | BlockFormat::Q5_K | BlockFormat::Q6_K => {
            blocks.for_each(|(x, o)| quantize_k::quantize_block(format, x, o))
        }
        BlockFormat::Q2_K | BlockFormat::Q3_K => {
            return Err(QuantError::QuantizeUnsupported(format))
        }
    }
    Ok(())
}

/// [`quantize`] into a new buffer.
pub fn quantize_to_vec(format: BlockFormat, values: &[f32]) -> Result<Vec<u8>, QuantError> {
    let mut out = vec![0u8; format.row_bytes(values.len())?];
    quantize(format, values, &mut out)?;
    Ok(out)
}

/// `1 / d`, or 0 for a zero scale (an all-zero block).
fn inverse(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

/// Q8_0: `d = amax / 127`, codes rounded half away from zero.
fn q8_0(x: &[f32], out: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (o, v) in out[2..].iter_mut().zip(x) {
        *o = (v * id).round() as i8 as u8;
    }
}

/// Q4_0 / Q5_0: the value of largest magnitude (the first if tied) gets code 0.
fn symmetric(format: BlockFormat, x: &[f32], out: &mut [u8]) {
    let levels = 1u32 << spec(format).expect("quantized").bits;
    let half = (levels / 2) as f32;
    let mut max = 0f32;
    for &v in x {
        if v.abs() > max.abs() {
            max = v;
        }
    }
    let d = max / -half;
    let id = inverse(d);
    let codes: Vec<u8> = x
        .iter()
        .map(|v| ((v * id + (half + 0.5)).trunc() as u8).min((levels - 1) as u8))
        .collect();
    out.fill(0);
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    pack_codes(format, &codes, out);
}

/// Q4_1 / Q5_1: `d = (max - min) / (levels - 1)`, `m = min`, codes rounded half up.
fn affine(format: BlockFormat, x: &[f32], out: &mut [u8]) {
    let levels = 1u32 << spec(format).expect("quantized").bits;
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let min = x.iter().fold(f32::INFINITY, |m, &v| m.min(v));
    let d = (max - min) / (levels - 1) as f32;
    let id = inverse(d);
    let codes: Vec<u8> = x
        .iter()
        .map(|v| (((v - min) * id + 0.5).trunc() as u8).min((levels - 1) as u8))
        .collect();
    out.fill(0);
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    out[2..4].copy_from_slice(&f16::from_f32(min).to_le_bytes());
    pack_codes(format, &codes, out);
}
