//! Tests of the small ops: each against a float64 reference within one BF16 rounding step,
//! every SIMD build and the portable one bit for bit, and each row bitwise the same alone, in any
//! batch, and split over the pool.

use super::*;
use crate::backend::quant::Isa;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::time::Duration;

/// One BF16 rounding step, relative: the result may be the rounding of the exact value or
/// its neighbour (when f32 arithmetic lands on the other side of a rounding boundary).
const BF16_STEP: f64 = 1.0 / 128.0;

fn pools() -> Vec<KernelPool> {
    let spin = Duration::from_micros(50);
    let mut v = vec![
        KernelPool::with_options(1, Isa::Portable, spin),
        KernelPool::with_options(2, Isa::Portable, spin),
    ];
    for isa in Isa::available_simd() {
        v.push(KernelPool::with_options(1, isa, spin));
        v.push(KernelPool::with_options(2, isa, spin));
    }
    v
}

fn random(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<bf16> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n)
        .map(|_| bf16::from_f32(rng.random_range(lo..hi)))
        .collect()
}

fn f64s(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// `got` within one BF16 step of each `want` (plus `atol`, for values near zero).
fn assert_close(what: &str, got: &[bf16], want: &[f64], atol: &dyn Fn(usize) -> f64) {
    assert_eq!(got.len(), want.len());
    for (i, (g, &w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f64();
        let bound = BF16_STEP * w.abs() + atol(i);
        assert!(
            (g - w).abs() <= bound,
            "{what}[{i}]: got {g}, want {w} (bound {bound})"
        );
    }
}

#[test]
fn rms_norm_matches_a_float64_reference() {
    for (rows, dim) in [(1, 1), (3, 7), (2, 63), (4, 65), (5, 576), (40, 576)] {
        let x = random(rows as u64, rows * dim, -3.0, 3.0);
        let w = random(99, dim, 0.5, 1.5);
        let eps = 1e-5;
        let want: Vec<f64> = f64s(&x)
            .chunks(dim)
            .flat_map(|row| {
                let ms = row.iter().map(|v| v * v).sum::<f64>() / dim as f64;
                let inv = 1.0 / (ms + eps).sqrt();
                let w = f64s(&w);
                row.iter()
                    .zip(w)
                    .map(|(v, w)| v * inv * w)
                    .collect::<Vec<_>>()
            })
            .collect();
        for pool in pools() {
            let mut out = vec![bf16::ZERO; rows * dim];
            rms_norm(&pool, &mut out, Input::Apart(&x), &w, dim, eps as f32).unwrap();
            assert_close("rms_norm", &out, &want, &|_| 1e-30);
            let mut in_place = x.clone();
            rms_norm(&pool, &mut in_place, Input::Out, &w, dim, eps as f32).unwrap();
            assert_eq!(in_place, out, "rms_norm in place, {rows}x{dim}");
        }
    }
}

#[test]
fn elementwise_ops_match_a_float64_reference() {
    let n = 3 * BLOCK + 5;
    let mut a = random(1, n, -12.0, 12.0);
    // The ends of the range: exp's clamp, and a gate far past where sigmoid saturates.
    a[..6].copy_from_slice(&[-100.0, -88.0, -20.0, 0.0, 20.0, 100.0].map(bf16::from_f32));
    let b = random(2, n, -4.0, 4.0);
    let sig = |g: f64| 1.0 / (1.0 + (-g).exp());
    let cases = [
        (
            ElementwiseOp::Add,
            &(|g: f64, u: f64| g + u) as &dyn Fn(f64, f64) -> f64,
        ),
        (ElementwiseOp::SiluMul, &|g: f64, u: f64| g * sig(g) * u),
        (ElementwiseOp::SigmoidMul, &|g: f64, v: f64| v * sig(g)),
    ];
    for (op, f) in cases {
        let want: Vec<f64> = f64s(&a)
            .iter()
            .zip(f64s(&b))
            .map(|(&x, y)| f(x, y))
            .collect();
        // Below exp's clamp a silu is -|g| e^-87 instead of -|g| e^g: both nothing, as a
        // float32 next to any other activation (1e-36).
        let atol = |i: usize| if i < 2 { 1e-35 } else { 1e-30 };
        for pool in pools() {
            let mut out = vec![bf16::ZERO; n];
            binary(&pool, op, &mut out, Input::Apart(&a), Input::Apart(&b)).unwrap();
            assert_close(op.name(), &out, &want, &atol);
            let (mut first, mut second) = (a.clone(), b.clone());
            binary(&pool, op, &mut first, Input::Out, Input::Apart(&b)).unwrap();
            binary(&pool, op, &mut second, Input::Apart(&a), Input::Out).unwrap();
            assert_eq!((&first, &second), (&out, &out), "{} in place", op.name());
        }
    }
    // A NaN stays a NaN.
    let nan = [bf16::NAN];
    for op in [ElementwiseOp::SiluMul, ElementwiseOp::SigmoidMul] {
        let mut out = [bf16::ZERO];
        binary(
            &pools()[0],
            op,
            &mut out,
            Input::Apart(&nan),
            Input::Apart(&[bf16::ONE]),
        )
        .unwrap();
        assert!(out[0].is_nan(), "{}", op.name());
    }
}

#[test]
fn rope_matches_a_float64_reference() {
    for style in [RopeStyle::Half, RopeStyle::Interleaved] {
        let (rows, heads, hd, rotary) = (4, 2, 20, 16);
        let shape = RopeShape {
            heads,
            head_dim: hd,
            style,
        };
        let x = random(5, rows * heads * hd, -2.0, 2.0);
        // The last past the angle table's bound, so both ways to the angles are checked.
        let pos = [
            0u32,
            7,
            1000,
            crate::backend::cpu::rope_angles::MAX_POSITIONS as u32 + 5,
        ];
        let freq: Vec<f32> = (0..rotary / 2)
            .map(|i| 10000f32.powf(-((2 * i) as f32) / rotary as f32))
            .collect();
        let mut want = f64s(&x);
        let mut atol = vec![1e-30; want.len()];
        for (r, &p) in pos.iter().enumerate() {
            for h in 0..heads {
                let base = (r * heads + h) * hd;
                for (i, &f) in freq.iter().enumerate() {
                    let (i, j) = match style {
                        RopeStyle::Half => (base + i, base + i + rotary / 2),
                        RopeStyle::Interleaved => (base + 2 * i, base + 2 * i + 1),
                    };
                    // The angle is defined in f32 (the position times the f32 frequency).
                    let (sin, cos) = ((p as f32 * f) as f64).sin_cos();
                    let (xi, xj) = (want[i], want[j]);
                    (want[i], want[j]) = (xi * cos - xj * sin, xj * cos + xi * sin);
                    // The two products may cancel: a step of the larger input, not the result.
                    let step = BF16_STEP * (xi.abs() + xj.abs());
                    (atol[i], atol[j]) = (step, step);
                }
            }
        }
        for pool in pools() {
            let mut got = x.clone();
            rope(&pool, &RopeCache::default(), &mut got, &pos, &freq, shape).unwrap();
            assert_close("rope", &got, &want, &|i| atol[i]);
        }
    }
}

/// Every op on `rows` rows of `dim`, on `pool`: the outputs of rms_norm, silu_mul and rope.
fn all_ops(pool: &KernelPool, rows: usize, dim: usize, seed: u64) -> [Vec<bf16>; 3] {
    let x = random(seed, rows * dim, -3.0, 3.0);
    let y = random(seed + 1, rows * dim, -3.0, 3.0);
    let w = random(3, dim, 0.5, 1.5);
    let mut norm = vec![bf16::ZERO; rows * dim];
    rms_norm(pool, &mut norm, Input::Apart(&x), &w, dim, 1e-5).unwrap();
    let mut silu = vec![bf16::ZERO; rows * dim];
    let op = ElementwiseOp::SiluMul;
    binary(pool, op, &mut silu, Input::Apart(&x), Input::Apart(&y)).unwrap();
    let mut roped = x.clone();
    let pos: Vec<u32> = (0..rows as u32).map(|r| 3 * r + 1).collect();
    let freq: Vec<f32> = (0..dim / 4).map(|i| 0.9f32.powi(i as i32)).collect();
    let shape = RopeShape {
        heads: 2,
        head_dim: dim / 2,
        style: RopeStyle::Half,
    };
    rope(pool, &RopeCache::default(), &mut roped, &pos, &freq, shape).unwrap();
    [norm, silu, roped]
}

#[test]
fn simd_and_portable_builds_agree_bit_for_bit() {
    let simd = Isa::available_simd();
    if simd.is_empty() {
        eprintln!("no AVX2 here: nothing to compare");
        return;
    }
    let spin = Duration::from_micros(50);
    let portable = KernelPool::with_options(1, Isa::Portable, spin);
    for isa in simd {
        let pool = KernelPool::with_options(1, isa, spin);
        for (rows, dim) in [(1, 2), (3, 66), (2, 130), (9, 576), (4, 1536)] {
            let want = all_ops(&portable, rows, dim, rows as u64);
            assert_eq!(
                all_ops(&pool, rows, dim, rows as u64),
                want,
                "{isa:?} {rows}x{dim}"
            );
        }
    }
}

#[test]
fn rows_are_bitwise_the_same_alone_in_a_batch_and_split_over_the_pool() {
    let dim = 576;
    // 64 rows of 576 are split into several tasks on a two-thread pool.
    assert!(64 * dim >= 2 * LARGEST_TASK);
    for pool in pools() {
        let batch = all_ops(&pool, 64, dim, 11);
        for rows in [1, 2, 5, 9, 16, 64] {
            let few = all_ops(&pool, rows, dim, 11);
            for (op, (few, batch)) in few.iter().zip(&batch).enumerate() {
                assert!(
                    few[..] == batch[..rows * dim],
                    "op {op}: {rows} rows differ from the first {rows} of 64"
                );
            }
        }
    }
}
