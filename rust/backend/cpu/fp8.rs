//! FP8 E4M3 weight rows for the CPU `linear` (W8A16, DeepSeek-V3's block-scaled layout):
//! each row is decoded into the task's f32 scratch and then goes through the same dot as
//! every other format.
//!
//! Invariant: a decoded element is `e4m3(byte) * scale` computed in f32, one multiply, so
//! with a power-of-two scale it is exactly the value a BF16 copy of the FP8-rounded weight
//! holds, and the product equals the BF16 `linear` of that copy bit for bit.

use super::formats::fp8_e4m3_to_f32;
use super::linear::WeightRows;
use crate::backend::FP8_BLOCK;
use std::sync::OnceLock;

/// The value of every E4M3 byte (a table: the decode is on the hot path of a decode step).
fn e4m3_values() -> &'static [f32; 256] {
    static TABLE: OnceLock<[f32; 256]> = OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| fp8_e4m3_to_f32(b as u8)))
}

/// FP8 weights `[out_features, in_features]` with f32 scales per 128 x 128 block.
pub(super) struct Fp8Rows<'a> {
    pub weight: &'a [u8],
    /// `[ceil(out_features / 128), ceil(in_features / 128)]`.
    pub block_scales: &'a [f32],
    pub in_features: usize,
}

impl WeightRows for Fp8Rows<'_> {
    type Elem = f32;

    fn row<'a>(&'a self, o: usize, buf: &'a mut Vec<f32>) -> &'a [f32] {
        let n = self.in_features;
        let values = e4m3_values();
        let blocks = n.div_ceil(FP8_BLOCK);
        let scales = &self.block_scales[o / FP8_BLOCK * blocks..][..blocks];
        let codes = &self.weight[o * n..(o + 1) * n];
        buf.resize(n, 0.0);
        for ((out, codes), &scale) in buf
            .chunks_mut(FP8_BLOCK)
            .zip(codes.chunks(FP8_BLOCK))
            .zip(scales)
        {
            for (d, &c) in out.iter_mut().zip(codes) {
                *d = values[c as usize] * scale;
            }
        }
        buf
    }
}
