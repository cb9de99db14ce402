//! NVFP4 quantization: the dequantization formula, the error bound of a round trip, and
//! the backend's NVFP4 linear against the dequantized matrix.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::{
    e2m1_to_f32, fp8_e4m3_to_f32, CpuBackend, Dtype, GpuBackend, GpuBackendExt, Kernels,
    LinearArgs, LinearWeight,
};
use specdraft::speculative::mtp::nvfp4::{fp8_e4m3_from_f32, E2M1_MAX, FP8_E4M3_MAX};
use specdraft::speculative::mtp::{dequantize_nvfp4, quantize_nvfp4};

fn random_matrix(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut rng = SmallRng::seed_from_u64(seed);
    // Heavy-tailed, with a few blocks much smaller than the rest (subnormal FP8 scales).
    (0..rows * cols)
        .map(|i| {
            let x: f32 = rng.random_range(-1.0..1.0);
            let small = if (i / 16) % 7 == 3 { 1e-4 } else { 1.0 };
            x * x * x * 8.0 * small
        })
        .collect()
}

#[test]
fn dequantize_is_the_formula_bit_for_bit() {
    let (rows, cols) = (5, 48);
    let mut rng = SmallRng::seed_from_u64(1);
    let codes: Vec<u8> = (0..rows * cols / 2).map(|_| rng.random()).collect();
    // Every finite FP8 scale appears, normals and subnormals alike.
    let scales: Vec<u8> = (0..rows * cols / 16)
        .map(|i| (i * 37 % 0x7f) as u8)
        .collect();
    let g = 0.0123f32;
    let w = dequantize_nvfp4(&codes, &scales, g, rows, cols);
    for r in 0..rows {
        for c in 0..cols {
            let byte = codes[(r * cols + c) / 2];
            let code = if c % 2 == 0 { byte & 0xf } else { byte >> 4 };
            let mag = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][(code & 7) as usize];
            let e2m1 = if code & 8 != 0 { -mag } else { mag };
            let s = scales[(r * cols + c) / 16];
            let (exp, man) = ((s >> 3) & 0xf, (s & 7) as f32);
            let fp8 = if exp == 0 {
                man / 8.0 * 2f32.powi(-6)
            } else {
                (1.0 + man / 8.0) * 2f32.powi(exp as i32 - 7)
            };
            let want = e2m1 * fp8 * g;
            assert_eq!(
                w[r * cols + c].to_bits(),
                want.to_bits(),
                "row {r} column {c}"
            );
            assert_eq!(e2m1, e2m1_to_f32(code));
        }
    }
}

#[test]
fn round_trip_error_is_within_the_format_bound() {
    let (rows, cols) = (32, 128);
    let w = random_matrix(rows, cols, 2);
    let q = quantize_nvfp4(&w, rows, cols).unwrap();
    let amax = w.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert_eq!(q.global_scale, amax / (E2M1_MAX * FP8_E4M3_MAX));
    let d = q.dequantize();
    let mut sq_err = 0.0f64;
    let mut sq = 0.0f64;
    for b in 0..rows * cols / 16 {
        let block = &w[b * 16..(b + 1) * 16];
        let bamax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let s = bamax / (E2M1_MAX * q.global_scale);
        assert_eq!(
            q.scales[b],
            fp8_e4m3_from_f32(s),
            "block {b}: scale is fp8(block_amax / (6 g))"
        );
        let sq_scale = fp8_e4m3_to_f32(q.scales[b]);
        // Half the widest E2M1 gap (4 -> 6) in units of the block scale, plus what rounding
        // the scale itself can cost at the saturated end.
        let bound = q.global_scale * (sq_scale + 6.0 * (s - sq_scale).abs()) * 1.0001 + 1e-30;
        for j in 0..16 {
            let (x, y) = (block[j], d[b * 16 + j]);
            assert!(
                (x - y).abs() <= bound,
                "block {b} element {j}: {x} -> {y}, bound {bound}"
            );
            sq_err += ((x - y) as f64).powi(2);
            sq += (x as f64).powi(2);
        }
    }
    let rel = (sq_err / sq).sqrt();
    assert!(rel < 0.12, "relative RMS error {rel}");
}

#[test]
fn zero_and_bad_inputs() {
    let q = quantize_nvfp4(&[0.0; 32], 2, 16).unwrap();
    assert_eq!(q.global_scale, 0.0);
    assert!(q.codes.iter().chain(&q.scales).all(|&b| b == 0));
    assert!(q.dequantize().iter().all(|&x| x == 0.0));
    let err = quantize_nvfp4(&[0.0; 24], 2, 12).unwrap_err().to_string();
    assert!(err.contains("multiple of 16"), "{err}");
    let err = quantize_nvfp4(&[0.0; 16], 2, 16).unwrap_err().to_string();
    assert!(err.contains("has 32 values, got 16"), "{err}");
    let mut w = vec![1.0; 16];
    w[3] = f32::NAN;
    let err = quantize_nvfp4(&w, 1, 16).unwrap_err().to_string();
    assert!(err.contains("column 3"), "{err}");
}

#[test]
fn backend_nvfp4_linear_equals_dense_linear_of_the_dequantized_matrix() {
    let (rows, cols, xrows) = (24, 64, 3);
    let w = random_matrix(rows, cols, 3);
    let q = quantize_nvfp4(&w, rows, cols).unwrap();
    let gpu = CpuBackend::new();
    let x: Vec<f32> = (0..xrows * cols)
        .map(|i| ((i * 7 % 13) as f32 - 6.0) / 4.0)
        .collect();
    let xp = gpu.upload_bf16(&x, "x").unwrap();
    let codes = gpu.upload(&q.codes, "codes").unwrap();
    let scales = gpu.upload(&q.scales, "scales").unwrap();
    let out = gpu.alloc(xrows * rows * 4, "out").unwrap();
    gpu.linear(LinearArgs {
        out,
        out_dtype: Dtype::F32,
        x: xp,
        weight: LinearWeight::Nvfp4 {
            codes,
            block_scales: scales,
            global_scale: q.global_scale,
        },
        bias: None,
        rows: xrows,
        in_features: cols,
        out_features: rows,
        stream: 0,
    })
    .unwrap();
    let got: Vec<f32> = gpu.download(out, xrows * rows).unwrap();
    let d = q.dequantize();
    let xb = gpu.download_bf16(xp, xrows * cols).unwrap();
    for r in 0..xrows {
        for o in 0..rows {
            let want: f64 = (0..cols)
                .map(|c| xb[r * cols + c] as f64 * d[o * cols + c] as f64)
                .sum();
            let g = got[r * rows + o] as f64;
            assert!(
                (g - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "row {r} out {o}: {g} vs {want}"
            );
        }
    }
    for p in [xp, codes, scales, out] {
        gpu.free(p).unwrap();
    }
    assert_eq!(gpu.ledger().live_count(), 0);
}
