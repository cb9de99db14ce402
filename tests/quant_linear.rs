//! The quantized linear against a float64 reference, and its bit-level invariants.
//!
//! Reference: the file's blocks dequantized (bit-identical to the `gguf` package, see
//! `quant_formats.rs`) times the input quantized by the documented rule (Q8 blocks of 32 for
//! legacy formats, of 256 for K-quants: `d = amax / 127`, `q = round_ties_even(x * (1/d))`),
//! summed in f64. Derived bound (`u = 2^-24`, `nb` blocks per row): each block term is formed
//! with at most 4 roundings relative to the magnitudes of its two parts, the `nb` terms are
//! added in order (`nb - 1` roundings), the f32 dequantization of the reference weights adds
//! one, and the bias one more relative to the result:
//! `|out - ref| <= (nb + 5) u sum_b M_b sum_{e in b} |xq_e| + 2u |ref|`, where `M_b` bounds the
//! parts of the block's values (`|d| * c1 + |d2| * c2`, see `quant_common::part_bounds`).
//! Float weights: 16 running sums, a 4-level tree and up to 15 tail additions give
//! `(n / 16 + 22) u sum_i |w_i x_i| + 2u |ref|`.

mod quant_common;

use half::bf16;
use quant_common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::quant::{
    dequantize, linear, BlockFormat, Isa, KernelPool, PackedWeight, QuantError,
};
use std::time::Duration;

const U: f64 = 1.0 / (1u64 << 24) as f64;

fn pool(threads: usize, isa: Isa) -> KernelPool {
    KernelPool::with_options(threads, isa, Duration::from_micros(50))
}

/// A random `[outf, inf]` weight: its file bytes and its packed form.
fn weight(
    rng: &mut SmallRng,
    format: BlockFormat,
    outf: usize,
    inf: usize,
) -> (Vec<u8>, PackedWeight) {
    let blocks = outf * inf / format.block_len();
    let bytes = random_blocks(rng, format, blocks, &mut scale_in(1.0 / 256.0, 1.0 / 16.0));
    let packed = PackedWeight::new(format, outf, inf, &bytes).unwrap();
    (bytes, packed)
}

fn inputs(rng: &mut SmallRng, rows: usize, inf: usize) -> Vec<f32> {
    (0..rows * inf)
        .map(|i| {
            let v: f32 = rng.random_range(-1.0..1.0);
            // An outlier now and then, as hidden states have.
            if i % 61 == 7 {
                v * 20.0
            } else {
                v
            }
        })
        .collect()
}

/// The documented input quantization, as the f64 values `d * q`.
fn quantized_input(x: &[f32], block: usize) -> Vec<f64> {
    x.chunks(block)
        .flat_map(|b| {
            let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d == 0.0 { 0.0 } else { 1.0 / d };
            b.iter()
                .map(move |v| d as f64 * (v * id).round_ties_even() as f64)
        })
        .collect()
}

/// `(reference, bound)` for every output of every row.
fn reference(
    format: BlockFormat,
    bytes: &[u8],
    (outf, inf): (usize, usize),
    x: &[f32],
    bias: &[f32],
) -> (Vec<f64>, Vec<f64>) {
    let mut w = vec![0f32; outf * inf];
    dequantize(format, bytes, &mut w).unwrap();
    let n = format.block_len();
    let nb = inf / n;
    let (c1, c2) = part_bounds(format);
    let f16s = f16_fields(format);
    let (mut refs, mut bounds) = (Vec::new(), Vec::new());
    for xr in x.chunks(inf) {
        let xq: Vec<f64> = if format.is_quantized() {
            quantized_input(xr, if format.is_k_quant() { 256 } else { 32 })
        } else {
            xr.iter().map(|&v| v as f64).collect()
        };
        for o in 0..outf {
            let wr = &w[o * inf..(o + 1) * inf];
            let r: f64 =
                wr.iter().zip(&xq).map(|(&a, b)| a as f64 * b).sum::<f64>() + bias[o] as f64;
            let b = if format.is_quantized() {
                let mut s = 0.0;
                for blk in 0..nb {
                    let raw = &bytes[(o * nb + blk) * format.block_bytes()..];
                    let field = |k: usize| {
                        f16s.get(k).map_or(0.0, |&at| {
                            half::f16::from_le_bytes([raw[at], raw[at + 1]])
                                .to_f64()
                                .abs()
                        })
                    };
                    let m = field(0) * c1 + field(1) * c2;
                    s += m * xq[blk * n..(blk + 1) * n]
                        .iter()
                        .map(|v| v.abs())
                        .sum::<f64>();
                }
                (nb + 5) as f64 * U * s
            } else {
                let s: f64 = wr.iter().zip(&xq).map(|(&a, b)| (a as f64 * b).abs()).sum();
                (inf / 16 + 22) as f64 * U * s
            };
            refs.push(r);
            bounds.push(b + 2.0 * U * r.abs());
        }
    }
    (refs, bounds)
}

/// In-feature counts for a format: odd numbers of blocks (floats: not a multiple of 16).
fn in_features(format: BlockFormat) -> Vec<usize> {
    match format.block_len() {
        1 => vec![15, 33, 577],
        32 => vec![32, 96, 288],
        _ => vec![256, 768],
    }
}

#[test]
fn linear_matches_the_f64_reference_within_the_derived_bound() {
    let mut rng = SmallRng::seed_from_u64(30);
    let pools = [pool(2, Isa::detect()), pool(1, Isa::Portable)];
    for format in BlockFormat::ALL {
        for (shape, inf) in in_features(format).into_iter().enumerate() {
            let outf = [21, 8, 3][shape % 3];
            let (bytes, w) = weight(&mut rng, format, outf, inf);
            let bias: Vec<f32> = (0..outf).map(|_| rng.random_range(-1.0..1.0)).collect();
            let x = inputs(&mut rng, 17, inf);
            let (want, bound) = reference(format, &bytes, (outf, inf), &x, &bias);
            for p in &pools {
                for rows in 1..=17 {
                    let mut out = vec![0f32; rows * outf];
                    linear(p, &w, &x[..rows * inf], rows, Some(&bias), &mut out).unwrap();
                    for (i, &g) in out.iter().enumerate() {
                        let err = (g as f64 - want[i]).abs();
                        assert!(
                            err <= bound[i],
                            "{format} {outf}x{inf} rows={rows} {:?} out {i}: {g} vs {} (bound {})",
                            p.isa(),
                            want[i],
                            bound[i]
                        );
                    }
                }
            }
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn rows_are_bit_identical_whatever_the_batch_and_thread_count() {
    let mut rng = SmallRng::seed_from_u64(31);
    let pools: Vec<KernelPool> = (1..=3).map(|t| pool(t, Isa::detect())).collect();
    for format in BlockFormat::ALL {
        let inf = *in_features(format).last().unwrap();
        let outf = 37;
        let (_, w) = weight(&mut rng, format, outf, inf);
        let x = inputs(&mut rng, 16, inf);
        let single: Vec<Vec<u32>> = (0..16)
            .map(|r| {
                let mut out = vec![0f32; outf];
                linear(&pools[0], &w, &x[r * inf..(r + 1) * inf], 1, None, &mut out).unwrap();
                bits(&out)
            })
            .collect();
        for (t, p) in pools.iter().enumerate() {
            for k in 1..=16 {
                for first in [0, (16 - k) / 2, 16 - k] {
                    let mut out = vec![0f32; k * outf];
                    linear(p, &w, &x[first * inf..(first + k) * inf], k, None, &mut out).unwrap();
                    for r in 0..k {
                        assert_eq!(
                            bits(&out[r * outf..(r + 1) * outf]),
                            single[first + r],
                            "{format}: row {} of a {k}-row call on {} threads",
                            first + r,
                            t + 1
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn long_calls_match_their_rows_computed_alone() {
    // Past one tile of 32 rows, and large enough that the input is quantized by several tasks.
    let mut rng = SmallRng::seed_from_u64(35);
    let p = pool(2, Isa::detect());
    for (format, inf) in [
        (BlockFormat::Q4_1, 1536),
        (BlockFormat::Q4_K, 1536),
        (BlockFormat::F16, 577),
    ] {
        let (rows, outf) = (45, 24);
        let (_, w) = weight(&mut rng, format, outf, inf);
        let x = inputs(&mut rng, rows, inf);
        let mut all = vec![0f32; rows * outf];
        linear(&p, &w, &x, rows, None, &mut all).unwrap();
        for r in 0..rows {
            let mut one = vec![0f32; outf];
            linear(&p, &w, &x[r * inf..(r + 1) * inf], 1, None, &mut one).unwrap();
            assert_eq!(
                bits(&all[r * outf..(r + 1) * outf]),
                bits(&one),
                "{format} row {r}"
            );
        }
    }
}

#[test]
fn long_tiled_calls_match_the_portable_path_rows_alone_and_the_reference() {
    // Prefill-sized calls: several 32-row tiles, a partial last tile, output rows past the last
    // full eight-row group, and inputs large enough to be quantized by several tasks.
    let mut rng = SmallRng::seed_from_u64(36);
    let simd = pool(2, Isa::detect());
    let portable = pool(1, Isa::Portable);
    for (format, inf) in [
        (BlockFormat::Q4_1, 1536),
        (BlockFormat::Q8_0, 576),
        (BlockFormat::Q5_0, 576),
        (BlockFormat::Q4_K, 1536),
        (BlockFormat::Q6_K, 768),
    ] {
        let outf = 29;
        let (bytes, w) = weight(&mut rng, format, outf, inf);
        let x = inputs(&mut rng, 200, inf);
        let (want, bound) = reference(format, &bytes, (outf, inf), &x, &vec![0.0; outf]);
        for rows in [37, 200] {
            let (x, n) = (&x[..rows * inf], rows * outf);
            let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
            linear(&simd, &w, x, rows, None, &mut a).unwrap();
            linear(&portable, &w, x, rows, None, &mut b).unwrap();
            assert_eq!(
                bits(&a),
                bits(&b),
                "{format}: {rows} rows, SIMD vs portable"
            );
            for r in 0..rows {
                let mut one = vec![0f32; outf];
                linear(&simd, &w, &x[r * inf..(r + 1) * inf], 1, None, &mut one).unwrap();
                let got = &a[r * outf..(r + 1) * outf];
                assert_eq!(bits(got), bits(&one), "{format}: row {r} of {rows}");
            }
            for (i, &g) in a.iter().enumerate() {
                let err = (g as f64 - want[i]).abs();
                assert!(
                    err <= bound[i],
                    "{format} {rows} rows, out {i}: {g} vs {} (bound {})",
                    want[i],
                    bound[i]
                );
            }
        }
    }
}

#[test]
fn simd_and_portable_paths_are_bit_identical() {
    if Isa::detect() == Isa::Portable {
        eprintln!("no AVX2 here: nothing to compare");
        return;
    }
    let mut rng = SmallRng::seed_from_u64(32);
    let portable = pool(1, Isa::Portable);
    assert_eq!(portable.isa(), Isa::Portable);
    for isa in simd_isas() {
        let simd = pool(1, isa);
        assert_eq!(simd.isa(), isa);
        for format in BlockFormat::ALL {
            for inf in in_features(format) {
                let outf = 45;
                let (_, w) = weight(&mut rng, format, outf, inf);
                let x = inputs(&mut rng, 17, inf);
                for rows in [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 17] {
                    let (mut a, mut b) = (vec![0f32; rows * outf], vec![0f32; rows * outf]);
                    linear(&simd, &w, &x[..rows * inf], rows, None, &mut a).unwrap();
                    linear(&portable, &w, &x[..rows * inf], rows, None, &mut b).unwrap();
                    assert_eq!(
                        bits(&a),
                        bits(&b),
                        "{format} {outf}x{inf}, {rows} rows, {isa:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn bf16_input_equals_its_f32_widening_and_nan_stays_in_its_row() {
    let mut rng = SmallRng::seed_from_u64(33);
    let p = pool(2, Isa::detect());
    for format in [BlockFormat::Q4_1, BlockFormat::Q6_K, BlockFormat::BF16] {
        let inf = *in_features(format).last().unwrap();
        let outf = 16;
        let (_, w) = weight(&mut rng, format, outf, inf);
        let x16: Vec<bf16> = inputs(&mut rng, 3, inf)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let mut x32: Vec<f32> = x16.iter().map(|v| v.to_f32()).collect();
        let (mut a, mut b) = (vec![0f32; 3 * outf], vec![0f32; 3 * outf]);
        linear(&p, &w, &x16, 3, None, &mut a).unwrap();
        linear(&p, &w, &x32, 3, None, &mut b).unwrap();
        assert_eq!(bits(&a), bits(&b), "{format}");
        x32[inf + 5] = f32::NAN;
        linear(&p, &w, &x32, 3, None, &mut b).unwrap();
        assert!(
            b[outf..2 * outf].iter().all(|v| v.is_nan()),
            "{format}: NaN row"
        );
        assert_eq!(bits(&a[..outf]), bits(&b[..outf]), "{format}: row 0");
        assert_eq!(
            bits(&a[2 * outf..]),
            bits(&b[2 * outf..]),
            "{format}: row 2"
        );
    }
}

#[test]
fn bad_arguments_are_errors() {
    let mut rng = SmallRng::seed_from_u64(34);
    let p = pool(2, Isa::detect());
    let (_, w) = weight(&mut rng, BlockFormat::Q8_0, 8, 64);
    let x = vec![0.5f32; 2 * 64];
    let mut out = vec![0f32; 2 * 8];
    let len = |what, expected, got| QuantError::Length {
        what,
        expected,
        got,
        unit: "elements",
    };
    assert_eq!(
        linear(&p, &w, &x[..127], 2, None, &mut out),
        Err(len("input rows", 128, 127))
    );
    assert_eq!(
        linear(&p, &w, &x, 2, None, &mut out[..15]),
        Err(len("output rows", 16, 15))
    );
    assert_eq!(
        linear(&p, &w, &x, 2, Some(&[0.0; 7]), &mut out),
        Err(len("bias", 8, 7))
    );
    assert!(matches!(
        linear(&p, &w, &x, usize::MAX, None, &mut out),
        Err(QuantError::Overflow { .. })
    ));
    // Zero rows is a valid, empty call; zero in-features leave the bias.
    linear(&p, &w, &x[..0], 0, None, &mut out[..0]).unwrap();
    for format in [BlockFormat::Q4_1, BlockFormat::Q6_K, BlockFormat::F16] {
        let empty = PackedWeight::new(format, 8, 0, &[]).unwrap();
        let bias: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let mut out = vec![f32::NAN; 16];
        linear(&p, &empty, &x[..0], 2, Some(&bias), &mut out).unwrap();
        assert_eq!(out, [&bias[..], &bias[..]].concat(), "{format}");
    }
}
