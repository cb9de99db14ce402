//! The FP8 `linear` case: random E4M3 weights (every finite code, NaN codes left out) with
//! a distinct f32 scale per 128 x 128 block, on the backend under test and on the CPU
//! reference. Tolerances as in `mod.rs`, with `atol` covering f32 sums of `in_features`
//! products of magnitude at most 448 * 2^-6 = 7 taken in a different order.

use super::{rng, uniform, LinearCase};
use rand::Rng;
use specdraft::backend::{Dtype, GpuBackend, LinearWeight, FP8_BLOCK};

pub fn linear_fp8(
    dut: &dyn GpuBackend,
    rows: usize,
    inf: usize,
    outf: usize,
    out_dtype: Dtype,
    with_bias: bool,
    seed: u64,
) -> Result<(), String> {
    let mut r = rng(seed + 1);
    let codes: Vec<u8> = (0..outf * inf)
        .map(|_| loop {
            let c: u8 = r.random();
            if c & 0x7f != 0x7f {
                break c;
            }
        })
        .collect();
    let blocks = outf.div_ceil(FP8_BLOCK) * inf.div_ceil(FP8_BLOCK);
    let scales = uniform(seed + 3, blocks, 1.0 / 1024.0, 1.0 / 64.0);
    let case = LinearCase::new(rows, inf, outf, out_dtype, with_bias, seed);
    case.check(dut, "linear_fp8", 7.0 * 1e-6 * inf as f32, |s| {
        Ok(LinearWeight::Fp8 {
            weight: s.u8(&codes)?,
            block_scales: s.f32(&scales)?,
        })
    })
}
