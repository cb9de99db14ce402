//! NVFP4 against an outside reference: a separate implementation of the format written here
//! from its definition (NVIDIA ModelOpt's layout: E2M1 element codes, FP8 E4M3 block scales
//! of 16 columns, one f32 global scale) and test vectors worked out by hand, including
//! rounding ties of both formats and all-zero blocks. Checked against the crate's
//! quantizer, dequantizer, code tables and the backend's NVFP4 linear.
//!
//! The definition: `W[r, c] = e2m1(code) * e4m3(scale[r, c / 16]) * g`, with
//! `g = amax(|W|) / (6 * 448)`, `scale = e4m3(block_amax / (6 * g))` and each code the E2M1
//! value nearest to `w / (e4m3(scale) * g)`; every rounding is to nearest with ties to the
//! even code, E4M3 saturates at 448 (it has no infinity), and zero is never negative.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::{
    e2m1_to_f32, fp8_e4m3_to_f32, CpuBackend, DevicePtr, Dtype, GpuBackend, GpuBackendExt, Kernels,
    LinearArgs, LinearWeight,
};
use specdraft::speculative::mtp::nvfp4::{e2m1_from_f32, fp8_e4m3_from_f32};
use specdraft::speculative::mtp::{dequantize_nvfp4, quantize_nvfp4};

/// The format from its bit fields, written without the crate's tables, and a quantizer that
/// rounds by searching every code (so it shares no rounding logic with the crate's).
mod spec {
    /// E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal.
    pub fn e2m1(code: u8) -> f32 {
        let sign = if code & 0x8 != 0 { -1.0 } else { 1.0 };
        let (e, m) = ((code >> 1) & 0x3, (code & 0x1) as f32);
        let mag = if e == 0 {
            m * 0.5
        } else {
            (1.0 + m / 2.0) * 2f32.powi(e as i32 - 1)
        };
        sign * mag
    }

    /// E4M3 (`float8_e4m3fn`): sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0
    /// is subnormal; S.1111.111 is NaN and there is no infinity.
    pub fn e4m3(byte: u8) -> f32 {
        let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
        let (e, m) = ((byte >> 3) & 0xf, (byte & 0x7) as f32);
        if e == 0xf && m == 7.0 {
            return f32::NAN;
        }
        let mag = if e == 0 {
            m / 8.0 * 2f32.powi(-6)
        } else {
            (1.0 + m / 8.0) * 2f32.powi(e as i32 - 7)
        };
        sign * mag
    }

    /// The non-negative code in `0..=max_code` whose value is nearest to `a >= 0`; at a tie
    /// the even code (mantissa LSB 0). Beyond the largest value this saturates.
    fn nearest(a: f32, max_code: u8, value: fn(u8) -> f32) -> u8 {
        if a >= value(max_code) {
            return max_code;
        }
        let mut best = 0u8;
        for c in 1..=max_code {
            let (d, db) = (
                (value(c) as f64 - a as f64).abs(),
                (value(best) as f64 - a as f64).abs(),
            );
            if d < db || (d == db && c % 2 == 0) {
                best = c;
            }
        }
        best
    }

    pub fn e2m1_code(x: f32) -> u8 {
        let c = nearest(x.abs(), 7, e2m1);
        if c != 0 && x < 0.0 {
            c | 0x8
        } else {
            c
        }
    }

    pub fn e4m3_code(x: f32) -> u8 {
        let c = nearest(x.abs(), 0x7e, e4m3);
        if c != 0 && x < 0.0 {
            c | 0x80
        } else {
            c
        }
    }

    /// `(codes, scales, g)` of a row-major `[rows, cols]` matrix.
    pub fn quantize(w: &[f32]) -> (Vec<u8>, Vec<u8>, f32) {
        let amax = w.iter().fold(0f32, |m, x| m.max(x.abs()));
        let g = amax / (6.0 * 448.0);
        let mut codes = vec![0u8; w.len() / 2];
        let mut scales = vec![0u8; w.len() / 16];
        for (b, block) in w.chunks(16).enumerate() {
            if g == 0.0 {
                break;
            }
            let bamax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
            scales[b] = e4m3_code(bamax / (6.0 * g));
            let denom = e4m3(scales[b]) * g;
            for (j, &x) in block.iter().enumerate() {
                let c = if denom == 0.0 {
                    0
                } else {
                    e2m1_code(x / denom)
                };
                let i = b * 16 + j;
                codes[i / 2] |= if i % 2 == 0 { c } else { c << 4 };
            }
        }
        (codes, scales, g)
    }

    pub fn dequantize(codes: &[u8], scales: &[u8], g: f32, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let nibble = (codes[i / 2] >> (4 * (i % 2))) & 0xf;
                e2m1(nibble) * e4m3(scales[i / 16]) * g
            })
            .collect()
    }
}

#[test]
fn code_tables_are_the_definition() {
    let e2m1: Vec<f32> = (0..16).map(spec::e2m1).collect();
    assert_eq!(
        e2m1,
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
        "the reference itself"
    );
    for code in 0..16u8 {
        assert_eq!(e2m1_to_f32(code), spec::e2m1(code), "e2m1 code {code}");
    }
    // Fixed points of E4M3 from the format's description.
    let pins = [
        (0x00, 0.0),
        (0x01, 2f32.powi(-9)),
        (0x07, 7.0 * 2f32.powi(-9)),
        (0x08, 2f32.powi(-6)),
        (0x38, 1.0),
        (0x39, 1.125),
        (0x7e, 448.0),
        (0xb8, -1.0),
    ];
    for (b, v) in pins {
        assert_eq!(spec::e4m3(b), v, "reference e4m3 {b:#04x}");
    }
    for byte in 0..=255u8 {
        let (got, want) = (fp8_e4m3_to_f32(byte), spec::e4m3(byte));
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "e4m3 {byte:#04x}: {got} vs {want}"
        );
    }
    assert!(fp8_e4m3_to_f32(0x7f).is_nan() && fp8_e4m3_to_f32(0xff).is_nan());
}

#[test]
fn encoders_round_to_nearest_with_ties_to_even() {
    // Every E2M1 midpoint is a tie; the even code wins. Hand-worked: (value, code).
    let ties = [
        (0.25, 0x0),
        (0.75, 0x2),
        (1.25, 0x2),
        (1.75, 0x4),
        (2.5, 0x4),
        (3.5, 0x6),
        (5.0, 0x6),
        (-0.75, 0xa),
        (-5.0, 0xe),
        (-0.25, 0x0),
        (7.0, 0x7),
        (1e30, 0x7),
    ];
    for (v, code) in ties {
        assert_eq!(spec::e2m1_code(v), code, "reference e2m1({v})");
        assert_eq!(e2m1_from_f32(v), code, "e2m1({v})");
    }
    // E4M3 ties in the normal range, the subnormal range, at the normal/subnormal boundary,
    // and the saturation at 448.
    let ties = [
        (1.0625, 0x38),
        (1.1875, 0x3a),
        (1.5 * 2f32.powi(-9), 0x02),
        (2.5 * 2f32.powi(-9), 0x02),
        (7.5 * 2f32.powi(-9), 0x08),
        (0.5 * 2f32.powi(-9), 0x00),
        (-1.0625, 0xb8),
        (-0.4 * 2f32.powi(-9), 0x00),
        (464.0, 0x7e),
        (1e9, 0x7e),
    ];
    for (v, code) in ties {
        assert_eq!(spec::e4m3_code(v), code, "reference e4m3({v})");
        assert_eq!(fp8_e4m3_from_f32(v), code, "e4m3({v})");
    }
    // Off a tie, every value between codes goes to the nearer one (both encoders, all codes).
    for c in 0..0x7eu8 {
        let (lo, hi) = (spec::e4m3(c), spec::e4m3(c + 1));
        for (x, want) in [(lo + (hi - lo) * 0.49, c), (lo + (hi - lo) * 0.51, c + 1)] {
            assert_eq!(
                spec::e4m3_code(x),
                want,
                "reference between {c:#x} and next"
            );
            assert_eq!(fp8_e4m3_from_f32(x), want, "{x} between {c:#x} and next");
        }
    }
}

/// A 3 x 32 matrix worked by hand. Row 0, block 0 holds the tensor's amax 2688 = 6 * 448,
/// so g = 1 and that block's scale is 448 (0x7e): its elements are 448 times the E2M1
/// midpoints (every one a tie) and a few exact values. Row 0, block 1 is all zeros. Row 1's
/// blocks have amax 6 * 1.0625 and 6 * 1.1875 (E4M3 ties: scales 1.0 and 1.25), row 2's
/// 6 * 1.5 * 2^-9 (a subnormal tie: scale 2^-8) and, last, a single -3.
fn hand_matrix() -> Vec<f32> {
    let mut w = vec![0f32; 3 * 32];
    let row0 = [
        2688.0, 112.0, 336.0, 560.0, 784.0, 1120.0, 1568.0, 2240.0, -2688.0, -0.0, 134.4, -336.0,
        448.0, 672.0, -1792.0, 0.0,
    ];
    w[..16].copy_from_slice(&row0);
    w[32] = 6.375;
    w[33] = -1.0;
    w[48] = 7.125;
    w[49] = 0.3;
    w[64] = 6.0 * 1.5 * 2f32.powi(-9);
    w[65] = 2f32.powi(-9);
    w[95] = -3.0;
    w
}

/// The bytes of `hand_matrix`, worked out by hand from the definition.
fn hand_bytes() -> (Vec<u8>, Vec<u8>) {
    // Row 0 block 0, element codes (÷ 448): 6 -> 7, .25 -> 0 (tie), .75 -> 2 (tie),
    // 1.25 -> 2 (tie), 1.75 -> 4 (tie), 2.5 -> 4 (tie), 3.5 -> 6 (tie), 5 -> 6 (tie),
    // -6 -> f, -0 -> 0, .3 -> 1, -.75 -> a (tie), 1 -> 2, 1.5 -> 3, -4 -> e, 0 -> 0.
    let e = [
        0x7, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0xf, 0x0, 0x1, 0xa, 0x2, 0x3, 0xe, 0x0,
    ];
    let mut codes = vec![0u8; 48];
    for (i, c) in e.iter().enumerate() {
        codes[i / 2] |= c << (4 * (i % 2));
    }
    // Row 1 block 0: scale 1.0; 6.375 -> 6 (saturates, 7), -1 -> a.
    codes[16] = 0xa7;
    // Row 1 block 1: scale 1.25; 7.125 / 1.25 = 5.7 -> 6 (7); 0.3 / 1.25 = 0.24 -> 0.
    codes[24] = 0x07;
    // Row 2 block 0: scale 2^-8; 9 * 2^-9 / 2^-8 = 4.5 -> 4 (6); 2^-9 / 2^-8 = 0.5 -> 1.
    codes[32] = 0x16;
    // Row 2 block 1: -3 alone: scale e4m3(3 / 6) = 0.5 (0x30); -3 / 0.5 = -6 -> f, high
    // nibble of the block's last byte.
    codes[47] = 0xf0;
    let scales = vec![0x7e, 0x00, 0x38, 0x3a, 0x02, 0x30];
    (codes, scales)
}

#[test]
fn hand_worked_vectors() {
    let w = hand_matrix();
    let (codes, scales) = hand_bytes();
    let (rc, rs, rg) = spec::quantize(&w);
    assert_eq!(
        (&rc, &rs, rg),
        (&codes, &scales, 1.0),
        "the reference itself"
    );
    let q = quantize_nvfp4(&w, 3, 32).unwrap();
    assert_eq!(q.global_scale, 1.0);
    assert_eq!(q.scales, scales, "block scales");
    assert_eq!(q.codes, codes, "element codes");
    // Dequantized by hand: row 0 block 0 is 448 times the E2M1 values, block 1 zeros.
    let d = q.dequantize();
    let row0 = [
        6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -6.0, 0.0, 0.5, -1.0, 1.0, 1.5, -4.0, 0.0,
    ]
    .map(|v| v * 448.0);
    assert_eq!(&d[..16], &row0);
    assert!(d[16..32].iter().all(|&x| x == 0.0 && x.is_sign_positive()));
    assert_eq!((d[32], d[33], d[48], d[49]), (6.0, -1.0, 7.5, 0.0));
    assert_eq!(
        (d[64], d[65], d[95]),
        (4.0 * 2f32.powi(-8), 2f32.powi(-9), -3.0)
    );
}

/// Random matrices with ties planted: elements on E2M1 midpoints of their block's scale.
fn tie_heavy_matrix(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mids = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    let mut w: Vec<f32> = (0..rows * cols)
        .map(|i| {
            let x: f32 = rng.random_range(-1.0..1.0);
            let small = if (i / 16) % 7 == 3 { 1e-4 } else { 1.0 };
            x * x * x * 8.0 * small
        })
        .collect();
    for block in w.chunks_mut(16) {
        match rng.random_range(0..4) {
            0 => block.fill(0.0),
            1 => {
                // Scale exactly 1 in units of g once the block amax is 6 g ...
                for x in block.iter_mut() {
                    *x = mids[rng.random_range(0..mids.len())]
                        * if rng.random() { 1.0 } else { -1.0 };
                }
                block[0] = 6.0;
            }
            _ => {}
        }
    }
    w
}

#[test]
fn quantizer_matches_the_reference_byte_for_byte() {
    for (rows, cols, seed) in [(8, 64, 1), (32, 128, 2), (5, 16, 3), (64, 48, 4)] {
        let mut w = tie_heavy_matrix(rows, cols, seed);
        // ... and g = 1, so every planted midpoint is an exact tie.
        w[cols - 1] = 2688.0;
        let q = quantize_nvfp4(&w, rows, cols).unwrap();
        let (codes, scales, g) = spec::quantize(&w);
        assert_eq!(q.global_scale.to_bits(), g.to_bits(), "{rows}x{cols}");
        assert_eq!(q.scales, scales, "{rows}x{cols}: scales");
        assert_eq!(q.codes, codes, "{rows}x{cols}: codes");
        // Without the planted amax, g is an arbitrary f32 and scales land anywhere.
        let w = tie_heavy_matrix(rows, cols, seed + 100);
        let q = quantize_nvfp4(&w, rows, cols).unwrap();
        let (codes, scales, g) = spec::quantize(&w);
        assert_eq!(
            (q.global_scale.to_bits(), &q.scales, &q.codes),
            (g.to_bits(), &scales, &codes)
        );
    }
}

#[test]
fn dequantize_is_the_definition_bit_for_bit() {
    let (rows, cols) = (5, 48);
    let mut rng = SmallRng::seed_from_u64(1);
    let codes: Vec<u8> = (0..rows * cols / 2).map(|_| rng.random()).collect();
    // Every finite E4M3 scale appears, normals and subnormals alike.
    let scales: Vec<u8> = (0..rows * cols / 16)
        .map(|i| (i * 37 % 0x7f) as u8)
        .collect();
    let g = 0.0123f32;
    let got = dequantize_nvfp4(&codes, &scales, g, rows, cols);
    let want = spec::dequantize(&codes, &scales, g, rows * cols);
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "element {i}: {a} vs {b}");
    }
}

#[test]
fn round_trip_error_is_within_the_format_bound() {
    let (rows, cols) = (32, 128);
    let w = tie_heavy_matrix(rows, cols, 2);
    let q = quantize_nvfp4(&w, rows, cols).unwrap();
    let d = q.dequantize();
    let (mut sq_err, mut sq) = (0.0f64, 0.0f64);
    for (b, block) in w.chunks(16).enumerate() {
        let bamax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let s = bamax / (6.0 * q.global_scale);
        let sq_scale = spec::e4m3(q.scales[b]);
        // Half the widest E2M1 gap (4 -> 6) in units of the block scale, plus what rounding
        // the scale itself can cost at the saturated end.
        let bound = q.global_scale * (sq_scale + 6.0 * (s - sq_scale).abs()) * 1.0001 + 1e-30;
        for (j, &x) in block.iter().enumerate() {
            let y = d[b * 16 + j];
            assert!((x - y).abs() <= bound, "block {b} element {j}: {x} -> {y}");
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

/// `out = x W^T` through the backend's NVFP4 linear, F32 out (the one place this file calls
/// a kernel op).
fn nvfp4_linear(
    gpu: &CpuBackend,
    x: DevicePtr,
    codes: &[u8],
    scales: &[u8],
    g: f32,
    (rows, inf, outf): (usize, usize, usize),
) -> Vec<f32> {
    let c = gpu.upload(codes, "codes").unwrap();
    let s = gpu.upload(scales, "scales").unwrap();
    let out = gpu.alloc(rows * outf * 4, "out").unwrap();
    gpu.linear(LinearArgs {
        out,
        out_dtype: Dtype::F32,
        x,
        weight: LinearWeight::Nvfp4 {
            codes: c,
            block_scales: s,
            global_scale: g,
        },
        bias: None,
        rows,
        in_features: inf,
        out_features: outf,
        stream: 0,
    })
    .unwrap();
    let y = gpu.download(out, rows * outf).unwrap();
    for p in [c, s, out] {
        gpu.free(p).unwrap();
    }
    y
}

#[test]
fn backend_nvfp4_linear_is_the_reference_matrix_product() {
    let gpu = CpuBackend::new();
    let mut cases = vec![(hand_matrix(), 3, 32)];
    let w = tie_heavy_matrix(24, 64, 3);
    cases.push((w, 24, 64));
    for (w, outf, inf) in cases {
        let (codes, scales, g) = spec::quantize(&w);
        let d = spec::dequantize(&codes, &scales, g, w.len());
        let xrows = 3;
        let x: Vec<f32> = (0..xrows * inf)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 4.0)
            .collect(); // exact in BF16
        let xp = gpu.upload_bf16(&x, "x").unwrap();
        let got = nvfp4_linear(&gpu, xp, &codes, &scales, g, (xrows, inf, outf));
        gpu.free(xp).unwrap();
        for r in 0..xrows {
            for o in 0..outf {
                let want: f64 = (0..inf)
                    .map(|c| x[r * inf + c] as f64 * d[o * inf + c] as f64)
                    .sum();
                let scale: f64 = (0..inf)
                    .map(|c| (x[r * inf + c] as f64 * d[o * inf + c] as f64).abs())
                    .sum();
                let gv = got[r * outf + o] as f64;
                // f32 accumulation of `inf` products: at most `inf` roundings of the sum.
                let bound = inf as f64 * f32::EPSILON as f64 * scale;
                assert!(
                    (gv - want).abs() <= bound + 1e-30,
                    "{outf}x{inf} row {r} out {o}: {gv} vs {want}"
                );
            }
        }
    }
    assert_eq!(gpu.ledger().live_count(), 0);
}
