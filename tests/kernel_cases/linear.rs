//! The `linear` cases: BF16 and NVFP4 weights, with or without a bias, on random rows
//! ([`LinearCase`] names a case's shape).

use super::*;

/// The shape of one `linear` case; `x` is drawn from `seed`, the bias from `seed + 2`, and
/// the weight's own draws are the case's (from `seed + 1` on).
pub struct LinearCase {
    pub rows: usize,
    pub inf: usize,
    pub outf: usize,
    pub out_dtype: Dtype,
    pub with_bias: bool,
    pub seed: u64,
}

impl LinearCase {
    pub fn new(
        rows: usize,
        inf: usize,
        outf: usize,
        out_dtype: Dtype,
        with_bias: bool,
        seed: u64,
    ) -> Self {
        LinearCase {
            rows,
            inf,
            outf,
            out_dtype,
            with_bias,
            seed,
        }
    }

    /// Runs `linear` with the weight `weight` uploads into the scope, on `dut` and on the
    /// reference, and compares with the output dtype's `rtol` and the case's `atol`.
    pub fn check(
        &self,
        dut: &dyn GpuBackend,
        what: &str,
        atol: f32,
        weight: impl Fn(&Scope) -> Result<LinearWeight, BackendError>,
    ) -> Result<(), String> {
        let (rows, outf, out_dtype) = (self.rows, self.outf, self.out_dtype);
        let x = uniform(self.seed, rows * self.inf, -1.0, 1.0);
        let bias = uniform(self.seed + 2, outf, -1.0, 1.0);
        let (got, want) = both(dut, |b| {
            let s = Scope::new(b);
            let px = s.bf16(&x)?;
            let weight = weight(&s)?;
            let pb = if self.with_bias {
                Some(s.bf16(&bias)?)
            } else {
                None
            };
            let o = s.out(out_dtype, rows * outf)?;
            b.linear(LinearArgs {
                out: o,
                out_dtype,
                x: px,
                weight,
                bias: pb,
                rows,
                in_features: self.inf,
                out_features: outf,
                stream: 0,
            })?;
            match out_dtype {
                Dtype::F32 => b.download::<f32>(o, rows * outf),
                _ => b.download_bf16(o, rows * outf),
            }
        })?;
        let rtol = if out_dtype == Dtype::F32 {
            F32_RTOL
        } else {
            BF16_RTOL
        };
        close(what, &got, &want, rtol, atol)
    }
}

pub fn linear(
    dut: &dyn GpuBackend,
    rows: usize,
    inf: usize,
    outf: usize,
    out_dtype: Dtype,
    with_bias: bool,
    seed: u64,
) -> Result<(), String> {
    let w = uniform(seed + 1, outf * inf, -1.0, 1.0);
    let case = LinearCase::new(rows, inf, outf, out_dtype, with_bias, seed);
    // f32 sums of `inf` products of size <= 1 in a different order.
    case.check(dut, "linear", 1e-5 * inf as f32, |s| {
        Ok(LinearWeight::Bf16 {
            weight: s.bf16(&w)?,
        })
    })
}

pub fn linear_nvfp4(
    dut: &dyn GpuBackend,
    rows: usize,
    inf: usize,
    outf: usize,
    out_dtype: Dtype,
    with_bias: bool,
    seed: u64,
) -> Result<(), String> {
    let mut r = rng(seed + 1);
    let codes: Vec<u8> = (0..outf * inf / 2).map(|_| r.random()).collect();
    // Scale bytes over the normal and subnormal E4M3 range, avoiding NaN (0x7f / 0xff).
    let scales: Vec<u8> = (0..outf * inf / 16)
        .map(|_| r.random_range(0u8..0x60) | if r.random() { 0x80 } else { 0 })
        .collect();
    let case = LinearCase::new(rows, inf, outf, out_dtype, with_bias, seed);
    case.check(dut, "linear_nvfp4", 1e-5 * inf as f32, |s| {
        Ok(LinearWeight::Nvfp4 {
            codes: s.u8(&codes)?,
            block_scales: s.u8(&scales)?,
            global_scale: 0.0123,
        })
    })
}
