//! Tests of the CPU `linear`: each row of a batch equals the one-row call bit for bit (BF16
//! and NVFP4 weights), small integers come out exact, and the SIMD and portable kernels agree
//! bit for bit.

use super::*;
use crate::backend::{
    CpuBackend, DevicePtr, Dtype, GpuBackend, GpuBackendExt, Kernels, LinearArgs, LinearWeight,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Row `r` of every k-row `linear` (f32 out; k = 1..=9, several windows of the input
/// rows) equals the 1-row call on that input row, bit for bit.
fn check_rows_independent(
    gpu: &CpuBackend,
    weight: LinearWeight,
    bias: Option<DevicePtr>,
    in_features: usize,
    outf: usize,
) {
    let total = 12;
    let mut rng = SmallRng::seed_from_u64(7);
    let xs: Vec<f32> = (0..total * in_features)
        .map(|_| rng.random_range(-2.0f32..2.0))
        .collect();
    let x = gpu.upload_bf16(&xs, "test x").unwrap();
    let out = gpu.alloc(total * outf * 4, "test out").unwrap();
    let call = |first: usize, rows: usize| -> Vec<u32> {
        gpu.linear(LinearArgs {
            out,
            out_dtype: Dtype::F32,
            x: x.offset(first * in_features * 2),
            weight,
            bias,
            rows,
            in_features,
            out_features: outf,
            stream: 0,
        })
        .unwrap();
        let v: Vec<f32> = gpu.download(out, rows * outf).unwrap();
        v.iter().map(|v| v.to_bits()).collect()
    };
    let single: Vec<Vec<u32>> = (0..total).map(|r| call(r, 1)).collect();
    for k in 1..=9 {
        for first in [0, 1, total - k] {
            let many = call(first, k);
            for r in 0..k {
                let got = &many[r * outf..(r + 1) * outf];
                assert_eq!(got, single[first + r], "k={k}, first={first}, row {r}");
            }
        }
    }
    gpu.free(x).unwrap();
    gpu.free(out).unwrap();
}

#[test]
fn linear_rows_are_bitwise_independent_of_the_batch() {
    let gpu = CpuBackend::new();
    let (inf, outf) = (577, 33);
    let mut rng = SmallRng::seed_from_u64(3);
    let w: Vec<f32> = (0..inf * outf)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let b: Vec<f32> = (0..outf).map(|_| rng.random_range(-1.0..1.0)).collect();
    let (w, b) = (
        gpu.upload_bf16(&w, "test w").unwrap(),
        gpu.upload_bf16(&b, "test b").unwrap(),
    );
    let weight = LinearWeight::Bf16 { weight: w };
    check_rows_independent(&gpu, weight, Some(b), inf, outf);
    gpu.free(w).unwrap();
    gpu.free(b).unwrap();
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn linear_nvfp4_rows_are_bitwise_independent_of_the_batch() {
    let gpu = CpuBackend::new();
    let (inf, outf) = (592, 33);
    let mut rng = SmallRng::seed_from_u64(5);
    let codes: Vec<u8> = (0..inf * outf / 2).map(|_| rng.random()).collect();
    // FP8 scales between 2^-3 and 2^3 (no NaN codes).
    let scales: Vec<u8> = (0..inf * outf / 16)
        .map(|_| rng.random_range(0x20u8..0x50))
        .collect();
    let b: Vec<f32> = (0..outf).map(|_| rng.random_range(-1.0..1.0)).collect();
    let (w, s, b) = (
        gpu.upload(&codes, "test w").unwrap(),
        gpu.upload(&scales, "test s").unwrap(),
        gpu.upload_bf16(&b, "test b").unwrap(),
    );
    let weight = LinearWeight::Nvfp4 {
        codes: w,
        block_scales: s,
        global_scale: 0.75,
    };
    check_rows_independent(&gpu, weight, Some(b), inf, outf);
    for p in [w, s, b] {
        gpu.free(p).unwrap();
    }
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn linear_is_exact_on_small_integers() {
    // Products and sums of small integers are exact in f32, so the order cannot matter.
    let (rows, inf, outf) = (3, 37, 5);
    let w: Vec<u16> = (0..outf * inf)
        .map(|i| half::bf16::from_f32((i % 5) as f32 - 2.0).to_bits())
        .collect();
    let xs: Vec<f32> = (0..rows * inf).map(|i| (i % 7) as f32 - 3.0).collect();
    let bias: Vec<f32> = (0..outf).map(|o| o as f32).collect();
    let src = Bf16Rows {
        weight: &w,
        in_features: inf,
    };
    let pool = KernelPool::new(2);
    let mut scratch = RowsScratch::default();
    let got = linear_rows(&pool, &src, &xs, Some(&bias), rows, inf, outf, &mut scratch).unwrap();
    for r in 0..rows {
        for o in 0..outf {
            let want: f32 = (0..inf)
                .map(|i| ((o * inf + i) % 5) as f32 - 2.0)
                .zip(&xs[r * inf..(r + 1) * inf])
                .map(|(w, x)| w * x)
                .sum::<f32>()
                + o as f32;
            assert_eq!(got[r * outf + o], want, "row {r} feature {o}");
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_and_portable_kernels_agree_bitwise() {
    use crate::backend::quant::{Isa, SupportedIsa};
    let Some(proof) = SupportedIsa::at_most(Isa::Avx2).avx2() else {
        return;
    };
    let (rows, inf, outf) = (9, 577, 40);
    let mut rng = SmallRng::seed_from_u64(9);
    let w: Vec<u16> = (0..outf * inf)
        .map(|_| half::bf16::from_f32(rng.random_range(-1.0..1.0)).to_bits())
        .collect();
    let xs: Vec<f32> = (0..rows * inf)
        .map(|_| rng.random_range(-3.0..3.0))
        .collect();
    let src = Bf16Rows {
        weight: &w,
        in_features: inf,
    };
    for rows in [1, 2, 3, 4, 6, 7, rows] {
        let (mut a, mut b) = (vec![0f32; outf * rows], vec![0f32; outf * rows]);
        let xs = &xs[..rows * inf];
        task(&src, &mut Default::default(), xs, rows, 0, &mut a, None);
        task_avx2(proof, &src, &mut Default::default(), xs, rows, 0, &mut b);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b), "{rows} rows");
    }
}
