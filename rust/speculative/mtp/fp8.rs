//! FP8 E4M3 storage of the head's projections under [`MtpQuantization::Fp8`], in the
//! block-scaled layout of the `linear` op ([`LinearWeight::Fp8`]): one E4M3 byte per element
//! and an f32 scale per 128 x 128 block.
//!
//! A BF16 projection is quantized with one power-of-two scale for the whole tensor,
//! `2^ceil(log2(amax / 448))`, written into every block: each stored value `e4m3 * 2^k` is
//! then exact in BF16 and in f32, so the FP8 head computes bit for bit what a BF16 head
//! computes on the same weights rounded to that grid (the `linear` op decodes in f32 with one
//! multiply). A checkpoint that is already FP8 keeps its own bytes and block scales.
//!
//! [`MtpQuantization::Fp8`]: super::MtpQuantization::Fp8
//! [`LinearWeight::Fp8`]: crate::backend::LinearWeight::Fp8

use super::nvfp4::{fp8_e4m3_from_f32, FP8_E4M3_MAX};
use crate::backend::FP8_BLOCK;
use crate::speculative::ProposerError;

/// An FP8 tensor on the host, in the layout the `linear` op reads.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Host {
    /// E4M3 bytes `[out_features, in_features]`.
    pub codes: Vec<u8>,
    /// f32 `[ceil(out_features / 128), ceil(in_features / 128)]`.
    pub block_scales: Vec<f32>,
}

/// Quantizes row-major `w` (`[out_features, in_features]`) to E4M3 with one power-of-two
/// tensor scale in every block (round to nearest, ties to even; an all-zero tensor gets
/// scale 1). A NaN or infinite value is refused: no FP8 code stands for it faithfully.
pub fn quantize_fp8(
    w: &[f32],
    out_features: usize,
    in_features: usize,
) -> Result<Fp8Host, ProposerError> {
    let bad = |message: String| ProposerError::InvalidArgument {
        method: "quantize_fp8",
        message,
    };
    if out_features.checked_mul(in_features) != Some(w.len()) {
        return Err(bad(format!(
            "{} values for a [{out_features}, {in_features}] weight",
            w.len()
        )));
    }
    if let Some(i) = w.iter().position(|x| !x.is_finite()) {
        return Err(bad(format!("element {i} is {}, not finite", w[i])));
    }
    let amax = w.iter().fold(0f32, |m, x| m.max(x.abs()));
    let scale = if amax == 0.0 {
        1.0
    } else {
        2f32.powi((amax / FP8_E4M3_MAX).log2().ceil() as i32)
    };
    let blocks = out_features.div_ceil(FP8_BLOCK) * in_features.div_ceil(FP8_BLOCK);
    Ok(Fp8Host {
        // Division by a power of two is exact, so the only rounding is the encoder's.
        codes: w.iter().map(|&x| fp8_e4m3_from_f32(x / scale)).collect(),
        block_scales: vec![scale; blocks],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_keeps_the_largest_value_in_range_and_refuses_non_finite() {
        // amax 1000: scale 4 (1000 / 4 = 250 <= 448 < 1000 / 2).
        let q = quantize_fp8(&[1000.0, -1.0, 0.0, 3.0], 2, 2).unwrap();
        assert_eq!(q.block_scales, vec![4.0]);
        assert_eq!(crate::backend::fp8_e4m3_to_f32(q.codes[0]) * 4.0, 1024.0);
        assert_eq!(q.codes[2], 0);
        let zeros = quantize_fp8(&[0.0; 3], 1, 3).unwrap();
        assert_eq!((zeros.codes, zeros.block_scales), (vec![0; 3], vec![1.0]));
        assert!(quantize_fp8(&[1.0, f32::NAN], 1, 2).is_err());
        assert!(quantize_fp8(&[1.0, 2.0], 1, 3).is_err());
        // 129 x 130: a 2 x 2 grid of blocks.
        let big = quantize_fp8(&vec![0.5; 129 * 130], 129, 130).unwrap();
        assert_eq!(big.block_scales.len(), 4);
    }
}
