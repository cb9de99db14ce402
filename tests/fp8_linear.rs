//! The FP8 `linear` against an outside reference: an E4M3 decoder written here from the
//! format's definition and the product computed in f64.
//!
//! E4M3 (`float8_e4m3fn`): 1 sign bit, 4 exponent bits with bias 7, 3 mantissa bits;
//! exponent 0 holds the subnormals `m / 8 * 2^-6`; there is no infinity, and `S.1111.111`
//! (0x7F, 0xFF) is NaN, so the largest magnitude is 0x7E = 448. The weight layout is
//! DeepSeek-V3's: `W[o, c] = e4m3(weight[o, c]) * scale[o / 128, c / 128]`.
//!
//! Bound: the kernel decodes each weight in f32 (one rounding of `e4m3 * scale`), multiplies
//! by a BF16 input (one rounding) and adds `in_features` such terms plus the bias in f32, so
//! `|got - exact| <= (in_features + 3) * 2^-24 * (sum_c |W[o, c] x[c]| + |bias[o]|)`, the
//! classical bound for a sum of rounded products in any order.

use half::bf16;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::{
    CpuBackend, DevicePtr, Dtype, GpuBackend, GpuBackendExt, Kernels, LinearArgs, LinearWeight,
};

/// E4M3 from its bit fields, in f64.
fn e4m3(byte: u8) -> f64 {
    let sign = if byte >> 7 == 1 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((byte >> 3) & 0x0f), f64::from(byte & 0x07));
    if e == 15 && m == 7.0 {
        return f64::NAN;
    }
    if e == 0 {
        sign * (m / 8.0) * 2f64.powi(1 - 7)
    } else {
        sign * (1.0 + m / 8.0) * 2f64.powi(e - 7)
    }
}

const BLOCK: usize = 128;

struct Case {
    rows: usize,
    inf: usize,
    outf: usize,
    codes: Vec<u8>,
    scales: Vec<f32>,
    x: Vec<f32>,
    bias: Vec<f32>,
}

impl Case {
    /// Every code but the NaNs, cycled through the matrix from a random start per row, so
    /// each code (subnormals and both signs included) lands in several blocks.
    fn new(rows: usize, inf: usize, outf: usize, seed: u64) -> Case {
        let finite: Vec<u8> = (0..=255u8).filter(|c| c & 0x7f != 0x7f).collect();
        Case::from_codes(rows, inf, outf, seed, &finite)
    }

    /// Codes taken from `finite` only.
    fn from_codes(rows: usize, inf: usize, outf: usize, seed: u64, finite: &[u8]) -> Case {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut codes = Vec::with_capacity(outf * inf);
        for _ in 0..outf {
            let start = rng.random_range(0..finite.len());
            codes.extend((0..inf).map(|c| finite[(start + c) % finite.len()]));
        }
        let blocks = outf.div_ceil(BLOCK) * inf.div_ceil(BLOCK);
        // Scales that are not powers of two, each block its own.
        let scales = (0..blocks)
            .map(|_| rng.random_range(0.001f32..0.05))
            .collect();
        let bf = |v: f32| bf16::from_f32(v).to_f32();
        let x = (0..rows * inf)
            .map(|_| bf(rng.random_range(-2.0..2.0)))
            .collect();
        let bias = (0..outf).map(|_| bf(rng.random_range(-1.0..1.0))).collect();
        Case {
            rows,
            inf,
            outf,
            codes,
            scales,
            x,
            bias,
        }
    }

    fn weight(&self, o: usize, c: usize) -> f64 {
        let blocks_per_row = self.inf.div_ceil(BLOCK);
        let scale = self.scales[o / BLOCK * blocks_per_row + c / BLOCK];
        e4m3(self.codes[o * self.inf + c]) * f64::from(scale)
    }

    /// `(exact, bound)` for row `r`, feature `o`.
    fn reference(&self, r: usize, o: usize) -> (f64, f64) {
        let (mut sum, mut mag) = (f64::from(self.bias[o]), f64::from(self.bias[o].abs()));
        for c in 0..self.inf {
            let t = self.weight(o, c) * f64::from(self.x[r * self.inf + c]);
            sum += t;
            mag += t.abs();
        }
        (sum, (self.inf + 3) as f64 * 2f64.powi(-24) * mag)
    }

    /// The backend's f32 output, `[rows, outf]`.
    fn run(&self, gpu: &dyn GpuBackend) -> Vec<f32> {
        let w = gpu.upload(&self.codes, "test fp8 weight").unwrap();
        let s = gpu.upload(&self.scales, "test fp8 scales").unwrap();
        let x = gpu.upload_bf16(&self.x, "test x").unwrap();
        let b = gpu.upload_bf16(&self.bias, "test bias").unwrap();
        let out = gpu.alloc(self.rows * self.outf * 4, "test out").unwrap();
        gpu.linear(LinearArgs {
            out,
            out_dtype: Dtype::F32,
            x,
            weight: LinearWeight::Fp8 {
                weight: w,
                block_scales: s,
            },
            bias: Some(b),
            rows: self.rows,
            in_features: self.inf,
            out_features: self.outf,
            stream: 0,
        })
        .unwrap();
        let got = gpu.download::<f32>(out, self.rows * self.outf).unwrap();
        for p in [w, s, x, b, out] {
            gpu.free(p).unwrap();
        }
        got
    }
}

#[test]
fn the_decoder_here_follows_the_definition() {
    assert_eq!(e4m3(0x7e), 448.0);
    assert_eq!(e4m3(0xfe), -448.0);
    assert_eq!(e4m3(0x38), 1.0);
    assert_eq!(e4m3(0x08), 2f64.powi(-6));
    assert_eq!(e4m3(0x07), 7.0 / 8.0 * 2f64.powi(-6));
    assert_eq!(e4m3(0x01), 2f64.powi(-9));
    assert!(e4m3(0x7f).is_nan() && e4m3(0xff).is_nan());
    assert_eq!(e4m3(0x80), 0.0);
}

#[test]
fn fp8_linear_equals_the_f64_product_within_the_stated_bound() {
    let gpu = CpuBackend::new();
    // Subnormals and zeros alone, so that no large term hides an error in them.
    let subnormal: Vec<u8> = (0..8u8).chain(0x80..0x88).collect();
    // Blocks crossed in both directions (2 x 3 blocks), one block, and a 1-row decode.
    let cases = [
        Case::new(5, 300, 130, 1),
        Case::new(3, 128, 7, 2),
        Case::new(1, 257, 129, 3),
        Case::from_codes(3, 200, 130, 6, &subnormal),
    ];
    for case in cases {
        let (rows, inf, outf) = (case.rows, case.inf, case.outf);
        let got = case.run(&gpu);
        for r in 0..rows {
            for o in 0..outf {
                let (want, bound) = case.reference(r, o);
                let g = f64::from(got[r * outf + o]);
                assert!(
                    (g - want).abs() <= bound,
                    "[{rows}x{inf} -> {outf}] row {r} feature {o}: {g} vs {want} (bound {bound})"
                );
            }
        }
    }
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn a_nan_code_makes_only_its_own_feature_nan() {
    let gpu = CpuBackend::new();
    let mut case = Case::new(2, 40, 3, 4);
    case.codes[case.inf + 5] = 0x7f;
    case.codes[2 * case.inf + 9] = 0xff;
    let got = case.run(&gpu);
    for r in 0..2 {
        assert!(got[r * 3].is_finite(), "row {r}");
        assert!(
            got[r * 3 + 1].is_nan() && got[r * 3 + 2].is_nan(),
            "row {r}"
        );
    }
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn power_of_two_scales_give_the_bf16_product_of_the_decoded_weights_bit_for_bit() {
    // e4m3 * 2^k is exact in BF16, so the FP8 kernel and the BF16 kernel see equal weights.
    let gpu = CpuBackend::new();
    let mut case = Case::new(6, 200, 20, 5);
    case.scales = vec![0.015625, 4.0];
    let dense: Vec<f32> = (0..case.outf * case.inf)
        .map(|i| case.weight(i / case.inf, i % case.inf) as f32)
        .collect();
    let fp8 = case.run(&gpu);
    let w = gpu.upload_bf16(&dense, "test dense").unwrap();
    assert_eq!(gpu.download_bf16(w, dense.len()).unwrap(), dense);
    let x = gpu.upload_bf16(&case.x, "test x").unwrap();
    let b = gpu.upload_bf16(&case.bias, "test bias").unwrap();
    let out = gpu.alloc(case.rows * case.outf * 4, "test out").unwrap();
    for rows in [1, case.rows] {
        gpu.linear(LinearArgs {
            out,
            out_dtype: Dtype::F32,
            x,
            weight: LinearWeight::Bf16 { weight: w },
            bias: Some(b),
            rows,
            in_features: case.inf,
            out_features: case.outf,
            stream: 0,
        })
        .unwrap();
        let bf = gpu.download::<f32>(out, rows * case.outf).unwrap();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&bf), bits(&fp8[..rows * case.outf]), "{rows} rows");
    }
    for p in [w, x, b, out] {
        gpu.free(p).unwrap();
    }
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn short_fp8_buffers_are_refused_by_name() {
    let gpu = CpuBackend::new();
    let (rows, inf, outf) = (1, 130, 2);
    let x = gpu.upload_bf16(&vec![0.5; inf], "x").unwrap();
    let out = gpu.alloc(outf * 4, "out").unwrap();
    let full = gpu.upload(&vec![0x38u8; outf * inf], "w").unwrap();
    let short = gpu
        .upload(&vec![0x38u8; outf * inf - 1], "w short")
        .unwrap();
    // 130 columns need two blocks of scales.
    let one_scale = gpu.upload(&[1.0f32], "s short").unwrap();
    let two_scales = gpu.upload(&[1.0f32, 1.0], "s").unwrap();
    let call = |weight: DevicePtr, block_scales: DevicePtr| {
        gpu.linear(LinearArgs {
            out,
            out_dtype: Dtype::F32,
            x,
            weight: LinearWeight::Fp8 {
                weight,
                block_scales,
            },
            bias: None,
            rows,
            in_features: inf,
            out_features: outf,
            stream: 0,
        })
    };
    let err = call(short, two_scales).unwrap_err().to_string();
    assert!(err.contains("linear fp8 weight"), "{err}");
    let err = call(full, one_scale).unwrap_err().to_string();
    assert!(err.contains("linear fp8 block_scales"), "{err}");
    call(full, two_scales).unwrap();
    assert_eq!(gpu.download::<f32>(out, outf).unwrap(), vec![65.0; outf]);
    for p in [x, out, full, short, one_scale, two_scales] {
        gpu.free(p).unwrap();
    }
    assert_eq!(gpu.ledger().live_count(), 0);
}
