//! The FP8 `linear` case: random E4M3 weights (every finite code, NaN codes left out) with
//! a distinct f32 scale per 128 x 128 block, on the backend under test and on the CPU
//! reference. Tolerances as in `mod.rs`, with `atol` covering f32 sums of `in_features`
//! products of magnitude at most 448 * 2^-6 = 7 taken in a different order.

use super::{both, close, rng, uniform, Scope, BF16_RTOL, F32_RTOL};
use rand::Rng;
use specdraft::backend::{Dtype, GpuBackend, GpuBackendExt, LinearArgs, LinearWeight, FP8_BLOCK};

pub fn linear_fp8(
    dut: &dyn GpuBackend,
    rows: usize,
    inf: usize,
    outf: usize,
    out_dtype: Dtype,
    with_bias: bool,
    seed: u64,
) -> Result<(), String> {
    let x = uniform(seed, rows * inf, -1.0, 1.0);
    let bias = uniform(seed + 2, outf, -1.0, 1.0);
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
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let (px, pw, ps) = (s.bf16(&x)?, s.u8(&codes)?, s.f32(&scales)?);
        let pb = if with_bias {
            Some(s.bf16(&bias)?)
        } else {
            None
        };
        let o = s.out(out_dtype, rows * outf)?;
        b.linear(LinearArgs {
            out: o,
            out_dtype,
            x: px,
            weight: LinearWeight::Fp8 {
                weight: pw,
                block_scales: ps,
            },
            bias: pb,
            rows,
            in_features: inf,
            out_features: outf,
            stream: 0,
        })?;
        match out_dtype {
            Dtype::F32 => b.download::<f32>(o, rows * outf),
            _ => b.download_bf16(o, rows * outf),
        }
    })?;
    let atol = 7.0 * 1e-6 * inf as f32;
    let rtol = if out_dtype == Dtype::F32 {
        F32_RTOL
    } else {
        BF16_RTOL
    };
    close("linear_fp8", &got, &want, rtol, atol)
}
