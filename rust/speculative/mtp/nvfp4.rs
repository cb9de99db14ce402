//! NVFP4 (NVIDIA ModelOpt layout) quantization and dequantization on the host, and the FP8
//! E4M3 encoder its block scales (and the head's `Fp8` projections, in `fp8`) use.
//!
//! Layout: `weight` u8 `[out, in/2]`, two E2M1 codes a byte, LOW nibble = even column;
//! `weight_scale` FP8 E4M3 `[out, in/16]`, row-major; `weight_scale_2` f32 scalar.
//! `W[r, c] = e2m1(code) * fp8(weight_scale[r, c/16]) * weight_scale_2`.
//!
//! Quantization (all arithmetic in f32, in this order, so the Python converter in
//! `python/specdraft/quantize.py` produces the same bytes):
//! `weight_scale_2 = amax(|W|) / (6 * 448)`; per block of 16,
//! `scale = fp8(block_amax / (6 * weight_scale_2))`; each element's code is the E2M1 value
//! nearest to `w / (fp8_value(scale) * weight_scale_2)`, ties to the even code, saturating
//! at 6. An all-zero tensor gets `weight_scale_2 = 0` and all-zero codes and scales; a zero
//! magnitude is always code 0 (never negative zero).
//!
//! Written here rather than taken from a crate because no crate the field relies on encodes
//! E2M1 or FP8 E4M3 with ModelOpt's rounding.

use crate::backend::{e2m1_to_f32, fp8_e4m3_to_f32};
use crate::model::{DeviceAllocations, QuantizedWeight};
use crate::speculative::ProposerError;

/// The largest finite FP8 E4M3 value.
pub const FP8_E4M3_MAX: f32 = 448.0;
/// The largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;
/// Columns sharing one FP8 block scale (the `linear` op's definition).
pub use crate::backend::NVFP4_BLOCK;

/// f32 to FP8 E4M3 (`float8_e4m3fn`), round to nearest, ties to even, saturating at 448.
/// NaN becomes the NaN code `0x7f`.
pub fn fp8_e4m3_from_f32(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= FP8_E4M3_MAX {
        return sign | 0x7e;
    }
    let min_normal = 2f32.powi(-6);
    let code = if a < min_normal {
        // Subnormals step by 2^-9; code 8 (m rounding up to 8) is exactly the smallest normal.
        (a * 512.0).round_ties_even() as u8
    } else {
        let e = a.log2().floor() as i32;
        // log2 can be off by one next to a power of two; correct it exactly.
        let e = if 2f32.powi(e) > a {
            e - 1
        } else if 2f32.powi(e + 1) <= a {
            e + 1
        } else {
            e
        };
        let frac = a / 2f32.powi(e) - 1.0; // exact: a power-of-two division
        let mut m = (frac * 8.0).round_ties_even() as i32;
        let mut e = e;
        if m == 8 {
            m = 0;
            e += 1;
        }
        (((e + 7) as u8) << 3) | m as u8
    };
    if code == 0 {
        0
    } else {
        sign | code.min(0x7e)
    }
}

/// The E2M1 code (bit 3 sign) nearest to `v`, ties to the even code, saturating at ±6.
pub fn e2m1_from_f32(v: f32) -> u8 {
    let a = v.abs();
    // Midpoints of [0, .5, 1, 1.5, 2, 3, 4, 6]; at a tie the even code (inclusive bound) wins.
    let mag = if a.is_nan() || a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    if mag != 0 && v < 0.0 {
        mag | 0x08
    } else {
        mag
    }
}

/// An NVFP4 tensor on the host, in the ModelOpt layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Nvfp4Host {
    /// u8 `[out_features, in_features / 2]`, low nibble = even column.
    pub codes: Vec<u8>,
    /// FP8 E4M3 `[out_features, in_features / 16]`.
    pub scales: Vec<u8>,
    /// `weight_scale_2`.
    pub global_scale: f32,
    /// Rows.
    pub out_features: usize,
    /// Columns (a multiple of 16).
    pub in_features: usize,
}

fn bad_shape(message: String) -> ProposerError {
    ProposerError::InvalidArgument {
        method: "quantize_nvfp4",
        message,
    }
}

/// Quantizes a row-major `[out_features, in_features]` f32 matrix to NVFP4.
pub fn quantize_nvfp4(
    w: &[f32],
    out_features: usize,
    in_features: usize,
) -> Result<Nvfp4Host, ProposerError> {
    if in_features == 0 || !in_features.is_multiple_of(NVFP4_BLOCK) {
        return Err(bad_shape(format!(
            "in_features {in_features} must be a positive multiple of {NVFP4_BLOCK}"
        )));
    }
    if out_features.checked_mul(in_features) != Some(w.len()) {
        return Err(bad_shape(format!(
            "a [{out_features}, {in_features}] matrix has {} values, got {}",
            out_features.saturating_mul(in_features),
            w.len()
        )));
    }
    if let Some(i) = w.iter().position(|x| !x.is_finite()) {
        return Err(bad_shape(format!(
            "element {i} (row {}, column {}) is {}; only finite weights can be quantized",
            i / in_features,
            i % in_features,
            w[i]
        )));
    }
    let amax = w.iter().fold(0f32, |m, x| m.max(x.abs()));
    let global_scale = amax / (E2M1_MAX * FP8_E4M3_MAX);
    let blocks = w.len() / NVFP4_BLOCK;
    let mut codes = vec![0u8; w.len() / 2];
    let mut scales = vec![0u8; blocks];
    if global_scale > 0.0 {
        for b in 0..blocks {
            let block = &w[b * NVFP4_BLOCK..(b + 1) * NVFP4_BLOCK];
            let bamax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
            let s = fp8_e4m3_from_f32(bamax / (E2M1_MAX * global_scale));
            scales[b] = s;
            let denom = fp8_e4m3_to_f32(s) * global_scale;
            if denom == 0.0 {
                continue;
            }
            for (j, &x) in block.iter().enumerate() {
                let c = e2m1_from_f32(x / denom);
                let idx = b * NVFP4_BLOCK + j;
                codes[idx / 2] |= if idx.is_multiple_of(2) { c } else { c << 4 };
            }
        }
    }
    Ok(Nvfp4Host {
        codes,
        scales,
        global_scale,
        out_features,
        in_features,
    })
}

impl Nvfp4Host {
    /// The dequantized matrix, `[out_features, in_features]` row-major, by the format's formula.
    pub fn dequantize(&self) -> Vec<f32> {
        dequantize_nvfp4(
            &self.codes,
            &self.scales,
            self.global_scale,
            self.out_features,
            self.in_features,
        )
    }

    /// Uploads into `allocs` as a [`QuantizedWeight`].
    pub fn upload(&self, allocs: &DeviceAllocations, name: &str) -> crate::Result<QuantizedWeight> {
        Ok(QuantizedWeight {
            weight: allocs.upload(&self.codes, name)?,
            weight_scale: allocs.upload(&self.scales, &format!("{name}.weight_scale"))?,
            weight_scale_2: self.global_scale,
            input_scale: None,
            out_features: self.out_features,
            in_features: self.in_features,
        })
    }
}

/// `W[r, c] = e2m1(code) * fp8(scale[r, c/16]) * global_scale`, in f32, row-major.
pub fn dequantize_nvfp4(
    codes: &[u8],
    scales: &[u8],
    global_scale: f32,
    out_features: usize,
    in_features: usize,
) -> Vec<f32> {
    let n = out_features * in_features;
    (0..n)
        .map(|i| {
            let byte = codes[i / 2];
            let code = if i % 2 == 0 { byte & 0x0f } else { byte >> 4 };
            e2m1_to_f32(code) * fp8_e4m3_to_f32(scales[i / NVFP4_BLOCK]) * global_scale
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_round_trips_every_finite_code_and_rounds_ties_to_even() {
        for code in 0u8..=255 {
            let v = fp8_e4m3_to_f32(code);
            if v.is_nan() || code == 0x80 {
                continue;
            }
            assert_eq!(fp8_e4m3_from_f32(v), code, "code {code:#x} value {v}");
        }
        // 1.0625 lies halfway between 1.0 (mantissa 0) and 1.125 (mantissa 1): even wins.
        assert_eq!(fp8_e4m3_from_f32(1.0625), 0x38);
        // 1.1875 lies halfway between 1.125 (m=1) and 1.25 (m=2): even wins.
        assert_eq!(fp8_e4m3_from_f32(1.1875), 0x3a);
        assert_eq!(fp8_e4m3_from_f32(1e9), 0x7e);
        assert_eq!(fp8_e4m3_from_f32(-1e9), 0xfe);
        // Halfway between the two smallest subnormals, 2^-9 and 2^-8: even (2^-8) wins.
        assert_eq!(fp8_e4m3_from_f32(1.5 * 2f32.powi(-9)), 0x02);
        assert_eq!(fp8_e4m3_from_f32(0.4 * 2f32.powi(-9)), 0x00);
    }

    #[test]
    fn e2m1_rounds_to_nearest_with_ties_to_even_codes() {
        let cases = [
            (0.25, 0),
            (0.26, 1),
            (0.75, 2),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (3.5, 6),
            (5.0, 6),
            (5.01, 7),
            (100.0, 7),
            (-0.6, 9),
            (-0.1, 0),
        ];
        for (v, code) in cases {
            assert_eq!(e2m1_from_f32(v), code, "value {v}");
        }
    }
}
