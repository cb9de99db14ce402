//! Short calls (a decode step, a short verify) of the quantized linear: the AVX2 kernel
//! decodes each weight record in registers for them and takes output groups in pairs, so
//! these tests cover every count of groups per task (odd and even, with and without rows past
//! the last full group), 1..=6 rows on 1..=3 threads against the portable path, and codes at
//! the ends of their ranges, where an i16 sum inside `maddubs` would saturate if a bound
//! were wrong.

mod quant_common;

use quant_common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::quant::{linear, BlockFormat, Isa, KernelPool, PackedWeight};
use std::time::Duration;

fn pool(threads: usize, isa: Isa) -> KernelPool {
    KernelPool::with_options(threads, isa, Duration::from_micros(50))
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `rows` rows of `linear` on `p`.
fn run(p: &KernelPool, w: &PackedWeight, x: &[f32], rows: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * w.out_features()];
    linear(p, w, &x[..rows * w.in_features()], rows, None, &mut out).unwrap();
    out
}

#[test]
fn short_calls_match_the_portable_path_for_every_group_count() {
    if Isa::detect() == Isa::Portable {
        eprintln!("no AVX2 here: nothing to compare");
        return;
    }
    let mut rng = SmallRng::seed_from_u64(41);
    let portable = pool(1, Isa::Portable);
    let simd: Vec<KernelPool> = simd_isas()
        .into_iter()
        .flat_map(|isa| (1..=3).map(move |t| pool(t, isa)))
        .collect();
    for format in quantized() {
        let inf = if format.is_k_quant() { 512 } else { 96 };
        // 1..7 full groups, with and without a tail of rows past the last one.
        for outf in [8, 13, 16, 24, 31, 40, 48, 56] {
            let blocks = outf * inf / format.block_len();
            let bytes = random_blocks(&mut rng, format, blocks, &mut scale_in(1e-3, 1e-1));
            let w = PackedWeight::new(format, outf, inf, &bytes).unwrap();
            let x: Vec<f32> = (0..10 * inf).map(|_| rng.random_range(-2.0..2.0)).collect();
            // Registers (1-4), tiles of one group (5-9), the scratch (10).
            for rows in 1..=10 {
                let want = bits(&run(&portable, &w, &x, rows));
                for p in &simd {
                    let got = bits(&run(p, &w, &x, rows));
                    assert_eq!(
                        got,
                        want,
                        "{format} {outf}x{inf}, {rows} rows, {} threads, {:?}",
                        p.threads(),
                        p.isa()
                    );
                }
            }
        }
    }
}

/// A block of `format` whose every code is `code` (the field at its largest or smallest) and
/// whose scale is 1 (and min 0).
fn uniform_block(format: BlockFormat, code: u8) -> Vec<u8> {
    let one = half::f16::from_f32(1.0).to_le_bytes();
    let mut b = vec![0u8; format.block_bytes()];
    b[..2].copy_from_slice(&one);
    match format {
        BlockFormat::Q8_0 => b[2..].fill(code),
        // Q4_0 / Q4_1: two 4-bit codes per byte after the scale fields.
        BlockFormat::Q4_0 => b[2..].fill(code * 0x11),
        BlockFormat::Q4_1 => b[4..].fill(code * 0x11),
        _ => unreachable!("legacy 4- and 8-bit formats only"),
    }
    b
}

#[test]
fn extreme_codes_give_the_exact_sum() {
    // Every code at an end of its range against activations all at +-127: the largest pair
    // sums `maddubs` meets (Q8_0: 2 * 128 * 127; 4-bit: eight terms of 2 * 15 * 127).
    let mut pools = vec![pool(1, Isa::Portable)];
    for isa in simd_isas() {
        pools.extend([pool(1, isa), pool(2, isa)]);
    }
    // Q8_0 codes -128 (stored 0x80) and 127, Q4_0 code 15 (value 7) and 0 (value -8), Q4_1
    // code 15 (value 15).
    let cases = [
        (BlockFormat::Q8_0, 0x80u8, -128i64),
        (BlockFormat::Q8_0, 0x7f, 127),
        (BlockFormat::Q4_0, 15, 7),
        (BlockFormat::Q4_0, 0, -8),
        (BlockFormat::Q4_1, 15, 15),
    ];
    let (outf, inf) = (24, 32);
    for (format, code, value) in cases {
        let bytes: Vec<u8> = (0..outf)
            .flat_map(|_| uniform_block(format, code))
            .collect();
        let w = PackedWeight::new(format, outf, inf, &bytes).unwrap();
        for sign in [1.0f32, -1.0] {
            // Every input at the same magnitude: the codes are all +-127, `d = 1 / 127`.
            let x = vec![sign; 5 * inf];
            let da = 1.0f32 / 127.0;
            let isum = value * 127 * sign as i64 * inf as i64;
            // One block: `fma(d * da, isum, 0)`, a single rounding of an exact product (f64
            // holds it exactly), plus `m * sa` = 0 for Q4_1's zero min.
            let want = (da as f64 * isum as f64) as f32;
            for p in &pools {
                for rows in [1, 2, 5] {
                    let got = run(p, &w, &x, rows);
                    assert!(
                        got.iter().all(|&g| g.to_bits() == want.to_bits()),
                        "{format} code {code:#x}, inputs {sign}, {rows} rows, {:?} on {} \
                         threads: {:?} vs {want}",
                        p.isa(),
                        p.threads(),
                        &got[..4]
                    );
                }
            }
        }
    }
}
